"""One thread reads every worker's channel: the scheduler's ear.

The scheduler holds one kept-alive :class:`~hvdkit.launch.protocol.Channel`
per worker, and each worker sends a keep-alive every second. With a reading
thread per channel, 1,000 workers meant 1,000 threads waking every second:
9–28 % of a core more than with this one thread, in thread wake-ups and GIL
hand-overs (benchmarks/control_plane.py ``--compare``). A :class:`Listener` waits on all the sockets
at once (:mod:`selectors`: epoll on Linux) and reads only those with bytes;
a peer silent for its channel's silence limit (:meth:`~hvdkit.launch.protocol.Channel.keep_alive`)
is found by a look over every channel once per :data:`LOOK_EVERY_S`, not by a timer per
channel.

    listener = Listener(heard=on_message, ended=on_end)
    channel.keep_alive(10.0)                  # its silence limit
    listener.add(channel, who=registration)   # from any thread
    # heard(registration, {"type": "exit", ...}) and, once, ended(registration, why)
    # run on the listener's thread, in the order the bytes came.
    listener.close()
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

from .protocol import Channel
from .wakeup import Wakeup

log = logging.getLogger("hvdkit.protocol")
LOOK_EVERY_S = 1.0  # how often the silence of every channel (and a close elsewhere) is checked


class Listener:
    """Reads the messages of many channels on one thread and hands them on.

    ``heard(who, message)`` gets every message a channel's bytes complete
    (keep-alives are not messages); ``ended(who, error)`` is called once per
    channel when it is over: ``error`` is ``None`` when the peer closed the
    connection or it broke or was closed here, a :class:`~protocol.Silent`
    when the peer sent nothing for the silence limit of its channel's
    :meth:`~protocol.Channel.keep_alive` (a channel without one is never
    silent). Both run on the listener's
    thread and must be quick (a queue put); an exception in either is logged
    and the listener goes on.
    """

    def __init__(
        self,
        heard: Callable[[object, dict], None],
        ended: Callable[[object, Exception | None], None],
    ):
        self._heard, self._ended = heard, ended
        self._selector = selectors.DefaultSelector()
        self._wakeup = Wakeup()
        self._selector.register(self._wakeup, selectors.EVENT_READ, None)
        self._adding: list[tuple[Channel, object]] = []
        self._lock = threading.Lock()
        self._closed = False
        self._channels: dict[Channel, object] = {}  # only the listener's thread touches it
        self._thread = threading.Thread(target=self._loop, name="hvdkit-listener", daemon=True)
        self._thread.start()

    def add(self, channel: Channel, who: object) -> None:
        """Listen to ``channel`` from now on; ``who`` is what the callbacks are given."""
        with self._lock:
            self._adding.append((channel, who))
        self._wakeup.set()

    def close(self) -> None:
        """Stop listening (the channels stay open) and wait for the thread to end."""
        with self._lock:
            self._closed = True
        self._wakeup.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    # ------------------------------------------------------------ the listener's thread
    def _loop(self) -> None:
        next_look = time.monotonic() + LOOK_EVERY_S
        try:
            while True:
                ready = self._selector.select(max(0.0, next_look - time.monotonic()))
                for key, _ in ready:
                    if key.data is None:
                        if not self._take_additions():
                            return
                    else:
                        self._read(key.fileobj, *key.data)
                if time.monotonic() >= next_look:
                    self._look()
                    next_look = time.monotonic() + LOOK_EVERY_S
        finally:
            self._selector.close()
            self._wakeup.close()

    def _take_additions(self) -> bool:
        """Register the channels added since; False once closed."""
        self._wakeup.clear()
        with self._lock:
            adding, self._adding = self._adding, []
            if self._closed:
                return False
        for channel, who in adding:
            self._register(channel, who)
        return True

    def _register(self, channel: Channel, who: object) -> None:
        try:
            fd = channel.sock.fileno()
        except OSError:
            fd = -1
        if fd < 0:  # closed before it was listened to
            self._call(self._ended, who, None)
            return
        stale = self._selector.get_map().get(fd)
        if stale is not None:  # a channel closed elsewhere whose number the kernel reused
            self._forget(stale.fileobj, *stale.data)
        self._selector.register(channel.sock, selectors.EVENT_READ, (channel, who))
        self._channels[channel] = who

    def _read(self, sock: socket.socket, channel: Channel, who: object) -> None:
        try:
            messages, over = channel.read_ready()
        except Exception:  # never a dead listener: this channel is as good as lost
            log.exception("reading %s failed", channel.peer)
            messages, over = [], True
        for msg in messages:
            self._call(self._heard, who, msg)
        if over:
            self._forget(sock, channel, who)

    def _look(self) -> None:
        """End the channels silent for their silence limit, and those closed elsewhere."""
        now = time.monotonic()
        for channel, who in list(self._channels.items()):
            if channel.closed:
                self._forget(channel.sock, channel, who)
            elif (error := channel.silence(now)) is not None:
                self._forget(channel.sock, channel, who, error)

    def _forget(self, sock, channel: Channel, who: object, error: Exception | None = None) -> None:
        if self._channels.pop(channel, None) is None:
            return
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass  # closed elsewhere: epoll dropped it with its last reference
        self._call(self._ended, who, error)

    def _call(self, callback, *args) -> None:
        try:
            callback(*args)
        except Exception:  # a bad message must not stop the reading of every other one
            log.exception("the scheduler's handling of a worker's message failed")

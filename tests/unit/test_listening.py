"""The scheduler's one reading thread (hvdkit.launch.listening.Listener) over real sockets.

Each case uses secured channel pairs (socketpairs, the job's signing): the
worker's end sends, the listener reads the scheduler's end. Nothing is timed;
the waits only bound a hang.
"""

from __future__ import annotations

import queue
import socket
import threading

import pytest

from hvdkit.launch import listening, protocol
from hvdkit.launch.listening import Listener
from hvdkit.launch.protocol import Channel

WAIT_S = 60.0  # only against a hang


def pair(n: int = 0) -> tuple[Channel, Channel]:
    """(the scheduler's end, the worker's end), signed as a job's channel is."""
    a, b = socket.socketpair()
    sched, worker = Channel(a), Channel(b)
    to_worker, to_sched = f"k{n}-down".encode() * 4, f"k{n}-up".encode() * 4
    sched.secure(to_worker, to_sched, f"session-{n}")
    worker.secure(to_sched, to_worker, f"session-{n}")
    return sched, worker


def added(listener: Listener, who: object = "w", n: int = 0) -> tuple[Channel, Channel]:
    """A new channel pair whose scheduler end ``listener`` listens to, as ``who``."""
    sched, worker = pair(n)
    listener.add(sched, who)
    return sched, worker


class Heard:
    """The callbacks, recording into one queue in the order the listener calls them."""

    def __init__(self):
        self.calls: queue.Queue = queue.Queue()

    def heard(self, who, msg):
        self.calls.put(("heard", who, msg))

    def ended(self, who, error):
        self.calls.put(("ended", who, error))

    def next(self):
        return self.calls.get(timeout=WAIT_S)


@pytest.fixture
def ear():
    heard = Heard()
    listener = Listener(heard.heard, heard.ended)
    yield listener, heard
    listener.close()


def test_messages_reach_their_owner_in_order_and_keep_alives_do_not(ear):
    listener, heard = ear
    (_, w1), (_, w2) = added(listener, "one", 1), added(listener, "two", 2)
    w1.send(type="ready", round=0)
    w1.send(type=protocol.ALIVE)
    w1.send(type="exit", round=0, code=3)
    assert heard.next() == ("heard", "one", {"type": "ready", "round": 0})
    assert heard.next() == ("heard", "one", {"type": "exit", "round": 0, "code": 3})
    w2.send(type="finished", round=0)
    assert heard.next() == ("heard", "two", {"type": "finished", "round": 0})
    assert heard.calls.empty()


def test_a_message_split_across_reads_and_several_in_one_read(ear):
    listener, heard = ear
    s, w = added(listener)
    w.sock, real = _Capture(), w.sock  # sign three lines without sending them
    for i in range(3):
        w.send(type="resumed", round=1, step=i)
    lines = w.sock.data
    w.sock = real
    real.sendall(lines[:7])  # part of the first line
    real.sendall(lines[7:])  # its rest and the next two
    for i in range(3):
        assert heard.next() == ("heard", "w", {"type": "resumed", "round": 1, "step": i})


class _Capture:
    def __init__(self):
        self.data = b""

    def sendall(self, data):
        self.data += data


def test_the_peer_closing_ends_the_channel_once(ear):
    listener, heard = ear
    s, w = added(listener)
    w.send(type="exit", round=0, code=0)
    w.close()
    assert heard.next() == ("heard", "w", {"type": "exit", "round": 0, "code": 0})
    assert heard.next() == ("ended", "w", None)
    _, w2 = added(listener, "next", 2)  # the listener goes on with the next channel
    w2.send(type="ready", round=4)
    assert heard.next() == ("heard", "next", {"type": "ready", "round": 4})
    assert heard.calls.empty()


def test_forged_lines_are_dropped_and_too_many_end_the_channel(ear):
    listener, heard = ear
    s, w = added(listener)
    for _ in range(protocol.MAX_DROPPED - 1):
        w.sock.sendall(b'{"b": "{\\"type\\": \\"abort\\"}", "n": 0, "m": "00"}\n')
    w.send(type="ready", round=0)  # still heard after MAX_DROPPED - 1 forgeries
    assert heard.next() == ("heard", "w", {"type": "ready", "round": 0})
    w.sock.sendall(b"not json\n")
    assert heard.next() == ("ended", "w", None)
    assert s.dropped == protocol.MAX_DROPPED


def test_a_silent_peer_is_ended_as_silent_and_its_channel_closed(monkeypatch):
    monkeypatch.setattr(listening, "LOOK_EVERY_S", 0.05)
    heard = Heard()
    listener = Listener(heard.heard, heard.ended)
    try:
        s, _w = pair()
        s.keep_alive(0.2)  # the channel's silence limit is the listener's
        listener.add(s, "quiet")
        kind, who, error = heard.next()
        assert (kind, who, type(error)) == ("ended", "quiet", protocol.Silent)
        assert "for 0.2 s, not even a keep-alive" in str(error)
        assert s.closed
    finally:
        listener.close()


def test_a_channel_closed_here_is_ended_and_its_number_reused_is_listened_to(ear):
    listener, heard = ear
    s, _w = added(listener, "closed here", 1)
    fd = s.sock.fileno()
    s.close()  # as the scheduler does with a worker it no longer trusts
    a, b = socket.socketpair()  # the kernel gives the lowest free numbers: s's again
    assert fd in (a.fileno(), b.fileno())
    new_s, new_w = (Channel(a), Channel(b)) if a.fileno() == fd else (Channel(b), Channel(a))
    new_s.secure(b"d" * 16, b"u" * 16, "x")
    new_w.secure(b"u" * 16, b"d" * 16, "x")
    listener.add(new_s, "new")
    new_w.send(type="ready", round=2)
    got = {heard.next()[:2] for _ in range(2)}
    assert got == {("ended", "closed here"), ("heard", "new")}


def test_a_failing_callback_is_logged_and_the_listener_goes_on(caplog):
    calls = []

    def heard(who, msg):
        calls.append(msg["round"])
        if msg["round"] == 0:
            raise RuntimeError("boom")

    done = threading.Event()
    listener = Listener(heard, lambda who, error: done.set())
    try:
        _, w = added(listener)
        w.send(type="ready", round=0)
        w.send(type="ready", round=1)
        w.close()
        assert done.wait(WAIT_S)
        assert calls == [0, 1]
        assert "handling of a worker's message failed" in caplog.text
    finally:
        listener.close()


def test_many_channels_one_thread(ear):
    listener, heard = ear
    before = threading.active_count()
    pairs = [pair(i) for i in range(64)]
    for i, (s, _) in enumerate(pairs):
        listener.add(s, i)
    for i, (_, w) in enumerate(pairs):
        w.send(type="ready", round=i)
    got = sorted(heard.next()[1:] for _ in pairs)
    assert got == [(i, {"type": "ready", "round": i}) for i in range(64)]
    assert threading.active_count() == before


def test_close_ends_the_thread_and_leaves_the_channels_open():
    heard = Heard()
    listener = Listener(heard.heard, heard.ended)
    s, w = added(listener)
    listener.close()
    assert not listener._thread.is_alive()
    assert not s.closed
    w.send(type="ready", round=0)
    assert s.recv() == {"type": "ready", "round": 0}  # readable by another reader after
    assert heard.calls.empty()

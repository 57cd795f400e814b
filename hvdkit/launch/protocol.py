"""The scheduler/worker wire format: one JSON object per line over TCP.

A connection starts with a challenge (:func:`admit` on the scheduler,
:func:`register` on the worker): the scheduler sends a fresh nonce, the
worker answers with its registration signed over that nonce (it proves it
knows the job token without sending it, see :mod:`hvdkit.launch.auth`).
From then on every line is ``{"b": <message>, "n": <sequence>, "m": <mac>}``
under per-direction keys and the session's two nonces; a line that fails the
check is logged and dropped, so a forged ``abort`` or ``assign`` never reaches
the code above. Lines are bounded (:data:`MAX_LINE`) and the handshake has an
overall deadline, so garbage, oversized and slow (slow-loris) input cost a
bounded amount of memory and time; every line is parsed by
:func:`auth.loads` (bounded, UTF-8, shallow), so no input raises anything but
a refusal. :class:`Admission` runs handshakes concurrently (at most
:data:`MAX_PENDING` at once, :data:`MAX_PENDING_PER_ADDRESS` from one
address), so a slow or hostile client never holds up a real worker; a
connection beyond those is told ``busy`` and closed, and the worker tries
again (:class:`Busy`) until its registration timeout.
"""

from __future__ import annotations

import json
import logging
import queue
import select
import socket
import threading
import time
from typing import NoReturn

from .. import config
from . import auth

log = logging.getLogger("hvdkit.protocol")
MAX_LINE = 1 << 20  # bytes; a worker's exit report carries its last output lines
MAX_HELLO = 1 << 16  # bytes; a registration line (before the client is authenticated)
HANDSHAKE_TIMEOUT_S = 10.0  # for the whole registration, however slowly bytes trickle in
MAX_PENDING = 32  # handshakes in progress at once; more connections are told "busy"
MAX_PENDING_PER_ADDRESS = MAX_PENDING // 2  # so one address cannot take every slot
MAX_DROPPED = 16  # forged lines on one connection before it is given up
PROTOCOL_VERSION = 2
ALIVE = "alive"  # a keep-alive message: recv() skips it; it proves the peer is there
ALIVE_EVERY_S = 1.0  # how often each end of a kept-alive channel sends one
MIN_SILENCE_S = 10.0  # the shortest silence that counts a peer as lost (a loaded machine)
# The kinds of message (a message's "type"), each named once; every message about a
# round carries its number, "round".
# The handshake (admit/register below):
CHALLENGE = "challenge"  # scheduler: a fresh "nonce" to sign
REGISTER = "register"  # worker: its registration, signed over the nonce ("hostname", "pid")
REFUSED = "refused"  # scheduler: not admitted ("reason")
# scheduler -> worker, after the handshake:
ASSIGN = "assign"  # a rank of round "round" and Horovod's settings; "inplace": for the
#   running program (a new world, elastic), "join": the program joins running survivors
ABORT = "abort"  # stop the program of round "round" ("reason")
PREEMPT = "preempt"  # the scheduler got SIGTERM: stop at a common step with a checkpoint
GO = "go"  # every rank of round "round" is ready: start Horovod (elastic)
DESCRIBE = "describe"  # what are the ranks of round "round" doing? (answered with STATE)
DONE = "done"  # the job ended with status "code"
# worker -> scheduler:
EXIT = "exit"  # the program of round "round" ended: "code", "detail", "tail" (last lines)
STATE = "state"  # the answer to DESCRIBE: "ranks", {rank: what it is doing}
# A worker's word about its program in an elastic job, besides its exit report.
READY = "ready"  # the program is about to meet the other ranks of round "round"
RESUMED = "resumed"  # rank 0 trains again in round "round", from step "step"
FINISHED = "finished"  # the program's training function returned: it meets no new world
TOO_LONG = b"\x00too long"  # what recv_line returns for a line over its bound (not JSON)
_NOTHING = object()  # Channel._message: a line that carries no message

# Why the scheduler refuses a connection: the fixed kinds its refusal log counts.
BAD_TOKEN = "bad job token"
NOT_REGISTRATION = "not a registration"
BUSY = "busy"  # too many handshakes in progress (from this address, or in all)
DROPPED = "dropped"  # closed, broke or was too slow before registering
REFUSAL_KINDS = (BAD_TOKEN, NOT_REGISTRATION, BUSY, DROPPED)


class Refused(Exception):
    """The scheduler refused this worker, or a client failed the handshake.

    ``kind`` is one of :data:`REFUSAL_KINDS` (scheduler side); the text is
    what the client is told: the kind, then any detail in parentheses.
    """

    def __init__(self, reason: str, kind: str = DROPPED, detail: str = ""):
        super().__init__(reason)
        self.kind, self.detail = kind, detail


class Busy(Refused):
    """The scheduler did not start a handshake (busy, not up, or the connection broke first).

    Nothing was refused: the worker tries again until its timeout.
    """


def silence_limit(stall_s: float) -> float:
    """Seconds a kept-alive peer may send nothing before it counts as lost.

    The stall timeout (``HVDKIT_STALL_TIMEOUT``), at least
    :data:`MIN_SILENCE_S`: a worker whose machine or network is cut is then
    taken for lost as soon as a frozen rank would be, while a keep-alive held
    up a few seconds by a loaded machine is not.
    """
    return max(stall_s, MIN_SILENCE_S)


class Silent(OSError):
    """The peer of a kept-alive channel sent nothing, not even a keep-alive, for too long.

    An ``OSError``: to the code that reads, the connection is lost (a cut
    network or a frozen machine closes no connection; this ends it).
    """


class Channel:
    """A TCP connection carrying newline-terminated JSON messages."""

    def __init__(self, sock: socket.socket, max_line: int = MAX_LINE):
        self.sock = sock
        self.peer = sock.getpeername()
        self.max_line = max_line
        self._buf = bytearray()
        self._skipping = False  # inside an oversized line: discard up to its newline
        self._send_lock = threading.Lock()
        self._keys: tuple[bytes, bytes, str] | None = None  # send key, receive key, session
        self._sent = self._received = 0
        self.dropped = 0
        self._silence_s: float | None = None  # set by keep_alive()
        self.heard_at = time.monotonic()  # when the peer's last authentic line came
        self._closed = threading.Event()

    # ------------------------------------------------------------ authentication
    def secure(self, send_key: bytes, recv_key: bytes, session: str) -> None:
        """From now on sign what is sent and accept only authentic, in-order lines."""
        self._keys = (send_key, recv_key, session)

    @property
    def secured(self) -> bool:
        return self._keys is not None

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    # ------------------------------------------------------------ sending
    def send(self, **msg) -> None:
        with self._send_lock:
            self._send_locked(**msg)

    def _send_locked(self, **msg) -> None:
        body = json.dumps(msg, separators=(",", ":"))
        if self._keys is not None:
            send_key, _, session = self._keys
            sig = auth.mac(send_key, session, self._sent, body)
            body = json.dumps({"b": body, "n": self._sent, "m": sig})
            self._sent += 1
        self.sock.sendall(body.encode() + b"\n")

    def send_raw(self, line: bytes) -> None:
        with self._send_lock:
            self.sock.sendall(line + b"\n")

    def keep_alive(self, silence_s: float, every_s: float = ALIVE_EVERY_S) -> None:
        """Send an :data:`ALIVE` every ``every_s`` until closed; and let :meth:`recv` raise
        :class:`Silent` once the peer has sent nothing for ``silence_s``.

        Both ends of a secured channel call it (scheduler and worker): a
        network cut or a frozen machine then ends the connection on both
        sides within ``silence_s`` instead of leaving each waiting forever.

        Example:
            >>> ch.keep_alive(silence_limit(stall_timeout()))
            >>> ch.recv()   # skips keep-alives; Silent after silence_s without a word
        """
        self._silence_s = silence_s
        _KeepAlive.of(every_s).add(self)

    def _send_alive(self) -> bool:
        """One keep-alive, unless a message is being sent (that proves life); False if gone."""
        if not self._send_lock.acquire(blocking=False):
            return True
        try:
            self._send_locked(type=ALIVE)
            return True
        except OSError:
            return False  # the connection is gone; the reader finds out
        finally:
            self._send_lock.release()

    # ------------------------------------------------------------ receiving
    def recv_line(self, deadline: float | None = None) -> bytes | None:
        """The next line (without its newline); None at end of stream.

        With ``deadline`` (a :func:`time.monotonic` value) raises
        :class:`TimeoutError` once it passes, however the bytes trickle in. A
        line longer than ``max_line`` comes back as :data:`TOO_LONG` (not
        JSON) and its rest is skipped, so memory stays bounded.
        """
        if deadline is None:
            return self._read_line(None)
        before = self.sock.gettimeout()
        try:
            return self._read_line(deadline)
        finally:
            self.sock.settimeout(before)

    def _read_line(self, deadline: float | None) -> bytes | None:
        while True:
            line = self._take_line()
            if line is not None:
                return line
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no complete message before the deadline")
                self.sock.settimeout(left)
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self._buf += chunk

    def _take_line(self) -> bytes | None:
        """The next complete line in the buffer (:data:`TOO_LONG` for an oversized one); None
        until more bytes come."""
        while True:
            newline = self._buf.find(b"\n")
            if newline >= 0:
                line = bytes(self._buf[:newline])
                del self._buf[: newline + 1]
                if self._skipping:
                    self._skipping = False
                    continue
                return line
            if len(self._buf) > self.max_line:
                self._buf.clear()
                if not self._skipping:
                    self._skipping = True
                    return TOO_LONG
            return None

    def recv(self, deadline: float | None = None) -> dict | None:
        """Next message, or None when the peer closed the connection.

        Before :meth:`secure`, anything that is not a JSON object comes back as
        ``{"type": "garbage"}``. After it, lines that are not authentic are
        logged and dropped (after :data:`MAX_DROPPED` of them the connection
        counts as lost); the one unsigned message accepted is a ``refused`` as
        the first line, which can only end the conversation.

        After :meth:`keep_alive`, keep-alives are skipped, and a peer silent
        for the silence limit raises :class:`Silent` (before ``deadline``) and
        closes the channel: if the network comes back, the peer learns it is out.
        """
        silent_at = None if self._silence_s is None else time.monotonic() + self._silence_s
        while True:
            until = silent_at if deadline is None else min(deadline, silent_at or deadline)
            try:
                line = self.recv_line(until)
            except TimeoutError:
                if silent_at is not None and until == silent_at:
                    raise self._given_up_as_silent() from None
                raise
            if line is None:
                return None
            msg = self._message(line)
            if msg is _NOTHING:
                if silent_at is not None:  # only an authentic line proves the peer is there
                    silent_at = max(silent_at, self.heard_at + self._silence_s)
                continue
            return msg

    def silence(self, now: float) -> Silent | None:
        """After :meth:`keep_alive`: once the peer has sent no authentic line for the silence
        limit, the channel is closed and the :class:`Silent` error returned; else None.

        For a reader that does not wait in :meth:`recv` (which raises it itself).
        """
        if self._silence_s is None or now - self.heard_at <= self._silence_s:
            return None
        return self._given_up_as_silent()

    def _given_up_as_silent(self) -> Silent:
        self.close()  # if the network comes back, the peer learns it is out
        return Silent(
            f"nothing from {auth.where(self.peer)} for {self._silence_s:g} s, not even a keep-alive"
        )

    def read_ready(self) -> tuple[list[dict], bool]:
        """What the socket holds now, read without waiting: ``(messages, ended)``.

        For one thread that reads many channels (:class:`~hvdkit.launch.listening.Listener`):
        the messages the bytes complete, as :meth:`recv` would return them (keep-alives
        skipped; :attr:`heard_at` moved on by every authentic line), and whether the
        connection is over (closed by the peer, broken, or too many forged lines).
        """
        try:
            chunk = self.sock.recv(65536, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            chunk = None  # woken for nothing: no bytes after all
        except OSError:
            return [], True
        if chunk == b"":
            return [], True
        if chunk:
            self._buf += chunk
        messages = []
        while (line := self._take_line()) is not None:
            msg = self._message(line)
            if msg is None:
                return messages, True
            if msg is not _NOTHING:
                messages.append(msg)
        return messages, False

    def _message(self, line: bytes) -> dict | object | None:
        """The message ``line`` carries; :data:`_NOTHING` for a keep-alive or a dropped line;
        None once too many lines were dropped (the connection is given up)."""
        if self._keys is None:
            return _plain(line, self.max_line)
        msg = self._authentic(line)
        if msg is not None:
            self.heard_at = time.monotonic()
            return _NOTHING if msg.get("type") == ALIVE else msg
        self.dropped += 1
        if self.dropped >= MAX_DROPPED:
            log.warning("giving up the connection with %s: too many forged lines", self.peer)
            return None
        return _NOTHING

    def _authentic(self, line: bytes) -> dict | None:
        _, recv_key, session = self._keys
        try:
            env = auth.loads(line, self.max_line)
        except auth.AuthError as exc:
            log.warning("dropped a malformed line from %s (%s)", auth.where(self.peer), exc.detail)
            return None
        if not isinstance(env, dict):
            log.warning("dropped a malformed line from %s (not an object)", auth.where(self.peer))
            return None
        if env.get("type") == REFUSED and "m" not in env and self._received == 0:
            return {"type": REFUSED, "reason": str(env.get("reason", "refused"))[:500]}
        text, seq = env.get("b"), env.get("n")
        if not isinstance(text, str) or seq != self._received:
            log.warning("dropped a replayed or out-of-order line from %s", auth.where(self.peer))
            return None
        if not auth.verify(recv_key, env.get("m"), session, seq, text):
            log.warning("dropped a forged line from %s (bad MAC)", auth.where(self.peer))
            return None
        try:
            msg = auth.parse_body(text)
        except auth.AuthError:
            return None
        self._received += 1
        return msg

    def close(self) -> None:
        self._closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class _KeepAlive:
    """One thread per process and interval sends the keep-alives of all its channels.

    A scheduler holds one channel per worker; with a sending thread each, 1,000
    workers meant 1,000 threads waking every second and contending for the GIL,
    which delayed the scheduler's own messages by seconds
    (benchmarks/control_plane.py). Only channels whose socket can take a line
    now are sent to: a peer that reads nothing (its send buffer full) is
    skipped, never waited for, so one stuck peer cannot hold up the others'
    keep-alives; its own silence limit ends it.
    """

    _by_interval: dict[float, _KeepAlive] = {}
    _made = threading.Lock()

    def __init__(self, every_s: float):
        self.every_s = every_s
        self._channels: set[Channel] = set()
        self._lock = threading.Lock()
        name = f"hvdkit-keepalive-{every_s:g}s"
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    @classmethod
    def of(cls, every_s: float) -> _KeepAlive:
        with cls._made:
            if every_s not in cls._by_interval:
                cls._by_interval[every_s] = cls(every_s)
            return cls._by_interval[every_s]

    def add(self, ch: Channel) -> None:
        with self._lock:
            self._channels.add(ch)

    def _loop(self) -> None:
        due = time.monotonic()
        while True:
            due += self.every_s
            time.sleep(max(0.0, due - time.monotonic()))
            due = max(due, time.monotonic() - self.every_s)  # after a long stall: no burst
            with self._lock:
                live = {ch for ch in self._channels if not ch._closed.is_set()}
                self._channels = live
            for ch in _writable(live):
                if not ch._send_alive():
                    with self._lock:
                        self._channels.discard(ch)


def _writable(channels) -> list[Channel]:
    """The channels whose socket accepts a line without blocking now."""
    poller, by_fd = select.poll(), {}
    for ch in channels:
        try:
            fd = ch.sock.fileno()
        except OSError:
            continue
        if fd >= 0:
            by_fd[fd] = ch
            poller.register(fd, select.POLLOUT)
    if not by_fd:
        return []
    return [by_fd[fd] for fd, ev in poller.poll(0) if ev & select.POLLOUT and fd in by_fd]


def _plain(line: bytes, max_bytes: int) -> dict:
    """An unsigned line as a message; ``{"type": "garbage", "why": ...}`` unless a JSON object."""
    if line == TOO_LONG:
        return {"type": "garbage", "why": f"a line over {max_bytes} bytes"}
    try:
        msg = auth.loads(line, max_bytes)
    except auth.AuthError as exc:
        return {"type": "garbage", "why": exc.detail}
    if isinstance(msg, dict):
        return msg
    return {"type": "garbage", "why": f"a JSON {type(msg).__name__}, not an object"}


# ---------------------------------------------------------------- the handshake
def admit(conn: socket.socket, token: str, deadline: float) -> tuple[Channel, dict]:
    """Scheduler side: challenge a new connection; its secured channel and registration.

    Raises :class:`Refused` (its ``kind`` and the reason) after telling the
    client, or :class:`OSError` / :class:`TimeoutError` if the connection
    broke or was too slow.
    """
    ch = Channel(conn, max_line=MAX_HELLO)  # nobody is authenticated yet: a small line
    nonce = auth.new_nonce()
    ch.send(type=CHALLENGE, nonce=nonce, version=PROTOCOL_VERSION)
    line = ch.recv_line(deadline)
    if line is None:
        raise Refused("closed the connection before registering", DROPPED)
    try:
        text, given = auth.open_envelope(line, MAX_HELLO)
    except auth.AuthError:
        msg = _plain(line, MAX_HELLO)
        if msg.get("type") == "garbage":
            _refuse(ch, NOT_REGISTRATION, str(msg["why"]))
        if msg.get("type") != REGISTER:
            _refuse(ch, NOT_REGISTRATION)
        if "token" in msg:  # hvdkit before the challenge sent the token itself
            _refuse(ch, BAD_TOKEN, "this worker's hvdkit sends it in clear: update it")
        _refuse(ch, BAD_TOKEN, "no proof of it")
    keys = auth.channel_keys(token, config.SCHEDULER)
    if not auth.verify(keys.register, given, nonce, text):
        _refuse(ch, BAD_TOKEN)
    try:
        hello = auth.parse_body(text)
    except auth.AuthError as exc:
        _refuse(ch, NOT_REGISTRATION, exc.detail)
    if hello.get("type") != REGISTER or not auth.is_nonce(hello.get("nonce")):
        _refuse(ch, NOT_REGISTRATION)
    ch.max_line = MAX_LINE
    ch.secure(keys.send, keys.receive, nonce + hello["nonce"])
    return ch, hello


def _refuse(ch: Channel, kind: str, detail: str = "") -> NoReturn:
    reason = f"{kind} ({detail})" if detail else kind
    try:
        ch.send(type=REFUSED, reason=reason)
    except OSError:
        pass
    ch.close()
    raise Refused(reason, kind, detail)


def register(ch: Channel, token: str, deadline: float, **fields) -> None:
    """Worker side: answer the scheduler's challenge with ``fields``; secures ``ch``.

    Raises :class:`Busy` if no challenge came (the scheduler was busy and
    said so, closed the connection, or it broke or timed out first): try
    again. Raises :class:`Refused` if the scheduler refused before the
    challenge (an older scheduler refuses our message this way too).
    """
    try:
        msg = ch.recv(deadline)
    except (OSError, TimeoutError) as exc:
        raise Busy(f"no challenge ({type(exc).__name__}: {exc})") from None
    if msg is None:
        raise Busy("the scheduler closed the connection before its challenge")
    if msg.get("type") == BUSY:
        raise Busy(str(msg.get("reason", BUSY))[:200])
    if msg.get("type") == REFUSED:
        raise Refused(str(msg.get("reason"))[:500])
    if msg.get("type") != CHALLENGE or not auth.is_nonce(msg.get("nonce")):
        raise Refused(f"unexpected first message {str(msg)[:200]} (not an hvdkit scheduler?)")
    mine = auth.new_nonce()
    body = {"type": REGISTER, "nonce": mine, **fields}
    keys = auth.channel_keys(token, config.WORKER)
    ch.send_raw(auth.seal(keys.register, body, msg["nonce"]))
    ch.secure(keys.send, keys.receive, msg["nonce"] + mine)


class Admission:
    """Accepts connections on ``sock`` and runs their handshakes concurrently.

    Authenticated ``(channel, registration, address)`` come out of
    :meth:`next`. At most :data:`MAX_PENDING` handshakes run at once, at
    most :data:`MAX_PENDING_PER_ADDRESS` of them from one address; a
    connection beyond that is told ``busy`` and closed (its worker tries
    again). Refusals and failures are logged with the client's address, one
    line per kind (:data:`REFUSAL_KINDS`) and 10 s at most 20 times. After
    :meth:`close` (or once ``sock`` is closed) late and queued workers are
    refused ("the job is full").
    """

    def __init__(self, sock: socket.socket, token: str, timeout_s: float = HANDSHAKE_TIMEOUT_S):
        self.sock, self.token, self.timeout_s = sock, token, timeout_s
        self._ready: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}  # address -> handshakes in progress (none: absent)
        self._closed = False
        self._refusals = auth.RefusalLog(log, "refused a worker from", REFUSAL_KINDS, burst=20)
        sock.settimeout(0.5)  # accept() wakes up to notice the socket was closed
        self._thread = threading.Thread(target=self._accept_loop, name="hvdkit-admit", daemon=True)
        self._thread.start()

    @property
    def refused(self) -> int:
        """How many connections were refused or dropped so far."""
        return sum(self._refusals.counts.values())

    @property
    def refusals(self):
        """Refusals so far by kind (:data:`REFUSAL_KINDS`)."""
        return self._refusals.counts

    @property
    def pending(self) -> int:
        """Handshakes in progress."""
        with self._lock:
            return sum(self._pending.values())

    def next(self, timeout: float) -> tuple[Channel, dict, tuple] | None:
        try:
            return self._ready.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            leftovers = []
            while True:
                try:
                    leftovers.append(self._ready.get_nowait())
                except queue.Empty:
                    break
        for ch, _, _ in leftovers:
            _quietly_refuse(ch, "the job is full or over")

    def _take_slot(self, host: str) -> str:
        """Count a handshake from ``host``; ``""``, or why there is no slot for it."""
        with self._lock:
            total, mine = sum(self._pending.values()), self._pending.get(host, 0)
            if total >= MAX_PENDING:
                return f"{total} handshakes in progress"
            if mine >= MAX_PENDING_PER_ADDRESS:
                return f"{mine} handshakes in progress from this address"
            self._pending[host] = mine + 1
            return ""

    def _free_slot(self, host: str) -> None:
        with self._lock:
            left = self._pending[host] - 1
            if left:
                self._pending[host] = left
            else:
                del self._pending[host]

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:  # the scheduler closed the socket
                break
            why = self._take_slot(addr[0])
            if why:
                self._refusals(auth.where(addr), BUSY, why)
                _tell_busy(conn, why)
                continue
            threading.Thread(target=self._handshake, args=(conn, addr), daemon=True).start()
        self.close()

    def _handshake(self, conn: socket.socket, addr) -> None:
        try:
            try:
                ch, hello = admit(conn, self.token, time.monotonic() + self.timeout_s)
            except Refused as exc:
                self._refusals(auth.where(addr), exc.kind, exc.detail)
                return
            except TimeoutError:
                why = f"no registration within {self.timeout_s:g} s"
                self._refusals(auth.where(addr), DROPPED, why)
                conn.close()
                return
            except Exception as exc:  # one line per kind, never a traceback
                self._refusals(auth.where(addr), DROPPED, f"{type(exc).__name__}: {exc}")
                conn.close()
                return
            conn.settimeout(None)  # the job may wait long for the other workers
            with self._lock:
                if not self._closed:
                    self._ready.put((ch, hello, addr))
                    return
            _quietly_refuse(ch, "the job is full or over")
        finally:
            self._free_slot(addr[0])


def _tell_busy(conn: socket.socket, why: str) -> None:
    """Say ``busy`` (without waiting on the client) and close: the worker tries again."""
    try:
        conn.setblocking(False)
        conn.send(json.dumps({"type": BUSY, "reason": f"scheduler busy: {why}"}).encode() + b"\n")
    except OSError:
        pass
    conn.close()


def _quietly_refuse(ch: Channel, reason: str) -> None:
    try:
        ch.send(type=ABORT, reason=reason)
    except OSError:
        pass
    ch.close()

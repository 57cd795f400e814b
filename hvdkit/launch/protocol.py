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
bounded amount of memory and time. :class:`Admission` runs handshakes
concurrently (at most :data:`MAX_PENDING` at once), so a slow or hostile
client never holds up a real worker.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
import time

from . import auth

log = logging.getLogger("hvdkit.protocol")
MAX_LINE = 1 << 20  # bytes; a worker's exit report carries its last output lines
HANDSHAKE_TIMEOUT_S = 10.0  # for the whole registration, however slowly bytes trickle in
MAX_PENDING = 32  # handshakes in progress at once; more connections are closed at once
MAX_DROPPED = 16  # forged lines on one connection before it is given up
PROTOCOL_VERSION = 2


class Refused(Exception):
    """The scheduler refused this worker, or a client failed the handshake."""


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

    # ------------------------------------------------------------ authentication
    def secure(self, send_key: bytes, recv_key: bytes, session: str) -> None:
        """From now on sign what is sent and accept only authentic, in-order lines."""
        self._keys = (send_key, recv_key, session)

    @property
    def secured(self) -> bool:
        return self._keys is not None

    # ------------------------------------------------------------ sending
    def send(self, **msg) -> None:
        with self._send_lock:
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

    # ------------------------------------------------------------ receiving
    def recv_line(self, deadline: float | None = None) -> bytes | None:
        """The next line (without its newline); None at end of stream.

        With ``deadline`` (a :func:`time.monotonic` value) raises
        :class:`TimeoutError` once it passes, however the bytes trickle in. A
        line longer than ``max_line`` comes back as ``b"\\x00too long"`` (not
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
                    return b"\x00too long"
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no complete message before the deadline")
                self.sock.settimeout(left)
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self._buf += chunk

    def recv(self, deadline: float | None = None) -> dict | None:
        """Next message, or None when the peer closed the connection.

        Before :meth:`secure`, anything that is not a JSON object comes back as
        ``{"type": "garbage"}``. After it, lines that are not authentic are
        logged and dropped (after :data:`MAX_DROPPED` of them the connection
        counts as lost); the one unsigned message accepted is a ``refused`` as
        the first line, which can only end the conversation.
        """
        while True:
            line = self.recv_line(deadline)
            if line is None:
                return None
            if self._keys is None:
                return _plain(line)
            msg = self._authentic(line)
            if msg is not None:
                return msg
            self.dropped += 1
            if self.dropped >= MAX_DROPPED:
                log.warning("giving up the connection with %s: too many forged lines", self.peer)
                return None

    def _authentic(self, line: bytes) -> dict | None:
        _, recv_key, session = self._keys
        try:
            env = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            env = None
        if not isinstance(env, dict):
            log.warning("dropped a malformed line from %s", _where(self.peer))
            return None
        if env.get("type") == "refused" and "m" not in env and self._received == 0:
            return {"type": "refused", "reason": str(env.get("reason", "refused"))[:500]}
        text, seq = env.get("b"), env.get("n")
        if not isinstance(text, str) or seq != self._received:
            log.warning("dropped a replayed or out-of-order line from %s", _where(self.peer))
            return None
        if not auth.verify(recv_key, env.get("m"), session, seq, text):
            log.warning("dropped a forged line from %s (bad MAC)", _where(self.peer))
            return None
        try:
            msg = auth.parse_body(text)
        except auth.AuthError:
            return None
        self._received += 1
        return msg

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _plain(line: bytes) -> dict:
    try:
        msg = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        msg = None
    if isinstance(msg, dict):
        return msg
    return {"type": "garbage", "raw": line[:200].decode("utf-8", "replace")}


def _where(peer) -> str:
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)


# ---------------------------------------------------------------- the handshake
def admit(conn: socket.socket, token: str, deadline: float) -> tuple[Channel, dict]:
    """Scheduler side: challenge a new connection; its secured channel and registration.

    Raises :class:`Refused` (the reason) after telling the client, or
    :class:`OSError` / :class:`TimeoutError` if the connection broke or was
    too slow.
    """
    ch = Channel(conn)
    nonce = auth.new_nonce()
    ch.send(type="challenge", nonce=nonce, version=PROTOCOL_VERSION)
    line = ch.recv_line(deadline)
    if line is None:
        raise Refused("closed the connection before registering")
    try:
        text, given = auth.open_envelope(line)
    except auth.AuthError:
        msg = _plain(line)
        if msg.get("type") != "register":
            _refuse(ch, "not a registration")
        if "token" in msg:  # hvdkit before the challenge sent the token itself
            _refuse(ch, "bad job token (this worker's hvdkit sends it in clear: update it)")
        _refuse(ch, "bad job token (no proof of it)")
    if not auth.verify(auth.derive_key(token, auth.REGISTER), given, nonce, text):
        _refuse(ch, "bad job token")
    hello = auth.parse_body(text)
    if hello.get("type") != "register" or not auth.is_nonce(hello.get("nonce")):
        _refuse(ch, "not a registration")
    ch.secure(
        auth.derive_key(token, auth.SCHEDULER_TO_WORKER),
        auth.derive_key(token, auth.WORKER_TO_SCHEDULER),
        nonce + hello["nonce"],
    )
    return ch, hello


def _refuse(ch: Channel, reason: str):
    try:
        ch.send(type="refused", reason=reason)
    except OSError:
        pass
    ch.close()
    raise Refused(reason)


def register(ch: Channel, token: str, deadline: float, **fields) -> None:
    """Worker side: answer the scheduler's challenge with ``fields``; secures ``ch``.

    Raises :class:`Refused` if the scheduler refused before the challenge (an
    older scheduler refuses our message this way too).
    """
    msg = ch.recv(deadline)
    if msg is None:
        raise Refused("connection closed")
    if msg.get("type") == "refused":
        raise Refused(str(msg.get("reason")))
    if msg.get("type") != "challenge" or not auth.is_nonce(msg.get("nonce")):
        raise Refused(f"unexpected first message {str(msg)[:200]} (not an hvdkit scheduler?)")
    mine = auth.new_nonce()
    body = {"type": "register", "nonce": mine, **fields}
    ch.send_raw(auth.seal(auth.derive_key(token, auth.REGISTER), body, msg["nonce"]))
    ch.secure(
        auth.derive_key(token, auth.WORKER_TO_SCHEDULER),
        auth.derive_key(token, auth.SCHEDULER_TO_WORKER),
        msg["nonce"] + mine,
    )


class Admission:
    """Accepts connections on ``sock`` and runs their handshakes concurrently.

    Authenticated ``(channel, registration, address)`` come out of
    :meth:`next`. Refusals and failures are logged with the client's
    address. After :meth:`close` (or once ``sock`` is closed) late and queued
    workers are refused ("the job is full").
    """

    def __init__(self, sock: socket.socket, token: str, timeout_s: float = HANDSHAKE_TIMEOUT_S):
        self.sock, self.token, self.timeout_s = sock, token, timeout_s
        self._ready: queue.Queue = queue.Queue()
        self._slots = threading.BoundedSemaphore(MAX_PENDING)
        self._lock = threading.Lock()
        self._closed = False
        # A flood of bad connections gets 20 lines per kind every 10 s, then a count.
        self._refusals = auth.RefusalLog(log, "refused a worker from", burst=20)
        sock.settimeout(0.5)  # accept() wakes up to notice the socket was closed
        self._thread = threading.Thread(target=self._accept_loop, name="hvdkit-admit", daemon=True)
        self._thread.start()

    @property
    def refused(self) -> int:
        """How many connections were refused or dropped so far."""
        return sum(self._refusals.counts.values())

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

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, addr = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:  # the scheduler closed the socket
                break
            if not self._slots.acquire(blocking=False):
                self._refusals(_where(addr), "too many pending handshakes")
                conn.close()
                continue
            threading.Thread(target=self._handshake, args=(conn, addr), daemon=True).start()
        self.close()

    def _handshake(self, conn: socket.socket, addr) -> None:
        try:
            try:
                ch, hello = admit(conn, self.token, time.monotonic() + self.timeout_s)
            except Refused as exc:
                self._refusals(_where(addr), str(exc))
                return
            except (OSError, ValueError, auth.AuthError) as exc:
                why = f"dropped: {exc or type(exc).__name__}"
                if isinstance(exc, TimeoutError):
                    why = f"dropped: no registration within {self.timeout_s:g} s"
                self._refusals(_where(addr), why)
                conn.close()
                return
            conn.settimeout(None)  # the job may wait long for the other workers
            with self._lock:
                if not self._closed:
                    self._ready.put((ch, hello, addr))
                    return
            _quietly_refuse(ch, "the job is full or over")
        finally:
            self._slots.release()


def _quietly_refuse(ch: Channel, reason: str) -> None:
    try:
        ch.send(type="abort", reason=reason)
    except OSError:
        pass
    ch.close()

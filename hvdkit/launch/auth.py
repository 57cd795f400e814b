"""Message authentication for the launcher: the job token never crosses the wire.

Every process of a job knows the job token; none ever sends it. They prove
knowledge of it with HMAC-SHA256 under keys derived from it, one per purpose,
so a key used in one place reveals nothing about the others or the token:

* registration (worker -> scheduler): the scheduler sends a fresh nonce, the
  worker answers ``HMAC(K_register, nonce || its message)``; a recorded answer
  is useless on another connection, whose nonce differs;
* the scheduler/worker conversation after that: each direction has its own
  key, and every message carries ``HMAC(K, session || sequence || message)``,
  the session being both sides' nonces: a forged ``abort`` or rank assignment,
  or a message replayed from another connection or out of order, is dropped;
* heartbeats (UDP): ``HMAC(K_heartbeat, body)`` where the body holds the rank,
  a random sender session, a sequence number and the send time; the receiver
  refuses a sequence number it has seen (replay) and a datagram whose time is
  off (stale, or replayed after the receiver forgot the session).

Bodies are JSON objects, so fields can be added without changing the format.
Comparisons are constant-time (:func:`hmac.compare_digest`).

    >>> key = derive_key("job-token", HEARTBEAT)
    >>> data = seal(key, {"r": 0, "s": 1})
    >>> unseal(key, data)
    {'r': 0, 's': 1}
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import struct
import threading
import time
from collections import Counter, OrderedDict

# Purposes of the keys derived from the job token.
REGISTER = "register"  # worker -> scheduler, answering the scheduler's challenge
SCHEDULER_TO_WORKER = "scheduler-to-worker"
WORKER_TO_SCHEDULER = "worker-to-scheduler"
HEARTBEAT = "heartbeat"

NONCE_HEX_CHARS = 32  # 128 random bits
MAC_HEX_CHARS = 64  # SHA-256


class AuthError(ValueError):
    """A message that is malformed, forged, replayed or stale; the text says which."""


def derive_key(token: str, purpose: str) -> bytes:
    """The key for ``purpose``: ``HMAC-SHA256(token, "hvdkit-" + purpose)``."""
    if not token:
        raise AuthError("empty job token")
    return hmac.new(token.encode(), f"hvdkit-{purpose}".encode(), hashlib.sha256).digest()


def new_nonce() -> str:
    """A fresh random challenge or session id (hex)."""
    return secrets.token_hex(NONCE_HEX_CHARS // 2)


def is_nonce(value: object) -> bool:
    return (
        isinstance(value, str)
        and len(value) == NONCE_HEX_CHARS
        and all(c in "0123456789abcdef" for c in value)
    )


def mac(key: bytes, *parts: str | bytes | int) -> str:
    """HMAC-SHA256 of ``parts``, each length-prefixed so no two part lists collide."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        if isinstance(part, int):
            part = str(part)
        if isinstance(part, str):
            part = part.encode()
        h.update(struct.pack(">Q", len(part)))
        h.update(part)
    return h.hexdigest()


def verify(key: bytes, given: object, *parts: str | bytes | int) -> bool:
    """Whether ``given`` is the MAC of ``parts``, compared in constant time."""
    if not isinstance(given, str) or len(given) != MAC_HEX_CHARS or not given.isascii():
        return False
    return hmac.compare_digest(mac(key, *parts), given)


def body_json(body: dict) -> str:
    return json.dumps(body, separators=(",", ":"))


def seal(key: bytes, body: dict, *context: str | int) -> bytes:
    """``body`` as a signed envelope ``{"b": <json text>, "m": <mac>}`` (bytes).

    The MAC covers ``context`` (e.g. a challenge nonce) and the exact body text,
    so nothing needs to be re-serialised the same way to verify it.
    """
    text = body_json(body)
    return json.dumps({"b": text, "m": mac(key, *context, text)}).encode()


def open_envelope(data: bytes | str) -> tuple[str, object]:
    """``(body text, mac)`` of an envelope, or :class:`AuthError` if it is not one."""
    try:
        env = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise AuthError("malformed: not JSON") from None
    if not isinstance(env, dict) or not isinstance(env.get("b"), str):
        raise AuthError("malformed: not a signed message")
    return env["b"], env.get("m")


def parse_body(text: str) -> dict:
    try:
        body = json.loads(text)
    except ValueError:
        raise AuthError("malformed: signed body is not JSON") from None
    if not isinstance(body, dict):
        raise AuthError("malformed: signed body is not an object")
    return body


def unseal(key: bytes, data: bytes | str, *context: str | int) -> dict:
    """The body of an authentic envelope made by :func:`seal`, else :class:`AuthError`."""
    text, given = open_envelope(data)
    if not verify(key, given, *context, text):
        raise AuthError("forged: bad MAC (wrong job token, or altered)")
    return parse_body(text)


class ReplayGuard:
    """Refuses replayed and stale heartbeats: ``(rank, session, sequence, time)``.

    Each sender picks a random session id when it starts and numbers its
    datagrams from 0. A datagram is fresh if its sequence number was not seen
    in that session, within a sliding window of the last :attr:`WINDOW`
    numbers (datagrams may arrive out of order; older ones are refused as
    IPsec does), and its send time is consistent: for a new session within
    ``max_skew_s`` of this machine's clock (the machines' clocks must agree
    that well), afterwards at most ``max_delay_s`` later than the session's
    fastest datagram predicts. Remembers at most ``max_sessions`` sessions
    (oldest forgotten first); a forgotten session's datagrams then have to
    pass the clock test again.

        >>> guard = ReplayGuard(clock=lambda: 100.0)
        >>> guard.check(0, "session-a", 0, 99.5)
        >>> guard.check(0, "session-a", 0, 99.5)
        Traceback (most recent call last):
        ...
        hvdkit.launch.auth.AuthError: replayed: sequence 0 of rank 0 already seen
    """

    WINDOW = 64

    def __init__(
        self,
        max_skew_s: float = 300.0,
        max_delay_s: float = 30.0,
        max_sessions: int = 4096,
        clock=time.time,
    ):
        self.max_skew_s, self.max_delay_s = max_skew_s, max_delay_s
        self.max_sessions, self.clock = max_sessions, clock
        # (rank, session) -> (highest sequence, sequences seen in the window, fastest lag)
        self._sessions: OrderedDict[tuple[int, str], tuple[int, set[int], float]] = OrderedDict()

    def check(self, rank: int, session: str, seq: int, sent_at: float) -> None:
        """Accept the datagram (and remember it) or raise :class:`AuthError`."""
        if seq < 0:
            raise AuthError(f"malformed: sequence {seq}")
        lag = self.clock() - sent_at  # transit time plus the clocks' difference
        key = (rank, session)
        known = self._sessions.get(key)
        if known is None:
            if abs(lag) > self.max_skew_s:
                raise AuthError(
                    f"stale: sent {lag:+.0f} s from now (more than {self.max_skew_s:g} s; "
                    "replayed, or the machines' clocks disagree)"
                )
            top, seen, offset = seq, set(), lag
        else:
            top, seen, offset = known
            if seq in seen or seq <= top - self.WINDOW:
                raise AuthError(f"replayed: sequence {seq} of rank {rank} already seen")
            if lag - offset > self.max_delay_s:
                raise AuthError(f"stale: arrived {lag - offset:.0f} s late")
        top = max(top, seq)
        seen = {s for s in seen if s > top - self.WINDOW}
        seen.add(seq)
        self._sessions[key] = (top, seen, min(offset, lag))  # the fastest transit seen
        self._sessions.move_to_end(key)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)


class RefusalLog:
    """Counts refused messages by kind and logs them without letting a flood fill the log.

    The kind is the reason up to its first ``:`` or `` (`` ("bad job token",
    "replayed", ...). Each kind gets at most ``burst`` lines per
    ``interval_s``; the next line after a quiet spell says how many were
    suppressed. :attr:`counts` has every refusal.

        >>> import logging
        >>> refusals = RefusalLog(logging.getLogger("demo"), "refused a heartbeat from")
        >>> refusals("10.0.0.9:4000", "replayed: sequence 3 of rank 0 already seen")
        >>> refusals.counts["replayed"]
        1
    """

    def __init__(self, logger, what: str, burst: int = 1, interval_s: float = 10.0):
        self.logger, self.what = logger, what
        self.burst, self.interval_s = burst, interval_s
        self.counts: Counter[str] = Counter()
        self._window: dict[str, tuple[float, int, int]] = {}  # start, logged, suppressed
        self._lock = threading.Lock()

    def __call__(self, address: str, reason: str) -> None:
        kind = reason.split(":")[0].split(" (")[0]
        now = time.monotonic()
        with self._lock:
            self.counts[kind] += 1
            start, logged, suppressed = self._window.get(kind, (now, 0, 0))
            if now - start >= self.interval_s:
                start, logged = now, 0
            if logged >= self.burst:
                self._window[kind] = (start, logged, suppressed + 1)
                return
            self._window[kind] = (start, logged + 1, 0)
        more = f" ({suppressed} more like it were not logged)" if suppressed else ""
        self.logger.warning("%s %s: %s%s", self.what, address, reason, more)

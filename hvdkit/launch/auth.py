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
* heartbeats (UDP): ``HMAC(K_heartbeat, receiver || body)`` where the body
  holds the rank, a random sender session, a sequence number and the send
  time, and ``receiver`` is the random id of the one receiver it is sent to
  (a datagram fails the MAC anywhere else); the receiver refuses a sequence
  number it has seen (replay) and a datagram whose time is off (stale, or
  replayed after the receiver forgot the session).

Everything a listener reads from the network is parsed by :func:`loads`:
bounded in size, strict UTF-8, no depth that could exhaust the stack; it
raises only :class:`AuthError`. Refusals are logged through
:class:`RefusalLog`, keyed on a fixed set of kinds.

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
import os
import re
import secrets
import struct
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

from .. import config

# For _depth: all linear (no pattern backtracks over more than one string).
_ESCAPES = re.compile(r"\\.", re.S)
_STRINGS = re.compile(r'"[^"]*"')
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")

# Purposes of the keys derived from the job token.
REGISTER = "register"  # worker -> scheduler, answering the scheduler's challenge
SCHEDULER_TO_WORKER = "scheduler-to-worker"
WORKER_TO_SCHEDULER = "worker-to-scheduler"
HEARTBEAT = "heartbeat"

NONCE_HEX_CHARS = 32  # 128 random bits
MAC_HEX_CHARS = 64  # SHA-256


# What a refusal of a message can be; an AuthError's text starts with one of them.
MALFORMED, FORGED, REPLAYED, STALE = "malformed", "forged", "replayed", "stale"
AUTH_KINDS = (MALFORMED, FORGED, REPLAYED, STALE)
MAX_DEPTH = 32  # nesting of a JSON message; hvdkit's own go 3 deep


class AuthError(ValueError):
    """A message that is malformed, forged, replayed or stale; the text says which.

    The text is ``"<kind>: <detail>"``; :attr:`kind` is always one of
    :data:`AUTH_KINDS`, whatever the detail says.
    """

    @property
    def kind(self) -> str:
        head = str(self).split(":", 1)[0]
        return head if head in AUTH_KINDS else MALFORMED

    @property
    def detail(self) -> str:
        head, _, rest = str(self).partition(": ")
        return rest if head in AUTH_KINDS else str(self)


def loads(data: bytes | str, max_bytes: int) -> object:
    """JSON from the network, or :class:`AuthError` (``malformed: ...``); nothing else escapes.

    Refuses input longer than ``max_bytes``, bytes that are not UTF-8 (JSON
    over bytes would otherwise guess UTF-16 or UTF-32), and nesting deeper
    than :data:`MAX_DEPTH` (a line of ``[[[...`` would otherwise exhaust the
    parser's recursion).

        >>> loads(b'{"a": [1]}', 100)
        {'a': [1]}
        >>> loads(b"[" * 2000, 4096)
        Traceback (most recent call last):
        ...
        hvdkit.launch.auth.AuthError: malformed: nested more than 32 deep
    """
    if len(data) > max_bytes:
        raise AuthError(f"malformed: {len(data)} bytes (more than {max_bytes})")
    if isinstance(data, (bytes, bytearray)):
        try:
            data = bytes(data).decode("utf-8")
        except UnicodeDecodeError:
            raise AuthError("malformed: not UTF-8") from None
    if _depth(data) > MAX_DEPTH:
        raise AuthError(f"malformed: nested more than {MAX_DEPTH} deep")
    try:
        return json.loads(data)
    except RecursionError:  # unreachable after _depth; kept so nothing else escapes
        raise AuthError(f"malformed: nested more than {MAX_DEPTH} deep") from None
    except ValueError:
        raise AuthError("malformed: not JSON") from None


def _depth(text: str) -> int:
    """An upper bound of the JSON nesting of ``text`` (exact for valid JSON), at C speed.

    Escapes, then strings are cut out (a bracket in a string nests nothing), then the
    innermost empty pairs are removed round after round: valid JSON of depth
    d is gone after d rounds. What is left when a round changes nothing is
    unbalanced, and counts with all its openers. Stops after
    :data:`MAX_DEPTH` + 1 rounds, so a 1 MiB line costs a few dozen passes.
    """
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return 0
    bare = _NOT_BRACKETS.sub("", _STRINGS.sub("", _ESCAPES.sub("", text)))
    rounds = 0
    while bare and rounds <= MAX_DEPTH:
        inner = bare.replace("[]", "").replace("{}", "")
        if inner == bare:
            return rounds + bare.count("[") + bare.count("{")
        bare, rounds = inner, rounds + 1
    return rounds


def derive_key(token: str, purpose: str) -> bytes:
    """The key for ``purpose``: ``HMAC-SHA256(token, "hvdkit-" + purpose)``."""
    if not token:
        raise AuthError("empty job token")
    return hmac.new(token.encode(), f"hvdkit-{purpose}".encode(), hashlib.sha256).digest()


@dataclass(frozen=True)
class ChannelKeys:
    """One side's keys of a scheduler/worker channel, all derived from the job token.

    ``register``: the worker's answer to the challenge (the same on both sides);
    ``send`` / ``receive``: this side's direction keys after admission.
    """

    register: bytes
    send: bytes
    receive: bytes


def channel_keys(token: str, side: str) -> ChannelKeys:
    """The keys ``side`` (``config.SCHEDULER`` or ``config.WORKER``) uses on its channel.

    Example:
        >>> s, w = channel_keys("t0k", "scheduler"), channel_keys("t0k", "worker")
        >>> (s.send == w.receive, s.receive == w.send, s.register == w.register)
        (True, True, True)
    """
    to_worker = derive_key(token, SCHEDULER_TO_WORKER)
    to_scheduler = derive_key(token, WORKER_TO_SCHEDULER)
    if side == config.SCHEDULER:
        send, receive = to_worker, to_scheduler
    elif side == config.WORKER:
        send, receive = to_scheduler, to_worker
    else:
        raise ValueError(f"side={side!r} is neither {config.SCHEDULER!r} nor {config.WORKER!r}")
    return ChannelKeys(derive_key(token, REGISTER), send, receive)


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


def open_envelope(data: bytes | str, max_bytes: int) -> tuple[str, object]:
    """``(body text, mac)`` of an envelope, or :class:`AuthError` if it is not one."""
    env = loads(data, max_bytes)
    if not isinstance(env, dict) or not isinstance(env.get("b"), str):
        raise AuthError("malformed: not a signed message")
    return env["b"], env.get("m")


def parse_body(text: str) -> dict:
    try:
        body = loads(text, len(text))
    except AuthError as exc:
        raise AuthError(f"malformed: signed body: {exc.detail}") from None
    if not isinstance(body, dict):
        raise AuthError("malformed: signed body is not an object")
    return body


def unseal(key: bytes, data: bytes | str, *context: str | int, max_bytes: int = 1 << 16) -> dict:
    """The body of an authentic envelope made by :func:`seal`, else :class:`AuthError`."""
    text, given = open_envelope(data, max_bytes)
    if not verify(key, given, *context, text):
        raise AuthError("forged: bad MAC (wrong job token, altered, or meant for another receiver)")
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


OTHER = "other"  # a kind a RefusalLog was not told about (a bug, still counted)


class RefusalLog:
    """Counts refusals by kind and logs them without letting a flood fill the log.

    ``kinds`` is the fixed set of kinds this listener refuses for (``"bad job
    token"``, ``"replayed"``, ...); a call names one of them and may add a
    detail. The counters and the rate windows are keyed on the kind only, so
    they stay as few as the kinds, whatever a sender makes the details say.
    Each kind gets at most ``burst`` lines per ``interval_s``; the next line
    after a quiet spell says how many were suppressed. A line is one line:
    the detail and the address are cut to :attr:`MAX_DETAIL` printable
    characters. :attr:`counts` has every refusal.

        >>> import logging
        >>> refusals = RefusalLog(logging.getLogger("demo"), "refused a heartbeat from", AUTH_KINDS)
        >>> refusals("10.0.0.9:4000", REPLAYED, "sequence 3 of rank 0 already seen")
        >>> refusals("10.0.0.9:4000", "sequence 4 of rank 0", "a detail passed as the kind")
        >>> dict(refusals.counts)
        {'replayed': 1, 'other': 1}
    """

    MAX_DETAIL = 200

    def __init__(self, logger, what: str, kinds, burst: int = 1, interval_s: float = 10.0):
        self.logger, self.what = logger, what
        self.kinds = frozenset(kinds) | {OTHER}
        self.burst, self.interval_s = burst, interval_s
        self.counts: Counter[str] = Counter()
        self._window: dict[str, tuple[float, int, int]] = {}  # start, logged, suppressed
        self._lock = threading.Lock()

    def __call__(self, address: str, kind: str, detail: str = "") -> None:
        if kind not in self.kinds:
            kind = OTHER
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
        reason = f"{kind}: {_printable(detail)}" if detail else kind
        self.logger.warning("%s %s: %s%s", self.what, _printable(address), reason, more)

    def refuse(self, address: str, exc: AuthError) -> None:
        """Log an :class:`AuthError` under its kind."""
        self(address, exc.kind, exc.detail)


def where(peer: object) -> str:
    """``"host:port"`` of a socket address, for refusal lines."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)


def _printable(text: object) -> str:
    text = str(text)[: RefusalLog.MAX_DETAIL]
    return "".join(c if c.isprintable() else "?" for c in text)


# ---------------------------------------------------------------- the token in a file
def write_token_file(path: str, token: str) -> None:
    """Write ``token`` to ``path`` atomically, readable by the owner only (mode 600).

    Readers never see a half-written token.
    """
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    os.replace(tmp, path)


def read_token_file(path: str) -> str:
    """The job token in ``path``, a file only its owner can read.

    Raises:
        LaunchError: the file cannot be read, is empty, or others may read
            it (group or world permissions); the message names the fix.
    """
    from ..errors import LaunchError

    where = f"{config.TOKEN_FILE}={path}"
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise LaunchError(
            f"{where} cannot be read here ({exc.strerror}). hvdkitrun --gloo gives the ranks "
            "the job token in this file: across machines it must exist at that path on "
            "every machine (a shared home directory, or copy it there with mode 600), or "
            "use --mpi."
        ) from None
    with os.fdopen(fd) as f:
        mode = os.fstat(f.fileno()).st_mode
        if mode & 0o077:
            raise LaunchError(
                f"{where} may be read by other users (mode {mode & 0o777:o}); a job token "
                f"file must be private: chmod 600 {path}."
            )
        token = f.read(4096).strip()
    if not token:
        raise LaunchError(f"{where} is empty; it must hold the job token.")
    return token


def job_token() -> str:
    """This process's job token: ``HVDKIT_JOB_TOKEN``, else ``HVDKIT_TOKEN_FILE``'s content.

    ``""`` when neither is set.
    """
    from .. import config

    token = config.get(config.JOB_TOKEN)
    if token:
        return token
    path = config.get(config.TOKEN_FILE)
    return read_token_file(path) if path else ""

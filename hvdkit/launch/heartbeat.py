"""Liveness heartbeats from ranks to the launcher, over UDP.

Under ``hvdkitrun`` every rank, from ``hvdkit.init()`` on, sends one small
datagram per second to the launcher. A rank that is frozen (SIGSTOP, a
deadlock holding the GIL, a machine that went away) stops sending, and the
launcher ends the job naming it after the stall timeout. Datagrams are signed
with a key derived from the job token (the token is never sent) and the id of
the one receiver they are meant for, and carry a sequence number and the send
time, so stray, forged, replayed, stale or misdirected packets are refused
(:mod:`hvdkit.launch.auth`). The launcher gives the ranks the receiver as
``HVDKIT_MONITOR_ADDR=<host>:<port>/<receiver id>`` (:func:`monitor_addr`).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from .._comm.progress import COMPLETED, WAITED_S, WAITING
from . import auth

log = logging.getLogger("hvdkit.heartbeat")

INTERVAL_S = 1.0
STUCK_GRACE_S = 5 * INTERVAL_S  # see stuck_report
STUCK = "ranks stuck in different collectives"  # how stuck_report's report begins


def stall_timeout(value: float | None = None) -> float:
    """The stall timeout: ``value`` if given, else ``HVDKIT_STALL_TIMEOUT``, else 120 s."""
    from .. import config
    from ..errors import LaunchError

    if value is None:
        value = config.get_float(
            config.STALL_TIMEOUT,
            config.DEFAULT_STALL_TIMEOUT_S,
            what="a number of seconds",
            error=LaunchError,
        )
    if value <= 0:
        raise LaunchError(f"stall timeout {value:g} must be positive (seconds).")
    return value


def horovod_stall_env(stall_s: float) -> dict[str, str]:
    """Settings for Horovod's own stall inspector.

    It covers a rank that is alive but never reaches a collective the others
    wait in, outside hvdkit's own collectives; Horovod names the missing ranks
    and, with a shutdown time, ends the collective with an error on every
    rank. The shutdown comes after hvdkit's stuck report (stall timeout +
    ``STUCK_GRACE_S``), which names what every rank waits in.
    """
    return {
        "HOROVOD_STALL_CHECK_TIME_SECONDS": str(int(max(1, min(60, stall_s / 2)))),
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(int(stall_s + 2 * STUCK_GRACE_S)),
    }


def monitor_addr(host: str, port: int, receiver: str) -> str:
    """``HVDKIT_MONITOR_ADDR``'s value: where heartbeats go, and the receiver's id.

    >>> monitor_addr("127.0.0.1", 4000, "ab" * 16)
    '127.0.0.1:4000/abababababababababababababababab'
    """
    return f"{host}:{port}/{receiver}"


def parse_monitor_addr(value: str) -> tuple[str, int, str]:
    """``(host, port, receiver)`` of an ``HVDKIT_MONITOR_ADDR`` value.

    Raises:
        LaunchError: the value is not ``host:port/receiver``.
    """
    from .. import config
    from ..errors import LaunchError

    where, _, receiver = value.partition("/")
    host, _, port = where.rpartition(":")
    if not host or not port.isdigit() or not auth.is_nonce(receiver):
        raise LaunchError(
            f"{config.MONITOR_ADDR}={value!r} is not <host>:<port>/<receiver id>. The launcher "
            "(hvdkitrun, or a worker) sets it: start the program with a launcher of the same "
            f"hvdkit version, or unset {config.MONITOR_ADDR}."
        )
    return host, int(port), receiver


class Beats:
    """The datagrams of one sender to one receiver: signed bodies with a session id and sequence.

    >>> beats = Beats("job-token", rank=0, receiver="ab" * 16)
    >>> b"job-token" in beats.next()
    False
    """

    def __init__(
        self,
        token: str,
        rank: int,
        status: Callable[[], dict] | None = None,
        *,
        receiver: str,
    ):
        self._key = auth.derive_key(token, auth.HEARTBEAT)
        self._receiver = receiver
        self._fixed = {"r": rank, "p": os.getpid(), "h": socket.gethostname()}
        self._fixed["n"] = auth.new_nonce()  # this process's session
        self._seq = itertools.count()
        self._status = status
        self._lock = threading.Lock()

    def set_rank(self, rank: int) -> None:
        """From the next beat on, speak for ``rank`` (after an in-process recovery)."""
        with self._lock:
            self._fixed["r"] = rank

    def next(self, **extra) -> bytes:
        """The next datagram; ``extra`` fields (e.g. ``bye=True``) are added to its body."""
        body = {**(self._status() if self._status else {}), **self._fixed, **extra}
        with self._lock:  # the beat thread and the exit handler both send
            body.update(s=next(self._seq), t=time.time())
        return auth.seal(self._key, body, self._receiver)


def _bye_if_clean_exit(send: Callable[..., None]) -> Callable[[], None]:
    """An atexit handler that sends "bye" only if this process is ending cleanly.

    Python tells atexit handlers nothing about the exit status, so the two
    ways a script fails are watched as they happen: an uncaught exception
    (``sys.excepthook``) and ``sys.exit`` with a non-zero or non-integer
    status. (A ``SystemExit`` raised by hand, or a non-zero ``sys.exit`` that
    the script catches and survives, is not seen.)
    """
    failed = []
    previous_hook, previous_exit = sys.excepthook, sys.exit

    def excepthook(kind, value, traceback):
        failed.append(kind.__name__)
        previous_hook(kind, value, traceback)

    def exit_(status=None):
        if status not in (None, 0):
            failed.append(f"sys.exit({status!r})")
        previous_exit(status)

    sys.excepthook, sys.exit = excepthook, exit_

    def bye():
        if not failed:
            send(bye=True)

    return bye


def start_sender_from_env(rank: int, status: Callable[[], dict] | None = None) -> None:
    """Start heartbeats if the launcher asked for them (``HVDKIT_MONITOR_ADDR``).

    The job token comes from ``HVDKIT_JOB_TOKEN`` or ``HVDKIT_TOKEN_FILE``
    (:func:`auth.job_token`; hvdkitrun --gloo uses the file).
    """
    from .. import config

    addr = config.get(config.MONITOR_ADDR)
    if addr:
        host, port, receiver = parse_monitor_addr(addr)
        start_sender(host, port, auth.job_token(), rank, status, receiver=receiver)


def start_sender(
    host: str,
    port: int,
    token: str,
    rank: int,
    status: Callable[[], dict] | None = None,
    *,
    receiver: str,
) -> threading.Thread:
    """Send heartbeats for ``rank`` from a daemon thread until the process exits.

    Each datagram is a signed JSON body (:func:`hvdkit.launch.auth.seal`) with
    the rank, pid, host, a random session id, a sequence number and the send
    time, its MAC bound to ``receiver`` (the id of the monitor at
    ``host:port``); the token itself is never sent. ``status``, if given,
    returns extra fields to include in each beat (a JSON object; keys must
    not clash).

    At a clean interpreter exit (the script ended, or ``sys.exit(0)``) a last
    "bye" datagram tells the launcher this rank finished, so that silence
    afterwards is not taken for a stall. An uncaught exception or
    ``sys.exit(n)`` with ``n != 0`` sends none: that rank failed.

    The first beat is sent before this returns.
    """
    from .. import config
    from ..errors import LaunchError

    if not token:
        raise LaunchError(
            f"{config.MONITOR_ADDR} is set but neither {config.JOB_TOKEN} nor "
            f"{config.TOKEN_FILE} is: heartbeats could not be authenticated. Start the program "
            f"with hvdkitrun (which sets them), or unset {config.MONITOR_ADDR}."
        )
    from .._comm import progress as _progress

    beats = Beats(token, rank, status, receiver=receiver)
    _progress.on_rank_change(beats.set_rank)  # an in-process recovery renumbers ranks
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    def send(**extra):
        try:
            sock.sendto(beats.next(**extra), (host, port))
        except Exception:
            pass

    def loop():
        while True:
            time.sleep(INTERVAL_S)
            send()

    # The first beat leaves before this returns: a rank that freezes right
    # after (SIGSTOP as Horovod starts) is then known to its launcher, which
    # watches only ranks it has heard from, and is found silent at the stall
    # timeout. Sent from the beat thread, it could lose the race to the freeze.
    send()
    atexit.register(_bye_if_clean_exit(send))
    thread = threading.Thread(target=loop, name="hvdkit-heartbeat", daemon=True)
    thread.start()
    return thread


@dataclass
class RankStatus:
    pid: int
    host: str
    last_seen: float
    beats: int = 0
    finished: bool = False
    session: str = ""
    info: dict = field(default_factory=dict)  # the last authentic beat's body


MAX_DATAGRAM = 4096  # bytes; a longer datagram is cut here and then fails its MAC
MAX_RANK = 1 << 20


@dataclass
class HeartbeatMonitor:
    """Receives heartbeats; tells which ranks have been silent for too long.

    Accepts only datagrams signed with the job's heartbeat key for this
    receiver (:attr:`receiver`, a random id: a datagram meant for another
    receiver fails its MAC here) whose ``(rank, session, sequence, time)`` is
    fresh (:class:`auth.ReplayGuard`); anything else (garbage, forged,
    replayed, stale) is counted in :attr:`refused` by kind
    (:data:`auth.AUTH_KINDS`) and logged, at most once per kind every 10 s
    with the number suppressed meanwhile (:class:`auth.RefusalLog`).
    """

    token: str
    bind_host: str = "127.0.0.1"
    ranks: dict[int, RankStatus] = field(default_factory=dict)
    LOOK_S: ClassVar[float] = 0.5  # the receiving thread looks whether to stop this often

    def __post_init__(self):
        self._key = auth.derive_key(self.token, auth.HEARTBEAT)
        self.receiver = auth.new_nonce()  # this receiver's identity, in every MAC it accepts
        self._guard = auth.ReplayGuard()
        self._refusals = auth.RefusalLog(log, "refused a heartbeat from", auth.AUTH_KINDS)
        self.refused = self._refusals.counts
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((self.bind_host, 0))
        self._sock.settimeout(self.LOOK_S)
        self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hvdkit-monitor", daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._stop.is_set():
            try:
                data, addr = self._sock.recvfrom(MAX_DATAGRAM)
            except (TimeoutError, OSError):
                continue
            if self._stop.is_set():  # close()'s wake-up (or a datagram as it closes)
                break
            try:
                self.accept(data)
            except auth.AuthError as exc:
                self._refusals.refuse(auth.where(addr), exc)
            except Exception as exc:  # one line per kind, never a dead receiver
                self._refusals(auth.where(addr), auth.MALFORMED, type(exc).__name__)

    def accept(self, data: bytes) -> int:
        """Record an authentic, fresh heartbeat; its rank. Raises :class:`auth.AuthError`."""
        body = auth.unseal(self._key, data, self.receiver, max_bytes=MAX_DATAGRAM)
        try:
            rank, pid, host = int(body["r"]), int(body["p"]), str(body["h"])
            session, seq, sent_at = str(body["n"]), int(body["s"]), float(body["t"])
        except (KeyError, TypeError, ValueError):
            raise auth.AuthError("malformed: a signed heartbeat without its fields") from None
        if not 0 <= rank < MAX_RANK:
            raise auth.AuthError(f"malformed: rank {rank}")
        with self._lock:
            self._guard.check(rank, session, seq, sent_at)
            status = self.ranks.get(rank)
            if status is None or status.session != session:
                # One process, one entry: the same session heard under another
                # number was renumbered by an in-process recovery. It may beat
                # under its old number after forget() and before it learns the
                # new one (it meets the new world first); that entry would then
                # fall silent and be taken for a frozen rank.
                for old in [k for k, s in self.ranks.items() if k != rank and s.session == session]:
                    del self.ranks[old]
            if status is None:
                status = self.ranks[rank] = RankStatus(pid, host, 0.0)
            if status.session != session:  # a new process for this rank
                status.session, status.finished = session, False
            status.pid, status.host, status.info = pid, host, body
            status.last_seen = time.monotonic()
            status.beats += 1
            status.finished = status.finished or bool(body.get("bye"))
        return rank

    def silent_ranks(self, timeout: float) -> list[tuple[int, float]]:
        """``(rank, seconds since last heartbeat)`` for ranks silent longer than ``timeout``."""
        now = time.monotonic()
        with self._lock:
            return sorted(
                (r, now - s.last_seen)
                for r, s in self.ranks.items()
                if not s.finished and now - s.last_seen > timeout
            )

    def stuck_report(self, timeout: float) -> str:
        """Why the job is stuck, if a live rank has waited in one collective over ``timeout``.

        Ranks report the hvdkit collective they wait in (:mod:`hvdkit._comm.progress`).
        Waiting longer than the stall timeout means the other ranks are in a
        different collective, or in none (a long rank-local section): the
        report names what every rank is doing. ``""`` when nothing is stuck.
        """
        now = time.monotonic()
        with self._lock:
            live = {r: s for r, s in self.ranks.items() if not s.finished}
            if any(now - s.last_seen > max(timeout / 2, 3 * INTERVAL_S) for s in live.values()):
                # A silent rank is frozen, not waiting: its last report ages
                # without it; silent_ranks() names it once the timeout passes.
                return ""
            waited = [w for w in (_waited(s, now) for s in live.values()) if w is not None]
            # The grace lets a frozen rank (silent, so named by silent_ranks())
            # be reported as such before the peers waiting on it look stuck.
            if not waited or max(waited) <= timeout + STUCK_GRACE_S:
                return ""
            parts = [f"rank {r} {_doing(s, now)}" for r, s in sorted(live.items())]
        return (
            f"{STUCK} for more than {timeout:g} s: "
            + "; ".join(parts)
            + ". Every rank must run the same collectives in the same order "
            "(see docs/divergence.md)"
        )

    def doings(self) -> dict[int, str]:
        """What each live rank is doing now, as in :meth:`stuck_report`.

        Example: ``{0: "is in no hvdkit collective (busy in its own code; 9
        done)", 1: "waits in allreduce 'x' for 31 s"}``. The scheduler asks
        every worker for this when one of them reports stuck ranks, since a
        worker's monitor sees only the ranks on its own machine.
        """
        now = time.monotonic()
        with self._lock:
            return {r: _doing(s, now) for r, s in sorted(self.ranks.items()) if not s.finished}

    def forget(self) -> None:
        """The ranks are renumbered (an in-process recovery): file each under ``-1 - rank``.

        Until a process beats again it stays watched under the old one, so a
        rank that froze meanwhile is still found silent. Its next beat, under
        whatever number, replaces the entry (:meth:`accept` keeps one per
        process session).
        """
        with self._lock:
            self.ranks = {-1 - r if r >= 0 else r: s for r, s in self.ranks.items()}

    def local_pids(self) -> dict[int, int]:
        """Rank -> pid of the ranks that run on this machine."""
        me = socket.gethostname()
        with self._lock:
            return {r: s.pid for r, s in self.ranks.items() if s.host == me}

    def close(self):
        """Stop receiving, at once: a datagram to itself ends the wait in ``recvfrom``."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.sendto(b"", self._sock.getsockname())
        self._thread.join(timeout=2)
        self._sock.close()


def _waited(status: RankStatus, now: float) -> float | None:
    """Seconds ``status``'s rank has waited in its collective, or None if it waits in none."""
    if not status.info.get(WAITING):
        return None
    return float(status.info.get(WAITED_S, 0.0)) + (now - status.last_seen)


def _doing(status: RankStatus, now: float) -> str:
    """``waits in allreduce 'x' (step 3) for 31 s`` or ``is in no hvdkit collective (...)``."""
    waited = _waited(status, now)
    if waited is not None:
        return f"waits in {str(status.info[WAITING])[:200]} for {waited:.0f} s"
    done = status.info.get(COMPLETED, "?")
    return f"is in no hvdkit collective (busy in its own code; {done} done)"

"""Liveness heartbeats from ranks to the launcher, over UDP.

Under ``hvdkitrun`` every rank, from ``hvdkit.init()`` on, sends one small
datagram per second to the launcher. A rank that is frozen (SIGSTOP, a
deadlock holding the GIL, a machine that went away) stops sending, and the
launcher ends the job naming it after the stall timeout. Datagrams carry the
job token, so stray or forged packets are ignored.
"""

from __future__ import annotations

import atexit
import hmac
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field

INTERVAL_S = 1.0
DEFAULT_STALL_TIMEOUT_S = 120.0


def stall_timeout(value: float | None = None) -> float:
    """The stall timeout: ``value`` if given, else ``HVDKIT_STALL_TIMEOUT``, else 120 s."""
    from .. import config
    from ..errors import LaunchError

    if value is None:
        raw = config.get(config.STALL_TIMEOUT, str(DEFAULT_STALL_TIMEOUT_S))
        try:
            value = float(raw)
        except ValueError:
            raise LaunchError(f"HVDKIT_STALL_TIMEOUT={raw!r} is not a number of seconds.") from None
    if value <= 0:
        raise LaunchError(f"stall timeout {value:g} must be positive (seconds).")
    return value


def horovod_stall_env(stall_s: float) -> dict[str, str]:
    """Settings for Horovod's own stall inspector.

    It covers a rank that is alive but never reaches a collective the others
    wait in (heartbeats cannot see that); Horovod names the missing ranks and,
    with a shutdown time, ends the collective with an error on every rank.
    """
    return {
        "HOROVOD_STALL_CHECK_TIME_SECONDS": str(int(max(1, min(60, stall_s / 2)))),
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(int(stall_s)),
    }


def start_sender(host: str, port: int, token: str, rank: int) -> threading.Thread:
    """Send heartbeats for ``rank`` from a daemon thread until the process exits.

    At a normal interpreter exit a last "bye" datagram tells the launcher this
    rank finished, so that silence afterwards is not taken for a stall.
    """
    payload = {"t": token, "r": rank, "p": os.getpid(), "h": socket.gethostname()}
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    def send(**extra):
        try:
            sock.sendto(json.dumps({**payload, **extra}).encode(), (host, port))
        except OSError:
            pass  # the launcher may be gone; nothing useful to do here

    def loop():
        seq = 0
        while True:
            send(s=seq)
            seq += 1
            time.sleep(INTERVAL_S)

    atexit.register(send, bye=True)
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


@dataclass
class HeartbeatMonitor:
    """Receives heartbeats; tells which ranks have been silent for too long."""

    token: str
    bind_host: str = "127.0.0.1"
    ranks: dict[int, RankStatus] = field(default_factory=dict)

    def __post_init__(self):
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((self.bind_host, 0))
        self._sock.settimeout(0.5)
        self.port = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hvdkit-monitor", daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._stop.is_set():
            try:
                data, _ = self._sock.recvfrom(4096)
            except (TimeoutError, OSError):
                continue
            msg = self._parse(data)
            if msg is None:
                continue
            rank, pid, host, bye = msg
            with self._lock:
                status = self.ranks.get(rank)
                if status is None:
                    status = self.ranks[rank] = RankStatus(pid, host, 0.0)
                status.last_seen = time.monotonic()
                status.beats += 1
                status.finished = status.finished or bye

    def _parse(self, data: bytes) -> tuple[int, int, str, bool] | None:
        """(rank, pid, host, is_bye) of an authentic, well-formed heartbeat, else None."""
        try:
            msg = json.loads(data)
            token = str(msg["t"])
            rank, pid, host = int(msg["r"]), int(msg["p"]), str(msg["h"])
        except (ValueError, TypeError, KeyError):
            return None
        if not hmac.compare_digest(token.encode(), self.token.encode()) or rank < 0:
            return None
        return rank, pid, host, bool(msg.get("bye"))

    def silent_ranks(self, timeout: float) -> list[tuple[int, float]]:
        """``(rank, seconds since last heartbeat)`` for ranks silent longer than ``timeout``."""
        now = time.monotonic()
        with self._lock:
            return sorted(
                (r, now - s.last_seen)
                for r, s in self.ranks.items()
                if not s.finished and now - s.last_seen > timeout
            )

    def local_pids(self) -> dict[int, int]:
        """Rank -> pid of the ranks that run on this machine."""
        me = socket.gethostname()
        with self._lock:
            return {r: s.pid for r, s in self.ranks.items() if s.host == me}

    def close(self):
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()

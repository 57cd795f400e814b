"""Starting, supervising and stopping the processes of a job, by pid, within a bounded time."""

from __future__ import annotations

import contextlib
import functools
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import psutil

from .wakeup import Wakeup


def bin_dir() -> str:
    """The folder of the running interpreter: a venv's ``bin`` when called by path."""
    return os.path.dirname(sys.executable)


def find_tool(name: str) -> str | None:
    """``name`` (e.g. ``horovodrun``) beside the running interpreter, else on PATH.

    ``.venv/bin/hvdkitrun`` must work without the venv being activated, so the
    tools installed with hvdkit win over whatever PATH holds.
    """
    beside = os.path.join(bin_dir(), name)
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which(name)


def program_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the interpreter's folder first on PATH.

    So that ``python train.py`` in a job started by ``.venv/bin/hvdkitrun``
    runs the venv's Python, as it would with the venv activated.
    """
    path = env.get("PATH", "")
    if path.split(os.pathsep)[:1] != [bin_dir()]:
        env = {**env, "PATH": os.pathsep.join([bin_dir(), path]) if path else bin_dir()}
    return env


def spawn(
    command: list[str], env: dict[str, str], parent_death: int = signal.SIGTERM
) -> subprocess.Popen:
    """Start a supervised child: byte pipes, its own session, dies with its parent.

    Byte pipes, unbuffered: :class:`~hvdkit.launch.output.RankOutput` decodes
    them itself (a program may print anything) and sees each write at once.

    Its own session lets us stop it and everything it started as one group
    (and keeps the terminal's Ctrl-C for the supervisor to handle).
    ``parent_death`` is the signal it gets if we die: a worker's rank gets
    SIGKILL, since SIGTERM asks a rank for a preemption (hvdkit.preemption).
    """
    return subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
        start_new_session=True,
        preexec_fn=functools.partial(die_with_parent, parent_death),
    )


@contextlib.contextmanager
def stop_signals() -> Iterator[list[str]]:
    """Record SIGINT/SIGTERM/SIGHUP (by name) instead of dying, while supervising."""
    received: list[str] = []
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    prev = {
        s: signal.signal(s, lambda n, _f: received.append(signal.Signals(n).name)) for s in sigs
    }
    try:
        yield received
    finally:
        for s, handler in prev.items():
            signal.signal(s, handler)


@dataclass
class Ended:
    """How a supervised program ended."""

    returncode: int
    stalled: list[tuple[int, float]] = field(default_factory=list)  # (rank, seconds silent)
    stuck: str = ""  # ranks alive but waiting in different collectives (heartbeat.stuck_report)
    reasons: list[str] = field(default_factory=list)  # why it was told to stop, if it was


class _ExitWatch:
    """Waits up to a time for the child's exit (its pidfd) or a :class:`Wakeup`, whichever first.

    Where ``pidfd_open`` is missing (Linux before 5.3), the wait is the full time
    unless woken: the child's exit is then seen at the next poll, as before.
    """

    def __init__(self, child: subprocess.Popen, wake: Wakeup | None):
        self._wake = wake
        self._fds: list = [] if wake is None else [wake]
        self._pidfd = None
        with contextlib.suppress(AttributeError, OSError):  # no pidfd here, or already reaped
            self._pidfd = os.pidfd_open(child.pid)
            self._fds.append(self._pidfd)

    def __enter__(self) -> _ExitWatch:
        return self

    def __exit__(self, *exc) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)

    def wait(self, seconds: float) -> None:
        if not self._fds:
            time.sleep(seconds)
            return
        ready, _, _ = select.select(self._fds, [], [], seconds)
        if self._wake is not None and self._wake in ready:
            self._wake.clear()


def supervise(
    child: subprocess.Popen,
    monitor,
    stall_s: float,
    stop_reasons: list[str],
    *,
    on_tick: Callable[[], float | None] | None = None,
    on_stop: Callable[[list[tuple[int, float]], str], None] | None = None,
    poll_s: float = 0.25,
    stuck_s: float | None = None,
    wake: Wakeup | None = None,
) -> Ended:
    """Wait for ``child``; stop its process group on a stall or once a stop reason appears.

    A rank is stalled after ``stall_s`` without a heartbeat, stuck after
    ``stuck_s`` (default ``stall_s``) waiting in one collective.

    The one supervise loop of ``hvdkitrun`` and of a worker. ``monitor`` is a
    :class:`~hvdkit.launch.heartbeat.HeartbeatMonitor`; ``stop_reasons`` is
    filled by other threads (signals, the scheduler's abort). ``on_tick`` runs
    at least every ``poll_s`` (or as soon as the seconds it returns, if fewer),
    at once when ``child`` exits, and when another thread sets ``wake``;
    ``on_stop(stalled, stuck)`` runs before the group is stopped (:func:`stop_group`:
    SIGTERM, which an hvdkit rank takes as a preemption): the place to kill
    outright a rank that must not take it so.
    """
    stalled: list[tuple[int, float]] = []
    stuck = ""
    with _ExitWatch(child, wake) as watch:
        while child.poll() is None:
            sooner = on_tick() if on_tick is not None else None
            stalled = monitor.silent_ranks(stall_s)
            stuck = "" if stalled else monitor.stuck_report(stall_s if stuck_s is None else stuck_s)
            if stalled or stuck or stop_reasons:
                break
            watch.wait(poll_s if sooner is None else min(poll_s, sooner))
    # Snapshot now: a reason that arrives after the program ended (e.g. the
    # scheduler closing the connection once we report) did not stop it.
    reasons = list(stop_reasons)
    if child.poll() is None:
        if on_stop is not None:
            on_stop(stalled, stuck)
        stop_group(child.pid)
    child.wait()
    return Ended(child.returncode, stalled, stuck=stuck, reasons=reasons)


def stop(processes: list[psutil.Process], grace_s: float = 5.0) -> list[int]:
    """SIGTERM (after SIGCONT, so stopped processes can act on it), then SIGKILL.

    Only the given processes are signalled: ones we started, or that reported
    themselves as ranks of this job. Returns the pids that had to be killed.
    """
    alive = [p for p in processes if _running(p)]
    for p in alive:
        _signal(p, signal.SIGCONT)
        _signal(p, signal.SIGTERM)
    _, alive = psutil.wait_procs(alive, timeout=grace_s)
    for p in alive:
        _signal(p, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=grace_s)
    return [p.pid for p in alive]


def kill(processes: list[psutil.Process | None]) -> None:
    """SIGKILL the given processes (ours: started by us or reported as our ranks)."""
    for p in processes:
        if p is not None and _running(p):
            _signal(p, signal.SIGKILL)


def stop_group(pgid: int, grace_s: float = 5.0) -> None:
    """Terminate a process group we created (``start_new_session=True``)."""
    for sig in (signal.SIGCONT, signal.SIGTERM):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _group_alive(pgid):
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def descendant(ancestor_pid: int, pid: int) -> psutil.Process | None:
    """``pid``'s process if it descends from ``ancestor_pid`` (a process we started).

    Pids reported over the network are never trusted on their own: only a
    process in our own tree may be signalled.
    """
    try:
        proc = psutil.Process(pid)
        if any(parent.pid == ancestor_pid for parent in proc.parents()):
            return proc
    except psutil.Error:
        pass
    return None


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """``preexec_fn``: the child gets ``sig`` if the launcher dies (Linux only).

    Covers a launcher killed by SIGKILL or the OOM killer, which cannot run
    its own clean-up.
    """
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, int(sig))
    except (OSError, AttributeError):
        pass


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)
    except psutil.Error:
        pass


def _group_alive(pgid: int) -> bool:
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error, OSError):
            continue
    return False

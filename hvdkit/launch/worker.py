"""A worker of a multi-node job without SSH (MindSpore's worker role).

Registers with the scheduler, receives its rank and Horovod's Gloo
rendezvous settings, runs the training command with them, reports how it
ended, and stops it if the scheduler says another rank failed.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

import psutil

from .. import _compat, config
from ..errors import LaunchError
from . import processes
from .heartbeat import HeartbeatMonitor, horovod_stall_env, stall_timeout
from .output import RankOutput
from .protocol import Channel

log = logging.getLogger("hvdkit.worker")
_ROLE_VARS = (config.ROLE, *config.MINDSPORE_ALIASES.values())


def interface_for(address: str) -> str:
    """Name of the network interface that holds ``address`` (for HOROVOD_GLOO_IFACE)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    raise LaunchError(f"no network interface has the address {address}; cannot set up Gloo.")


def connect(host: str, port: int, timeout_s: float) -> Channel:
    """Connect to the scheduler, retrying until it is up or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            sock = socket.create_connection((host, port), timeout=5)
            sock.settimeout(None)  # the job may wait long for other workers
            return Channel(sock)
        except OSError as exc:
            last = exc
            time.sleep(0.5)
    raise LaunchError(
        f"cannot reach the scheduler at {host}:{port} within {timeout_s:g} s ({last}); check "
        "HVDKIT_SCHED_HOST/HVDKIT_SCHED_PORT and that the scheduler is running."
    )


def horovod_env(assign: dict, sched_host: str, iface: str) -> dict[str, str]:
    """The variables Horovod's Gloo launcher gives each process."""
    return {
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": sched_host,
        "HOROVOD_GLOO_RENDEZVOUS_PORT": str(assign["rendezvous_port"]),
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": iface,
        "HOROVOD_HOSTNAME": assign["hostname"],
        "HOROVOD_RANK": str(assign["rank"]),
        "HOROVOD_SIZE": str(assign["size"]),
        "HOROVOD_LOCAL_RANK": str(assign["local_rank"]),
        "HOROVOD_LOCAL_SIZE": str(assign["local_size"]),
        "HOROVOD_CROSS_RANK": str(assign["cross_rank"]),
        "HOROVOD_CROSS_SIZE": str(assign["cross_size"]),
    }


def run_worker(
    sched_host: str,
    sched_port: int,
    token: str,
    command: list[str],
    timeout_s: float,
    log_dir: str | None,
) -> int:
    """Register, run ``command`` as the assigned rank, report; returns the exit status."""
    _compat.check_gloo_hostname(sched_host)
    stall = stall_timeout()  # bad settings fail here, before this worker counts as arrived
    ch = connect(sched_host, sched_port, timeout_s)
    try:
        assign = _register(ch, token, sched_host, sched_port)
        return _run_program(ch, assign, sched_host, token, command, stall, log_dir)
    finally:
        ch.close()


def _register(ch: Channel, token: str, sched_host: str, sched_port: int) -> dict:
    ch.send(type="register", token=token, hostname=socket.gethostname(), pid=os.getpid())
    msg = ch.recv()
    if msg is None or msg.get("type") == "refused":
        reason = (msg or {}).get("reason", "connection closed")
        raise LaunchError(
            f"the scheduler at {sched_host}:{sched_port} refused this worker: {reason}. Use the "
            "job token the scheduler printed (HVDKIT_JOB_TOKEN) and the scheduler's port."
        )
    if msg.get("type") == "abort":
        raise LaunchError(f"the scheduler stopped the job before it started: {msg.get('reason')}")
    if msg.get("type") != "assign":
        raise LaunchError(f"unexpected message from the scheduler: {msg}")
    return msg


def _report(ch: Channel, code: int, detail: str, tail: list[str]) -> None:
    try:
        ch.send(type="exit", code=code, detail=detail, tail=tail)
    except OSError:
        pass  # the scheduler is gone; it has its own account of this rank


def _describe_exit(code: int) -> str:
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"killed by signal {-code}"


def _run_program(ch, assign, sched_host, token, command, stall, log_dir) -> int:
    rank = assign["rank"]
    try:
        iface = interface_for(ch.sock.getsockname()[0])
    except LaunchError as exc:
        _report(ch, 1, str(exc), [])
        raise
    env = processes.program_env({k: v for k, v in os.environ.items() if k not in _ROLE_VARS})
    env.update(horovod_env(assign, sched_host, iface))
    for key, value in horovod_stall_env(stall).items():  # alive but stuck, not frozen
        env.setdefault(key, value)
    log.info(
        "rank %d of %d (local %d of %d) on %s",
        rank,
        assign["size"],
        assign["local_rank"],
        assign["local_size"],
        iface,
    )
    # The program's heartbeats come to this worker (same machine), which stops
    # a frozen program after the stall timeout and reports it.
    monitor = HeartbeatMonitor(token, bind_host="127.0.0.1")
    env[config.MONITOR_ADDR] = f"127.0.0.1:{monitor.port}"
    env[config.JOB_TOKEN] = token

    out = RankOutput(log_dir)
    try:
        with processes.stop_signals() as stop_reasons:
            try:
                child = processes.spawn(command, env)
            except OSError as exc:
                detail = f"cannot start {command[0]!r}: {exc.strerror}"
                _report(ch, 127, detail, [])
                raise LaunchError(detail) from None
            code, stalled, reasons = _supervise(ch, child, monitor, out, rank, stall, stop_reasons)
    finally:
        monitor.close()
        out.close()
    if stalled is not None:
        detail = f"stalled: no heartbeat for {stalled:.0f} s (stall timeout {stall:g} s)"
        code = code if code > 0 else 1
    else:
        detail = _describe_exit(code)
    if reasons and stalled is None:
        log.error("rank %d stopped: %s", rank, reasons[0])
    _report(ch, code, detail, out.tail(rank))
    if code == 0:
        return 1 if reasons else 0
    return code if code > 0 else 1


def _supervise(ch, child, monitor, out, rank, stall, stop_reasons):
    """Relay output; stop the program on a stall, a signal, an abort or a lost scheduler.

    Returns ``(exit code, seconds silent if it stalled else None, stop reasons)``.
    """
    pumps = [_pump(out, rank, child.stdout, "stdout"), _pump(out, rank, child.stderr, "stderr")]

    def listen():
        m = ch.recv() if child.poll() is None else None
        if m is None:
            stop_reasons.append("lost the connection to the scheduler")
        elif m.get("type") == "abort":
            stop_reasons.append(str(m.get("reason")))

    threading.Thread(target=listen, daemon=True).start()
    stalled = None
    while child.poll() is None:
        silent = monitor.silent_ranks(stall)
        if silent and stalled is None:
            stalled = silent[0][1]
            log.error("rank %d stalled: no heartbeat for %.0f s; stopping it", rank, stalled)
        if stalled is not None or stop_reasons:
            processes.stop_group(child.pid)
        time.sleep(0.25)
    # Snapshot now: once we report, the scheduler may close the connection,
    # which the listener would otherwise record as a reason.
    reasons = list(stop_reasons)
    for t in pumps:
        t.join(timeout=5)
    return child.returncode, stalled, reasons


def _pump(out: RankOutput, rank: int, pipe, stream: str) -> threading.Thread:
    def loop():
        for line in pipe:
            out.rank_line(rank, stream, line.rstrip("\n"))

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t

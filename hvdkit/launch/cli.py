"""``hvdkitrun``: a thin front over ``horovodrun`` that fails cleanly.

    hvdkitrun -np 2 python train.py
    hvdkitrun -np 4 -H a:2,b:2 --mpi --log-dir log_output python train.py
    HVDKIT_ROLE=scheduler hvdkitrun ...        # see hvdkit.launch.rendezvous

What it adds to horovodrun: rank-prefixed console output and per-rank log
files; the Open MPI run-as-root flags only when running as root; an exit
status that names the failing rank and its last lines once every other rank
has been stopped; and a stall timeout, so that a rank which stops making
progress ends the job instead of hanging it.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import signal
import socket
import sys
import time

from .. import config
from ..errors import LaunchError
from . import processes
from .heartbeat import HeartbeatMonitor, horovod_stall_env, stall_timeout
from .output import RankOutput, lost_a_peer

DEFAULT_TRANSPORT = "gloo"  # measured: see docs/launching.md
EXIT_STALLED = 124  # as timeout(1)
LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hvdkitrun",
        description="Launch a data-parallel hvdkit job on Horovod (Gloo or MPI).",
    )
    p.add_argument("-np", "--num-proc", type=int, dest="np", help="total number of processes")
    p.add_argument("--nproc-per-node", type=int, help="processes on each host (with -H/--hostfile)")
    p.add_argument("-H", "--hosts", help="comma-separated host:slots, e.g. a:2,b:2")
    p.add_argument("--hostfile", help="file with one 'host slots=N' or 'host:N' per line")
    t = p.add_mutually_exclusive_group()
    t.add_argument("--gloo", dest="transport", action="store_const", const="gloo")
    t.add_argument("--mpi", dest="transport", action="store_const", const="mpi")
    p.add_argument("--log-dir", help="write <dir>/rank.N/stdout and stderr")
    p.add_argument(
        "--stall-timeout", type=float, help="seconds (default: $HVDKIT_STALL_TIMEOUT or 120)"
    )
    p.add_argument("--no-prefix", action="store_true", help="do not prefix lines with [rank N]")
    p.add_argument("--start-timeout", type=int, default=60, help="horovodrun's start timeout")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def _hosts_from_args(args) -> list[tuple[str, int]] | None:
    if args.hosts and args.hostfile:
        raise LaunchError(
            f"give either -H ({args.hosts}) or --hostfile ({args.hostfile}), not both."
        )
    entries: list[str] = []
    if args.hosts:
        entries = [h for h in args.hosts.split(",") if h.strip()]
    elif args.hostfile:
        try:
            with open(args.hostfile) as f:
                entries = [ln.split("#")[0].strip() for ln in f]
        except OSError as exc:
            raise LaunchError(f"cannot read --hostfile {args.hostfile}: {exc}") from None
        entries = [e.replace(" slots=", ":") for e in entries if e]
    if not entries:
        return None
    hosts = []
    for e in entries:
        name, _, slots = e.partition(":")
        if not slots.isdigit() or int(slots) < 1:
            raise LaunchError(f"host entry {e!r} needs a slot count, e.g. {name or 'host'}:2.")
        hosts.append((name.strip(), int(slots)))
    return hosts


def plan(args) -> tuple[int, list[tuple[str, int]]]:
    """Number of processes and host list from -np / --nproc-per-node / -H / --hostfile."""
    hosts = _hosts_from_args(args)
    if args.nproc_per_node is not None:
        if args.nproc_per_node < 1:
            raise LaunchError(f"--nproc-per-node={args.nproc_per_node} must be >= 1.")
        hosts = [(h, args.nproc_per_node) for h, _ in (hosts or [("localhost", 0)])]
        np_ = args.nproc_per_node * len(hosts)
        if args.np is not None and args.np != np_:
            raise LaunchError(
                f"-np {args.np} conflicts with --nproc-per-node {args.nproc_per_node} on "
                f"{len(hosts)} host(s) ({np_} processes); drop -np or make them agree."
            )
        return np_, hosts
    if hosts is None:
        if args.np is None:
            raise LaunchError("say how many processes to start: -np N (or --nproc-per-node N).")
        return args.np, [("localhost", args.np)]
    slots = sum(s for _, s in hosts)
    np_ = slots if args.np is None else args.np
    if np_ > slots:
        raise LaunchError(f"-np {np_} is more than the {slots} slots of the hosts {hosts}.")
    return np_, hosts


def _is_local(host: str) -> bool:
    return host in LOCAL_NAMES or host in (socket.gethostname(), socket.getfqdn())


def _address_seen_by(host: str) -> str:
    """Our IP address on the route towards ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
        except OSError as exc:
            raise LaunchError(f"cannot resolve or route to host {host!r}: {exc}") from None
        return s.getsockname()[0]


def failing_rank(launcher_lines) -> tuple[int | None, str]:
    """Rank and reason from horovodrun's / mpirun's failure messages, if present."""
    text = "\n".join(launcher_lines)
    patterns = [
        r"Process (\d+) exit with status code (-?\d+)",  # horovodrun --gloo
        r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)",  # mpirun
        r"Process name: \[\[\d+,\d+\],(\d+)\]\s+Exit code:\s+(-?\d+)",  # mpirun
    ]
    for pat in patterns:
        m = re.search(pat, text)
        if m:
            what = "signal" if "signal" in pat else "exit code"
            return int(m.group(1)), f"{what} {m.group(2)}"
    return None, ""


def _addresses(names) -> list[str]:
    """The IPv4 addresses ``names`` resolve to (the job's other machines)."""
    found = set()
    for name in names:
        try:
            found.update(socket.gethostbyname_ex(name)[2])
        except OSError as exc:
            raise LaunchError(f"cannot resolve host {name!r}: {exc}") from None
    return sorted(found)


def run(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise LaunchError("no program given; e.g. hvdkitrun -np 2 python train.py")
    np_, hosts = plan(args)
    transport = args.transport or DEFAULT_TRANSPORT
    stall = stall_timeout(args.stall_timeout)
    horovodrun = processes.find_tool("horovodrun")
    if horovodrun is None:
        raise LaunchError(
            f"horovodrun is neither beside {sys.executable} nor on PATH; install Horovod into "
            "this Python (scripts/install.sh does) or put horovodrun on PATH."
        )

    all_local = all(_is_local(h) for h, _ in hosts)
    bind = "127.0.0.1" if all_local else "0.0.0.0"
    seen_as = (
        "127.0.0.1"
        if all_local
        else _address_seen_by(next(h for h, _ in hosts if not _is_local(h)))
    )
    token = config.get(config.JOB_TOKEN) or secrets.token_hex(16)
    monitor = HeartbeatMonitor(token, bind_host=bind)

    env = processes.program_env(dict(os.environ))
    env[config.MONITOR_ADDR] = f"{seen_as}:{monitor.port}"
    env[config.JOB_TOKEN] = token
    for key, value in horovod_stall_env(stall).items():
        env.setdefault(key, value)
    if os.geteuid() == 0 and transport == "mpi":
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    host_arg = ",".join(f"{h}:{s}" for h, s in hosts)
    cmd = [
        horovodrun,
        "-np",
        str(np_),
        "-H",
        host_arg,
        f"--{transport}",
        "--start-timeout",
        str(args.start_timeout),
        *command,
    ]
    if transport == "gloo":
        # horovodrun's own rendezvous server would listen on every interface
        # and answer anyone: run horovodrun with a guarded one (see guard.py).
        remote = _addresses(h for h, _ in hosts if not _is_local(h))
        guarded = [sys.executable, "-m", "hvdkit.launch.guarded_horovodrun", ",".join(remote), "--"]
        cmd = [*guarded, *cmd[1:]]

    out = RankOutput(args.log_dir, prefix=not args.no_prefix)
    try:
        with processes.stop_signals() as interrupted:
            child = processes.spawn(cmd, env)
            stalled = _supervise(child, monitor, out, stall, interrupted)
    finally:
        monitor.close()
        out.close()
    return _outcome(child, out, stall, stalled, interrupted)


def _supervise(
    child, monitor: HeartbeatMonitor, out: RankOutput, stall: float, interrupted: list[str]
) -> list[tuple[int, float]]:
    """Relay output until horovodrun ends, or stop the job on a stall or a signal.

    Returns the stalled ``(rank, seconds silent)`` pairs (empty if none).
    """
    pumps = [out.pump(child.stdout, "stdout"), out.pump(child.stderr, "stderr")]
    known: dict[int, object] = {}
    stalled: list[tuple[int, float]] = []
    while child.poll() is None:
        for r, pid in monitor.local_pids().items():
            if known.get(r) is None:  # only processes in our own tree
                known[r] = processes.descendant(child.pid, pid)
        stalled = monitor.silent_ranks(stall)
        if stalled or interrupted:
            break
        time.sleep(0.25)
    if child.poll() is None:  # stalled or interrupted: stop everything we started
        if stalled:
            r, age = stalled[0]
            out.launcher_line(
                f"hvdkitrun: rank {r} stalled: no heartbeat for {age:.0f} s (stall timeout "
                f"{stall:g} s; the process is frozen or stuck). Stopping the job."
            )
        processes.stop_group(child.pid)
    child.wait()
    for t in pumps:
        t.join(timeout=5)
    leftovers = processes.stop([p for p in known.values() if p is not None])
    if leftovers:
        out.launcher_line(f"hvdkitrun: killed leftover rank processes {leftovers}.")
    return stalled


def _outcome(child, out: RankOutput, stall: float, stalled, interrupted: list[str]) -> int:
    """Report how the job ended; returns hvdkitrun's exit status."""
    if interrupted:
        out.launcher_line(f"hvdkitrun: interrupted by {interrupted[0]}; job stopped.")
        return 128 + signal.Signals[interrupted[0]].value
    if stalled:
        r = stalled[0][0]
        _report_rank(out, r, f"stalled (no progress for more than {stall:g} s)")
        return EXIT_STALLED
    if child.returncode == 0:
        return 0
    r, why = failing_rank(out.launcher_lines)
    r, why = _root_cause(out, r, why)
    if r is None:
        missing = re.search(r"[Mm]issing ranks:\s*([\d, ]+)", "\n".join(out.launcher_lines))
        r = int(missing.group(1).split(",")[0]) if missing else None
        why = "stalled: Horovod reported it missing from a collective" if missing else ""
    if r is not None:
        _report_rank(out, r, f"failed ({why})")
    else:
        out.launcher_line(f"hvdkitrun: the job failed (horovodrun exit code {child.returncode}).")
    return child.returncode if child.returncode > 0 else 1


def _root_cause(out: RankOutput, rank: int | None, why: str) -> tuple[int | None, str]:
    """Prefer the rank that failed on its own over one that failed because of it.

    mpirun names the first rank to *exit* non-zero, which is often a healthy
    rank whose collective failed once the real culprit went away.
    """
    if rank is None or not lost_a_peer(out.tail(rank, 20)):
        return rank, why
    others = [r for r in sorted(out.tails) if r != rank and not lost_a_peer(out.tail(r, 20))]
    if len(others) == 1:
        out.launcher_line(
            f"hvdkitrun: rank {rank} ({why}) failed because Horovod shut down "
            f"after rank {others[0]} went away."
        )
        return others[0], "exited first; the others then lost it"
    return rank, why


def _report_rank(out: RankOutput, rank: int, what: str) -> None:
    lines = out.tail(rank)
    shown = "\n".join(f"    {ln}" for ln in lines) if lines else "    (no output)"
    out.launcher_line(f"hvdkitrun: rank {rank} {what}; its last lines:\n{shown}")


def main(argv: list[str] | None = None) -> int:
    role = config.get(config.ROLE)
    try:
        if role:
            from .rendezvous import main as role_main

            return role_main(role, argv)
        return run(argv)
    except LaunchError as exc:
        print(f"hvdkitrun: error: {exc}", file=sys.stderr)
        return 2

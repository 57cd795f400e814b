"""``hvdkitrun``: a thin front over ``horovodrun`` that fails cleanly.

    hvdkitrun -np 2 python train.py
    hvdkitrun -np 4 -H a:2,b:2 --mpi --log-dir log_output python train.py
    hvdkitrun -np 2 --max-restarts 2 python train.py   # restart a failed job twice
    HVDKIT_ROLE=scheduler hvdkitrun ...        # see hvdkit.launch.roles

What it adds to horovodrun: a default transport from a measured rule
(``transport.choose_transport``); for MPI jobs, ranks that yield their core
while waiting (``transport.MPI_ENV``); rank-prefixed console output and
per-rank log files; the Open MPI run-as-root flags only when running as root; an exit
status that names the failing rank and its last lines once every other rank
has been stopped; a stall timeout, so that a rank which stops making
progress ends the job instead of hanging it; and, with ``--max-restarts N``,
the whole job started again after such a failure, up to N times.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass

from .. import _compat, config
from .._comm import fingerprints
from ..clusters import slurm
from ..errors import LaunchError
from . import auth, processes, restart
from .failures import failing_rank, reported_endings, root_cause
from .heartbeat import HeartbeatMonitor, horovod_stall_env, monitor_addr, stall_timeout
from .output import RankOutput
from .preempt import SigtermForwarding, preempted_step
from .restart import RestartBudget, resume_step
from .transport import (
    GLOO,
    MPI,
    MPI_ENV,
    busy_cores,
    choose_transport,
    mpi_root_env,
    mpirun_btl,
    ranks_yield,
)

EXIT_STALLED = 124  # as timeout(1)
EXIT_PREEMPTED = config.EXIT_PREEMPTED  # stopped for SIGTERM at a checkpoint: run again
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
        "--stall-timeout",
        type=float,
        help=f"seconds (default: ${config.STALL_TIMEOUT} or {config.DEFAULT_STALL_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        help="start the whole job again after a failure, up to N times "
        f"(default: ${config.MAX_RESTARTS} or 0)",
    )
    p.add_argument(
        "--checkpoint-dir",
        help="where the job's checkpoints are; restarts log the step they resume from "
        f"(default: ${config.CHECKPOINT_DIR}; passed on to the job)",
    )
    p.add_argument(
        "--check-weights",
        action="store_true",
        help="at the end, compare a fingerprint of every rank's trained weights and fail "
        f"naming the ranks that differ (default: ${config.CHECK_WEIGHTS}; docs/divergence.md)",
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
    """Number of processes and host list from -np / --nproc-per-node / -H / --hostfile.

    Without -H/--hostfile/--nproc-per-node inside a Slurm allocation (an
    sbatch script, salloc): the allocation's nodes and tasks (docs/slurm.md).
    """
    hosts = _hosts_from_args(args)
    if hosts is None and args.nproc_per_node is None:
        hosts = slurm.allocation_hosts()
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
    if args.np is not None and args.np < 1:
        raise LaunchError(f"-np {args.np} must be >= 1 (the number of processes to start).")
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


def _is_this_machine(host: str) -> bool:
    """``_is_local``, or a name that resolves to one of this machine's addresses.

    ``-H 10.0.0.1:2,10.0.0.2:2`` started on 10.0.0.1 runs two processes here: an
    address can be bound only by the machine that has it (no packet is sent).
    """
    if _is_local(host):
        return True
    try:
        addresses = socket.gethostbyname_ex(host)[2]
    except OSError:
        return False
    for address in addresses:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.bind((address, 0))
            except OSError:
                continue
            return True
    return False


def placed(hosts: list[tuple[str, int]], np_: int) -> list[tuple[str, int]]:
    """``(host, processes)`` as horovodrun places ``np_`` processes: each host's slots in turn.

    Example:
        >>> placed([("a", 4), ("b", 4)], 2)
        [('a', 2)]
    """
    out, left = [], np_
    for host, slots in hosts:
        n = min(slots, left)
        if n:
            out.append((host, n))
        left -= n
    return out


def _address_seen_by(host: str) -> str:
    """Our IP address on the route towards ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
        except OSError as exc:
            raise LaunchError(f"cannot resolve or route to host {host!r}: {exc}") from None
        return s.getsockname()[0]


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
    """hvdkitrun from its arguments to its exit status; the steps below, in this order.

    Parse; choose the transport (announced unless given); check horovodrun is installed;
    settle the job token, the ranks' environment and the horovodrun command;
    then run the job, again after a failure while the restart budget lasts.
    """
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise LaunchError("no program given; e.g. hvdkitrun -np 2 python train.py")
    np_, hosts = plan(args)
    transport, announce = args.transport, ""
    if transport is None:
        transport, announce = _default_transport(hosts, np_)
    stall = stall_timeout(args.stall_timeout)
    budget = RestartBudget(restart.max_restarts(args.max_restarts))
    checkpoint_dir = args.checkpoint_dir or config.get(config.CHECKPOINT_DIR)
    _require_horovodrun()
    token, token_file = _job_token()
    env, left = _ranks_env(transport, token, checkpoint_dir, stall)
    cmd = _horovodrun_command(transport, np_, hosts, args.start_timeout, command)
    own_file = None  # a token file hvdkitrun wrote, removed when it ends
    if transport == GLOO:
        if not token_file:
            own_file = token_file = _private_token_file(token)
        env[config.TOKEN_FILE] = token_file
    out = RankOutput(args.log_dir, prefix=not args.no_prefix)
    if announce:
        out.launcher_line(announce)
    if left:
        out.launcher_line(
            f"hvdkitrun: not passing {', '.join(left)} from this environment to the ranks: "
            "the launcher gives each rank its own (unset them to silence this)."
        )
    job = _Launch(cmd, env, out, stall, token, *_monitor_addresses(hosts), np_)
    own_weights = None  # a fingerprint folder hvdkitrun made, removed when it ends
    if args.check_weights or config.get_bool(config.CHECK_WEIGHTS, False, error=LaunchError):
        job.weights_dir = config.get(config.WEIGHTS_DIR)  # shared storage, for several hosts
        if not job.weights_dir:
            own_weights = job.weights_dir = tempfile.mkdtemp(prefix="hvdkit-weights-")
        env[config.WEIGHTS_DIR] = job.weights_dir
    try:
        return _run_with_restarts(job, budget, checkpoint_dir)
    finally:
        out.close()
        if own_weights:
            shutil.rmtree(own_weights, ignore_errors=True)
        if own_file:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(own_file)


def _default_transport(hosts: list[tuple[str, int]], np_: int) -> tuple[str, str]:
    """The transport the measured rule picks (``transport.choose_transport``), and the line
    announcing it with what the rule saw."""
    layout = placed(hosts, np_)
    mpi_available = processes.find_tool("mpirun") is not None
    yields = ranks_yield(os.environ)
    load, seen = 0.0, "no mpirun"
    if mpi_available and yields:
        seen = "MPI's ranks yield"  # the load cannot matter: not measured
    elif mpi_available and not any(_is_this_machine(h) for h, _ in layout):
        seen = "none of them here"  # this machine's load cannot matter
    elif mpi_available:
        busy = busy_cores(os.cpu_count())
        # rounded as announced, so the message shows exactly what the rule saw
        load = round(os.getloadavg()[0] if busy is None else busy, 1)
        seen = f"load average {load:.1f}" if busy is None else f"{load:.1f} busy"
    transport = choose_transport(  # the rule: docs/performance.md
        layout,
        cores=os.cpu_count(),
        load=load,
        mpi_available=mpi_available,
        is_local=_is_this_machine,
        ranks_yield=yields,
    )
    other = "--gloo" if transport == MPI else "--mpi"
    announce = (
        f"hvdkitrun: transport {transport} ({np_} processes, {os.cpu_count()} cores here, "
        f"{seen}; see docs/performance.md); {other} to override."
    )
    return transport, announce


def _require_horovodrun() -> None:
    """Horovod's launcher is installed (hvdkitrun runs it in-process), or a clear error."""
    if processes.find_tool("horovodrun") is None:
        raise LaunchError(
            f"horovodrun is neither beside {sys.executable} nor on PATH; install Horovod into "
            "this Python (scripts/install.sh does) or put horovodrun on PATH."
        )


def _monitor_addresses(hosts: list[tuple[str, int]]) -> tuple[str, str]:
    """Where the heartbeat receiver listens, and the address the ranks send to."""
    if all(_is_local(h) for h, _ in hosts):
        return "127.0.0.1", "127.0.0.1"
    return "0.0.0.0", _address_seen_by(next(h for h, _ in hosts if not _is_local(h)))


def _job_token() -> tuple[str, str | None]:
    """The job token (``HVDKIT_JOB_TOKEN``, the given token file's, or a new one) and the
    token file it was read from, if any."""
    given_file = None if config.get(config.JOB_TOKEN) else config.get(config.TOKEN_FILE)
    if given_file:
        return auth.read_token_file(given_file), given_file
    return config.get(config.JOB_TOKEN) or secrets.token_hex(16), None


def _ranks_env(
    transport: str, token: str, checkpoint_dir: str | None, stall: float
) -> tuple[dict, list[str]]:
    """The environment horovodrun passes to the ranks (without the token file's path), and
    the ``NAME=value`` of each layout variable of this environment left out of it.

    A layout variable (``HOROVOD_RANK``, ...; :data:`hvdkit._compat.HOROVODRUN_LAYOUT_VARIABLES`)
    set where hvdkitrun runs would override every rank's own under horovodrun.
    """
    env = processes.program_env(dict(os.environ))
    left = [f"{k}={env.pop(k)}" for k in _compat.HOROVODRUN_LAYOUT_VARIABLES if k in env]
    if transport == GLOO:
        # horovodrun's Gloo launcher starts each rank as `env K=V ... python ...`,
        # the whole environment on a command line every local user can read:
        # the ranks get the token in a private file instead (auth.job_token),
        # written just before the job starts.
        env.pop(config.JOB_TOKEN, None)
    else:  # mpirun passes the environment to the ranks off the command line
        env[config.JOB_TOKEN] = token
    if checkpoint_dir:
        env[config.CHECKPOINT_DIR] = checkpoint_dir
    for key, value in horovod_stall_env(stall).items():
        env.setdefault(key, value)
    if transport == MPI:
        for key, value in MPI_ENV.items():
            env.setdefault(key, value)
        env.update(mpi_root_env())
    return env, left


def _horovodrun_command(transport, np_, hosts, start_timeout, command) -> list[str]:
    host_arg = ",".join(f"{h}:{s}" for h, s in hosts)
    options = ["-np", str(np_), "-H", host_arg, f"--{transport}"]
    options += ["--start-timeout", str(start_timeout)]
    # horovodrun runs inside hvdkit's wrapper (guarded_horovodrun.py): its build
    # check does not import TensorFlow, and under Gloo its rendezvous server
    # (which would listen on every interface and answer anyone) is a guarded one.
    remote = _addresses(h for h, _ in hosts if not _is_local(h)) if transport == GLOO else []
    wrapper = [sys.executable, "-m", "hvdkit.launch.guarded_horovodrun", ",".join(remote)]
    one_host = all(_is_this_machine(h) for h, _ in hosts)
    btl = mpirun_btl(one_host, os.environ) if transport == MPI else None
    if btl is not None:
        wrapper += ["--btl", btl]
    return [*wrapper, "--", *options, *command]


@dataclass
class _Launch:
    """What every attempt of the job runs with (hvdkitrun's launch of it)."""

    cmd: list[str]  # the horovodrun command
    env: dict[str, str]  # the ranks' environment
    out: RankOutput
    stall: float  # seconds
    token: str
    bind: str  # the heartbeat receiver's address
    seen_as: str  # this machine's address as the ranks see it
    np: int  # the number of ranks
    weights_dir: str | None = None  # --check-weights: where the ranks leave their fingerprints


def _run_with_restarts(job: _Launch, budget: RestartBudget, checkpoint_dir: str | None) -> int:
    """Run attempts until one succeeds, is interrupted or preempted, or the budget is spent."""
    with processes.stop_signals() as interrupted:
        while True:
            job.env[config.RESTART_COUNT] = str(budget.restarts)
            code, cause = _Attempt(job, interrupted).run()
            if cause is None:  # success, interrupted or preempted: never restarted
                return code
            delay = budget.record(cause)
            if delay is None:
                if budget.limit:
                    job.out.launcher_line(f"hvdkitrun: {budget.summary()}")
                return code
            job.out.launcher_line(budget.restart_line("hvdkitrun", resume_step(checkpoint_dir)))
            if _wait_unless_interrupted(delay, interrupted):
                return _interrupted(job.out, interrupted)
            job.out.reset_tails()


def _private_token_file(token: str) -> str:
    """A new mode-600 file in ``~/.hvdkit`` (mode 700) holding ``token``; its path."""
    folder = os.path.join(os.path.expanduser("~"), ".hvdkit")
    path = os.path.join(folder, f"hvdkitrun-{os.getpid()}-{secrets.token_hex(4)}.token")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        auth.write_token_file(path, token)
    except OSError as exc:
        raise LaunchError(
            f"cannot write the job token file {path} ({exc.strerror}). hvdkitrun --gloo gives "
            f"the ranks the token in a private file: make {folder} writable, or set "
            f"{config.TOKEN_FILE} to a mode-600 file that holds the token."
        ) from None
    return path


def _wait_unless_interrupted(seconds: float, interrupted: list[str]) -> bool:
    """Sleep the back-off; True if a signal asked us to stop meanwhile."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not interrupted:
        time.sleep(0.1)
    return bool(interrupted)


class _Attempt:
    """One run of the job under supervision: :meth:`run`; the other methods are its steps."""

    def __init__(self, job: _Launch, interrupted: list[str]):
        self.job, self.interrupted = job, interrupted
        # A fresh monitor per attempt: the last attempt's silent ranks are no stall.
        self.monitor = HeartbeatMonitor(job.token, bind_host=job.bind)
        self.ranks: dict[int, object] = {}  # rank -> its process here (psutil), once reported
        self.stop_now: list[str] = []  # why the job is stopped at once (supervise's reasons)
        self.forward = SigtermForwarding(config.preempt_grace(), job.out.launcher_line, "hvdkitrun")
        self.child = None

    def run(self) -> tuple[int, str | None]:
        """Returns (exit status, cause of failure to restart for, or None)."""
        job, monitor = self.job, self.monitor
        env = {
            **job.env,
            config.MONITOR_ADDR: monitor_addr(job.seen_as, monitor.port, monitor.receiver),
        }
        if job.weights_dir:
            fingerprints.clear(job.weights_dir)
        try:
            self.child = processes.spawn(job.cmd, env)
            pumps = [
                job.out.pump(self.child.stdout, "stdout"),
                job.out.pump(self.child.stderr, "stderr"),
            ]
            ended = processes.supervise(
                self.child,
                monitor,
                job.stall,
                self.stop_now,
                on_tick=self.on_tick,
                on_stop=self.on_stall,
            )
            for t in pumps:
                t.join(timeout=5)
            leftovers = processes.stop(self.known())
            if leftovers:
                job.out.launcher_line(f"hvdkitrun: killed leftover rank processes {leftovers}.")
            exited_ok = _finished_ranks(monitor)
            preempted = preempted_step(monitor)
        finally:
            monitor.close()
        return self.decide(ended, preempted, exited_ok)

    def decide(
        self, ended: processes.Ended, preempted: int | None, exited_ok: list[int]
    ) -> tuple[int, str | None]:
        """How the attempt ended: (exit status, cause of failure to restart for, or None).

        A job hvdkitrun stopped for a stalled or stuck rank ends so (EXIT_STALLED),
        even if its ranks, on the stop's SIGTERM, agreed a step and recorded a
        preemption: nothing preempted the job, and a restart resumes from that
        checkpoint. Unless hvdkitrun was sent SIGTERM itself: then the job was
        preempted, whatever else the supervision saw while the ranks agreed the step.
        """
        job = self.job
        own_stop = (ended.stalled or ended.stuck) and "SIGTERM" not in self.interrupted
        if preempted is not None and not own_stop:
            job.out.launcher_line(
                f"hvdkitrun: preempted: every rank stopped after step {preempted}, which the "
                "checkpoint holds; run the same command again to resume from it."
            )
            return EXIT_PREEMPTED, None
        finished = len(exited_ok) >= job.np
        if ended.returncode == 0 and self.forward.ended_after_the_end(self.interrupted, finished):
            job.out.launcher_line(
                "hvdkitrun: SIGTERM arrived after every rank had finished; the job is complete."
            )
            return 0, None
        code, cause = _outcome(ended, job.out, job.stall, self.interrupted, exited_ok)
        if job.weights_dir and code == 0:
            prints = fingerprints.read(job.weights_dir)
            differ = fingerprints.verdict(prints, job.np)
            if differ:
                job.out.launcher_line(f"hvdkitrun: {differ}")
                return config.EXIT_WEIGHTS_DIFFER, None
            if note := fingerprints.unseen(prints, job.np):
                job.out.launcher_line(f"hvdkitrun: --check-weights: {note}")
        return code, cause

    def known(self) -> list:
        """The rank processes found so far (ours: in horovodrun's tree)."""
        return [p for p in self.ranks.values() if p is not None]

    def track_local_ranks(self) -> None:
        for r, pid in self.monitor.local_pids().items():
            if self.ranks.get(r) is None:  # only processes in our own tree
                self.ranks[r] = processes.descendant(self.child.pid, pid)

    def on_tick(self) -> None:
        """Every poll: find new ranks; act on a signal (SIGTERM: pass it on first)."""
        self.track_local_ranks()
        if self.interrupted and not self.stop_now:
            others = [s for s in self.interrupted if s != "SIGTERM"]
            if others:  # Ctrl-C, SIGHUP: stop now
                self.stop_now.append(others[0])
            elif not self.forward.tick(self.known(), finished=self.all_finished()):
                self.stop_now.append("SIGTERM")

    def all_finished(self) -> bool:
        """Whether every rank of the job has said it finished (heartbeat bye)."""
        return len(_finished_ranks(self.monitor)) >= self.job.np

    def on_stall(self, stalled: list[tuple[int, float]], stuck: str) -> None:
        """Before the job is stopped: name a stalled rank and kill it outright.

        Stuck ranks (``stuck``) are left to the job's stop: its SIGTERM may let
        them checkpoint a common step on the way out (:meth:`decide`).
        """
        if stalled:
            r, age = stalled[0]
            self.job.out.launcher_line(
                f"hvdkitrun: rank {r} stalled: no heartbeat for {age:.0f} s (stall timeout "
                f"{self.job.stall:g} s; the process is frozen or stuck). Stopping the job."
            )
        # A frozen rank is killed outright: the SIGCONT that lets the others act
        # on SIGTERM would otherwise let it run on while the job is torn down
        # (under mpirun far enough to finish the job and write checkpoints).
        self.track_local_ranks()
        processes.kill([self.ranks.get(r) for r, _ in stalled])


def _finished_ranks(monitor: HeartbeatMonitor) -> list[int]:
    """Ranks that said goodbye (ended normally), in the order they did."""
    statuses = dict(monitor.ranks)
    return [r for r, s in sorted(statuses.items(), key=lambda kv: kv[1].last_seen) if s.finished]


def _interrupted(out: RankOutput, interrupted: list[str]) -> int:
    out.launcher_line(f"hvdkitrun: interrupted by {interrupted[0]}; job stopped.")
    return 128 + signal.Signals[interrupted[0]].value


def _outcome(
    ended: processes.Ended, out: RankOutput, stall: float, interrupted, exited_ok
) -> tuple[int, str | None]:
    """Report how the attempt ended: (hvdkitrun's exit status, cause to restart for or None)."""
    if interrupted:
        return _interrupted(out, interrupted), None
    if ended.stalled:
        r, age = ended.stalled[0]
        _report_rank(out, r, f"stalled (no progress for more than {stall:g} s)")
        return EXIT_STALLED, f"rank {r} stalled (no heartbeat for {age:.0f} s)"
    if ended.stuck:
        out.launcher_line(f"hvdkitrun: {ended.stuck}. Stopped the job.")
        return EXIT_STALLED, ended.stuck
    code = ended.returncode
    if code == 0:
        return 0, None
    named, why = failing_rank(out.launcher_lines)
    blame = root_cause([] if named is None else [named], out.tails_by_rank(), exited_ok)
    status = code if code > 0 else 1
    if blame is None:
        out.launcher_line(f"hvdkitrun: the job failed (horovodrun exit code {code}).")
        return status, f"the job failed (horovodrun exit code {code})"
    if blame.how:
        out.launcher_line(
            f"hvdkitrun: rank {named} ({why}) failed because rank {blame.rank} {blame.how}."
        )
        # the culprit's own status, where horovodrun reported it too
        why = reported_endings(out.launcher_lines).get(blame.rank, blame.how)
    _report_rank(out, blame.rank, f"failed ({why})")
    return status, f"rank {blame.rank} {why}"


def _report_rank(out: RankOutput, rank: int, what: str) -> None:
    lines = out.tail(rank)
    shown = "\n".join(f"    {ln}" for ln in lines) if lines else "    (no output)"
    out.launcher_line(f"hvdkitrun: rank {rank} {what}; its last lines:\n{shown}")


def main(argv: list[str] | None = None) -> int:
    try:
        role = config.role()  # hvdkit's or MindSpore's values ("MS_SCHED", "MS_WORKER")
        if role:
            from .roles import main as role_main

            return role_main(role, argv)
        return run(argv)
    except LaunchError as exc:
        print(f"hvdkitrun: error: {exc}", file=sys.stderr)
        return 2

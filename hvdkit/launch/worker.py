"""A worker of a multi-node job without SSH (MindSpore's worker role).

Registers with the scheduler, receives its rank and Horovod's Gloo
rendezvous settings, runs the training command with them, reports how it
ended, and stops it if the scheduler says another rank failed. When the
scheduler restarts the job the worker runs the command again with the new
round's settings (``HVDKIT_RESTART_COUNT`` tells the program which round).
Its phases and what it does with each word it gets are a table,
:mod:`hvdkit.launch.worker_states`; this module carries the acts out.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import NoReturn

import psutil

from .. import _compat, _phases, config
from ..errors import LaunchError
from . import processes, protocol
from .handover import ElasticHandover
from .heartbeat import HeartbeatMonitor, horovod_stall_env, monitor_addr, stall_timeout
from .output import RankOutput
from .preempt import SigtermForwarding, preempted_step
from .protocol import Channel
from .wakeup import Wakeup
from .worker_states import PROGRAM_PHASES, Act, Word, WorkerPhase, decide, verdict, word_of

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
        f"{config.named(config.SCHED_HOST)}/{config.named(config.SCHED_PORT)} and that the "
        "scheduler is running."
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
    """Register, then run ``command`` once per round the scheduler assigns; returns the status.

    One round without restarts. After reporting how its program ended the
    worker waits for the scheduler's next word: a new ``assign`` (the job
    restarts) or ``done`` with the job's status.
    """
    _compat.check_gloo_hostname(sched_host)
    stall = stall_timeout()  # bad settings fail here, before this worker counts as arrived
    ch, first = join(sched_host, sched_port, token, timeout_s, protocol.silence_limit(stall))
    try:
        out = RankOutput(log_dir)
        try:
            code, last = _run_rounds(ch, first, sched_host, token, command, stall, out)
        finally:
            out.close()
        return _final_status(code, last)
    finally:
        ch.close()


def _run_rounds(ch, first, sched_host, token, command, stall, out) -> tuple[int, dict | None]:
    """Run the program once per ``assign`` until ``done``; (our last status, ``done`` or None).

    The main thread's part of the worker's state machine
    (:mod:`~hvdkit.launch.worker_states`): the words that come while no program
    runs. None: the scheduler is gone, or a signal told this worker to stop.
    """
    worker = _Worker(ch, _Inbox(ch), sched_host, token, command, stall, out)
    code, said, msg = 1, "", first
    with processes.stop_signals() as signals:
        while True:
            act = worker.inbox.decide(msg)
            if act is Act.END:
                return code, msg
            if act is Act.REPORT_AGAIN:
                # Our program ended before its next world reached it (the job finishing,
                # or it died just as the scheduler sent the world: its report of the old
                # round came too late to count, so say again how it ended).
                how = f"{said} before" if code != 0 else "ended before"
                _report(ch, int(msg["round"]), code, f"{how} the job's new world formed", [])
            elif act is Act.START:
                code, said = _run_program(worker, msg, signals)
                if signals:  # told to stop: no next round for this worker (0: it had finished)
                    return (code if code in (0, config.EXIT_PREEMPTED) else 1), None
            msg = worker.inbox.next()


def _final_status(code: int, done: dict | None) -> int:
    """The worker's exit status from its program's last status and the scheduler's ``done``."""
    if done is None:  # the scheduler is gone, or we were stopped: our own account is all
        return code
    job = int(done.get("code", 1))
    return 0 if job == 0 else (code if code > 0 else 1)


@dataclass
class _Running:
    """The running program's round as the inbox thread sees it: what the scheduler said."""

    number: int
    reasons: list[str]  # why to stop the program now (aborts, a lost scheduler)
    monitor: HeartbeatMonitor | None  # answers the scheduler's DESCRIBE
    preempt: list[str] = field(default_factory=list)  # the scheduler's PREEMPT, if it came
    reassign: list[dict] = field(default_factory=list)  # in-place ASSIGNs (hvdkit.elastic)
    go: list[int] = field(default_factory=list)  # rounds whose ranks are all ready


class _Inbox:
    """Reads the scheduler's messages on a thread for the worker's whole life.

    It holds the worker's phase (:class:`~hvdkit.launch.worker_states.WorkerPhase`).
    While a program runs, the reading thread decides what each message is for
    (:func:`~hvdkit.launch.worker_states.decide`) and carries it out
    (:meth:`_carry_out`): a stop reason or a preemption for the running round,
    a new world or a ``go`` for the program, an answer to DESCRIBE; the other
    words wait in a queue for the main thread (:meth:`next`, :meth:`decide`).
    Each act for the running program sets :attr:`wake`, so that the
    supervision's next tick carries it out now, not at its next poll.
    """

    def __init__(self, ch: Channel):
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._round: _Running | None = None
        self.phase = WorkerPhase.REGISTERING
        self.wake = Wakeup()
        self.reader = threading.Thread(target=self._loop, args=(ch,), daemon=True)
        self.reader.start()

    def _loop(self, ch: Channel) -> None:
        while True:
            try:
                msg = ch.recv()
            except protocol.Silent as exc:
                log.error("%s: its machine or network may be down; stopping", exc)
                msg = None
            except Exception as exc:  # the connection is as good as lost; never a dead thread
                if not isinstance(exc, OSError):
                    log.error("reading the scheduler's messages failed: %s", type(exc).__name__)
                msg = None
            with self._lock:
                if self.phase is WorkerPhase.ENDED:  # the worker is done: nothing is read for
                    return
                if self.phase not in PROGRAM_PHASES:  # the main thread decides: the rest waits
                    if decide(self.phase, word_of(msg))[0] is not Act.DROP:
                        self._queue.put(msg)
                    if msg is None:
                        return
                    continue
                running = self._round
                current = msg is not None and msg.get("round", 0) == running.number
                act, self.phase = decide(self.phase, word_of(msg), current)
                self._carry_out(act, msg, running, ch)
                if act is not Act.DROP:
                    self.wake.set()
                if act is Act.ABANDON:
                    return

    def _carry_out(self, act: Act, msg: dict | None, running: _Running, ch: Channel) -> None:
        """The inbox thread's executor: one act about the running program (under the lock)."""
        if act is Act.STOP:
            running.reasons.append(str(msg.get("reason")))
        elif act is Act.FORWARD:
            running.preempt.append(str(msg.get("reason")))
        elif act is Act.HAND_OVER:
            running.reassign.append(msg)  # the program goes on in a new world
        elif act is Act.LET_GO:
            running.go.append(msg["round"])
        elif act is Act.ANSWER and running.monitor is not None:
            doings = {str(r): d for r, d in running.monitor.doings().items()}
            try:
                ch.send(type=protocol.STATE, round=running.number, ranks=doings)
            except OSError:
                pass  # the scheduler is gone; the lost connection ends the round
        elif act is Act.LATER:
            self._queue.put(msg)
        elif act is Act.ABANDON:
            running.reasons.append("lost the connection to the scheduler")
            self._queue.put(None)

    def decide(self, msg: dict | None) -> Act:
        """The main thread's decision about a word taken from :meth:`next`; enters its phase.

        START's phase, RUNNING, begins only when the program's round is routed
        here (:meth:`running`): until then the reading thread keeps deciding
        nothing and queues what comes.
        """
        with self._lock:
            act, after = decide(self.phase, word_of(msg))
            if act is not Act.START:
                self.phase = after
            return act

    def running(self, round_: _Running | None) -> None:
        """Route the messages of ``round_`` to it (RUNNING); ``None``: its program ended
        (EXITED: REPORTING)."""
        with self._lock:
            if (round_ is None) == (self.phase in PROGRAM_PHASES):
                word = Word.EXITED if round_ is None else Word.ASSIGN
                _, self.phase = decide(self.phase, word)
            self._round = round_

    def news(self) -> tuple[list[int], list[dict]]:
        """Take the running round's ``go`` rounds and new worlds, oldest first.

        The round's number becomes the last new world's (the program's exit
        is reported as of it). Taken under the lock the reading thread holds
        while it adds to them and compares rounds, so it never sees half a change.
        """
        with self._lock:
            running = self._round
            if running is None:
                return [], []
            go, worlds = list(running.go), list(running.reassign)
            running.go.clear()
            running.reassign.clear()
            if worlds:
                running.number = int(worlds[-1]["round"])
            return go, worlds

    def next(self) -> dict | None:
        return self._queue.get()


# While this worker's program is to say it is ready for a new world (the file it
# writes is not an event here), the supervision looks this often, not every 0.25 s:
# every rank of the world waits for the last "ready" to reach the scheduler.
READY_POLL_S = 0.02
BUSY_LOG_EVERY_S = 10.0  # while the scheduler is busy, say so this often
RETRY_MAX_S = 2.0  # longest pause between two attempts to register


def join(
    sched_host: str, sched_port: int, token: str, timeout_s: float, silence_s: float | None = None
) -> tuple[Channel, dict]:
    """Connect and register, trying again while the scheduler is busy; the channel and first word.

    The scheduler tells a connection ``busy`` when too many handshakes are in
    progress (a flood of connections, or many workers at once); so does a
    connection closed or broken before the scheduler's challenge. The worker
    then tries again, pausing up to :data:`RETRY_MAX_S`, until ``timeout_s``
    (``HVDKIT_SCHED_TIMEOUT``) has passed since it started. A refusal (wrong
    token, not a registration) ends it at once. With ``silence_s`` the
    channel is kept alive from the handshake on (:meth:`Channel.keep_alive`).
    """
    deadline = time.monotonic() + timeout_s
    attempts, pause, told, last = 0, 0.2, None, ""
    while True:
        ch = connect(sched_host, sched_port, max(deadline - time.monotonic(), 0.1))
        attempts += 1
        try:
            return ch, _register(ch, token, sched_host, sched_port, silence_s)
        except protocol.Busy as exc:
            ch.close()
            last = str(exc)
        now = time.monotonic()
        if now >= deadline:
            raise LaunchError(
                f"could not register with the scheduler at {sched_host}:{sched_port} within "
                f"{timeout_s:g} s: it started no handshake in {attempts} attempts (last: {last}). "
                "Something may be holding its connections (a flood: firewall its port, see "
                f"docs/security.md); raise {config.SCHED_TIMEOUT} to wait longer."
            )
        if told is None or now - told >= BUSY_LOG_EVERY_S:
            log.warning(
                "the scheduler at %s:%d is busy (%s); trying again for up to %.0f s",
                sched_host,
                sched_port,
                last,
                deadline - now,
            )
            told = now
        time.sleep(min(pause * random.uniform(0.5, 1.0), deadline - now))
        pause = min(pause * 2, RETRY_MAX_S)


def _register(
    ch: Channel, token: str, sched_host: str, sched_port: int, silence_s: float | None
) -> dict:
    """The handshake, then the scheduler's first word (``assign`` or ``done``).

    Raises :class:`protocol.Busy` if no handshake started (try again), else
    :class:`LaunchError` naming what went wrong and the fix.
    """
    # The token is never sent: we answer the scheduler's challenge with a MAC
    # and from then on accept only messages signed by it (protocol.register).
    where = f"the scheduler at {sched_host}:{sched_port}"
    try:
        protocol.register(
            ch,
            token,
            time.monotonic() + protocol.HANDSHAKE_TIMEOUT_S,
            hostname=socket.gethostname(),
            pid=os.getpid(),
        )
    except protocol.Busy:
        raise
    except protocol.Refused as exc:
        _refused(where, str(exc))
    if silence_s is not None:  # the scheduler may wait long for the others: say we are here
        ch.keep_alive(silence_s)
    why = "connection closed"
    try:
        msg = ch.recv()
    except OSError as exc:
        msg, why = None, f"{type(exc).__name__}: {exc}"
    if msg is not None and msg.get("type") == protocol.REFUSED:  # our answer to its challenge
        _refused(where, str(msg.get("reason")))
    if msg is None:
        raise LaunchError(
            f"{where} accepted this worker, then the connection ended before ranks were "
            f"assigned ({why}): the scheduler stopped or was stopped; see its log."
        )
    if msg.get("type") == protocol.ABORT:
        raise LaunchError(f"the scheduler stopped the job before it started: {msg.get('reason')}")
    if msg.get("type") not in (protocol.ASSIGN, protocol.DONE):
        raise LaunchError(f"unexpected message from the scheduler: {str(msg)[:200]}")
    return msg


def _refused(where: str, reason: str) -> NoReturn:
    if reason.startswith(protocol.BAD_TOKEN):
        raise LaunchError(
            f"{where} refused this worker: {reason}. Use the job token the scheduler "
            f"printed ({config.JOB_TOKEN}, or its token file)."
        )
    raise LaunchError(
        f"{where} refused this worker: {reason}. Check that {config.named(config.SCHED_PORT)} "
        "is the scheduler's port and that worker and scheduler run the same hvdkit version."
    )


def _report(ch: Channel, round_: int, code: int, detail: str, tail: list[str]) -> None:
    _send(ch, type=protocol.EXIT, round=round_, code=code, detail=detail, tail=tail)


def _send(ch: Channel, **msg) -> None:
    try:
        ch.send(**msg)
    except OSError:
        pass  # the scheduler is gone; it has its own account of this rank


def _finished(monitor: HeartbeatMonitor) -> bool:
    """Whether the program's ranks have all said they finished (their heartbeat's bye)."""
    statuses = list(monitor.ranks.values())
    return bool(statuses) and all(s.finished for s in statuses)


def _own(pid: int) -> list[psutil.Process]:
    """``[the process pid]`` if it still runs, else ``[]``."""
    try:
        return [psutil.Process(pid)]
    except psutil.Error:
        return []


def _ranks(child, monitor: HeartbeatMonitor) -> list[psutil.Process]:
    """The rank processes of ``child``'s tree that sent heartbeats (``child`` itself, usually)."""
    found = []
    for pid in monitor.local_pids().values():
        if pid == child.pid:
            try:
                found.append(psutil.Process(pid))
            except psutil.Error:
                pass
        elif (proc := processes.descendant(child.pid, pid)) is not None:
            found.append(proc)
    return found


@dataclass(frozen=True)
class _Worker:
    """This worker: what every round's run of its program shares."""

    ch: Channel
    inbox: _Inbox
    sched_host: str
    token: str
    command: list[str]
    stall: float
    out: RankOutput


def _run_program(job: _Worker, assign: dict, signals: list[str]) -> tuple[int, str]:
    """Run the program as the rank of one round, report how it ended; (its status, how)."""
    return _ProgramRun(job, assign, signals).run()


class _ProgramRun:
    """One round's run of the program, in steps: environment, start, supervision, report.

    While the program runs, each tick of the supervision
    (:func:`~hvdkit.launch.processes.supervise`) takes two separate steps:

    * :meth:`_relay_elastic` (elastic jobs): what the program says in its
      hand-over folder (ready, resumed, finished) goes to the scheduler; what
      the scheduler says (go, a new world) goes into the folder;
    * :meth:`_forward_signals`: this worker's signals and the scheduler's
      ``preempt`` reach the program; it returns why to stop it, if it must.

    The reasons to stop are the round's (:class:`_Running`), which the inbox
    thread fills too; only :meth:`_tick` adds to them. The ``go``s and new
    worlds the inbox keeps are taken with :meth:`_Inbox.news`, under its lock.
    """

    def __init__(self, job: _Worker, assign: dict, signals: list[str]):
        self.job, self.assign, self.signals = job, assign, signals
        self.rank = assign["rank"]
        self.first_round = int(assign.get("round", 0))
        self.iface = ""
        self.monitor: HeartbeatMonitor | None = None
        self.elastic: ElasticHandover | None = None
        self.running = _Running(self.first_round, [], None)
        self.forward = SigtermForwarding(
            config.preempt_grace(), log.warning, f"worker (rank {self.rank})"
        )
        self.child = None

    def run(self) -> tuple[int, str]:
        env = self._environment()
        try:
            ended, preempted = self._start_and_supervise(env)
        finally:
            self.job.inbox.running(None)
            self.monitor.close()
            if self.elastic is not None:
                self.elastic.close()
        return self._report(ended, preempted)

    # ------------------------------------------------------------ before the start
    def _environment(self) -> dict[str, str]:
        """The program's environment; opens the heartbeat monitor and the hand-over folder."""
        job, assign, round_ = self.job, self.assign, self.first_round
        try:
            self.iface = interface_for(job.ch.sock.getsockname()[0])
        except LaunchError as exc:
            _report(job.ch, round_, 1, str(exc), [])
            raise
        env = processes.program_env({k: v for k, v in os.environ.items() if k not in _ROLE_VARS})
        env.update(horovod_env(assign, job.sched_host, self.iface))
        env[config.RESTART_COUNT] = str(round_)
        for key, value in horovod_stall_env(job.stall).items():  # alive but stuck, not frozen
            env.setdefault(key, value)
        log.info(
            "rank %d of %d (local %d of %d) on %s%s",
            self.rank,
            assign["size"],
            assign["local_rank"],
            assign["local_size"],
            self.iface,
            f", restart {round_}" if round_ else "",
        )
        # The program's heartbeats come to this worker (same machine), which stops
        # a frozen program after the stall timeout and reports it.
        self.monitor = HeartbeatMonitor(job.token, bind_host="127.0.0.1")
        env[config.MONITOR_ADDR] = monitor_addr(
            "127.0.0.1", self.monitor.port, self.monitor.receiver
        )
        env[config.JOB_TOKEN] = job.token
        if assign.get("elastic"):
            self.elastic = ElasticHandover(assign, env)
        self.running.monitor = self.monitor
        job.inbox.running(self.running)
        return env

    # ------------------------------------------------------------ while it runs
    def _start_and_supervise(self, env: dict[str, str]):
        """Start the program and watch it until it ends; (how it ended, preempted step)."""
        job = self.job
        try:
            # A rank whose worker died must die too: SIGTERM would ask it to checkpoint
            # and stop the whole job (a preemption), and it would train on meanwhile.
            self.child = processes.spawn(job.command, env, parent_death=signal.SIGKILL)
        except OSError as exc:
            detail = f"cannot start {job.command[0]!r}: {exc.strerror}"
            _report(job.ch, self.first_round, 127, detail, [])
            raise LaunchError(detail) from None
        pumps = [
            job.out.pump(self.child.stdout, "stdout", rank=self.rank),
            job.out.pump(self.child.stderr, "stderr", rank=self.rank),
        ]
        # In an elastic job a frozen peer is stopped by its own worker after the stall
        # timeout, and then every other rank's collective fails and they go on
        # in-process: waiting that long in a collective is not yet "stuck" here.
        stuck = 2 * job.stall if self.elastic is not None else job.stall
        ended = processes.supervise(
            self.child,
            self.monitor,
            job.stall,
            self.running.reasons,
            on_tick=self._tick,
            on_stop=self._on_stop,
            stuck_s=stuck,
            wake=job.inbox.wake,
        )
        for t in pumps:
            t.join(timeout=5)
        return ended, preempted_step(self.monitor)

    def _tick(self) -> float | None:
        """One look of the supervision; a shorter wait before the next, if one is due soon."""
        if self.running.reasons:
            return None
        if self.elastic is not None:
            self._relay_elastic()
        reason = self._forward_signals()
        if reason is not None:
            self.running.reasons.append(reason)
        if self.elastic is not None and self.elastic.awaits_ready():
            return READY_POLL_S  # the program says it is ready in a file: look often meanwhile
        return None

    def _relay_elastic(self) -> None:
        """The hand-over folder's news to the scheduler; the scheduler's word into the folder."""
        ch, elastic, rank = self.job.ch, self.elastic, self.rank
        ready = elastic.newly_ready()
        if ready is not None:
            log.info("rank %d is ready for round %d", rank, ready)
            _send(ch, type=protocol.READY, round=ready)
        resumed = elastic.newly_resumed()
        if resumed is not None:
            _send(ch, type=protocol.RESUMED, round=resumed[0], step=resumed[1])
        finished = elastic.newly_finished()
        if finished is not None:
            log.info("rank %d finished training (round %d)", rank, finished)
            _send(ch, type=protocol.FINISHED, round=finished)
        go, worlds = self.job.inbox.news()
        for round_ in go:
            elastic.go(round_)
        for new in worlds:  # the job lost or gained a worker: our program goes on
            if elastic.finished is not None:  # it will not read it: no new world for it
                log.info("rank %d finished training: it stays out of round %d", rank, new["round"])
                continue
            _phases.enter("word", new["rank"], new["size"])
            self.monitor.forget()
            elastic.hand_over(new, horovod_env(new, self.job.sched_host, self.iface))

    def _forward_signals(self) -> str | None:
        """Pass SIGTERM (or the scheduler's preempt) on to the ranks; why to stop now, if so."""
        others = [s for s in self.signals if s != "SIGTERM"]
        if others:  # Ctrl-C, SIGHUP: stop now
            return f"received {others[0]}"
        term = "SIGTERM" in self.signals
        if (term or self.running.preempt) and not self.forward.tick(
            _ranks(self.child, self.monitor), finished=_finished(self.monitor)
        ):
            return "received SIGTERM" if term else self.running.preempt[0]
        return None

    def _on_stop(self, stalled, stuck: str) -> None:
        lost = stuck and self.elastic is not None  # the others go on without it
        if stalled:
            log.error(
                "rank %d stalled: no heartbeat for %.0f s; stopping it", self.rank, stalled[0][1]
            )
        elif stuck:
            how = "killing it" if lost else "stopping the job"
            log.error("rank %d waited in one collective too long; %s", self.rank, how)
        if stalled or lost:
            # A frozen rank, and a stuck one in an elastic job, is killed outright, never
            # sent SIGTERM: a rank takes SIGTERM as a preemption, and once its peers move
            # (a thawed freeze; a peer's long rank-local section ends) it agrees a step
            # with them and every rank stops "preempted" (seen: a fault-free elastic job
            # ended exit 75 after one rank spent 20.7 s in tf.data's iterator destructor).
            # Killed, it is a lost rank: the others go on without it (elastic) or the job
            # restarts. A stuck rank of a job that restarts whole gets the group's SIGTERM,
            # as under hvdkitrun: if its peers move within the stop's grace, every rank
            # checkpoints a common step for the restart, and :func:`verdict` still
            # reports it stuck, the restart's cause.
            processes.kill(_ranks(self.child, self.monitor) or _own(self.child.pid))

    # ------------------------------------------------------------ after it ended
    def _report(self, ended: processes.Ended, preempted: int | None) -> tuple[int, str]:
        """Tell the scheduler how the program ended (:func:`worker_states.verdict` decides);
        (the worker's status for it, how)."""
        job, rank = self.job, self.rank
        finished_first = self.forward.ended_after_the_end(self.signals, _finished(self.monitor))
        said = verdict(
            ended,
            preempted,
            rank,
            job.stall,
            self.signals,
            finished_first,
            preempting=bool(self.running.preempt),
        )
        for level, line in said.notes:
            getattr(log, level)("%s", line)
        # the last round the program ran in
        _report(job.ch, self.running.number, said.code, said.detail, job.out.tail(rank))
        job.out.reset_tails()
        return said.status, said.detail

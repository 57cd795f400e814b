"""The scheduler of a multi-node job without SSH (MindSpore's scheduler role).

Workers register over TCP with the job token; when ``worker_num`` have come,
the scheduler assigns ranks (contiguous per host, in order of arrival),
starts Horovod's own Gloo rendezvous server, and hands every worker the
``HOROVOD_*`` settings Horovod's Gloo launcher would have given it. It then
watches: the first worker that fails or disappears makes it tell all others to
stop. Without restarts it then exits non-zero naming that rank; with
``max_restarts`` it starts the job again (a new *round*: new rendezvous, same
token) on the workers still connected, waiting for replacements of lost
ones, or going on with ``min_workers`` or more. A round is followed by
:class:`hvdkit.launch.rounds.Round` (its phases and transitions in one
table). The launcher uses Horovod's runner only (the rendezvous server,
guarded in :mod:`hvdkit.launch.guard`);
:mod:`hvdkit.backends.horovod` is the only module that uses its collectives.

Messages: one JSON object per line; their kinds, each named once with its
fields, are listed in :mod:`hvdkit.launch.protocol` (``ASSIGN`` ... ``STATE``).
One thread reads every worker's connection (:mod:`hvdkit.launch.listening`)
and turns what it hears into :class:`~hvdkit.launch.rounds.Report` s on one
queue, which the round's watch follows.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import signal
import socket
import threading
import time

from .. import config
from .._comm import fingerprints
from .._validate import is_int
from ..errors import LaunchError
from . import protocol
from .heartbeat import stall_timeout
from .listening import Listener
from .protocol import FINISHED, READY, RESUMED
from .restart import RestartBudget, resume_step
from .rounds import LOST, SIGNALLED, SILENT, Registration, Report, Round, RoundResult

log = logging.getLogger("hvdkit.scheduler")


def assign_ranks(hosts_in_order: list[str], regs_by_host: dict[str, list]) -> list[dict]:
    """Rank layout: contiguous ranks per host, hosts in order of first arrival.

    Returns one dict per registration with Horovod's rank, size, local and
    cross coordinates (cross = among hosts that have that local rank).
    """
    size = sum(len(regs_by_host[h]) for h in hosts_in_order)
    out, rank = [], 0
    for host_index, host in enumerate(hosts_in_order):
        regs = regs_by_host[host]
        for local_rank, reg in enumerate(regs):
            peers = [h for h in hosts_in_order if len(regs_by_host[h]) > local_rank]
            out.append(
                dict(
                    reg=reg,
                    rank=rank,
                    size=size,
                    local_rank=local_rank,
                    local_size=len(regs),
                    cross_rank=peers.index(host),
                    cross_size=len(peers),
                    host_index=host_index,
                )
            )
            rank += 1
    return out


def layout_for(regs: list) -> list[dict]:
    """:func:`assign_ranks` for workers in order (each with a ``host``): hosts in first-seen order.

    After a worker is lost the remaining ones keep their order, so ranks are
    renumbered contiguously per host without gaps.
    """
    hosts: list[str] = []
    by_host: dict[str, list] = {}
    for r in regs:
        if r.host not in by_host:
            hosts.append(r.host)
            by_host[r.host] = []
        by_host[r.host].append(r)
    return assign_ranks(hosts, by_host)


class Scheduler:
    def __init__(
        self,
        host: str,
        port: int,
        worker_num: int,
        token: str,
        timeout_s: float,
        *,
        max_restarts: int = 0,
        min_workers: int | None = None,
        replace_timeout_s: float = config.DEFAULT_REPLACE_TIMEOUT_S,
        elastic: bool = False,
    ):
        if worker_num < 1:
            raise LaunchError(f"{config.named(config.WORKER_NUM)}={worker_num} must be at least 1.")
        min_workers = worker_num if min_workers is None else min_workers
        if not 1 <= min_workers <= worker_num:
            raise LaunchError(
                f"{config.MIN_WORKERS}={min_workers} must be between 1 and "
                f"{config.named(config.WORKER_NUM)}={worker_num}; lower it or raise "
                f"{config.named(config.WORKER_NUM)}."
            )
        self.worker_num, self.token, self.timeout_s = worker_num, token, timeout_s
        self.min_workers, self.replace_timeout_s = min_workers, replace_timeout_s
        self.budget = RestartBudget(max_restarts)
        self.elastic = elastic  # survivors of a failure go on in-process (hvdkit.elastic)
        # a worker that sends nothing for this long (a cut network, a frozen machine) is lost
        self.silence_s = protocol.silence_limit(stall_timeout())
        self._round_no = 0  # rounds started so far, restarts and in-process recoveries alike
        self._servers_in_use: list = []  # an earlier round's rendezvous, still needed
        self.host, self.port = host, port
        # one thread reads every worker's channel (before the door admits anyone)
        self.listener = Listener(self._heard, self._ended)
        self.door = _Door(host, port, worker_num, token, self._registered)
        # the workers' word, as rounds.Report, and SIGNALLED (a SimpleQueue's put is reentrant:
        # the SIGTERM handler can put while the main thread is inside a get)
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        # elastic: a rank's training function returned; the job takes no newcomer now
        self.finishing = False
        self.round_sizes: dict[int, int] = {}  # ranks per round, for the membership lines
        self.newcomers = self.door.newcomers  # registered after the first round
        # round -> rank -> what it was doing, as workers answered a DESCRIBE
        self._doings: dict[int, dict[int, str]] = {}
        self._doings_lock = threading.Lock()
        self.sigterm: list[str] = []  # filled by the SIGTERM handler run() installs
        self.weights_dir: str | None = None  # run(): HVDKIT_CHECK_WEIGHTS's fingerprint folder

    def _registered(self, reg: Registration) -> None:
        """A worker passed the door: keep its channel alive and listen to it."""
        reg.channel.keep_alive(self.silence_s)
        self.listener.add(reg.channel, reg)

    # ------------------------------------------------------------ the job
    def run(self) -> int:
        self.weights_dir = fingerprints.scheduler_folder()  # HVDKIT_CHECK_WEIGHTS: at the end
        log.info(
            "scheduler listening on %s:%d for %d workers", self.host, self.port, self.worker_num
        )
        try:
            regs = self.door.all_workers(self.timeout_s)
        except BaseException:
            self.door.close()
            self.listener.close()
            raise
        if self.budget.limit == 0 and not self.elastic:
            # A late or surplus worker is refused at once instead of waiting
            # on a socket nobody accepts from.
            self.door.close()
        else:
            self.door.keep_open()
        everyone = list(regs)
        try:
            with self._noting_sigterm():
                return self._rounds(regs, everyone)
        finally:
            self.door.close()
            self.listener.close()
            for r in everyone:
                r.channel.close()

    @contextlib.contextmanager
    def _noting_sigterm(self):
        """While rounds run, SIGTERM is passed on to the workers (a preemption), not fatal."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers live on the main thread; SIGTERM stays fatal
            return

        def noted(*_):
            self.sigterm.append("SIGTERM")
            self.events.put(SIGNALLED)  # wakes a round's watch now

        previous = signal.signal(signal.SIGTERM, noted)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _rounds(self, regs: list[Registration], everyone: list[Registration]) -> int:
        """Run rounds until the job succeeds, is preempted, or runs out of restarts."""
        inplace: list[Registration] = []
        while True:
            result = self._round(regs, self._round_no, inplace)
            self._round_no += 1
            inplace = []
            if result.joining:
                everyone.extend(r for r in result.joining if r not in everyone)
                log.warning(
                    "%s joins: %d of %d workers as round %d (%d go on in-process; they make "
                    "room at their next commit boundary)",
                    ", ".join(r.describe() for r in result.joining),
                    len(result.survivors) + len(result.joining),
                    self.worker_num,
                    self._round_no,
                    len(result.survivors),
                )
                regs, inplace = result.survivors + result.joining, result.survivors
                continue
            if result.survivors:
                requeued = result.requeued or []
                kept = {*result.survivors, *requeued}  # a set: N look-ups, not N * N
                lost = [r for r in regs if r not in kept]
                log.warning(
                    "%s; %d of %d workers go on in-process as round %d (lost: %s)",
                    result.cause,
                    len(result.survivors),
                    len(regs),
                    self._round_no,
                    ", ".join(r.describe() for r in lost),
                )
                for r in requeued:
                    log.warning("%s was joining; it waits to join again", r.describe())
                    self.newcomers.put(r)
                self._let_back(lost)
                regs, inplace = result.survivors, list(result.survivors)
                continue
            if result.culprit is None and result.preempted:
                log.warning(
                    "job preempted: every rank %s; start the same job again to resume",
                    result.preempted,
                )
                return self._finish(everyone, config.EXIT_PREEMPTED)
            differ = None
            if result.culprit is None and self.weights_dir:
                differ = fingerprints.check(self.weights_dir)
            if differ:
                log.error("job failed: %s", differ)
                return self._finish(everyone, config.EXIT_WEIGHTS_DIFFER)
            if result.culprit is None:
                log.info("all %d ranks finished successfully", len(regs))
                return self._finish(everyone, 0)
            shown = "\n".join(f"    {ln}" for ln in result.tail) or "    (no output)"
            if self.sigterm:  # told to stop: no restart
                log.error("job stopped after SIGTERM: %s; its last lines:\n%s", result.cause, shown)
                return self._finish(everyone, 128 + signal.SIGTERM)
            delay = self.budget.record(result.cause)
            if delay is None:
                log.error("job failed: %s; its last lines:\n%s", result.cause, shown)
                if self.budget.limit:
                    log.error("%s", self.budget.summary())
                return self._finish(everyone, 1)
            log.error("round failed: %s; its last lines:\n%s", result.cause, shown)
            checkpoints = resume_step(config.get(config.CHECKPOINT_DIR))
            log.warning("%s", self.budget.restart_line("scheduler", checkpoints))
            time.sleep(delay)
            self.finishing = False  # the restarted programs train again
            try:
                regs = self._gather([r for r in regs if not r.gone])
            except LaunchError as exc:
                log.error("job failed: %s", exc)
                log.error("%s", self.budget.summary())
                return self._finish(everyone, 1)
            everyone.extend(r for r in regs if r not in everyone)

    def _let_back(self, lost: list[Registration]) -> None:
        """Elastic: a worker whose program failed (it is still there) may join again.

        A return is not a restart: ``HVDKIT_MAX_RESTARTS`` counts whole-job
        restarts only. Each worker's program comes back at most that many
        times (:attr:`Registration.returns`): a program failing every time
        would otherwise cost the survivors a regroup per return for ever.
        """
        limit = self.budget.limit
        for r in lost:
            if r.gone:
                continue  # the worker itself is lost: a new one may register
            if r.returns >= limit:
                log.warning(
                    "%s does not join again: its program came back %d of %d times allowed per "
                    "worker (%s); start a new worker to replace it",
                    r.describe(),
                    r.returns,
                    limit,
                    config.MAX_RESTARTS,
                )
                continue
            r.returns += 1
            log.warning(
                "%s joins again with a new program (its return %d of %d; %s)",
                r.describe(),
                r.returns,
                limit,
                self.budget.left_line(),
            )
            self.newcomers.put(r)

    def _finish(self, regs: list[Registration], code: int) -> int:
        while True:  # workers waiting to replace someone are told too
            try:
                regs.append(self.newcomers.get_nowait())
            except queue.Empty:
                break
        for r in regs:
            if not r.gone:
                r.send(type=protocol.DONE, code=code)
        return code

    def _gather(self, alive: list[Registration]) -> list[Registration]:
        """The workers of the next round: those left, plus replacements that register.

        Waits up to the registration timeout for replacements while fewer than
        ``min_workers`` are left, else up to the (shorter) replacement timeout.
        """
        regs = list(alive)
        start = time.monotonic()
        while True:
            regs = [r for r in regs if not r.gone]
            if len(regs) >= self.worker_num:
                break
            wait = self.timeout_s if len(regs) < self.min_workers else self.replace_timeout_s
            left = start + wait - time.monotonic()
            if left <= 0:
                break
            try:
                regs.append(self.newcomers.get(timeout=min(left, 1.0)))
            except queue.Empty:
                continue
        if len(regs) < self.min_workers:
            raise LaunchError(
                f"only {len(regs)} worker(s) left after the failure and none came to replace the "
                f"lost ones within {self.timeout_s:g} s; the job needs at least "
                f"{config.MIN_WORKERS}={self.min_workers}. Start replacement workers with the "
                f"same job token, or lower {config.MIN_WORKERS}."
            )
        if len(regs) < self.worker_num:
            log.warning(
                "continuing on %d of %d workers (%s=%d)",
                len(regs),
                self.worker_num,
                config.MIN_WORKERS,
                self.min_workers,
            )
        return regs

    def _round(
        self, regs: list[Registration], round_: int, inplace: list[Registration]
    ) -> RoundResult:
        """Run one round: ``inplace`` are workers whose programs go on in-process.

        The others start their program. When both kinds are in a round (a
        worker joins the survivors), the survivors are told only once every
        newcomer's program is ready to meet them (see :meth:`_watch`).
        """
        layout = layout_for(regs)
        server, rdv_port = self._start_rendezvous(layout, {r.host for r in regs})
        inplace = set(inplace)  # N look-ups below, not N * N
        joining = [r for r in regs if r not in inplace] if inplace else []
        try:
            later = {}  # survivors' assignments, sent once the newcomers are ready
            for a in layout:
                reg = a.pop("reg")
                reg.rank = a["rank"]
                a["hostname"] = f"host{a.pop('host_index')}"
                msg = dict(
                    type=protocol.ASSIGN,
                    rendezvous_port=rdv_port,
                    round=round_,
                    elastic=self.elastic,
                    inplace=reg in inplace,
                    join=reg in joining,
                    lost=bool(inplace) and not joining,  # this world replaces one that lost a rank
                    **a,
                )
                if joining and reg in inplace:
                    later[reg] = msg
                else:
                    reg.round = round_
                    reg.send(**msg)
            self.round_sizes[round_] = len(regs)
            kind = "growing" if joining else "in-process" if inplace else "restart"
            log.info(
                "assigned %d ranks on %d host(s); rendezvous on port %d (%s round %d); %s",
                len(regs),
                len({r.host for r in regs}),
                rdv_port,
                kind if round_ else "first",
                round_,
                self.budget.left_line(),
            )
            result = self._watch(regs, round_, later, meet=bool(inplace))
        except BaseException:
            server.stop()
            raise
        finally:
            for old in self._servers_in_use:
                old.stop()
            self._servers_in_use = []
        if result.joining:
            # The survivors may still be meeting in this round's rendezvous (a newcomer
            # can register right after an in-process recovery): it serves them until
            # the next round ends.
            self._servers_in_use = [server]
        else:
            server.stop()
        return result

    def _start_rendezvous(self, layout: list[dict], hosts: set[str]) -> tuple:
        """Horovod's Gloo rendezvous server for ``layout``, serving only ``hosts``; (it, port)."""
        from horovod.runner.common.util.hosts import SlotInfo

        from .guard import GuardedRendezvous

        plan = [
            SlotInfo(
                hostname=f"host{a['host_index']}",
                rank=a["rank"],
                local_rank=a["local_rank"],
                cross_rank=a["cross_rank"],
                size=a["size"],
                local_size=a["local_size"],
                cross_size=a["cross_size"],
            )
            for a in layout
        ]
        # Horovod's server, bound to our address, serving only registered workers.
        server = GuardedRendezvous(self.host, hosts)
        port = server.start()
        server.init(plan)
        return server, port

    def _watch(
        self, regs: list[Registration], round_: int, later: dict, meet: bool = False
    ) -> RoundResult:
        """Follow a round until every rank reported; how it ended (:class:`rounds.Round`)."""
        return Round(self, regs, round_, later, meet).run()

    def take_doings(self, round_: int) -> dict[int, str]:
        """What each rank of ``round_`` was doing, as workers answered a ``describe``."""
        with self._doings_lock:
            return self._doings.pop(round_, {})

    @staticmethod
    def lost(reg: Registration) -> str:
        return f"lost its worker ({reg.describe()}) without an exit report"

    def _heard(self, reg: Registration, msg: dict) -> None:
        """A worker's message, on the listener's thread: as a report for the round, or kept."""
        kind = msg.get("type")
        if kind == protocol.EXIT:
            self.events.put(_exit_report(reg, msg))
        elif kind in (READY, FINISHED) and isinstance(msg.get("round"), int):
            self.events.put(Report(reg, msg["round"], kind))
        elif kind == RESUMED and all(is_int(msg.get(k)) for k in ("round", "step")):
            self.events.put(Report(reg, msg["round"], RESUMED, str(msg["step"])))
        elif kind == protocol.STATE:
            self._record_doings(msg)

    def _ended(self, reg: Registration, error: Exception | None) -> None:
        """A worker's connection is over, on the listener's thread: the worker is lost."""
        reg.gone = True
        if isinstance(error, protocol.Silent):
            lost = f"lost its worker ({reg.describe()}): no word for {self.silence_s:g} s"
            log.warning("%s, not even a keep-alive: its machine or network may be down", lost)
            self.events.put(Report(reg, None, SILENT, lost))
        else:
            self.events.put(Report(reg, None, LOST, self.lost(reg)))

    def _record_doings(self, msg: dict) -> None:
        """Keep a worker's answer to DESCRIBE: ``{"round": n, "ranks": {"0": "waits in ..."}}``.

        A malformed answer is ignored (it only adds detail to a report).
        """
        ranks, round_ = msg.get("ranks"), msg.get("round")
        if not isinstance(ranks, dict) or not isinstance(round_, int):
            return
        with self._doings_lock:
            mine = self._doings.setdefault(round_, {})
            for rank, doing in ranks.items():
                if str(rank).isdigit():
                    mine[int(rank)] = str(doing)[:300]


class _Door:
    """The scheduler's listening socket: the workers that register, at the start and later.

    Handshakes run concurrently in :class:`protocol.Admission` (challenge, MAC
    check, refusals logged), so a slow or hostile client never holds up a
    real worker; each one admitted is handed to ``registered``.
    """

    def __init__(self, host: str, port: int, worker_num: int, token: str, registered):
        self.worker_num, self.token, self.registered = worker_num, token, registered
        self.newcomers: queue.Queue = queue.Queue()  # registered after the first round
        self._closing = threading.Event()
        self._admission: protocol.Admission | None = None  # started by accept_one
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # A rerun on the port of a job that just ended (its connections in TIME_WAIT)
        # binds at once; a port another socket listens on is still refused (Linux).
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise LaunchError(
                f"the scheduler cannot listen on {host}:{port}: {exc.strerror}. Another job may "
                f"use this port: choose another {config.named(config.SCHED_PORT)} (and give it to "
                "the workers)."
            ) from None
        # Every worker may connect at once (a job's start): a connection beyond the
        # backlog is dropped by the kernel and its client tries again only after 1, 3,
        # 7, 15, 31 s (SYN retransmits), which made 1,000 workers take 30-80 s to
        # register with a backlog of 64 (benchmarks/control_plane.py). Linux caps it
        # at net.core.somaxconn.
        self.sock.listen(max(64, worker_num))

    def accept_one(self, timeout: float) -> Registration | None:
        """One authenticated registration, or None (timeout, refused, broken)."""
        if self._admission is None:
            self._admission = protocol.Admission(self.sock, self.token)
        got = self._admission.next(timeout)
        if got is None:
            return None
        ch, hello, addr = got
        try:
            pid = int(hello.get("pid", -1))
        except (TypeError, ValueError):
            pid = -1
        reg = Registration(ch, addr[0], str(hello.get("hostname", "?"))[:200], pid)
        self.registered(reg)
        return reg

    def all_workers(self, timeout_s: float) -> list[Registration]:
        """The job's first ``worker_num`` workers, within ``timeout_s``."""
        regs: list[Registration] = []
        deadline = time.monotonic() + timeout_s
        while len(regs) < self.worker_num:
            left = deadline - time.monotonic()
            if left <= 0:
                where = ", ".join(f"{r.hostname} ({r.host}, pid {r.pid})" for r in regs) or "none"
                for r in regs:
                    r.send(type=protocol.ABORT, round=0, reason="not all workers arrived")
                raise LaunchError(
                    f"only {len(regs)} of {self.worker_num} workers registered within "
                    f"{timeout_s:g} s (arrived: {where}). Start the missing workers with "
                    f"the same {config.named(config.SCHED_HOST)}/{config.named(config.SCHED_PORT)} "
                    f"and job token, or lower {config.named(config.WORKER_NUM)}."
                )
            reg = self.accept_one(min(left, 1.0))
            if reg is None:
                continue
            regs.append(reg)
            log.info(
                "worker %d/%d registered from %s (%s, pid %d)",
                len(regs),
                self.worker_num,
                reg.hostname,
                reg.host,
                reg.pid,
            )
        return regs

    def keep_open(self) -> None:
        """After the first round: workers that replace lost ones wait in :attr:`newcomers`."""
        threading.Thread(target=self._newcomers, daemon=True).start()

    def _newcomers(self) -> None:
        while not self._closing.is_set():
            reg = self.accept_one(1.0)
            if reg is not None:
                log.info("worker registered from %s (%s, pid %d)", reg.hostname, reg.host, reg.pid)
                self.newcomers.put(reg)

    def close(self) -> None:
        self._closing.set()
        self.sock.close()


def _exit_report(reg: Registration, msg: dict) -> Report:
    """The report of ``reg``'s exit message.

    A malformed report (e.g. a worker of another hvdkit version) counts as a
    failure with what could be read; it must not end the listening thread,
    which would leave the scheduler waiting for this worker forever.
    """
    try:
        code = int(msg.get("code", -1))
    except (TypeError, ValueError, OverflowError):
        code = -1
        detail = f"sent a malformed exit report ({str(msg)[:200]})"
    else:
        detail = str(msg.get("detail", f"exit code {code}"))
    tail = msg.get("tail", [])
    tail = tuple(str(line) for line in tail) if isinstance(tail, list) else ()
    round_ = msg.get("round")
    return Report(reg, round_ if isinstance(round_, int) else None, code, detail, tail)

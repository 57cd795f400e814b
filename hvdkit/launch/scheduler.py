"""The scheduler of a multi-node job without SSH (MindSpore's scheduler role).

Workers register over TCP with the job token; when ``worker_num`` have come,
the scheduler assigns ranks (contiguous per host, in order of arrival),
starts Horovod's own Gloo rendezvous server, and hands every worker the
``HOROVOD_*`` settings Horovod's Gloo launcher would have given it. It then
watches: the first worker that fails or disappears makes it tell all others to
stop. Without restarts it then exits non-zero naming that rank; with
``max_restarts`` it starts the job again (a new *round*: new rendezvous, same
token) on the workers still connected, waiting for replacements of lost
ones, or going on with ``min_workers`` or more. The launcher uses Horovod's
runner only (the rendezvous server, guarded in :mod:`hvdkit.launch.guard`);
:mod:`hvdkit.backends.horovod` is the only module that uses its collectives.

Messages (one JSON object per line, :mod:`hvdkit.launch.protocol`):
scheduler -> worker ``assign`` (with ``round``), ``abort`` (with ``round``),
``preempt`` (with ``round``: the scheduler got ``SIGTERM``), ``done`` (with
the job's ``code``); worker -> scheduler ``register``, ``exit`` (with
``round``; code 75 and "preempted after step N" for a preemption).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import signal
import socket
import threading
import time
from dataclasses import dataclass

from .. import config
from .._validate import is_int
from ..errors import LaunchError
from . import protocol
from .failures import root_cause
from .heartbeat import STUCK, stall_timeout
from .protocol import FINISHED, READY, RESUMED, Channel
from .restart import RestartBudget, resume_step

log = logging.getLogger("hvdkit.scheduler")
FAILURE_GRACE_S = 3.0
SIGNAL_POLL_S = 0.5  # how often a round's watch looks whether SIGTERM came
ABORT_WAIT_S = 30.0


@dataclass(eq=False)
class Registration:
    channel: Channel
    host: str  # the worker's address as the scheduler sees it: one per machine
    hostname: str
    pid: int
    rank: int = -1
    round: int = -1  # the round its program runs in (what its worker accepts messages for)
    gone: bool = False  # its connection closed: the worker (or its machine) is lost

    def send(self, **msg) -> bool:
        try:
            self.channel.send(**msg)
            return True
        except OSError:
            self.gone = True
            return False

    def describe(self) -> str:
        return f"pid {self.pid} on {self.hostname} {self.host}"


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


@dataclass
class RoundResult:
    """How one round of the job ended."""

    culprit: int | None = None  # None: every rank finished with status 0, or was preempted
    detail: str = ""
    tail: tuple = ()
    preempted: str = ""  # a rank's "preempted after step N": the job stopped for SIGTERM
    survivors: list | None = None  # elastic: the workers whose programs go on in-process
    joining: list | None = None  # elastic: workers that join the survivors (a cold start)
    # elastic: newcomers sent away from a growing round that failed through no fault of
    # theirs; they wait to join again (not lost, no restart counted)
    requeued: list | None = None

    @property
    def cause(self) -> str:
        return self.detail if self.culprit is None else f"rank {self.culprit} {self.detail}"


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
            raise LaunchError(f"HVDKIT_WORKER_NUM={worker_num} must be at least 1.")
        min_workers = worker_num if min_workers is None else min_workers
        if not 1 <= min_workers <= worker_num:
            raise LaunchError(
                f"HVDKIT_MIN_WORKERS={min_workers} must be between 1 and HVDKIT_WORKER_NUM="
                f"{worker_num}; lower it or raise HVDKIT_WORKER_NUM."
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
                "use this port: choose another HVDKIT_SCHED_PORT (and give it to the workers)."
            ) from None
        self.sock.listen(64)
        # (registration, round or None if the connection was lost, code, detail, tail);
        # code is an exit status, or protocol.READY, RESUMED or FINISHED (not an exit)
        self.events: queue.Queue = queue.Queue()
        # elastic: a rank's training function returned; the job takes no newcomer now
        self._finishing = False
        self._round_sizes: dict[int, int] = {}  # ranks per round, for the membership lines
        self.newcomers: queue.Queue = queue.Queue()  # registered after the first round
        # round -> rank -> what it was doing, as workers answered a "describe"
        self._doings: dict[int, dict[int, str]] = {}
        self._doings_lock = threading.Lock()
        self._closing = threading.Event()
        self._sigterm: list[str] = []  # filled by the SIGTERM handler run() installs
        self._admission: protocol.Admission | None = None  # started by _accept_one

    # ------------------------------------------------------------ registration
    def _accept_one(self, timeout: float) -> Registration | None:
        """One authenticated registration, or None (timeout, refused, broken).

        Handshakes run concurrently in :class:`protocol.Admission` (challenge,
        MAC check, refusals logged), so a slow or hostile client never holds
        up a real worker.
        """
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
        ch.keep_alive(self.silence_s)
        threading.Thread(target=self._listen, args=(reg,), daemon=True).start()
        return reg

    def _accept_registrations(self) -> list[Registration]:
        regs: list[Registration] = []
        deadline = time.monotonic() + self.timeout_s
        while len(regs) < self.worker_num:
            left = deadline - time.monotonic()
            if left <= 0:
                where = ", ".join(f"{r.hostname} ({r.host}, pid {r.pid})" for r in regs) or "none"
                for r in regs:
                    r.send(type="abort", round=0, reason="not all workers arrived")
                raise LaunchError(
                    f"only {len(regs)} of {self.worker_num} workers registered within "
                    f"{self.timeout_s:g} s (arrived: {where}). Start the missing workers with "
                    "the same HVDKIT_SCHED_HOST/PORT and job token, or lower HVDKIT_WORKER_NUM."
                )
            reg = self._accept_one(min(left, 1.0))
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

    def _accept_newcomers(self) -> None:
        """After the first round: workers that come to replace lost ones wait here."""
        while not self._closing.is_set():
            reg = self._accept_one(1.0)
            if reg is not None:
                log.info("worker registered from %s (%s, pid %d)", reg.hostname, reg.host, reg.pid)
                self.newcomers.put(reg)

    # ------------------------------------------------------------ the job
    def run(self) -> int:
        log.info(
            "scheduler listening on %s:%d for %d workers", self.host, self.port, self.worker_num
        )
        try:
            regs = self._accept_registrations()
        except BaseException:
            self.sock.close()
            raise
        if self.budget.limit == 0 and not self.elastic:
            # A late or surplus worker is refused at once instead of waiting
            # on a socket nobody accepts from.
            self.sock.close()
        else:
            threading.Thread(target=self._accept_newcomers, daemon=True).start()
        everyone = list(regs)
        try:
            with self._noting_sigterm():
                return self._rounds(regs, everyone)
        finally:
            self._closing.set()
            self.sock.close()
            for r in everyone:
                r.channel.close()

    @contextlib.contextmanager
    def _noting_sigterm(self):
        """While rounds run, SIGTERM is passed on to the workers (a preemption), not fatal."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers live on the main thread; SIGTERM stays fatal
            return
        previous = signal.signal(signal.SIGTERM, lambda *_: self._sigterm.append("SIGTERM"))
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
                lost = [r for r in regs if r not in result.survivors and r not in requeued]
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
                self._let_back(lost, result.cause)
                regs, inplace = result.survivors, list(result.survivors)
                continue
            if result.culprit is None and result.preempted:
                log.warning(
                    "job preempted: every rank %s; start the same job again to resume",
                    result.preempted,
                )
                return self._finish(everyone, config.EXIT_PREEMPTED)
            if result.culprit is None:
                log.info("all %d ranks finished successfully", len(regs))
                return self._finish(everyone, 0)
            shown = "\n".join(f"    {ln}" for ln in result.tail) or "    (no output)"
            if self._sigterm:  # told to stop: no restart
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
            self._finishing = False  # the restarted programs train again
            try:
                regs = self._gather([r for r in regs if not r.gone])
            except LaunchError as exc:
                log.error("job failed: %s", exc)
                log.error("%s", self.budget.summary())
                return self._finish(everyone, 1)
            everyone.extend(r for r in regs if r not in everyone)

    def _let_back(self, lost: list[Registration], cause: str) -> None:
        """Elastic: a worker whose program failed (it is still there) may join again.

        Each such return counts as a restart against ``HVDKIT_MAX_RESTARTS``,
        so a program that fails every time does not come back forever.
        """
        for r in lost:
            if r.gone:
                continue  # the worker itself is lost: a new one may register
            if self.budget.record(cause) is None:
                log.warning("%s does not join again: %s", r.describe(), self.budget.summary())
                continue
            log.warning(
                "%s joins again with a new program (restart %d/%d)",
                r.describe(),
                self.budget.restarts,
                self.budget.limit,
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
                r.send(type="done", code=code)
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
                f"HVDKIT_MIN_WORKERS={self.min_workers}. Start replacement workers with the same "
                "job token, or lower HVDKIT_MIN_WORKERS."
            )
        if len(regs) < self.worker_num:
            log.warning(
                "continuing on %d of %d workers (HVDKIT_MIN_WORKERS=%d)",
                len(regs),
                self.worker_num,
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
        from horovod.runner.common.util.hosts import SlotInfo

        from .guard import GuardedRendezvous

        layout = layout_for(regs)
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
        server = GuardedRendezvous(self.host, {r.host for r in regs})
        rdv_port = server.start()
        server.init(plan)
        joining = [r for r in regs if r not in inplace] if inplace else []
        try:
            later = {}  # survivors' assignments, sent once the newcomers are ready
            for a in layout:
                reg = a.pop("reg")
                reg.rank = a["rank"]
                a["hostname"] = f"host{a.pop('host_index')}"
                msg = dict(
                    type="assign",
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
            self._round_sizes[round_] = len(regs)
            kind = "in-process " if inplace and not joining else "growing " if joining else ""
            log.info(
                "assigned %d ranks on %d host(s); rendezvous on port %d%s",
                len(regs),
                len({r.host for r in regs}),
                rdv_port,
                f" ({kind}round {round_})" if round_ else "",
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

    def _watch(
        self, regs: list[Registration], round_: int, later: dict, meet: bool = False
    ) -> RoundResult:
        """Follow a round until every rank reported; how it ended.

        ``later``: the survivors' assignments of a growing round, sent when
        every joining worker said ``ready``; until then those workers still
        run the previous round (their reports carry its number). ``meet``: the
        ranks start Horovod in-process (survivors, newcomers of an elastic
        job): each says ``ready``, and all are told ``go`` together
        (:mod:`hvdkit._meeting`), so no rank waits in Gloo's rendezvous for
        one that noticed the change later.
        """
        remaining = {r: r.rank for r in regs}
        newcomers = {r for r in regs if r not in later} if later else set()
        waiting = set(newcomers)  # newcomers whose programs are not ready yet
        meeting = set(regs) if meet else set()  # ranks not yet ready to start Horovod
        carried = meet  # the survivors' programs come from the round before (in-process)
        ready_by = time.monotonic() + self.timeout_s
        failures: dict[int, tuple[str, list[str]]] = {}  # in the order they came
        exited_ok: list[int] = []
        grace_until = None
        described = False  # the other workers were asked what their ranks do
        preempt_sent = False
        # A worker lost before its listener saw this round's assignment.
        for r in regs:
            if r.gone:
                self.events.put((r, None, -1, self._lost(r), []))
        preempted = ""  # a rank's report "preempted after step N"
        while remaining:
            if self._sigterm and not preempt_sent:
                self._preempt(remaining)
                preempt_sent = True
            if waiting and time.monotonic() > ready_by:
                why = f"the joining workers' programs were not ready within {self.timeout_s:g} s"
                return self._without(remaining, newcomers, why)
            if not (later or meet or failures or preempt_sent or self._finishing):
                # (after the go: a round whose ranks have met, and trained, takes newcomers)
                grown = self._grow(remaining)
                if grown is not None:
                    return grown
            timeout = SIGNAL_POLL_S if grace_until is None else grace_until - time.monotonic()
            try:
                reg, rnd, code, detail, tail = self.events.get(timeout=max(0.0, timeout))
            except queue.Empty:
                if grace_until is None:
                    continue  # only a look at the signals
                break  # grace over: stop the rest
            if code == RESUMED:  # also of an earlier round: a newcomer may come first
                ranks = self._round_sizes.get(rnd, "?")
                log.info("round %d: %s ranks train again from step %s", rnd, ranks, detail)
                continue
            if code == FINISHED:  # of this round or the one before (a growing round)
                if reg in remaining and self._training_over(reg.rank, remaining, newcomers):
                    newcomers, waiting, later, meet = set(), set(), {}, False
                continue
            if reg not in remaining:
                continue
            if (
                rnd is not None
                and rnd != reg.round
                and not (carried and reg not in newcomers and code != READY and rnd < reg.round)
            ):
                continue  # a late report of an earlier round
            # (but a survivor carried in-process into this round runs the same program: if
            # it ended just as its new world was sent, its report of the old round is now)
            if code == READY:
                if rnd != round_:
                    continue  # ready for a round given up
                waiting.discard(reg)
                meeting.discard(reg)
                if not waiting and later:  # the newcomers are ready: the survivors come
                    for r, msg in later.items():
                        r.round = round_
                        r.send(**msg)
                    later = {}
                if meet and not meeting:  # every rank is ready: start Horovod together
                    for r in remaining:
                        r.send(type="go", round=round_)
                    meet, newcomers = False, set()  # members like the others from now on
                continue
            rank = remaining.pop(reg)
            if later:  # the survivors were not told yet: they still train in their world
                ended = RoundResult(rank, detail, tuple(tail))
                if reg in newcomers:  # it is lost; the other newcomers wait to join again
                    remaining[reg] = rank  # _without() sends it away with the others
                    why = f"joining rank {rank} {detail}"
                    return self._without(remaining, newcomers, why, ended, newcomers - {reg})
                if code != 0:  # a survivor died: the others regroup; the newcomers wait
                    why = f"a survivor was lost meanwhile: rank {rank} {detail}"
                    return self._without(remaining, newcomers, why, ended, newcomers)
            if code == 0 and reg not in newcomers:  # (its worker may not have said "finished")
                if self._training_over(rank, remaining, newcomers):
                    newcomers, waiting, later, meet = set(), set(), {}, False
            if code == config.EXIT_PREEMPTED:
                preempted = preempted or detail
                continue
            if code == 0:
                if not failures:
                    exited_ok.append(rank)
                continue
            failures[rank] = (detail, tail)
            if (
                self.elastic
                and len(remaining) >= self.min_workers
                and not (preempt_sent or self._finishing)
            ):
                # The others' programs notice the dead peer (a closed connection, our
                # word through their workers, or Gloo's timeout) and
                # wait for their next assignment: no abort, no restart.
                return RoundResult(rank, detail, tuple(tail), survivors=list(remaining))
            if detail.startswith(STUCK) and not described:
                # A worker sees only its own ranks: ask the others what theirs
                # are doing, so the report names every rank's collective.
                for r in remaining:
                    r.send(type="describe", round=r.round)
                described = True
            if grace_until is None:
                # Other ranks usually fail right after the real culprit;
                # collect them briefly so the report names the right one.
                grace_until = time.monotonic() + FAILURE_GRACE_S
        if not failures:
            return RoundResult(preempted=preempted)
        tails = {rank: tail for rank, (_, tail) in failures.items()}
        blame = root_cause(list(failures), tails, exited_ok)
        culprit = blame.rank
        detail, tail = failures.get(culprit, (blame.how, []))
        log.error("rank %d failed: %s; stopping the other workers", culprit, detail)
        for other, (said, _) in sorted(failures.items()):
            if other != culprit and said.startswith(STUCK):  # what each rank waited in
                log.error("rank %d also: %s", other, said)
        with self._doings_lock:
            doings = self._doings.pop(round_, {})
        meanwhile = [f"rank {o} {d}" for o, d in sorted(doings.items()) if o not in failures]
        for line in meanwhile:
            log.error("%s meanwhile", line)
        if meanwhile:  # the job's final report names every rank too
            detail = f"{detail}. Meanwhile {'; '.join(meanwhile)}"
        for r in remaining:
            r.send(type="abort", round=r.round, reason=f"rank {culprit} failed: {detail}")
        deadline = time.monotonic() + ABORT_WAIT_S
        while remaining and time.monotonic() < deadline:
            try:
                reg, rnd, code, *_ = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if code in (READY, RESUMED, FINISHED):  # not an exit report
                continue
            if reg in remaining and (rnd is None or rnd == round_):
                remaining.pop(reg)
        if remaining:
            log.error(
                "ranks %s did not report after being told to stop", sorted(remaining.values())
            )
            for r in remaining:  # not trusted with another round
                r.gone = True
                r.channel.close()
        return RoundResult(culprit, detail, tuple(tail))

    def _training_over(self, rank: int, remaining: dict, newcomers: set) -> bool:
        """``rank`` finished training: the job takes no newcomer from now on.

        Newcomers of this round still waiting to meet are sent away (they
        would wait for a world that never forms) and the others run to their
        end in the world they have; True if there were any.
        """
        if not self._finishing:
            self._finishing = True
            if self.elastic:
                log.info("rank %d finished training: the job takes no newcomer now", rank)
        if not newcomers & remaining.keys():
            return False
        self._send_away(remaining, newcomers, "the job finished training")
        return True

    def _grow(self, remaining: dict) -> RoundResult | None:
        """Elastic and short of workers: a registered newcomer makes the next round bigger."""
        if not self.elastic or len(remaining) >= self.worker_num:
            return None
        joining = []
        while len(remaining) + len(joining) < self.worker_num:
            try:
                reg = self.newcomers.get_nowait()
            except queue.Empty:
                break
            if not reg.gone:
                joining.append(reg)
        if not joining:
            return None
        return RoundResult(survivors=list(remaining), joining=joining)

    def _without(
        self,
        remaining: dict,
        newcomers: set,
        why: str,
        ended: RoundResult | None = None,
        requeue: set = frozenset(),
    ) -> RoundResult:
        """A growing round that cannot form: the newcomers are sent away, the others regroup.

        ``ended``: the rank whose end made it fail (its cause is the round's);
        without one, the newcomers are the cause (their programs were not
        ready). ``requeue``: newcomers that did nothing wrong; they wait to
        join again, without counting a restart.
        """
        self._send_away(remaining, newcomers, why)
        survivors = [r for r in remaining if not r.gone]
        if not survivors or len(survivors) < self.min_workers:
            for r in survivors:
                r.send(type="abort", round=r.round, reason=why)
            if ended is not None:
                return ended
            return RoundResult(remaining.get(survivors[0], 0) if survivors else 0, why)
        base = ended or RoundResult(detail=why)
        waiting = [r for r in requeue if not r.gone]
        return dataclasses.replace(base, survivors=survivors, requeued=waiting)

    @staticmethod
    def _send_away(remaining: dict, newcomers: set, why: str) -> None:
        log.warning("the joining workers are sent away (%s)", why)
        for r in newcomers:
            if remaining.pop(r, None) is not None:
                r.send(type="abort", round=r.round, reason=f"could not join the job: {why}")

    def _preempt(self, regs) -> None:
        """Pass the scheduler's SIGTERM on: every worker forwards it to its rank."""
        log.warning(
            "SIGTERM: asking the %d workers to stop their ranks at a common step and "
            "checkpoint it (grace period %g s, %s)",
            len(regs),
            config.preempt_grace(),
            config.PREEMPT_GRACE,
        )
        for r in regs:
            r.send(type="preempt", round=r.round, reason="the scheduler received SIGTERM")

    @staticmethod
    def _lost(reg: Registration) -> str:
        return f"lost its worker ({reg.describe()}) without an exit report"

    def _listen(self, reg: Registration) -> None:
        lost = None  # why the worker is lost, if not "without an exit report"
        while True:
            try:
                msg = reg.channel.recv()
            except protocol.Silent:
                lost = f"lost its worker ({reg.describe()}): no word for {self.silence_s:g} s"
                log.warning("%s, not even a keep-alive: its machine or network may be down", lost)
                msg = None
            except Exception as exc:  # the worker is as good as lost; never a dead thread
                if not isinstance(exc, OSError):
                    log.error("reading %s failed: %s", reg.describe(), type(exc).__name__)
                msg = None
            if msg is None:
                reg.gone = True
                self.events.put((reg, None, -1, lost or self._lost(reg), []))
                return
            if msg.get("type") == "exit":
                self.events.put((reg, *_exit_report(msg)))
            elif msg.get("type") in (READY, FINISHED) and isinstance(msg.get("round"), int):
                self.events.put((reg, msg["round"], msg["type"], "", []))
            elif msg.get("type") == RESUMED and all(is_int(msg.get(k)) for k in ("round", "step")):
                self.events.put((reg, msg["round"], RESUMED, str(msg["step"]), []))
            elif msg.get("type") == "state":
                self._record_doings(msg)

    def _record_doings(self, msg: dict) -> None:
        """Keep a worker's answer to ``describe``: ``{"round": n, "ranks": {"0": "waits in ..."}}``.

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


def _exit_report(msg: dict) -> tuple:
    """``(round, code, detail, tail)`` of a worker's exit message.

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
    tail = [str(line) for line in tail] if isinstance(tail, list) else []
    return msg.get("round"), code, detail, tail

"""One round of a job as the scheduler follows it: a named state machine.

The scheduler (:mod:`hvdkit.launch.scheduler`) sends every worker of a round
its assignment and hands the round to :class:`Round`, which reads the
workers' reports one at a time and decides how the round ended
(:class:`RoundResult`): every rank finished or was preempted, a rank failed
(the job stops or restarts whole), the survivors go on in-process (elastic),
or newcomers join them.

Phases (:class:`Phase`)::

    JOINING   a growing round: the newcomers start their programs; the survivors,
              not told yet, train on in the round before
    MEETING   every rank knows its world; each says "ready", then all are told
              "go" together (hvdkit._comm.meeting)
    TRAINING  the ranks train; a first round and a whole-job restart start here
    GRACE     a rank failed and the round cannot go on in-process: other failures
              are collected for FAILURE_GRACE_S, so the report names the culprit
    ENDED     the result is decided

Events (:class:`Event`): a worker's report READY, RESUMED or FINISHED; its
program's exit EXITED (status 0), PREEMPTED (75) or FAILED (any other); LOST
(its connection closed) and SILENT (no word for the silence limit); NEWCOMER
(a registered worker waits to join a round short of workers); LATE (the
newcomers were not ready within HVDKIT_SCHED_TIMEOUT); GRACE_OVER; SIGTERM
(to the scheduler: a preemption). A report of an earlier round, or from a
worker not in this round, is dropped before the table
(:meth:`Round.concerns`); a round whose ranks have all reported ends
(:meth:`Round.conclude`), in whatever phase.

The transitions: :data:`TRANSITIONS` is this table, and a unit test checks
that both say the same and walks every row::

    phase     event(s)                       handler               next phase(s)
    JOINING   READY                          on_ready              JOINING MEETING
    JOINING   RESUMED                        on_resumed            JOINING
    JOINING   FINISHED                       on_finished           TRAINING
    JOINING   EXITED                         on_exit_while_joining TRAINING ENDED
    JOINING   PREEMPTED FAILED LOST SILENT   on_exit_while_joining ENDED
    JOINING   LATE                           on_late               ENDED
    JOINING   SIGTERM                        on_sigterm            JOINING
    MEETING   READY                          on_ready              MEETING TRAINING
    MEETING   RESUMED                        on_resumed            MEETING
    MEETING   FINISHED                       on_finished           MEETING TRAINING
    MEETING   EXITED                         on_exited             MEETING TRAINING
    MEETING   PREEMPTED                      on_preempted          MEETING
    MEETING   FAILED LOST SILENT             on_failed             GRACE ENDED
    MEETING   SIGTERM                        on_sigterm            MEETING
    TRAINING  READY                          on_ready              TRAINING
    TRAINING  RESUMED                        on_resumed            TRAINING
    TRAINING  FINISHED                       on_finished           TRAINING
    TRAINING  EXITED                         on_exited             TRAINING
    TRAINING  PREEMPTED                      on_preempted          TRAINING
    TRAINING  FAILED LOST SILENT             on_failed             GRACE ENDED
    TRAINING  NEWCOMER                       on_newcomer           TRAINING ENDED
    TRAINING  SIGTERM                        on_sigterm            TRAINING
    GRACE     READY                          on_ready              GRACE
    GRACE     RESUMED                        on_resumed            GRACE
    GRACE     FINISHED                       on_finished           GRACE
    GRACE     EXITED                         on_exited             GRACE
    GRACE     PREEMPTED                      on_preempted          GRACE
    GRACE     FAILED LOST SILENT             on_failed             GRACE
    GRACE     GRACE_OVER                     conclude              ENDED
    GRACE     SIGTERM                        on_sigterm            GRACE

Why some rows go where they do: a newcomer's exit while JOINING, or a
survivor's failure then, ends the round (the survivors regroup, the other
newcomers wait to join again); a survivor's exit 0 means training is over, so
the newcomers are sent away. A failure in MEETING or TRAINING ends the round
with the survivors going on in-process when the job is elastic, at least
``HVDKIT_MIN_WORKERS`` are left, and neither a preemption nor the end of
training is under way; else it starts the GRACE period. "Finished" (a rank's
training function returned) makes the job take no newcomer from then on.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import queue
import time
from dataclasses import dataclass
from typing import Protocol

from .. import config
from .failures import root_cause
from .heartbeat import STUCK
from .protocol import FINISHED, READY, RESUMED, Channel

log = logging.getLogger("hvdkit.scheduler")
FAILURE_GRACE_S = 3.0
SIGNAL_POLL_S = 0.5  # how often a round's watch looks whether SIGTERM came
ABORT_WAIT_S = 30.0
LOST = "lost"  # a report's code when the worker's connection closed
SILENT = "silent"  # ... when it sent nothing, not even a keep-alive, for the silence limit


@dataclass(eq=False)
class Registration:
    """A worker registered with the scheduler: its channel, machine, and rank in its round."""

    channel: Channel
    host: str  # the worker's address as the scheduler sees it: one per machine
    hostname: str
    pid: int
    rank: int = -1
    round: int = -1  # the round its program runs in (what its worker accepts messages for)
    gone: bool = False  # its connection closed: the worker (or its machine) is lost
    returns: int = 0  # elastic: times its failed program joined again (not restarts)

    def send(self, **msg) -> bool:
        try:
            self.channel.send(**msg)
            return True
        except OSError:
            self.gone = True
            return False

    def describe(self) -> str:
        return f"pid {self.pid} on {self.hostname} {self.host}"


class Job(Protocol):
    """What a round reads and changes of its job (:class:`~hvdkit.launch.scheduler.Scheduler`)."""

    events: queue.Queue  # the workers' reports: (registration, round, code, detail, tail)
    newcomers: queue.Queue  # registered workers waiting to join
    sigterm: list[str]  # not empty once the scheduler got SIGTERM
    elastic: bool
    worker_num: int
    min_workers: int
    timeout_s: float
    finishing: bool  # a rank's training function returned: no newcomer from now on
    round_sizes: dict[int, int]

    def take_doings(self, round_: int) -> dict[int, str]: ...

    def lost(self, reg: Registration) -> str: ...


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


class Phase(enum.Enum):
    JOINING = "joining"
    MEETING = "meeting"
    TRAINING = "training"
    GRACE = "grace"
    ENDED = "ended"


class Event(enum.Enum):
    READY = "ready"
    RESUMED = "resumed"
    FINISHED = "finished"
    EXITED = "exited"
    PREEMPTED = "preempted"
    FAILED = "failed"
    LOST = "lost"
    SILENT = "silent"
    NEWCOMER = "newcomer"
    LATE = "late"
    GRACE_OVER = "grace over"
    SIGTERM = "SIGTERM"


@dataclass(frozen=True)
class Report:
    """One message of a worker, as its listener put it on the scheduler's queue.

    ``code``: an exit status, or READY, RESUMED, FINISHED, LOST or SILENT.
    ``round``: the round it is about (None for LOST and SILENT).
    """

    reg: Registration
    round: int | None
    code: int | str
    detail: str = ""
    tail: tuple = ()

    @property
    def event(self) -> Event:
        return _EVENT_OF_CODE.get(self.code, Event.FAILED)


_EVENT_OF_CODE = {
    READY: Event.READY,
    RESUMED: Event.RESUMED,
    FINISHED: Event.FINISHED,
    LOST: Event.LOST,
    SILENT: Event.SILENT,
    0: Event.EXITED,
    config.EXIT_PREEMPTED: Event.PREEMPTED,
}  # any other code is an exit status: FAILED


class Round:
    """One round's state and its handlers; :meth:`run` follows it to its end.

    ``later``: the survivors' assignments of a growing round, sent when every
    joining worker said ``ready``; until then those workers still run the
    previous round (their reports carry its number). ``meet``: the ranks start
    Horovod in-process (survivors, newcomers of an elastic job): each says
    ``ready``, and all are told ``go`` together, so no rank waits in Gloo's
    rendezvous for one that noticed the change later. Example::

        rnd = Round(scheduler, [a, b, c], 7, later={}, meet=False)  # TRAINING
        rnd.handle(Event.FAILED, Report(b, 7, 1, "exit code 1"))
        rnd.phase, rnd.result.survivors  # ENDED, [a, c] (an elastic job)
    """

    def __init__(self, job: Job, regs: list[Registration], number: int, later: dict, meet: bool):
        self.job, self.number, self.later = job, number, dict(later)
        self.remaining = {r: r.rank for r in regs}  # ranks yet to report how they ended
        self.newcomers = {r for r in regs if r not in later} if later else set()  # not met yet
        self.waiting = set(self.newcomers)  # newcomers whose programs are not ready yet
        # ranks not yet ready to start Horovod; None: no meeting (any more)
        self.unready: set | None = set(regs) if meet else None
        self.carried = meet  # the survivors' programs come from the round before (in-process)
        self.ready_by = time.monotonic() + job.timeout_s
        self.failures: dict[int, tuple[str, list[str]]] = {}  # in the order they came
        self.exited_ok: list[int] = []
        self.grace_until: float | None = None
        self.described = False  # the other workers were asked what their ranks do
        self.preempting = False  # the scheduler's SIGTERM was passed on
        self.preempted = ""  # a rank's report "preempted after step N"
        self.result: RoundResult | None = None
        self.phase = Phase.JOINING if later else Phase.MEETING if meet else Phase.TRAINING

    # ------------------------------------------------------------ the loop
    def run(self) -> RoundResult:
        """Follow the round until its result is decided; the result."""
        for r in self.remaining:  # lost before its listener saw this round's assignment
            if r.gone:
                self.job.events.put((r, None, LOST, self.job.lost(r), []))
        while self.phase is not Phase.ENDED:
            if not self.remaining:
                self.conclude()
                break
            event, report = self.next_event()
            if event is not None:
                self.handle(event, report)
        return self.result

    def next_event(self) -> tuple[Event | None, Report | None]:
        """What happens next; (None, None) when only a look at the signals was due."""
        job = self.job
        if job.sigterm and not self.preempting:
            return Event.SIGTERM, None
        if self.phase is Phase.JOINING and time.monotonic() > self.ready_by:
            return Event.LATE, None
        if self.takes_newcomers() and not job.newcomers.empty():
            return Event.NEWCOMER, None
        grace = self.grace_until
        timeout = SIGNAL_POLL_S if grace is None else grace - time.monotonic()
        try:
            reg, rnd, code, detail, tail = job.events.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return (None if grace is None else Event.GRACE_OVER), None
        report = Report(reg, rnd, code, detail, tuple(tail))
        return report.event, report

    def handle(self, event: Event, report: Report | None = None) -> None:
        """Apply one event: the handler :data:`TRANSITIONS` names for it in this phase."""
        if report is not None and not self.concerns(event, report):
            return
        row = TRANSITIONS.get((self.phase, event))
        if row is not None:  # (the loop makes no event the phase has no row for)
            row[0](self, report)

    def concerns(self, event: Event, report: Report) -> bool:
        """Whether a report is about this round (a late one of an earlier round is not)."""
        reg, rnd = report.reg, report.round
        if event is Event.RESUMED:  # also of an earlier round: a newcomer may come first
            return True
        if reg not in self.remaining:
            return False
        if event is Event.FINISHED or rnd is None or rnd == reg.round:
            return True
        # A survivor carried in-process runs the same program: if it ended just as its
        # new world was sent, its report of the old round is about this one.
        carried = self.carried and reg not in self.newcomers
        return carried and event is not Event.READY and rnd < reg.round

    def takes_newcomers(self) -> bool:
        """Elastic and short of workers, training with nothing else under way."""
        job = self.job
        return (
            self.phase is Phase.TRAINING
            and job.elastic
            and not (self.preempting or job.finishing)
            and len(self.remaining) < job.worker_num
        )

    # ------------------------------------------------------------ the handlers
    def on_ready(self, report: Report) -> None:
        if report.round != self.number:
            return  # ready for a round given up
        self.waiting.discard(report.reg)
        if self.unready is not None:
            self.unready.discard(report.reg)
        if self.phase is Phase.JOINING and not self.waiting:
            self.tell_survivors()
        if self.unready is not None and not self.unready:
            self.go()

    def on_resumed(self, report: Report) -> None:
        ranks = self.job.round_sizes.get(report.round, "?")
        log.info("round %d: %s ranks train again from step %s", report.round, ranks, report.detail)

    def on_finished(self, report: Report) -> None:
        self.training_over(report.reg.rank)

    def on_exited(self, report: Report) -> None:
        rank = self.remaining.pop(report.reg)
        if report.reg not in self.newcomers:  # (its worker may not have said "finished")
            self.training_over(rank)
        if not self.failures:
            self.exited_ok.append(rank)

    def on_preempted(self, report: Report) -> None:
        self.remaining.pop(report.reg)
        self.preempted = self.preempted or report.detail

    def on_failed(self, report: Report) -> None:
        rank = self.remaining.pop(report.reg)
        self.failures[rank] = (report.detail, list(report.tail))
        if self.recoverable():
            # The others' programs notice the dead peer (a closed connection, our word
            # through their workers, or Gloo's timeout) and wait for their next
            # assignment: no abort, no restart.
            self.end(RoundResult(rank, report.detail, report.tail, survivors=[*self.remaining]))
            return
        if report.detail.startswith(STUCK) and not self.described:
            # A worker sees only its own ranks: ask the others what theirs are
            # doing, so the report names every rank's collective.
            for r in self.remaining:
                r.send(type="describe", round=r.round)
            self.described = True
        if self.grace_until is None:
            # Other ranks usually fail right after the real culprit; collect them
            # briefly so the report names the right one.
            self.grace_until = time.monotonic() + FAILURE_GRACE_S
            self.phase = Phase.GRACE

    def on_exit_while_joining(self, report: Report) -> None:
        """A growing round's member ended before the survivors heard of the bigger world."""
        reg, detail = report.reg, report.detail
        rank = self.remaining[reg]
        ended = RoundResult(rank, detail, report.tail)
        if reg in self.newcomers:  # it is lost; the other newcomers wait to join again
            why = f"joining rank {rank} {detail}"
            self.end(self.without(why, ended, self.newcomers - {reg}))
            return
        del self.remaining[reg]
        if report.event is not Event.EXITED:  # a survivor died: regroup; the newcomers wait
            why = f"a survivor was lost meanwhile: rank {rank} {detail}"
            self.end(self.without(why, ended, self.newcomers))
            return
        self.training_over(rank)  # it finished: the newcomers are sent away
        self.exited_ok.append(rank)

    def on_late(self, _report: None) -> None:
        why = f"the joining workers' programs were not ready within {self.job.timeout_s:g} s"
        self.end(self.without(why))

    def on_newcomer(self, _report: None) -> None:
        joining = []
        while len(self.remaining) + len(joining) < self.job.worker_num:
            try:
                reg = self.job.newcomers.get_nowait()
            except queue.Empty:
                break
            if not reg.gone:
                joining.append(reg)
        if joining:
            self.end(RoundResult(survivors=list(self.remaining), joining=joining))

    def on_sigterm(self, _report: None) -> None:
        """Pass the scheduler's SIGTERM on: every worker forwards it to its rank."""
        log.warning(
            "SIGTERM: asking the %d workers to stop their ranks at a common step and "
            "checkpoint it (grace period %g s, %s)",
            len(self.remaining),
            config.preempt_grace(),
            config.PREEMPT_GRACE,
        )
        for r in self.remaining:
            r.send(type="preempt", round=r.round, reason="the scheduler received SIGTERM")
        self.preempting = True

    def conclude(self, _report: None = None) -> None:
        """Every rank reported, or the grace period is over: stop the rest and decide."""
        if not self.failures:
            self.end(RoundResult(preempted=self.preempted))
            return
        culprit, detail, tail = self.blame()
        for r in self.remaining:
            r.send(type="abort", round=r.round, reason=f"rank {culprit} failed: {detail}")
        self.wait_for_the_rest()
        self.end(RoundResult(culprit, detail, tuple(tail)))

    # ------------------------------------------------------------ their steps
    def end(self, result: RoundResult) -> None:
        self.result, self.phase = result, Phase.ENDED

    def recoverable(self) -> bool:
        """The survivors of a failure can go on in-process (elastic) now."""
        job = self.job
        enough = len(self.remaining) >= job.min_workers
        return job.elastic and enough and not (self.preempting or job.finishing)

    def tell_survivors(self) -> None:
        """The newcomers are ready: the survivors get the bigger world."""
        for r, msg in self.later.items():
            r.round = self.number
            r.send(**msg)
        self.later = {}
        self.phase = Phase.MEETING

    def go(self) -> None:
        """Every rank is ready: all start Horovod together."""
        for r in self.remaining:
            r.send(type="go", round=self.number)
        self.unready, self.newcomers = None, set()  # members like the others from now on
        if self.phase is Phase.MEETING:
            self.phase = Phase.TRAINING

    def training_over(self, rank: int) -> None:
        """``rank`` finished training: the job takes no newcomer from now on.

        Newcomers of this round still waiting to meet are sent away (they
        would wait for a world that never forms); the others run to their end
        in the world they have.
        """
        job = self.job
        if not job.finishing:
            job.finishing = True
            if job.elastic:
                log.info("rank %d finished training: the job takes no newcomer now", rank)
        if not self.newcomers & self.remaining.keys():
            return
        self.send_away("the job finished training")
        self.newcomers, self.waiting, self.later, self.unready = set(), set(), {}, None
        if self.phase in (Phase.JOINING, Phase.MEETING):
            self.phase = Phase.TRAINING

    def without(
        self, why: str, ended: RoundResult | None = None, requeue: set = frozenset()
    ) -> RoundResult:
        """A growing round that cannot form: the newcomers are sent away, the others regroup.

        ``ended``: the rank whose end made it fail (its cause is the round's);
        without one, the newcomers are the cause (their programs were not
        ready). ``requeue``: newcomers that did nothing wrong; they wait to
        join again, without counting a restart.
        """
        self.send_away(why)
        survivors = [r for r in self.remaining if not r.gone]
        if not survivors or len(survivors) < self.job.min_workers:
            for r in survivors:
                r.send(type="abort", round=r.round, reason=why)
            if ended is not None:
                return ended
            return RoundResult(self.remaining.get(survivors[0], 0) if survivors else 0, why)
        base = ended or RoundResult(detail=why)
        waiting = [r for r in requeue if not r.gone]
        return dataclasses.replace(base, survivors=survivors, requeued=waiting)

    def send_away(self, why: str) -> None:
        log.warning("the joining workers are sent away (%s)", why)
        for r in self.newcomers:
            if self.remaining.pop(r, None) is not None:
                r.send(type="abort", round=r.round, reason=f"could not join the job: {why}")

    def blame(self) -> tuple[int, str, list[str]]:
        """The culprit of the failures (:func:`root_cause`), logged with what the others did."""
        failures = self.failures
        tails = {rank: tail for rank, (_, tail) in failures.items()}
        culprit = root_cause(list(failures), tails, self.exited_ok)
        detail, tail = failures.get(culprit.rank, (culprit.how, []))
        log.error("rank %d failed: %s; stopping the other workers", culprit.rank, detail)
        for other, (said, _) in sorted(failures.items()):
            if other != culprit.rank and said.startswith(STUCK):  # what each rank waited in
                log.error("rank %d also: %s", other, said)
        doings = self.job.take_doings(self.number)
        meanwhile = [f"rank {o} {d}" for o, d in sorted(doings.items()) if o not in failures]
        for line in meanwhile:
            log.error("%s meanwhile", line)
        if meanwhile:  # the job's final report names every rank too
            detail = f"{detail}. Meanwhile {'; '.join(meanwhile)}"
        return culprit.rank, detail, tail

    def wait_for_the_rest(self) -> None:
        """Wait up to ABORT_WAIT_S for the told ranks' reports; the silent ones are dropped."""
        deadline = time.monotonic() + ABORT_WAIT_S
        events = self.job.events
        while self.remaining and time.monotonic() < deadline:
            try:
                reg, rnd, code, *_ = events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if code in (READY, RESUMED, FINISHED):  # not an exit report
                continue
            if reg in self.remaining and (rnd is None or rnd == self.number):
                self.remaining.pop(reg)
        if self.remaining:
            log.error(
                "ranks %s did not report after being told to stop", sorted(self.remaining.values())
            )
            for r in self.remaining:  # not trusted with another round
                r.gone = True
                r.channel.close()


_J, _M, _T, _G, _E = Phase.JOINING, Phase.MEETING, Phase.TRAINING, Phase.GRACE, Phase.ENDED
_LOSSES = (Event.FAILED, Event.LOST, Event.SILENT)


def _rows(phase, events, handler, *after) -> dict:
    return {(phase, e): (handler, frozenset(after)) for e in events}


# (phase, event) -> (handler, the phases it may leave the round in): the module's table
TRANSITIONS: dict[tuple[Phase, Event], tuple] = {
    **_rows(_J, [Event.READY], Round.on_ready, _J, _M),
    **_rows(_J, [Event.RESUMED], Round.on_resumed, _J),
    **_rows(_J, [Event.FINISHED], Round.on_finished, _T),
    **_rows(_J, [Event.EXITED], Round.on_exit_while_joining, _T, _E),
    **_rows(_J, [Event.PREEMPTED, *_LOSSES], Round.on_exit_while_joining, _E),
    **_rows(_J, [Event.LATE], Round.on_late, _E),
    **_rows(_J, [Event.SIGTERM], Round.on_sigterm, _J),
    **_rows(_M, [Event.READY], Round.on_ready, _M, _T),
    **_rows(_M, [Event.RESUMED], Round.on_resumed, _M),
    **_rows(_M, [Event.FINISHED], Round.on_finished, _M, _T),
    **_rows(_M, [Event.EXITED], Round.on_exited, _M, _T),
    **_rows(_M, [Event.PREEMPTED], Round.on_preempted, _M),
    **_rows(_M, _LOSSES, Round.on_failed, _G, _E),
    **_rows(_M, [Event.SIGTERM], Round.on_sigterm, _M),
    **_rows(_T, [Event.READY], Round.on_ready, _T),
    **_rows(_T, [Event.RESUMED], Round.on_resumed, _T),
    **_rows(_T, [Event.FINISHED], Round.on_finished, _T),
    **_rows(_T, [Event.EXITED], Round.on_exited, _T),
    **_rows(_T, [Event.PREEMPTED], Round.on_preempted, _T),
    **_rows(_T, _LOSSES, Round.on_failed, _G, _E),
    **_rows(_T, [Event.NEWCOMER], Round.on_newcomer, _T, _E),
    **_rows(_T, [Event.SIGTERM], Round.on_sigterm, _T),
    **_rows(_G, [Event.READY], Round.on_ready, _G),
    **_rows(_G, [Event.RESUMED], Round.on_resumed, _G),
    **_rows(_G, [Event.FINISHED], Round.on_finished, _G),
    **_rows(_G, [Event.EXITED], Round.on_exited, _G),
    **_rows(_G, [Event.PREEMPTED], Round.on_preempted, _G),
    **_rows(_G, _LOSSES, Round.on_failed, _G),
    **_rows(_G, [Event.GRACE_OVER], Round.conclude, _E),
    **_rows(_G, [Event.SIGTERM], Round.on_sigterm, _G),
}

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

Decisions and effects are apart: a handler looks at the round's state, updates
its bookkeeping and returns an :class:`Action` (the next phase, the messages
to send, a grace timer to start, whether to await the ranks told to stop, the
result); it never sends, waits or sets the phase. :meth:`Round.apply` is the
one executor that does, so a unit test walks every row without processes::

    event --> concerns? --no--> dropped
                 |yes
                 v
    TRANSITIONS[(phase, event)] --> handler(state, report) --> Action --> apply()
                                                                  (send, timer, wait, phase)

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
    MEETING   FINISHED                       on_finished           MEETING TRAINING ENDED
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
training function returned) makes the job take no newcomer from then on; a
survivor's "finished" of the round before, while the survivors meet after a
loss, ends the round as a failure: that loss came at the job's end, which is
not recovered in-process (the lost rank may not have run the script's code
after training), so the job restarts whole, whichever report came first.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import queue
import time
from dataclasses import dataclass, field
from typing import Protocol

from .. import config
from .failures import root_cause
from .heartbeat import STUCK
from .protocol import ABORT, DESCRIBE, FINISHED, GO, PREEMPT, READY, RESUMED, Channel

log = logging.getLogger("hvdkit.scheduler")
FAILURE_GRACE_S = 3.0
SIGNAL_POLL_S = 0.5  # how often a round's watch looks at its clocks with nothing reported
# Put on the events queue by the scheduler's SIGTERM handler (a reentrant put): the watch
# wakes and looks at the signals now, not at its next look.
SIGNALLED = object()
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

    events: queue.SimpleQueue  # the workers' reports (:class:`Report`), and SIGNALLED
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


@dataclass
class Action:
    """What a handler decided, for :meth:`Round.apply` (the one executor) to carry out.

    ``phase``: the round's next phase (None: it stays); ``send``: messages,
    each to one worker, in order; ``grace_s``: start the grace period (unless
    one runs); ``drain``: the ranks just told to stop are awaited (up to
    :data:`ABORT_WAIT_S`) before ``result``, the round's end, is taken.
    """

    phase: Phase | None = None
    send: list[tuple[Registration, dict]] = field(default_factory=list)
    grace_s: float | None = None
    drain: bool = False
    result: RoundResult | None = None

    def then(self, other: Action) -> Action:
        """This action followed by ``other``: both's messages, the later phase."""
        return dataclasses.replace(
            other, phase=other.phase or self.phase, send=[*self.send, *other.send]
        )


class Round:
    """One round's state, its handlers and the executor; :meth:`run` follows it to its end.

    ``later``: the survivors' assignments of a growing round, sent when every
    joining worker said ``ready``; until then those workers still run the
    previous round (their reports carry its number). ``meet``: the ranks start
    Horovod in-process (survivors, newcomers of an elastic job): each says
    ``ready``, and all are told ``go`` together, so no rank waits in Gloo's
    rendezvous for one that noticed the change later.

    A handler (``on_*``, :meth:`conclude`) updates the round's bookkeeping and
    returns an :class:`Action`; it never sends, waits or changes the phase:
    :meth:`apply`, the one executor, does. Example::

        rnd = Round(scheduler, [a, b, c], 7, later={}, meet=False)  # TRAINING
        act = rnd.on_failed(Report(b, 7, 1, "exit code 1"))
        act.phase, act.result.survivors  # ENDED, [a, c] (an elastic job)
        rnd.apply(act)                    # now rnd.phase is ENDED
    """

    def __init__(self, job: Job, regs: list[Registration], number: int, later: dict, meet: bool):
        self.job, self.number, self.later = job, number, dict(later)
        self.remaining = {r: r.rank for r in regs}  # ranks yet to report how they ended
        self.newcomers = {r for r in regs if r not in later} if later else set()  # not met yet
        self.waiting = set(self.newcomers)  # newcomers whose programs are not ready yet
        # ranks not yet ready to start Horovod; None: no meeting (any more)
        self.unready: set | None = set(regs) if meet else None
        self.carried = meet  # the survivors' programs come from the round before (in-process)
        self.after_loss = meet and not later  # its survivors go on after a loss (no newcomer)
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
                self.job.events.put(Report(r, None, LOST, self.job.lost(r)))
        while self.phase is not Phase.ENDED:
            if not self.remaining:
                self.apply(self.conclude())
                break
            event, arg = self.next_event()
            if event is not None:
                self.handle(event, arg)
        return self.result

    def next_event(self) -> tuple[Event | None, Report | list | None]:
        """What happens next, with its report (or the newcomers that join); (None, None)
        when only a look at the signals was due."""
        job = self.job
        if job.sigterm and not self.preempting:
            return Event.SIGTERM, None
        if self.phase is Phase.JOINING and time.monotonic() > self.ready_by:
            return Event.LATE, None
        if self.takes_newcomers() and not job.newcomers.empty():
            joining = self.take_newcomers()
            return (Event.NEWCOMER, joining) if joining else (None, None)
        grace = self.grace_until
        timeout = SIGNAL_POLL_S if grace is None else grace - time.monotonic()
        try:
            report = job.events.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return (None if grace is None else Event.GRACE_OVER), None
        if report is SIGNALLED:
            return None, None  # the next call finds job.sigterm
        return report.event, report

    def handle(self, event: Event, arg: Report | list | None = None) -> None:
        """Apply one event: the handler :data:`TRANSITIONS` names for it in this phase."""
        if isinstance(arg, Report) and not self.concerns(event, arg):
            return
        row = TRANSITIONS.get((self.phase, event))
        if row is not None:  # (the loop makes no event the phase has no row for)
            self.apply(row[0](self, arg))

    def apply(self, act: Action) -> None:
        """The executor: send the action's messages, start its timer, wait, enter its phase."""
        for reg, msg in act.send:
            reg.send(**msg)
        if act.grace_s is not None and self.grace_until is None:
            self.grace_until = time.monotonic() + act.grace_s
        if act.drain:
            self.wait_for_the_rest()
        if act.result is not None:
            self.result = act.result
        if act.phase is not None:
            self.phase = act.phase

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

    def take_newcomers(self) -> list[Registration]:
        """The waiting workers that fill the round up to ``worker_num`` (lost ones dropped)."""
        joining: list[Registration] = []
        while len(self.remaining) + len(joining) < self.job.worker_num:
            try:
                reg = self.job.newcomers.get_nowait()
            except queue.Empty:
                break
            if not reg.gone:
                joining.append(reg)
        return joining

    # ------------------------------------------------------------ the handlers
    def on_ready(self, report: Report) -> Action:
        if report.round != self.number:
            return Action()  # ready for a round given up
        self.waiting.discard(report.reg)
        if self.unready is not None:
            self.unready.discard(report.reg)
        act = Action()
        if self.phase is Phase.JOINING and not self.waiting:
            act = self.tell_survivors()
        if self.unready is not None and not self.unready:
            act = act.then(self.go(act.phase or self.phase))
        return act

    def on_resumed(self, report: Report) -> Action:
        ranks = self.job.round_sizes.get(report.round, "?")
        log.info("round %d: %s ranks train again from step %s", report.round, ranks, report.detail)
        return Action()

    def on_finished(self, report: Report) -> Action:
        late = report.round is not None and report.round < report.reg.round
        if self.phase is Phase.MEETING and self.after_loss and late:
            return self.lost_at_the_end(report.reg.rank)
        return self.training_over(report.reg.rank)

    def lost_at_the_end(self, rank: int) -> Action:
        """A survivor of a loss had finished training before its new world reached it.

        So the rank was lost as training ended, perhaps in the script's code after
        it (a save, an evaluation), which no in-process world can run again: the
        round fails, every rank is stopped, and the job restarts whole, as when
        the survivor's "finished" came before the loss.
        """
        self.job.finishing = True
        why = (
            "had finished training when the world after a lost rank reached it: a rank "
            "lost as training ended is not recovered in-process"
        )
        self.failures[rank] = (why, [])
        act = self.end(RoundResult(rank, why))
        act.send, act.drain = [(r, _msg(ABORT, r.round, reason=why)) for r in self.remaining], True
        return act

    def on_exited(self, report: Report) -> Action:
        rank = self.remaining.pop(report.reg)
        act = Action()
        if report.reg not in self.newcomers:  # (its worker may not have said "finished")
            act = self.training_over(rank)
        if not self.failures:
            self.exited_ok.append(rank)
        return act

    def on_preempted(self, report: Report) -> Action:
        self.remaining.pop(report.reg)
        self.preempted = self.preempted or report.detail
        return Action()

    def on_failed(self, report: Report) -> Action:
        rank = self.remaining.pop(report.reg)
        self.failures[rank] = (report.detail, list(report.tail))
        if self.recoverable():
            # The others' programs notice the dead peer (a closed connection, our word
            # through their workers, or Gloo's timeout) and wait for their next
            # assignment: no abort, no restart.
            return self.end(
                RoundResult(rank, report.detail, report.tail, survivors=[*self.remaining])
            )
        act = Action()
        if report.detail.startswith(STUCK) and not self.described:
            # A worker sees only its own ranks: ask the others what theirs are
            # doing, so the report names every rank's collective.
            act.send = [(r, _msg(DESCRIBE, r.round)) for r in self.remaining]
            self.described = True
        if self.grace_until is None:
            # Other ranks usually fail right after the real culprit; collect them
            # briefly so the report names the right one.
            act.grace_s, act.phase = FAILURE_GRACE_S, Phase.GRACE
        return act

    def on_exit_while_joining(self, report: Report) -> Action:
        """A growing round's member ended before the survivors heard of the bigger world."""
        reg, detail = report.reg, report.detail
        rank = self.remaining[reg]
        ended = RoundResult(rank, detail, report.tail)
        if reg in self.newcomers:  # it is lost; the other newcomers wait to join again
            return self.without(f"joining rank {rank} {detail}", ended, self.newcomers - {reg})
        del self.remaining[reg]
        if report.event is not Event.EXITED:  # a survivor died: regroup; the newcomers wait
            why = f"a survivor was lost meanwhile: rank {rank} {detail}"
            return self.without(why, ended, self.newcomers)
        self.exited_ok.append(rank)
        return self.training_over(rank)  # it finished: the newcomers are sent away

    def on_late(self, _report: None) -> Action:
        why = f"the joining workers' programs were not ready within {self.job.timeout_s:g} s"
        return self.without(why)

    def on_newcomer(self, joining: list[Registration]) -> Action:
        if not joining:
            return Action()
        return self.end(RoundResult(survivors=list(self.remaining), joining=joining))

    def on_sigterm(self, _report: None) -> Action:
        """Pass the scheduler's SIGTERM on: every worker forwards it to its rank."""
        log.warning(
            "SIGTERM: asking the %d workers to stop their ranks at a common step and "
            "checkpoint it (grace period %g s, %s)",
            len(self.remaining),
            config.preempt_grace(),
            config.PREEMPT_GRACE,
        )
        self.preempting = True
        why = "the scheduler received SIGTERM"
        return Action(send=[(r, _msg(PREEMPT, r.round, reason=why)) for r in self.remaining])

    def conclude(self, _report: None = None) -> Action:
        """Every rank reported, or the grace period is over: stop the rest and decide."""
        if not self.failures:
            return self.end(RoundResult(preempted=self.preempted))
        culprit, detail, tail = self.blame()
        why = f"rank {culprit} failed: {detail}"
        act = self.end(RoundResult(culprit, detail, tuple(tail)))
        act.send, act.drain = [(r, _msg(ABORT, r.round, reason=why)) for r in self.remaining], True
        return act

    # ------------------------------------------------------------ their steps
    @staticmethod
    def end(result: RoundResult) -> Action:
        return Action(phase=Phase.ENDED, result=result)

    def recoverable(self) -> bool:
        """The survivors of a failure can go on in-process (elastic) now."""
        job = self.job
        enough = len(self.remaining) >= job.min_workers
        return job.elastic and enough and not (self.preempting or job.finishing)

    def tell_survivors(self) -> Action:
        """The newcomers are ready: the survivors get the bigger world."""
        send = []
        for r, msg in self.later.items():
            r.round = self.number
            send.append((r, msg))
        self.later = {}
        return Action(phase=Phase.MEETING, send=send)

    def go(self, phase: Phase) -> Action:
        """Every rank is ready: all start Horovod together (``phase``: the round's by now)."""
        send = [(r, _msg(GO, self.number)) for r in self.remaining]
        self.unready, self.newcomers = None, set()  # members like the others from now on
        return Action(phase=Phase.TRAINING if phase is Phase.MEETING else None, send=send)

    def training_over(self, rank: int) -> Action:
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
            return Action()
        send = self.send_away("the job finished training")
        self.newcomers, self.waiting, self.later, self.unready = set(), set(), {}, None
        back = self.phase in (Phase.JOINING, Phase.MEETING)
        return Action(phase=Phase.TRAINING if back else None, send=send)

    def without(
        self, why: str, ended: RoundResult | None = None, requeue: set = frozenset()
    ) -> Action:
        """A growing round that cannot form: the newcomers are sent away, the others regroup.

        ``ended``: the rank whose end made it fail (its cause is the round's);
        without one, the newcomers are the cause (their programs were not
        ready). ``requeue``: newcomers that did nothing wrong; they wait to
        join again, without counting a restart.
        """
        send = self.send_away(why)
        survivors = [r for r in self.remaining if not r.gone]
        if not survivors or len(survivors) < self.job.min_workers:
            send += [(r, _msg(ABORT, r.round, reason=why)) for r in survivors]
            if ended is None:
                ended = RoundResult(self.remaining.get(survivors[0], 0) if survivors else 0, why)
            return dataclasses.replace(self.end(ended), send=send)
        base = ended or RoundResult(detail=why)
        waiting = [r for r in requeue if not r.gone]
        result = dataclasses.replace(base, survivors=survivors, requeued=waiting)
        return dataclasses.replace(self.end(result), send=send)

    def send_away(self, why: str) -> list[tuple[Registration, dict]]:
        """The newcomers leave the round; the messages that tell them so."""
        log.warning("the joining workers are sent away (%s)", why)
        send = []
        for r in self.newcomers:
            if self.remaining.pop(r, None) is not None:
                send.append((r, _msg(ABORT, r.round, reason=f"could not join the job: {why}")))
        return send

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
                report = events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if report is SIGNALLED or report.code in (READY, RESUMED, FINISHED):  # no exit report
                continue
            if report.reg in self.remaining and report.round in (None, self.number):
                self.remaining.pop(report.reg)
        if self.remaining:
            log.error(
                "ranks %s did not report after being told to stop", sorted(self.remaining.values())
            )
            for r in self.remaining:  # not trusted with another round
                r.gone = True
                r.channel.close()


def _msg(kind: str, round_: int, **fields) -> dict:
    """A message about round ``round_`` (:mod:`~hvdkit.launch.protocol`'s kinds)."""
    return {"type": kind, "round": round_, **fields}


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
    **_rows(_M, [Event.FINISHED], Round.on_finished, _M, _T, _E),
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

"""A worker's life as a named state machine: what it does with each word it gets.

The worker (:mod:`hvdkit.launch.worker`) registers, runs its program once per
round the scheduler assigns, and reports how each run ended. Two threads
take its words: the inbox thread reads the scheduler's messages while a
program runs, the main thread the rest (it starts the program and reports its
exit). Both ask :func:`decide`, which reads :data:`TRANSITIONS`, and carry out
the :class:`Act` it names; nothing here sends, waits or touches a process.

Phases (:class:`WorkerPhase`)::

    REGISTERING   registered with the scheduler; no program ran yet
    RUNNING       the program runs as a rank of the round
    HANDING_OVER  the running program was handed a new world (elastic): its
                  ranks meet, and start Horovod when told "go"
    REPORTING     the program ended and its exit was reported; the next word
                  (a new round, or the job's end) is awaited
    ENDED         the job is done, or the scheduler is gone

Words (:class:`Word`): the scheduler's ASSIGN (a round to run the program
in), NEW_WORLD (an ``assign`` for the running program), GO, ABORT, PREEMPT,
DESCRIBE and DONE; LOST (the connection ended); EXITED (the program ended).
ABORT, PREEMPT and DESCRIBE about another round than the running program's
are dropped (:func:`decide`). The table (a unit test checks that it is this
one and walks every row)::

    phase         word(s)                        act           next phase
    REGISTERING   ASSIGN                         START         RUNNING
    REGISTERING   NEW_WORLD                      REPORT_AGAIN  REPORTING
    REGISTERING   GO ABORT PREEMPT DESCRIBE      DROP          REGISTERING
    REGISTERING   DONE LOST                      END           ENDED
    RUNNING       ASSIGN DONE                    LATER         RUNNING
    RUNNING       NEW_WORLD                      HAND_OVER     HANDING_OVER
    RUNNING       GO                             LET_GO        RUNNING
    RUNNING       ABORT                          STOP          RUNNING
    RUNNING       PREEMPT                        FORWARD       RUNNING
    RUNNING       DESCRIBE                       ANSWER        RUNNING
    RUNNING       LOST                           ABANDON       RUNNING
    RUNNING       EXITED                         REPORT        REPORTING
    HANDING_OVER  ASSIGN DONE                    LATER         HANDING_OVER
    HANDING_OVER  NEW_WORLD                      HAND_OVER     HANDING_OVER
    HANDING_OVER  GO                             LET_GO        RUNNING
    HANDING_OVER  ABORT                          STOP          HANDING_OVER
    HANDING_OVER  PREEMPT                        FORWARD       HANDING_OVER
    HANDING_OVER  DESCRIBE                       ANSWER        HANDING_OVER
    HANDING_OVER  LOST                           ABANDON       HANDING_OVER
    HANDING_OVER  EXITED                         REPORT        REPORTING
    REPORTING     ASSIGN                         START         RUNNING
    REPORTING     NEW_WORLD                      REPORT_AGAIN  REPORTING
    REPORTING     GO ABORT PREEMPT DESCRIBE      DROP          REPORTING
    REPORTING     DONE LOST                      END           ENDED

Why: a NEW_WORLD with no program running means the program ended just as the
scheduler sent it (its report of the old round came too late to count), so
the worker says again how it ended. An ASSIGN or DONE while a program runs
waits (LATER) until the program's exit is reported: the scheduler sends them
only after it told the program to stop. ABANDON stops the program (no one is
left to report to) and ends the worker once it has.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .. import config
from . import protocol
from .failures import describe_exit
from .processes import Ended


class WorkerPhase(enum.Enum):
    REGISTERING = "registering"
    RUNNING = "running"
    HANDING_OVER = "handing over"
    REPORTING = "reporting"
    ENDED = "ended"


class Word(enum.Enum):
    ASSIGN = protocol.ASSIGN
    NEW_WORLD = "new world"  # an ASSIGN with "inplace"
    GO = protocol.GO
    ABORT = protocol.ABORT
    PREEMPT = protocol.PREEMPT
    DESCRIBE = protocol.DESCRIBE
    DONE = protocol.DONE
    LOST = "lost"  # not a message: the connection ended
    EXITED = "exited"  # not a message: the program ended


class Act(enum.Enum):
    """What the worker does with a word (its executor: :mod:`hvdkit.launch.worker`)."""

    START = "run the program as a rank of the round"
    REPORT = "report how the program ended"
    REPORT_AGAIN = "say again how the program ended, for the new world it missed"
    HAND_OVER = "hand the new world to the running program"
    LET_GO = "let the running program start Horovod"
    STOP = "stop the program: the scheduler said why"
    FORWARD = "pass the preemption on to the program's ranks"
    ANSWER = "tell the scheduler what the program's ranks are doing"
    LATER = "keep the word until the program's exit is reported"
    ABANDON = "stop the program: the scheduler is gone; then end"
    DROP = "drop the word: it is about no running program"
    END = "end the worker"


# Acts about the running program's round: a word of another round is dropped.
_OF_THE_ROUND = (Act.STOP, Act.FORWARD, Act.ANSWER)
_R, _H = WorkerPhase.RUNNING, WorkerPhase.HANDING_OVER
_G, _P, _E = WorkerPhase.REGISTERING, WorkerPhase.REPORTING, WorkerPhase.ENDED
_ASIDE = (Word.GO, Word.ABORT, Word.PREEMPT, Word.DESCRIBE)  # nothing runs to take them


def _rows(phase: WorkerPhase, words, act: Act, after: WorkerPhase) -> dict:
    return {(phase, w): (act, after) for w in words}


def _while_running(phase: WorkerPhase) -> dict:
    return {
        **_rows(phase, [Word.ASSIGN, Word.DONE], Act.LATER, phase),
        **_rows(phase, [Word.NEW_WORLD], Act.HAND_OVER, _H),
        **_rows(phase, [Word.GO], Act.LET_GO, _R),
        **_rows(phase, [Word.ABORT], Act.STOP, phase),
        **_rows(phase, [Word.PREEMPT], Act.FORWARD, phase),
        **_rows(phase, [Word.DESCRIBE], Act.ANSWER, phase),
        **_rows(phase, [Word.LOST], Act.ABANDON, phase),
        **_rows(phase, [Word.EXITED], Act.REPORT, _P),
    }


def _while_idle(phase: WorkerPhase) -> dict:
    return {
        **_rows(phase, [Word.ASSIGN], Act.START, _R),
        **_rows(phase, [Word.NEW_WORLD], Act.REPORT_AGAIN, _P),
        **_rows(phase, _ASIDE, Act.DROP, phase),
        **_rows(phase, [Word.DONE, Word.LOST], Act.END, _E),
    }


# (phase, word) -> (act, next phase): the module's table
TRANSITIONS: dict[tuple[WorkerPhase, Word], tuple[Act, WorkerPhase]] = {
    **_while_idle(_G),
    **_while_running(_R),
    **_while_running(_H),
    **_while_idle(_P),
}
PROGRAM_PHASES = (_R, _H)  # the inbox thread decides in these; the main thread otherwise


def word_of(msg: dict | None) -> Word | None:
    """The word a scheduler's message is (None: the connection ended); None for a kind the
    worker does not take (it is dropped)."""
    if msg is None:
        return Word.LOST
    kind = msg.get("type")
    if kind == protocol.ASSIGN:
        return Word.NEW_WORLD if msg.get("inplace") else Word.ASSIGN
    if kind == protocol.GO and not isinstance(msg.get("round"), int):
        return None
    return _WORDS.get(kind)


_WORDS = {w.value: w for w in (Word.GO, Word.ABORT, Word.PREEMPT, Word.DESCRIBE, Word.DONE)}


def decide(phase: WorkerPhase, word: Word | None, current: bool = True) -> tuple[Act, WorkerPhase]:
    """``(act, next phase)`` for ``word`` in ``phase``; ``current``: the word is about the
    running program's round (ABORT, PREEMPT and DESCRIBE of another are dropped).

    Example:
        >>> decide(WorkerPhase.RUNNING, Word.NEW_WORLD)
        (<Act.HAND_OVER: ...>, <WorkerPhase.HANDING_OVER: 'handing over'>)
    """
    if word is None:
        return Act.DROP, phase
    act, after = TRANSITIONS[(phase, word)]
    if act in _OF_THE_ROUND and not current:
        return Act.DROP, phase
    return act, after


@dataclass(frozen=True)
class Verdict:
    """What the worker reports for a run (``code``, ``detail``), its own status for it,
    and the lines it logs (``(level, text)``)."""

    code: int
    detail: str
    status: int
    notes: tuple = ()


def verdict(
    end: Ended,
    preempted: int | None,
    rank: int,
    stall_s: float,
    signals: list[str],
    finished_first: bool,
    preempting: bool = False,
) -> Verdict:
    """The report of one run of the program: a pure function of how it ended.

    ``preempted``: the step its ranks stopped after for a preemption, if they
    did; ``signals``: what this worker was told to stop with;
    ``finished_first``: the program's ranks had finished training when SIGTERM
    came (:meth:`~hvdkit.launch.preempt.SigtermForwarding.ended_after_the_end`);
    ``preempting``: the scheduler asked for a preemption (its word, passed on).

    A run this worker stopped for a stalled or stuck rank is reported as
    that, with a nonzero code other than ``EXIT_PREEMPTED``, even if its ranks
    recorded a preempted step: a preemption is the job's stop, this a lost rank.
    Unless a preemption was asked for (this worker's SIGTERM, the scheduler's
    word): then a recorded step is that preemption (the rank records it with its
    checkpoint on disk), whatever the supervision saw meanwhile.

    Example:
        >>> verdict(Ended(0), None, 0, 120.0, [], False)
        Verdict(code=0, detail='exit code 0', status=0, notes=())
    """
    asked = preempting or "SIGTERM" in signals
    if preempted is not None and (asked or not (end.stalled or end.stuck)):
        note = ("warning", f"rank {rank} stopped after step {preempted} for a preemption")
        detail = f"preempted after step {preempted}"
        return Verdict(config.EXIT_PREEMPTED, detail, config.EXIT_PREEMPTED, (note,))
    code, notes = end.returncode, []
    failed = code if code > 0 and code != config.EXIT_PREEMPTED else 1
    if end.stalled:
        silent = end.stalled[0][1]
        detail = f"stalled: no heartbeat for {silent:.0f} s (stall timeout {stall_s:g} s)"
        code = failed
    elif end.stuck:
        detail = end.stuck
        notes.append(("error", f"rank {rank} stopped: {detail}"))
        code = failed
    else:
        detail = describe_exit(code)
    if preempted is not None:  # stalled or stuck: that is what stopped it
        how = "stalled" if end.stalled else "stuck"
        said = f"rank {rank} recorded a preemption after step {preempted}; reported as {how}"
        notes.append(("warning", said))
    if end.reasons and not end.stalled:
        notes.append(("error", f"rank {rank} stopped: {end.reasons[0]}"))
    if code == 0 and signals:  # this worker was told to stop: was the program's work over?
        if not end.reasons and finished_first:
            said = f"rank {rank} had finished when SIGTERM came: its worker ends with 0"
            return Verdict(0, detail, 0, (*notes, ("info", said)))
        return Verdict(0, detail, 1, tuple(notes))
    if code == 0:
        return Verdict(0, detail, 1 if end.reasons else 0, tuple(notes))
    return Verdict(code, detail, code if code > 0 else 1, tuple(notes))

"""The scheduler's round as a state machine (hvdkit.launch.rounds), without processes.

Every row of the transition table is walked: a round is put in the row's phase
with fake workers, the row's event is fed to its handler, which must only decide
(no message sent, no phase set: it returns an Action), the executor applies the
action, and the test checks the phase it leaves, the messages each worker was
sent and the round's result.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import queue
import select
import threading

import pytest

from hvdkit import config
from hvdkit.launch import rounds, worker_states
from hvdkit.launch.rounds import LOST, SILENT, TRANSITIONS, Event, Phase, Registration, Round

FINISHED, READY, RESUMED = rounds.FINISHED, rounds.READY, rounds.RESUMED
J, M, T, G, E = Phase.JOINING, Phase.MEETING, Phase.TRAINING, Phase.GRACE, Phase.ENDED


class Wire:
    """A worker's end of the scheduler's channel: what the scheduler sent it."""

    sealed = False  # while a handler decides: nothing may be sent

    def __init__(self):
        self.sent: list[dict] = []

    def send(self, **msg):
        assert not Wire.sealed, f"a handler sent {msg} itself; its Action should carry it"
        self.sent.append(msg)

    def close(self):
        pass


class FakeJob:
    """The scheduler as a round sees it (rounds.Job)."""

    def __init__(self, *, elastic=True, worker_num=3, min_workers=2):
        self.events: queue.Queue = queue.Queue()
        self.newcomers: queue.Queue = queue.Queue()
        self.sigterm: list[str] = []
        self.elastic, self.worker_num, self.min_workers = elastic, worker_num, min_workers
        self.timeout_s = 60.0
        self.finishing = False
        self.round_sizes = {7: 3}
        self.doings: dict[int, dict[int, str]] = {}

    def take_doings(self, round_):
        return self.doings.pop(round_, {})

    def lost(self, reg):
        return f"lost its worker ({reg.describe()}) without an exit report"


def workers(*rounds_: int) -> list[Registration]:
    """Workers of ranks 0, 1, ... whose programs run in the given rounds."""
    return [
        Registration(Wire(), "127.0.0.1", "vm", 100 + i, rank=i, round=r)
        for i, r in enumerate(rounds_)
    ]


def sent(reg) -> list[dict]:
    return reg.channel.sent


def kinds(reg) -> list[str]:
    return [m["type"] for m in reg.channel.sent]


walked: set = set()  # the rows the cases below went through


def feed(rnd: Round, event: Event, reg=None, round_=None, code=None, detail="") -> Phase:
    """Give ``rnd`` one event; check the row's declared next phases; the phase it is in."""
    row = (rnd.phase, event)
    assert row in TRANSITIONS, f"no row for {row}"
    report = None
    if reg is not None:
        code = {Event.READY: READY, Event.RESUMED: RESUMED, Event.FINISHED: FINISHED}.get(
            event, code
        )
        report = rounds.Report(reg, round_, code, detail)
        assert report.event is event
    arg = rnd.take_newcomers() if event is Event.NEWCOMER else report
    if report is None or rnd.concerns(event, report):
        Wire.sealed = True
        try:
            act = TRANSITIONS[row][0](rnd, arg)  # the decision alone
        finally:
            Wire.sealed = False
        assert isinstance(act, rounds.Action) and rnd.phase is row[0], (row, act)
        rnd.apply(act)
    assert rnd.phase in TRANSITIONS[row][1], (row, rnd.phase)
    walked.add(row)
    return rnd.phase


# ------------------------------------------------------------------ rounds in each phase


def joining(job=None):
    """A growing round 6: a, b, c (survivors of round 5) are joined by d."""
    job = job or FakeJob(worker_num=4)
    a, b, c, d = workers(5, 5, 5, 6)
    later = {r: {"type": "assign", "round": 6, "inplace": True, "rank": r.rank} for r in (a, b, c)}
    rnd = Round(job, [a, b, c, d], 6, later, meet=True)
    assert rnd.phase is J
    return rnd, (a, b, c, d)


def meeting(job=None):
    """An in-process round 7: a, b, c go on after a loss and meet before starting Horovod."""
    regs = workers(7, 7, 7)
    rnd = Round(job or FakeJob(), regs, 7, {}, meet=True)
    assert rnd.phase is M
    return rnd, regs


def training(job=None):
    """Round 7 of ranks a, b, c that start their programs (a first round, a restart)."""
    regs = workers(7, 7, 7)
    rnd = Round(job or FakeJob(), regs, 7, {}, meet=False)
    assert rnd.phase is T
    return rnd, regs


def grace():
    """Round 7 of a job that is not elastic: rank 2 failed; the others are waited for."""
    rnd, (a, b, c) = training(FakeJob(elastic=False))
    assert feed(rnd, Event.FAILED, c, 7, 1, "exit code 1") is G
    return rnd, (a, b, c)


# ------------------------------------------------------------------ JOINING


def case_joining_ready():
    rnd, (a, b, c, d) = joining()
    assert feed(rnd, Event.READY, d, 5) is J  # ready for a round given up: nothing
    assert feed(rnd, Event.READY, d, 6) is M  # the newcomer is ready: the survivors are told
    assert [m["round"] for m in sent(a) + sent(b) + sent(c)] == [6, 6, 6]
    assert kinds(a) == ["assign"] and (a.round, rnd.unready) == (6, {a, b, c})
    assert sent(d) == []


def case_joining_resumed():
    rnd, regs = joining()
    assert feed(rnd, Event.RESUMED, regs[0], 5, detail="12") is J
    assert all(sent(r) == [] for r in regs)


def case_joining_finished():
    rnd, (a, b, c, d) = joining()
    assert feed(rnd, Event.FINISHED, b, 5) is T
    assert rnd.job.finishing and set(rnd.remaining) == {a, b, c}
    why = "could not join the job: the job finished training"
    assert sent(d) == [{"type": "abort", "round": 6, "reason": why}]
    assert sent(a) == sent(b) == sent(c) == []  # they train on in round 5 to their end


def case_joining_exited():
    rnd, (a, b, c, d) = joining()
    assert feed(rnd, Event.EXITED, a, 5, 0) is T  # a survivor finished: d is sent away
    assert rnd.exited_ok == [0] and kinds(d) == ["abort"] and set(rnd.remaining) == {b, c}
    rnd, (a, b, c, d) = joining()
    assert feed(rnd, Event.EXITED, d, 6, 0, "exit code 0") is E  # a newcomer ended: lost
    assert (rnd.result.culprit, rnd.result.survivors) == (3, [a, b, c])


def case_joining_preempted():
    rnd, (a, b, c, d) = joining()
    assert feed(rnd, Event.PREEMPTED, d, 6, config.EXIT_PREEMPTED, "preempted after step 3") is E
    assert rnd.result.cause == "rank 3 preempted after step 3"
    assert (rnd.result.survivors, rnd.result.requeued) == ([a, b, c], [])


def case_joining_failed():
    rnd, (a, b, c, d) = joining()
    assert feed(rnd, Event.FAILED, a, 5, -9, "killed by signal 9") is E
    assert rnd.result.cause == "rank 0 killed by signal 9"
    assert (rnd.result.survivors, rnd.result.requeued) == ([b, c], [d])  # d waits to join
    why = "could not join the job: a survivor was lost meanwhile: rank 0 killed by signal 9"
    assert sent(d) == [{"type": "abort", "round": 6, "reason": why}]
    assert sent(b) == sent(c) == []  # regrouped next round


def case_joining_lost():
    rnd, (a, b, c, d) = joining()
    assert feed(rnd, Event.LOST, d, None, LOST, "lost its worker") is E
    assert (rnd.result.culprit, rnd.result.survivors, rnd.result.requeued) == (3, [a, b, c], [])


def case_joining_silent():
    rnd, (a, b, c, d) = joining(FakeJob(worker_num=4, min_workers=3))
    assert feed(rnd, Event.SILENT, b, None, SILENT, "lost its worker: no word for 10 s") is E
    # too few left to regroup (2 < HVDKIT_MIN_WORKERS=3): they are stopped; b is the cause
    assert (rnd.result.culprit, rnd.result.survivors) == (1, None)
    assert kinds(a) == kinds(c) == kinds(d) == ["abort"]


def case_joining_late():
    rnd, (a, b, c, d) = joining()
    assert feed(rnd, Event.LATE) is E
    why = "the joining workers' programs were not ready within 60 s"
    assert (rnd.result.cause, rnd.result.survivors) == (why, [a, b, c])
    assert sent(d) == [{"type": "abort", "round": 6, "reason": f"could not join the job: {why}"}]


def case_joining_sigterm():
    rnd, regs = joining()
    assert feed(rnd, Event.SIGTERM) is J and rnd.preempting
    assert [(m["type"], m["round"]) for r in regs for m in sent(r)] == [
        ("preempt", 5),
        ("preempt", 5),
        ("preempt", 5),
        ("preempt", 6),
    ]
    assert not rnd.takes_newcomers()


# ------------------------------------------------------------------ MEETING


def case_meeting_ready():
    rnd, (a, b, c) = meeting()
    assert feed(rnd, Event.READY, a, 7) is M and feed(rnd, Event.READY, b, 7) is M
    assert sent(a) == []
    assert feed(rnd, Event.READY, c, 7) is T  # everyone is ready: all start together
    assert all(sent(r) == [{"type": "go", "round": 7}] for r in (a, b, c))


def case_meeting_resumed():
    rnd, regs = meeting()
    assert feed(rnd, Event.RESUMED, regs[0], 6, detail="20") is M


def case_meeting_finished():
    rnd, (a, b, c) = meeting()  # no newcomer: the meeting goes on
    assert feed(rnd, Event.FINISHED, a, 7) is M and rnd.job.finishing
    rnd, (a, b, c, d) = joining()  # a growing round whose survivors were told
    feed(rnd, Event.READY, d, 6)
    assert feed(rnd, Event.FINISHED, a, 5) is T  # they will not meet d: it is sent away
    assert kinds(d) == ["abort"] and kinds(a) == ["assign"]
    # a survivor of a loss that had finished training in the round before (6) when its
    # new world (7) came: the loss was at the job's end, which restarts the job whole
    rnd, (a, b, c) = meeting()
    assert feed(rnd, Event.READY, b, 7) is M  # (one that was still training met)
    for reg in (a, b, c):  # the told ranks' reports come
        rnd.job.events.put(rounds.Report(reg, 7, 1, "exit code 1"))
    assert feed(rnd, Event.FINISHED, a, 6) is E and rnd.job.finishing
    assert (rnd.result.culprit, rnd.result.survivors) == (0, None)
    assert rnd.result.detail.startswith("had finished training when the world after a lost")
    assert all(kinds(r) == ["abort"] for r in (a, b, c)) and not rnd.remaining


def case_meeting_exited():
    rnd, (a, b, c) = meeting()
    assert feed(rnd, Event.EXITED, a, 7, 0) is M
    assert (rnd.exited_ok, rnd.job.finishing) == ([0], True)


def case_meeting_preempted():
    rnd, (a, b, c) = meeting()
    assert feed(rnd, Event.PREEMPTED, b, 7, config.EXIT_PREEMPTED, "preempted after step 4") is M
    assert (rnd.preempted, set(rnd.remaining)) == ("preempted after step 4", {a, c})


def case_meeting_failed():
    rnd, (a, b, c) = meeting()
    assert feed(rnd, Event.FAILED, b, 7, 1, "exit code 1") is E
    assert (rnd.result.cause, rnd.result.survivors) == ("rank 1 exit code 1", [a, c])


def case_meeting_lost():
    rnd, (a, b, c) = meeting(FakeJob(min_workers=3))  # too few would be left: the grace period
    assert feed(rnd, Event.LOST, a, None, LOST, "lost its worker") is G
    assert rnd.result is None and rnd.grace_until is not None


def case_meeting_silent():
    rnd, (a, b, c) = meeting()
    assert feed(rnd, Event.SILENT, c, None, SILENT, "lost its worker: no word for 10 s") is E
    assert rnd.result.survivors == [a, b]


def case_meeting_sigterm():
    rnd, regs = meeting()
    assert feed(rnd, Event.SIGTERM) is M
    assert all(kinds(r) == ["preempt"] for r in regs)


# ------------------------------------------------------------------ TRAINING


def case_training_ready():
    rnd, regs = training()
    assert feed(rnd, Event.READY, regs[0], 7) is T and sent(regs[0]) == []


def case_training_resumed():
    rnd, regs = training()
    assert feed(rnd, Event.RESUMED, regs[0], 7, detail="30") is T


def case_training_finished():
    rnd, regs = training()
    assert feed(rnd, Event.FINISHED, regs[1], 7) is T and rnd.job.finishing
    assert not rnd.recoverable()  # a failure now is not recovered in-process


def case_training_exited():
    rnd, (a, b, c) = training()
    assert feed(rnd, Event.EXITED, c, 7, 0) is T and rnd.exited_ok == [2]


def case_training_preempted():
    rnd, regs = training()
    assert feed(rnd, Event.PREEMPTED, regs[0], 7, config.EXIT_PREEMPTED, "preempted") is T


def case_training_failed():
    rnd, (a, b, c) = training()
    assert feed(rnd, Event.FAILED, b, 7, 3, "exit code 3") is E
    assert (rnd.result.culprit, rnd.result.survivors) == (1, [a, c])
    rnd, (a, b, c) = training(FakeJob(elastic=False))
    assert feed(rnd, Event.FAILED, b, 7, 3, "exit code 3") is G


def case_training_lost():
    rnd, (a, b, c) = training()
    # a report of an earlier round, or from a worker not in this round, is dropped
    assert feed(rnd, Event.EXITED, a, 6, 0) is T and a in rnd.remaining
    assert feed(rnd, Event.LOST, a, None, LOST, "lost its worker") is E
    assert rnd.result.survivors == [b, c]


def case_training_silent():
    job = FakeJob()
    job.finishing = True  # training is over: no recovery in-process
    rnd, (a, b, c) = training(job)
    assert feed(rnd, Event.SILENT, a, None, SILENT, "no word") is G


def case_training_newcomer():
    job = FakeJob(worker_num=4)
    gone, d = workers(8, 8)
    gone.gone = True
    job.newcomers.put(gone)
    job.newcomers.put(d)
    rnd, regs = training(job)
    assert rnd.takes_newcomers()
    assert feed(rnd, Event.NEWCOMER) is E
    assert (rnd.result.survivors, rnd.result.joining) == (regs, [d])
    rnd, regs = training(job)
    job.newcomers.put(gone)  # only a worker that is gone: nothing changes
    assert feed(rnd, Event.NEWCOMER) is T and job.newcomers.empty()


def case_training_sigterm():
    job = FakeJob(worker_num=4)
    rnd, regs = training(job)
    assert feed(rnd, Event.SIGTERM) is T and not rnd.takes_newcomers()
    assert all(
        sent(r) == [{"type": "preempt", "round": 7, "reason": "the scheduler received SIGTERM"}]
        for r in regs
    )


# ------------------------------------------------------------------ GRACE


def case_grace_ready():
    rnd, (a, b, c) = grace()
    assert feed(rnd, Event.READY, a, 7) is G and sent(a) == []


def case_grace_resumed():
    rnd, (a, b, c) = grace()
    assert feed(rnd, Event.RESUMED, a, 7, detail="1") is G


def case_grace_finished():
    rnd, (a, b, c) = grace()
    assert feed(rnd, Event.FINISHED, a, 7) is G and rnd.job.finishing


def case_grace_exited():
    rnd, (a, b, c) = grace()
    assert feed(rnd, Event.EXITED, a, 7, 0) is G
    assert rnd.exited_ok == []  # after a failure an exit 0 proves nothing about the culprit


def case_grace_preempted():
    rnd, (a, b, c) = grace()
    assert feed(rnd, Event.PREEMPTED, b, 7, config.EXIT_PREEMPTED, "preempted after step 2") is G


def case_grace_failed():
    rnd, (a, b, c) = grace()
    stuck = f"{rounds.STUCK} waits in allreduce 'x' for 30 s"
    assert feed(rnd, Event.FAILED, a, 7, 1, stuck) is G
    assert kinds(b) == ["describe"] and list(rnd.failures) == [2, 0]


def case_grace_lost():
    rnd, (a, b, c) = grace()
    assert feed(rnd, Event.LOST, b, None, LOST, "lost its worker") is G
    assert list(rnd.failures) == [2, 1]


def case_grace_silent():
    rnd, (a, b, c) = grace()
    assert feed(rnd, Event.SILENT, b, None, SILENT, "no word") is G


def case_grace_grace_over():
    rnd, (a, b, c) = grace()
    rnd.job.events.put(rounds.Report(a, 7, 1, "exit code 1"))  # the told ranks' reports come
    rnd.job.events.put(rounds.Report(b, 7, 1, "exit code 1"))
    assert feed(rnd, Event.GRACE_OVER) is E
    assert (rnd.result.culprit, rnd.result.detail) == (2, "exit code 1")
    reason = "rank 2 failed: exit code 1"
    assert sent(a) == sent(b) == [{"type": "abort", "round": 7, "reason": reason}]
    assert not a.gone and not rnd.remaining


def case_grace_sigterm():
    rnd, (a, b, c) = grace()
    assert feed(rnd, Event.SIGTERM) is G and kinds(a) == kinds(b) == ["preempt"]


# ------------------------------------------------------------------ the tests

CASES = {
    (J, Event.READY): case_joining_ready,
    (J, Event.RESUMED): case_joining_resumed,
    (J, Event.FINISHED): case_joining_finished,
    (J, Event.EXITED): case_joining_exited,
    (J, Event.PREEMPTED): case_joining_preempted,
    (J, Event.FAILED): case_joining_failed,
    (J, Event.LOST): case_joining_lost,
    (J, Event.SILENT): case_joining_silent,
    (J, Event.LATE): case_joining_late,
    (J, Event.SIGTERM): case_joining_sigterm,
    (M, Event.READY): case_meeting_ready,
    (M, Event.RESUMED): case_meeting_resumed,
    (M, Event.FINISHED): case_meeting_finished,
    (M, Event.EXITED): case_meeting_exited,
    (M, Event.PREEMPTED): case_meeting_preempted,
    (M, Event.FAILED): case_meeting_failed,
    (M, Event.LOST): case_meeting_lost,
    (M, Event.SILENT): case_meeting_silent,
    (M, Event.SIGTERM): case_meeting_sigterm,
    (T, Event.READY): case_training_ready,
    (T, Event.RESUMED): case_training_resumed,
    (T, Event.FINISHED): case_training_finished,
    (T, Event.EXITED): case_training_exited,
    (T, Event.PREEMPTED): case_training_preempted,
    (T, Event.FAILED): case_training_failed,
    (T, Event.LOST): case_training_lost,
    (T, Event.SILENT): case_training_silent,
    (T, Event.NEWCOMER): case_training_newcomer,
    (T, Event.SIGTERM): case_training_sigterm,
    (G, Event.READY): case_grace_ready,
    (G, Event.RESUMED): case_grace_resumed,
    (G, Event.FINISHED): case_grace_finished,
    (G, Event.EXITED): case_grace_exited,
    (G, Event.PREEMPTED): case_grace_preempted,
    (G, Event.FAILED): case_grace_failed,
    (G, Event.LOST): case_grace_lost,
    (G, Event.SILENT): case_grace_silent,
    (G, Event.GRACE_OVER): case_grace_grace_over,
    (G, Event.SIGTERM): case_grace_sigterm,
}


@pytest.mark.parametrize("row", list(CASES), ids=lambda r: f"{r[0].name}-{r[1].name}")
def test_each_row(row):
    walked.discard(row)
    CASES[row]()
    assert row in walked, f"{CASES[row].__name__} never fed {row}"


def test_every_row_of_the_table_has_a_case():
    assert set(CASES) == set(TRANSITIONS)


def test_the_docstring_table_is_the_one_the_code_uses():
    """rounds' module docstring lists the transitions a reader sees: the same as the code's."""
    listed = {}
    for line in rounds.__doc__.splitlines():
        words = line.split()
        handlers = [i for i, w in enumerate(words) if w.startswith("on_") or w == "conclude"]
        if not words or words[0] not in Phase.__members__ or not handlers:
            continue  # not a row of the table
        at = handlers[0]
        for name in words[1:at]:
            listed[(Phase[words[0]], Event[name])] = (words[at], frozenset(words[at + 1 :]))
    coded = {
        row: (handler.__name__, frozenset(p.name for p in after))
        for row, (handler, after) in TRANSITIONS.items()
    }
    assert listed == coded


def _is_self_attr(node, attr: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == attr
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def test_only_the_executor_sends_waits_and_sets_the_phase():
    # the handlers decide (an Action); Round.apply is the one place that carries it out
    tree = ast.parse(inspect.getsource(rounds))
    where: dict[str, list[str]] = {"send": [], "phase": [], "wait": []}
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr == "send":
                    where["send"].append(fn.name)
                blocks = any(k.arg == "timeout" for k in node.keywords)  # a queue's get
                if node.func.attr in ("wait_for_the_rest", "sleep") or blocks:
                    where["wait"].append(f"{fn.name}:{node.func.attr}")
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                names = target.elts if isinstance(target, ast.Tuple) else [target]
                if any(_is_self_attr(n, "phase") for n in names):
                    where["phase"].append(fn.name)
    assert where["send"] == ["send", "apply"]  # Registration.send, and the executor
    assert where["phase"] == ["__init__", "apply"]
    assert sorted(where["wait"]) == sorted(
        ["next_event:get", "apply:wait_for_the_rest", "wait_for_the_rest:get"]
    ), where["wait"]


def test_a_round_runs_from_the_queue_to_its_result():
    """run(): reports come from the job's queue; a round whose ranks all reported ends."""
    job = FakeJob(elastic=False)
    a, b = workers(3, 3)
    for reg, rnd, code in [(a, 2, 1), (b, 3, FINISHED), (a, 3, 0), (b, 3, 0)]:
        job.events.put(rounds.Report(reg, rnd, code, "exit code 1" if code == 1 else ""))
    result = Round(job, [a, b], 3, {}, meet=False).run()  # a's report of round 2: dropped
    assert (result.culprit, result.preempted, result.survivors) == (None, "", None)
    job = FakeJob(elastic=False)
    a, b = workers(3, 3)
    b.gone = True  # lost before its listener saw the round: a LOST report is made for it
    job.events.put(rounds.Report(a, 3, 0))
    result = Round(job, [a, b], 3, {}, meet=False).run()
    assert result.cause == "rank 1 lost its worker (pid 101 on vm 127.0.0.1) without an exit report"


def test_sigterm_wakes_the_watch_without_waiting_for_its_next_look(monkeypatch):
    """The scheduler's SIGTERM handler puts SIGNALLED on the queue the watch waits on, so a
    preemption is passed on at once, not at the watch's next look (made an hour here)."""
    import signal

    from hvdkit.launch.scheduler import Scheduler

    monkeypatch.setattr(rounds, "SIGNAL_POLL_S", 3600.0)
    sched = Scheduler("127.0.0.1", 0, 2, "token-" + "x" * 20, 60.0)
    sched.door.sock.close()
    a, b = workers(3, 3)
    rnd = Round(sched, [a, b], 3, {}, meet=False)
    got: list = []
    watch = threading.Thread(target=lambda: got.append(rnd.next_event()), daemon=True)
    with sched._noting_sigterm():  # the handler run() installs (this test is on the main thread)
        watch.start()
        signal.raise_signal(signal.SIGTERM)
        watch.join(120.0)  # only against a hang: without the wake it would wait an hour
    sched.listener.close()
    assert sched.sigterm == ["SIGTERM"] and not watch.is_alive()
    # the watch woke for the signal; it had not seen it yet, or had
    assert got in ([(None, None)], [(Event.SIGTERM, None)])
    assert rnd.next_event() == (Event.SIGTERM, None)


# ------------------------------------------------------------------ the restart budget


class FakeServer:
    def stop(self):
        pass


def test_only_whole_job_restarts_use_the_budget_and_each_round_says_its_kind(caplog):
    """HVDKIT_MAX_RESTARTS=1, elastic, 3 workers (at least 2): b's program fails and comes
    back (a return, not a restart), joins a growing round, fails again and stays out (one
    return per worker); then a and c fail below the minimum: the one whole-job restart."""
    from hvdkit.launch.scheduler import Scheduler

    sched = Scheduler(
        "127.0.0.1",
        0,
        3,
        "token-" + "x" * 20,
        60.0,
        max_restarts=1,
        min_workers=2,
        replace_timeout_s=0.0,
        elastic=True,
    )
    sched.door.sock.close()
    a, b, c = workers(-1, -1, -1)
    script = {  # round -> the reports that come in it: (worker, round, code)
        0: [(b, 0, 1)],
        1: [(a, 1, READY), (c, 1, READY)],  # then b waits to join: the round grows
        2: [(b, 2, READY), (a, 2, READY), (c, 2, READY), (b, 2, 1)],
        3: [(a, 3, READY), (c, 3, READY), (a, 3, 1), (c, 3, 1)],
        4: [(a, 4, 0), (c, 4, 0)],
    }

    def start_rendezvous(layout, hosts):
        round_ = len(sched.round_sizes)
        for reg, rnd, code in script[round_]:
            sched.events.put(rounds.Report(reg, rnd, code, "exit code 1" if code == 1 else ""))
        return FakeServer(), 4000 + round_

    sched._start_rendezvous = start_rendezvous
    with caplog.at_level("INFO", logger="hvdkit"):
        assert sched._rounds([a, b, c], [a, b, c]) == 0
    said = [r.getMessage() for r in caplog.records]
    kinds = [m[m.rindex("(") :] for m in said if m.startswith("assigned ")]
    assert kinds == [
        "(first round 0); 1 of 1 whole-job restarts left",
        "(in-process round 1); 1 of 1 whole-job restarts left",
        "(growing round 2); 1 of 1 whole-job restarts left",
        "(in-process round 3); 1 of 1 whole-job restarts left",
        "(restart round 4); 0 of 1 whole-job restarts left",
    ], said
    assert (
        "pid 101 on vm 127.0.0.1 joins again with a new program "
        "(its return 1 of 1; 1 of 1 whole-job restarts left)"
    ) in said, said
    assert (
        "pid 101 on vm 127.0.0.1 does not join again: its program came back 1 of 1 times "
        "allowed per worker (HVDKIT_MAX_RESTARTS); start a new worker to replace it"
    ) in said, said
    assert (sched.budget.restarts, b.returns) == (1, 1)
    assert sched.budget.causes == ["rank 0 exit code 1"]
    assert [m["type"] for m in sent(b)][-1] == "done"  # left out, told how the job ended


# ------------------------------------------------------------------ the worker's table

WP, WORD, ACT = worker_states.WorkerPhase, worker_states.Word, worker_states.Act
ROUND = 2  # the running program's round


class Pipe:
    """The scheduler's side of a worker's channel: a message is taken when the inbox
    asks for the next one, so ``feed`` returns once the message before was handled."""

    def __init__(self):
        self.inbox: queue.Queue = queue.Queue()
        self.asked = threading.Semaphore(0)
        self.sent: list[dict] = []

    def recv(self):
        self.asked.release()
        return self.inbox.get()

    def send(self, **msg):
        self.sent.append(msg)

    def feed(self, msg) -> None:
        self.inbox.put(msg)
        assert self.asked.acquire(timeout=120), "the inbox never asked for the next message"


class FakeMonitor:
    def doings(self):
        return {0: "waits in allreduce"}


MESSAGES = {
    WORD.ASSIGN: {"type": "assign", "round": 3, "rank": 0},
    WORD.NEW_WORLD: {"type": "assign", "round": 3, "rank": 0, "inplace": True},
    WORD.GO: {"type": "go", "round": ROUND},
    WORD.ABORT: {"type": "abort", "round": ROUND, "reason": "rank 1 failed"},
    WORD.PREEMPT: {"type": "preempt", "round": ROUND, "reason": "SIGTERM"},
    WORD.DESCRIBE: {"type": "describe", "round": ROUND},
    WORD.DONE: {"type": "done", "code": 0},
    WORD.LOST: None,
}


def inbox_in(phase):
    """A worker's inbox in ``phase``, its pipe, and the running round (None when idle)."""
    from hvdkit.launch.worker import _Inbox, _Running

    pipe = Pipe()
    inbox = _Inbox(pipe)
    assert pipe.asked.acquire(timeout=120)  # the reading thread waits for a first message
    running = _Running(ROUND, [], FakeMonitor())
    if phase is not WP.REGISTERING:
        inbox.running(running)
    if phase is WP.HANDING_OVER:
        pipe.feed(MESSAGES[WORD.NEW_WORLD])
        assert inbox.news() == ([], [MESSAGES[WORD.NEW_WORLD]])
        running.number = ROUND  # (news made it the new world's)
    if phase is WP.REPORTING:
        inbox.running(None)
    assert inbox.phase is phase
    return inbox, pipe, running


@pytest.mark.parametrize(
    "row", list(worker_states.TRANSITIONS), ids=lambda r: f"{r[0].name}-{r[1].name}"
)
def test_each_row_of_the_workers_table(row):
    phase, word = row
    act, after = worker_states.TRANSITIONS[row]
    inbox, pipe, running = inbox_in(phase)
    inbox.wake.clear()  # (a HANDING_OVER inbox was woken by its new world)
    msg = MESSAGES.get(word)
    if word is WORD.EXITED:
        inbox.running(None)  # the executor's EXITED: the program ended
    elif phase in worker_states.PROGRAM_PHASES:  # the reading thread decides and acts
        if msg is None:
            pipe.inbox.put(None)  # the connection ends: the thread ends too
            assert inbox.next() is None
        else:
            pipe.feed(msg)
    else:  # the main thread decides; the reading thread queues only what it acts on
        if msg is not None:
            pipe.feed(msg)
            queued = [] if pipe.inbox.empty() and inbox._queue.empty() else [inbox.next()]
            assert queued == ([] if act is ACT.DROP else [msg]), (row, queued)
        assert inbox.decide(msg) is act
        if act is ACT.START:  # the executor starts the program: its round is routed here
            inbox.running(running)
    assert inbox.phase is after, (row, inbox.phase)
    effects = {
        "reasons": running.reasons,
        "preempt": running.preempt,
        "reassign": running.reassign,
        "go": running.go,
        "sent": pipe.sent,
    }
    expected = {
        ACT.STOP: {"reasons": ["rank 1 failed"]},
        ACT.FORWARD: {"preempt": ["SIGTERM"]},
        ACT.HAND_OVER: {"reassign": [msg]},
        ACT.LET_GO: {"go": [ROUND]},
        ACT.ANSWER: {
            "sent": [{"type": "state", "round": ROUND, "ranks": {"0": "waits in allreduce"}}]
        },
        ACT.ABANDON: {"reasons": ["lost the connection to the scheduler"]},
    }.get(act, {})
    assert {k: v for k, v in effects.items() if v} == expected, row
    if act is ACT.LATER:
        assert inbox.next() == msg
    # an act for the running program wakes the supervision's wait (a lost connection's
    # ABANDON may still be on its way: bounded wait; any other was set before the
    # inbox asked for the next message)
    by_reader = phase in worker_states.PROGRAM_PHASES and word is not WORD.EXITED
    wakes = by_reader and act is not ACT.DROP
    woken = bool(select.select([inbox.wake], [], [], 30 if wakes else 0)[0])
    assert woken == wakes, (row, woken)


@pytest.mark.parametrize("word", [WORD.ABORT, WORD.PREEMPT, WORD.DESCRIBE])
def test_a_word_about_another_round_is_dropped_while_a_program_runs(word):
    inbox, pipe, running = inbox_in(WP.RUNNING)
    pipe.feed({**MESSAGES[word], "round": ROUND - 1})
    assert (running.reasons, running.preempt, pipe.sent) == ([], [], [])
    assert inbox.phase is WP.RUNNING and inbox._queue.empty()
    assert worker_states.decide(WP.RUNNING, word, current=False) == (ACT.DROP, WP.RUNNING)


def test_the_workers_docstring_table_is_the_one_the_code_uses():
    listed = {}
    for line in worker_states.__doc__.splitlines():
        words = line.split()
        acts = [i for i, w in enumerate(words) if w in ACT.__members__]
        if not words or words[0] not in WP.__members__ or not acts:
            continue
        at = acts[0]
        for name in words[1:at]:
            listed[(WP[words[0]], WORD[name])] = (ACT[words[at]], WP[words[at + 1]])
    assert listed == worker_states.TRANSITIONS


STALLED = "stalled: no heartbeat for 31 s (stall timeout 30 s)"
STUCK = "stuck: ranks wait apart"
PREEMPTED_40 = (75, "preempted after step 40", 75)
ANSWER = {"type": "state", "round": ROUND, "ranks": {"0": "waits in allreduce"}}


def _ended(code=0, stalled=(), stuck="", reasons=()):
    from hvdkit.launch.processes import Ended

    return Ended(code, list(stalled), stuck=stuck, reasons=list(reasons))


@pytest.mark.parametrize(
    "ended, preempted, signals, finished_first, want",
    [
        (_ended(0), None, [], False, (0, "exit code 0", 0)),
        (_ended(3), None, [], False, (3, "exit code 3", 3)),
        (_ended(-9), None, [], False, (-9, "killed by signal 9 (SIGKILL)", 1)),
        (_ended(0, reasons=["abort"]), None, [], False, (0, "exit code 0", 1)),
        (_ended(0), 40, ["SIGTERM"], False, (75, "preempted after step 40", 75)),
        (_ended(0, stalled=[(0, 31.2)]), None, [], False, (1, STALLED, 1)),
        (
            _ended(-15, stuck="stuck: ranks wait apart"),
            None,
            [],
            False,
            (1, "stuck: ranks wait apart", 1),
        ),
        # stopped by its worker, stalled or stuck: never reported preempted (nor 75)...
        (_ended(-9, stuck=STUCK), 40, [], False, (1, STUCK, 1)),
        # ...unless a preemption was asked for (this worker's SIGTERM): its recorded step
        (_ended(75, stuck=STUCK), 40, ["SIGTERM"], False, PREEMPTED_40),
        (_ended(-9, stalled=[(0, 31.2)]), 40, ["SIGTERM"], False, PREEMPTED_40),
        (_ended(-9, stuck=STUCK), None, ["SIGTERM"], False, (1, STUCK, 1)),  # none recorded
        (_ended(75, stalled=[(0, 31.2)]), 40, [], False, (1, STALLED, 1)),
        (_ended(75, stuck=STUCK), None, [], False, (1, STUCK, 1)),
        (_ended(3, stuck=STUCK), 40, [], False, (3, STUCK, 3)),
        (_ended(0), None, ["SIGTERM"], True, (0, "exit code 0", 0)),
        (_ended(0), None, ["SIGTERM"], False, (0, "exit code 0", 1)),
        (_ended(0, reasons=["x"]), None, ["SIGTERM"], True, (0, "exit code 0", 1)),
    ],
)
def test_the_verdict_on_a_run_of_the_program(ended, preempted, signals, finished_first, want):
    # what the worker reports (code, detail) and its own status: a pure function
    said = worker_states.verdict(ended, preempted, 1, 30.0, signals, finished_first)
    assert (said.code, said.detail, said.status) == want


@pytest.mark.parametrize(
    "ended, preempting, want",
    [
        (_ended(75, stuck=STUCK), True, PREEMPTED_40),
        (_ended(-9, stalled=[(0, 31.2)]), True, PREEMPTED_40),
        (_ended(75, stuck=STUCK), False, (1, STUCK, 1)),
    ],
)
def test_a_step_recorded_for_the_schedulers_preemption_is_reported_so_though_a_rank_was_stuck(
    ended, preempting, want
):
    # The scheduler's preempt word (it was sent SIGTERM) reached this worker's ranks; one
    # looked stuck while they agreed their step: the job was preempted, not lost a rank.
    said = worker_states.verdict(ended, 40, 1, 30.0, [], False, preempting=preempting)
    assert (said.code, said.detail, said.status) == want


def _kind_literals(tree) -> list[tuple[int, str]]:
    """String literals used as a message's kind: ``type="x"``, ``{"type": "x"}``,
    ``msg.get("type") == "x"`` (or ``in ("x", ...)``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "type":
            found.append(node.value)
        elif isinstance(node, ast.Dict):
            found += [v for k, v in zip(node.keys, node.values, strict=True) if _is_str(k, "type")]
        elif isinstance(node, ast.Compare) and _gets_type(node.left):
            for other in node.comparators:
                found += (
                    other.elts if isinstance(other, (ast.Tuple, ast.List, ast.Set)) else [other]
                )
    return [(n.lineno, n.value) for n in found if _is_str(n)]


def _is_str(node, value=None) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and value in (None, node.value)
    )


def _gets_type(node) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and bool(node.args)
        and _is_str(node.args[0], "type")
    )


def test_message_kinds_are_named_once_in_protocol():
    # the launcher's modules write no message kind as a string: protocol.py names them
    from hvdkit.launch import protocol

    launch = pathlib.Path(protocol.__file__).parent
    found = [
        f"{path.name}:{line}: {kind!r}"
        for path in sorted(launch.glob("*.py"))
        if path.name != "protocol.py"
        for line, kind in _kind_literals(ast.parse(path.read_text()))
    ]
    assert found == [], found
    # the checker itself sees the forms it looks for
    sample = 'ch.send(type="abort")\nm.get("type") in ("go", "done")\nx = {"type": "exit"}'
    assert sorted(k for _, k in _kind_literals(ast.parse(sample))) == [
        "abort",
        "done",
        "exit",
        "go",
    ]


def test_the_inbox_thread_ends_quietly_when_the_connection_closes_after_the_end(monkeypatch):
    # The scheduler closes the connection after "done": the worker's phase is ENDED by
    # then, which has no row in the table; the reading thread ends without deciding.
    raised = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    inbox, pipe, _ = inbox_in(WP.REGISTERING)
    pipe.feed(MESSAGES[WORD.DONE])
    assert inbox.decide(inbox.next()) is ACT.END and inbox.phase is WP.ENDED
    pipe.inbox.put(None)  # the connection closes
    inbox.reader.join(60)
    assert not inbox.reader.is_alive() and raised == []

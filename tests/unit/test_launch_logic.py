"""The launcher's pure logic, without processes: planning, failing-rank choice, rank
assignment, root cause, restart budget, resume step."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from hvdkit import config
from hvdkit.errors import LaunchError
from hvdkit.launch import cli, failures, restart
from hvdkit.launch.failures import Blame, describe_exit, failing_rank, lost_a_peer, root_cause
from hvdkit.launch.scheduler import assign_ranks, layout_for

# ------------------------------------------------------------------ planning (-np, -H, ...)


def args(**kw) -> argparse.Namespace:
    base = dict(np=None, nproc_per_node=None, hosts=None, hostfile=None)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize(
    "given, expected",
    [
        (dict(np=2), (2, [("localhost", 2)])),
        (dict(nproc_per_node=3), (3, [("localhost", 3)])),
        (dict(hosts="a:2,b:2"), (4, [("a", 2), ("b", 2)])),
        (dict(np=3, hosts="a:2,b:2"), (3, [("a", 2), ("b", 2)])),
        (dict(nproc_per_node=4, hosts="a:1,b:1"), (8, [("a", 4), ("b", 4)])),
        (dict(np=8, nproc_per_node=4, hosts="a:1,b:1"), (8, [("a", 4), ("b", 4)])),
    ],
)
def test_plan(given, expected):
    assert cli.plan(args(**given)) == expected


def test_plan_reads_a_hostfile(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("a slots=2  # first\n\nb:3\n")
    assert cli.plan(args(hostfile=str(f))) == (5, [("a", 2), ("b", 3)])


@pytest.mark.parametrize(
    "given, fragment",
    [
        (dict(), "say how many processes"),
        (dict(np=3, hosts="localhost:2"), "more than the 2 slots"),
        (dict(np=4, nproc_per_node=2), "conflicts with --nproc-per-node"),
        (dict(hosts="a"), "needs a slot count"),
        (dict(hosts="a:0"), "needs a slot count"),
        (dict(nproc_per_node=0), "must be >= 1"),
        (dict(np=0), "-np 0 must be >= 1"),
        (dict(np=-2, hosts="a:2"), "-np -2 must be >= 1"),
        (dict(hosts="a:1", hostfile="f"), "not both"),
        (dict(hostfile="/nonexistent/hosts"), "cannot read --hostfile"),
    ],
)
def test_plan_errors_name_the_value(given, fragment):
    with pytest.raises(LaunchError, match=fragment):
        cli.plan(args(**given))


# ------------------------------------------------------------------ failing-rank choice


@pytest.mark.parametrize(
    "lines, expected",
    [
        (["Process 1 exit with status code 137."], (1, "exit code 137 (SIGKILL)")),
        (["Process 0 exit with status code 3."], (0, "exit code 3")),
        (
            [
                "mpirun noticed that process rank 0 with PID 4242 on node vm exited on signal 9 "
                "(Killed)."
            ],
            (0, "signal 9 (SIGKILL)"),
        ),
        (
            ["  Process name: [[5196,1],1]", "  Exit code:    3"],
            (1, "exit code 3"),
        ),
        (
            ["process rank 1 with PID 77 on node vm exiting", "improperly. There are three"],
            (1, "ended without finishing MPI (e.g. os._exit)"),
        ),
        (  # as Open MPI 4 wraps it
            [
                "mpirun has exited due to process rank 1 with PID 0 on",
                "node vm exiting improperly. There are three reasons this could occur:",
            ],
            (1, "ended without finishing MPI (e.g. os._exit)"),
        ),
        (
            ["Stalled ranks:", "0: [allreduce.x] Missing ranks: 1, 2"],
            (1, "stalled: Horovod reported it missing from a collective"),
        ),
        (["all is well"], (None, "")),
    ],
)
def test_failing_rank_from_launcher_lines(lines, expected):
    assert failing_rank(lines) == expected


def test_an_explicit_exit_report_wins_over_a_stall_report():
    lines = ["Missing ranks: 0", "Process 1 exit with status code 1"]
    assert failing_rank(lines) == (1, "exit code 1")


def test_describe_exit():
    assert describe_exit(0) == "exit code 0"
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-9) == "killed by signal 9 (SIGKILL)"
    assert describe_exit(-19) == "killed by signal 19 (SIGSTOP)"
    assert describe_exit(-200) == "killed by signal 200"


# ------------------------------------------------------------------ root cause (one rule)

LOST = ["step 3", "RuntimeError: Horovod has been shut down. This was caused by ..."]
GLOO_LOST = ["[../third_party/gloo/...] Connection closed by peer [127.0.0.1]:1234"]
OWN = ["step 3", "ValueError: bad batch"]


def test_lost_a_peer():
    assert lost_a_peer(LOST) and lost_a_peer(GLOO_LOST)
    assert not lost_a_peer(OWN) and not lost_a_peer([])


def test_the_first_rank_that_failed_on_its_own_is_blamed():
    assert root_cause([1], {0: LOST, 1: OWN}) == Blame(1)
    assert root_cause([0, 1, 2], {0: LOST, 1: OWN, 2: OWN}) == Blame(1)
    assert root_cause([2, 1], {1: OWN, 2: OWN}) == Blame(2)  # order given, not rank order


def test_mpirun_naming_a_follow_on_failure_is_corrected():
    # mpirun named rank 0, which only lost rank 1; rank 1 died silently.
    blame = root_cause([0], {0: LOST, 1: ["step 3"]})
    assert blame == Blame(1, "went away first; the others then lost it")


def test_a_rank_exiting_0_while_others_run_is_blamed():
    blame = root_cause([0], {0: LOST, 1: ["done"]}, exited_ok=[1])
    assert blame == Blame(1, "exited 0 while the other ranks still ran; they then lost it")


def test_a_rank_that_finished_is_not_blamed_for_a_real_failure():
    assert root_cause([0], {0: OWN, 1: ["done"]}, exited_ok=[1]) == Blame(0)


def test_ambiguous_follow_on_failures_fall_back_to_the_first_reported():
    # two silent candidates: no guess
    assert root_cause([0], {0: LOST, 1: ["a"], 2: ["b"]}) == Blame(0)
    assert root_cause([2, 0], {0: LOST, 2: GLOO_LOST}) == Blame(2)


def test_no_failed_rank_means_no_blame():
    assert root_cause([], {0: OWN}) is None


# ------------------------------------------------------------------ rank assignment


def test_assign_ranks_contiguous_per_host_with_cross_ranks():
    by_host = {"a": ["a0", "a1"], "b": ["b0"], "c": ["c0", "c1"]}
    layout = assign_ranks(["a", "b", "c"], by_host)
    got = [
        (
            d["reg"],
            d["rank"],
            d["size"],
            d["local_rank"],
            d["local_size"],
            d["cross_rank"],
            d["cross_size"],
            d["host_index"],
        )
        for d in layout
    ]
    assert got == [
        ("a0", 0, 5, 0, 2, 0, 3, 0),
        ("a1", 1, 5, 1, 2, 0, 2, 0),
        ("b0", 2, 5, 0, 1, 1, 3, 1),
        ("c0", 3, 5, 0, 2, 2, 3, 2),
        ("c1", 4, 5, 1, 2, 1, 2, 2),
    ]


def w(name, host):
    return SimpleNamespace(name=name, host=host)


def test_layout_keeps_arrival_order_and_renumbers_after_a_loss():
    a0, b0, a1, b1 = w("a0", "A"), w("b0", "B"), w("a1", "A"), w("b1", "B")
    first = layout_for([a0, b0, a1, b1])
    assert [(d["reg"].name, d["rank"], d["local_rank"]) for d in first] == [
        ("a0", 0, 0),
        ("a1", 1, 1),
        ("b0", 2, 0),
        ("b1", 3, 1),
    ]
    # host A's first worker is lost for good: ranks stay contiguous per host
    after = layout_for([b0, a1, b1])
    assert [
        (d["reg"].name, d["rank"], d["size"], d["local_rank"], d["local_size"]) for d in after
    ] == [("b0", 0, 3, 0, 2), ("b1", 1, 3, 1, 2), ("a1", 2, 3, 0, 1)]
    assert [d["cross_size"] for d in after] == [2, 1, 2]
    # a replacement appended at the end joins its host's block
    a2 = w("a2", "A")
    again = layout_for([b0, a1, b1, a2])
    assert [(d["reg"].name, d["rank"]) for d in again] == [
        ("b0", 0),
        ("b1", 1),
        ("a1", 2),
        ("a2", 3),
    ]


# ------------------------------------------------------------------ restart budget


def test_budget_zero_never_restarts_and_reports_the_one_cause():
    b = restart.RestartBudget(0)
    assert b.restarts == 0
    assert b.record("rank 1 exit code 3") is None
    assert b.summary() == "attempt 1: rank 1 exit code 3"


def test_budget_grants_n_restarts_with_growing_backoff_then_lists_every_cause():
    b = restart.RestartBudget(2)
    assert b.record("rank 1 killed by signal 9 (SIGKILL)") == 1.0
    assert b.restarts == 1
    line = b.restart_line("hvdkitrun", 40)
    assert line == (
        "hvdkitrun: restart 1/2 after rank 1 killed by signal 9 (SIGKILL); "
        "resuming from checkpoint step 40."
    )
    assert b.record("rank 0 stalled (no heartbeat for 21 s)") == 2.0
    assert b.restarts == 2
    assert "restart 2/2 after rank 0 stalled" in b.restart_line("scheduler", None)
    assert b.record("rank 1 exit code 3") is None
    assert b.restarts == 2
    assert b.summary() == (
        "gave up after 3 failed attempts (2 restarts): "
        "attempt 1: rank 1 killed by signal 9 (SIGKILL); "
        "attempt 2: rank 0 stalled (no heartbeat for 21 s); attempt 3: rank 1 exit code 3"
    )


def test_backoff_is_short_and_capped():
    assert [restart.backoff_s(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_max_restarts_from_argument_env_or_default(monkeypatch):
    monkeypatch.delenv(config.MAX_RESTARTS, raising=False)
    assert restart.max_restarts() == 0
    monkeypatch.setenv(config.MAX_RESTARTS, "3")
    assert restart.max_restarts() == 3
    assert restart.max_restarts(1) == 1  # the argument wins
    monkeypatch.setenv(config.MAX_RESTARTS, "two")
    with pytest.raises(LaunchError, match="HVDKIT_MAX_RESTARTS='two' is not a whole number"):
        restart.max_restarts()
    with pytest.raises(LaunchError, match="--max-restarts -1 must be >= 0"):
        restart.max_restarts(-1)


# ------------------------------------------------------------------ resume step


def manifest(step: int, **extra) -> str:
    """A manifest as hvdkit.Checkpointer writes one (self-checksum over the sorted JSON)."""
    body = {"format": "hvdkit-checkpoint", "version": 1, "step": step, **extra}
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    return json.dumps({**body, "manifest_sha256": digest})


def test_resume_step_is_the_newest_complete_checkpoint(tmp_path):
    assert restart.resume_step(None) is None
    assert restart.resume_step(tmp_path / "missing") is None
    assert restart.resume_step(tmp_path) is None
    for name, text in [
        ("ckpt-0000000010", manifest(10)),
        ("ckpt-0000000020", manifest(20, epoch=1)),
        ("ckpt-0000000030", manifest(30)[:-20]),  # torn
        ("ckpt-0000000040", manifest(40).replace('"step": 40', '"step": 41')),  # fails its check
        (".tmp-ckpt-0000000050-77", manifest(50)),  # unfinished write
        ("other", json.dumps(["not", "a", "manifest"])),
    ]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(text)
    (tmp_path / "ckpt-0000000060").mkdir()  # no manifest yet
    assert restart.resume_step(tmp_path) == 20


def test_resume_step_reads_the_real_checkpoint_format(tmp_path):
    """Against the writer hvdkit.Checkpointer uses (TensorFlow-free)."""
    from hvdkit.fault import _checkpoint_files

    entry = {"group": "model", "name": "w", "dtype": "float32"}
    _checkpoint_files.write(tmp_path, 7, [(entry, lambda: np.ones(3, np.float32))], {"epoch": 0})
    assert restart.resume_step(tmp_path) == 7


def test_every_reported_ending_is_kept_per_rank():
    # horovodrun --gloo reports each process that ended non-zero; the culprit is
    # often not the first one reported (its peers fail first, having lost it)
    lines = [
        "Process 0 exit with status code 1.",
        "Terminating remaining workers after failure of Process 0.",
        "Process 1 exit with status code 3.",
        "Process 1 exit with status code 1.",  # a later line for the same rank
    ]
    assert failures.reported_endings(lines) == {0: "exit code 1", 1: "exit code 3"}
    assert failures.reported_endings(["Process 2 exit with status code 137."]) == {
        2: "exit code 137 (SIGKILL)"
    }
    assert failures.reported_endings(["all is well"]) == {}


@pytest.mark.parametrize(
    "hosts, np_, expected",
    [
        ([("a", 4), ("b", 4)], 2, [("a", 2)]),  # horovodrun fills the first host's slots
        ([("a", 2), ("b", 2)], 3, [("a", 2), ("b", 1)]),
        ([("a", 1), ("b", 1)], 2, [("a", 1), ("b", 1)]),
        ([("localhost", 2)], 2, [("localhost", 2)]),
    ],
)
def test_placed_is_where_horovodrun_puts_the_processes(hosts, np_, expected):
    assert cli.placed(hosts, np_) == expected


def test_this_machine_includes_its_own_addresses_not_others():
    assert cli._is_this_machine("localhost")
    assert cli._is_this_machine("127.0.0.1")
    assert cli._is_this_machine(socket.gethostname())
    # an address another machine has (TEST-NET-1, never assigned) and an unknown name
    assert not cli._is_this_machine("192.0.2.1")
    assert not cli._is_this_machine("no-such-host.invalid")


# ------------------------------------------------------------------ the scheduler's port


def _scheduler(port: int):
    from hvdkit.launch.scheduler import Scheduler

    return Scheduler("127.0.0.1", port, 1, "token-" + "x" * 20, 10.0)


def test_a_scheduler_listens_again_on_the_port_a_finished_job_used():
    """A rerun (after a preemption, say) must not wait for TIME_WAIT to pass."""
    first = _scheduler(0)
    port = first.door.sock.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = first.door.sock.accept()
    conn.close()  # the scheduler closes first: its end of the connection is in TIME_WAIT
    client.close()
    first.door.sock.close()
    again = _scheduler(port)
    assert again.door.sock.getsockname()[1] == port
    # ... while a port another job listens on is still refused, naming it
    with pytest.raises(LaunchError, match=f"cannot listen on 127.0.0.1:{port}: Address already"):
        _scheduler(port)
    again.door.sock.close()


# ------------------------------------------------------- an elastic job's end (scheduler)


class _Wire:
    """A worker's end of the scheduler's channel: what the scheduler sent it."""

    def __init__(self):
        self.sent: list[dict] = []

    def send(self, **msg):
        self.sent.append(msg)


def _workers(*rounds: int) -> list:
    from hvdkit.launch.scheduler import Registration

    return [
        Registration(_Wire(), "127.0.0.1", "vm", 100 + i, rank=i, round=r)
        for i, r in enumerate(rounds)
    ]


def _watch_events(sched, regs, round_, later, meet, events):
    """Run the scheduler's watch of one round over ``events``, given in the order they came.

    The watch runs on a thread: a watch that never ends (the bug these
    tests are about) fails the test at a deadline instead of hanging it.
    """
    from hvdkit.launch.rounds import Report
    from hvdkit.launch.scheduler import READY

    for reg, rnd, code in events:
        sched.events.put(Report(reg, rnd, code, "" if code == READY else f"exit code {code}"))
    out = []
    watch = threading.Thread(
        target=lambda: out.append(sched._watch(regs, round_, later, meet)), daemon=True
    )
    watch.start()
    watch.join(timeout=120)
    assert out, f"the round never ended; sent: {[r.channel.sent for r in regs]}"
    return out[0]


def _elastic_scheduler():
    from hvdkit.launch.scheduler import Scheduler

    sched = Scheduler("127.0.0.1", 0, 3, "token-" + "x" * 20, 60.0, min_workers=2, elastic=True)
    sched.door.sock.close()
    return sched


def _assigned_later(round_: int, *survivors) -> dict:
    """A growing round's assignments of its survivors, held until the newcomers are ready."""
    return {
        r: {"type": "assign", "round": round_, "inplace": True, "rank": r.rank} for r in survivors
    }


def _kinds(reg) -> list[str]:
    return [m["type"] for m in reg.channel.sent]


@pytest.mark.parametrize("said_finished", [True, False])
def test_a_newcomer_ready_as_the_survivors_finish_training_is_sent_away(said_finished):
    """The end-of-job race of the chaos test: the newcomer's program became ready, the
    survivors were told the bigger world, but their training function had returned: they
    never meet it. Whether the survivors' workers said "finished" first or only their exit
    0 comes, the newcomer is sent away and the round ends with the survivors' exits."""
    from hvdkit.launch.scheduler import FINISHED, READY

    a, b, c = _workers(5, 5, 6)  # a, b: survivors of round 5; c joins in round 6
    later = _assigned_later(6, a, b)
    sched = _elastic_scheduler()
    sched.newcomers.put(_workers(6)[0])  # another one registers meanwhile
    finished = [(a, 5, FINISHED)] if said_finished else []
    events = [(c, 6, READY), *finished, (a, 6, 0), (b, 6, 0)]
    result = _watch_events(sched, [a, b, c], 6, later, True, events)
    assert (result.culprit, result.survivors, result.joining) == (None, None, None)
    assert _kinds(a) == _kinds(b) == ["assign"]  # the bigger world was offered; no "go"
    assert c.channel.sent == [
        {"type": "abort", "round": 6, "reason": "could not join the job: the job finished training"}
    ]
    assert sched.newcomers.qsize() == 1  # no growing round after the end of training


def test_survivors_that_finish_before_the_newcomer_is_ready_never_hear_of_the_bigger_world():
    from hvdkit.launch.scheduler import FINISHED, READY

    a, b, c = _workers(5, 5, 6)
    later = _assigned_later(6, a, b)
    sched = _elastic_scheduler()
    events = [(b, 5, FINISHED), (c, 6, READY), (a, 5, 0), (b, 5, 0)]
    result = _watch_events(sched, [a, b, c], 6, later, True, events)
    assert (result.culprit, result.survivors) == (None, None)
    assert a.channel.sent == b.channel.sent == []  # still in round 5, to their end
    assert _kinds(c) == ["abort"]


def test_a_newcomer_that_met_the_others_finishes_with_them():
    """Once every rank of a growing round met, the newcomer is a rank like the others:
    the end of training sends nobody away."""
    from hvdkit.launch.scheduler import FINISHED, READY

    a, b, c = _workers(5, 5, 6)
    later = _assigned_later(6, a, b)
    sched = _elastic_scheduler()
    ready = [(c, 6, READY), (a, 6, READY), (b, 6, READY)]
    events = [*ready, (b, 6, FINISHED), (a, 6, 0), (b, 6, 0), (c, 6, 0)]
    result = _watch_events(sched, [a, b, c], 6, later, True, events)
    assert (result.culprit, result.survivors) == (None, None)
    assert _kinds(a) == _kinds(b) == ["assign", "go"] and _kinds(c) == ["go"]


def test_a_failure_after_the_end_of_training_is_not_recovered_in_process():
    """Ranks whose training function returned will not meet a new world: a rank failing
    now (in the script's code after training) fails the round, as without elastic."""
    from hvdkit.launch.scheduler import FINISHED

    a, b, c = _workers(7, 7, 7)
    sched = _elastic_scheduler()
    events = [(a, 7, FINISHED), (b, 7, 1), (c, 7, 0), (a, 7, 0)]
    result = _watch_events(sched, [a, b, c], 7, {}, False, events)
    assert result.culprit == 1 and result.survivors is None


def test_before_the_end_of_training_a_failure_is_recovered_in_process():
    """The control of the test above: the same failure without "finished"."""
    a, b, c = _workers(7, 7, 7)
    sched = _elastic_scheduler()
    result = _watch_events(sched, [a, b, c], 7, {}, False, [(b, 7, 1)])
    assert result.culprit == 1 and result.survivors == [a, c]


def test_a_survivor_lost_while_a_newcomer_gets_ready_is_the_cause_and_the_newcomer_waits():
    """The chaos test under load: rank 0 was killed while a newcomer of a growing round was
    still starting. The round's cause is rank 0's death (it was logged "rank None"); the
    newcomer is sent away but is not lost: it waits to join again, and no restart is
    counted for it (it was charged one)."""
    from hvdkit.launch.scheduler import READY

    a, b, c, d = _workers(1, 1, 1, 2)  # a, b, c: round 1; d joins in round 2
    later = _assigned_later(2, a, b, c)
    sched = _elastic_scheduler()
    sched.worker_num = 4
    result = _watch_events(sched, [a, b, c, d], 2, later, True, [(a, 1, -9), (d, 2, READY)])
    assert (result.culprit, result.detail) == (0, "exit code -9")
    assert result.cause == "rank 0 exit code -9"
    assert result.survivors == [b, c] and result.requeued == [d]
    assert d.channel.sent == [
        {
            "type": "abort",
            "round": 2,
            "reason": "could not join the job: a survivor was lost meanwhile: rank 0 exit code -9",
        }
    ]
    assert b.channel.sent == c.channel.sent == []  # still in round 1: regrouped next


def test_a_survivor_whose_program_ended_as_its_new_world_was_sent_fails_the_new_round():
    """The CI's chaos test: a survivor froze just as the scheduler sent it the growing
    world; its worker stopped it at the stall timeout and reported it as of the old round
    (it had not handed the new one over). That report was ignored as late, and the other
    survivor waited for the frozen one's "ready" until HVDKIT_SCHED_TIMEOUT. A survivor
    carried in-process runs the same program: its report is about the round now."""
    from hvdkit.launch.scheduler import READY

    a, b, c = _workers(5, 5, 6)  # a, b: survivors of round 5; c joins in round 6
    later = _assigned_later(6, a, b)
    sched = _elastic_scheduler()
    result = _watch_events(sched, [a, b, c], 6, later, True, [(c, 6, READY), (a, 5, 1)])
    assert (result.culprit, result.survivors) == (0, [b, c])


def test_a_newcomer_that_dies_before_meeting_is_lost_and_the_other_newcomer_waits():
    a, b, c, d = _workers(1, 1, 2, 2)  # a, b: round 1; c and d join in round 2
    later = _assigned_later(2, a, b)
    sched = _elastic_scheduler()
    sched.worker_num = 4
    result = _watch_events(sched, [a, b, c, d], 2, later, True, [(c, 2, 1)])
    assert result.cause == "rank 2 exit code 1"
    assert result.survivors == [a, b] and result.requeued == [d]
    assert _kinds(c) == _kinds(d) == ["abort"]


def test_the_scheduler_requeues_a_waiting_newcomer_without_a_restart_and_names_the_cause(caplog):
    """What ``_rounds`` does with such a result: one line naming the dead rank and only it
    as lost; the newcomer goes back to the queue; the lost one's return is counted for its
    worker, not as a restart."""
    from hvdkit.launch.scheduler import RoundResult

    a, b, c, d = _workers(1, 1, 1, 2)
    sched = _elastic_scheduler()
    sched.worker_num, sched.budget.limit = 4, 3
    results = iter(
        [
            RoundResult(0, "killed by signal 9", survivors=[b, c], requeued=[d]),
            RoundResult(),  # the next round ends the job
        ]
    )
    queued = []

    def round_(regs, round_, inplace):
        queued.append(list(sched.newcomers.queue))
        return next(results)

    sched._round = round_
    sched._round_no = 3
    with caplog.at_level("WARNING", logger="hvdkit"):
        assert sched._rounds([a, b, c, d], [a, b, c, d]) == 0
    said = [r.getMessage() for r in caplog.records]
    assert (
        "rank 0 killed by signal 9; 2 of 4 workers go on in-process as round 4 "
        "(lost: pid 100 on vm 127.0.0.1)"
    ) in said, said
    assert "pid 103 on vm 127.0.0.1 was joining; it waits to join again" in said, said
    assert (sched.budget.restarts, a.returns) == (0, 1)  # a's program returns; d cost nothing
    assert queued == [[], [d, a]]  # both wait to join the next round


# ------------------------------------------------- a death the scheduler heard too late


class _ScriptedChannel(_Wire):
    """The scheduler's side as a script: ``recv`` gives ``script`` in order, then blocks."""

    def __init__(self, script: list[dict]):
        super().__init__()
        self._script = list(script)

    def recv(self):
        if self._script:
            return self._script.pop(0)
        threading.Event().wait()  # the scheduler says nothing more


def test_a_program_that_died_as_its_new_world_came_is_reported_with_how_it_died(monkeypatch):
    """The rank was SIGKILLed just as the scheduler sent the survivors their new world: its
    report of the old round is ignored as late, so the answer to the new round's assignment
    must say how the program ended (it said only "ended before ..." before)."""
    from hvdkit.launch import worker

    ch = _ScriptedChannel(
        [
            {"type": "assign", "inplace": True, "round": 2},  # the growing world, too late
            {"type": "done", "code": 0},
        ]
    )
    died = "killed by signal 9 (SIGKILL)"
    monkeypatch.setattr(worker, "_run_program", lambda ch, *a: (1, died))
    first = {"type": "assign", "round": 1, "rank": 0}
    code, done = worker._run_rounds(ch, first, "127.0.0.1", "t", ["prog"], 8.0, None)
    assert (code, done) == (1, {"type": "done", "code": 0})
    late = [m for m in ch.sent if m["type"] == "exit"]
    assert late == [
        {
            "type": "exit",
            "round": 2,
            "code": 1,
            "detail": f"{died} before the job's new world formed",
            "tail": [],
        }
    ]


def test_guarded_horovodrun_reports_a_failed_rank_without_a_traceback():
    """Real horovodrun --gloo, one rank exiting 75 (a preempted rank's code)."""
    program = [sys.executable, "-c", "import sys; sys.exit(75)"]
    argv = ["127.0.0.1", "--", "-np", "1", "-H", "localhost:1", "--gloo", *program]
    done = subprocess.run(
        [sys.executable, "-m", "hvdkit.launch.guarded_horovodrun", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stderr
    assert "Exit code: 75" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_new_worker_removes_the_hand_over_folders_of_killed_workers(tmp_path, monkeypatch):
    from hvdkit.launch.handover import ElasticHandover

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a worker killed with SIGKILL: its pid no longer exists
    prefix = ElasticHandover.PREFIX
    dead = tmp_path / f"{prefix}{gone.pid}-abc"
    alive = tmp_path / f"{prefix}{os.getpid()}-xyz"
    (dead / "sub").mkdir(parents=True)
    (dead / "assign.json").write_text("{}")
    alive.mkdir()
    (tmp_path / f"{prefix}old").mkdir()  # hvdkit before pids in the name: left alone
    (tmp_path / f"other-{gone.pid}-abc").mkdir()
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / f"{prefix}{gone.pid}-lnk").symlink_to(target)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    env: dict[str, str] = {}
    handover = ElasticHandover({"rank": 0}, env)
    mine = os.path.basename(handover.folder)
    assert mine.startswith(f"{prefix}{os.getpid()}-")
    assert env[config.ELASTIC_DIR] == handover.folder
    left = sorted(p.name for p in tmp_path.iterdir())
    kept = [alive.name, f"{prefix}{gone.pid}-lnk", f"{prefix}old", f"other-{gone.pid}-abc"]
    assert left == sorted([*kept, mine, "target"])
    handover.close()
    assert not os.path.exists(handover.folder)


def test_horovodruns_build_check_answers_as_horovod_without_importing_tensorflow():
    """hvdkitrun's horovodrun asks the extension in a child that loads no TensorFlow package."""
    import hvdkit
    from hvdkit import _compat

    # the oracle: Horovod's extension asked in this process, after TensorFlow's import
    own = {"gloo": hvdkit.gloo_built(), "mpi": hvdkit.mpi_built()}
    own["nccl"] = bool(hvdkit.nccl_built())
    assert {t: _compat.horovod_tf_built(t) for t in own} == own
    assert _compat.horovod_tf_built("no_such") is None  # cannot tell: Horovod's check runs
    script = (
        "import sys\n"
        "from horovod.common import util\n"
        "def refuse(*a, **k): raise AssertionError('Horovod imported TensorFlow to check')\n"
        "util._check_extension_lambda = refuse\n"
        "from hvdkit import _compat\n"
        "_compat.use_quick_build_checks()\n"
        "from horovod.runner import launch\n"
        "print(launch.gloo_built(), launch.mpi_built(verbose=True), 'tensorflow' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [str(own["gloo"]), str(own["mpi"]), "False"]


def test_horovodruns_own_build_check_runs_where_the_quick_one_cannot_tell(monkeypatch):
    from horovod.runner import launch

    from hvdkit import _compat

    monkeypatch.setattr(launch, "gloo_built", lambda verbose=False: f"Horovod's, verbose={verbose}")
    monkeypatch.setattr(launch, "mpi_built", lambda verbose=False: "Horovod's")
    monkeypatch.setattr(_compat, "horovod_tf_built", lambda transport: None)
    _compat.use_quick_build_checks()
    assert launch.gloo_built(verbose=True) == "Horovod's, verbose=True"
    assert launch.mpi_built() == "Horovod's"


# ------------------------------------------------------------------ a signal after the end


def attempt_with(finished: list[bool], interrupted: list[str]) -> cli._Attempt:
    """An attempt of a 2-rank job whose monitor has heard from the ranks as given."""
    from hvdkit.launch.heartbeat import RankStatus
    from hvdkit.launch.output import RankOutput

    job = cli._Launch([], {}, RankOutput(), 30.0, "token", "127.0.0.1", "127.0.0.1", np=2)
    attempt = cli._Attempt(job, interrupted)
    for rank, done in enumerate(finished):
        attempt.monitor.ranks[rank] = RankStatus(100 + rank, "h", float(rank), finished=done)
    return attempt


def test_a_sigterm_after_every_rank_finished_is_not_passed_on_and_the_job_is_complete():
    attempt = attempt_with([True, True], ["SIGTERM"])
    try:
        assert attempt.all_finished()
        attempt.on_tick()
        assert attempt.stop_now == [] and attempt.forward.sent_at is None  # nothing sent
        assert attempt.forward.ended_after_the_end(["SIGTERM"], finished=True)
    finally:
        attempt.monitor.close()


def test_a_sigterm_while_a_rank_trains_is_acted_on_even_if_it_finishes_later():
    attempt = attempt_with([True, False], ["SIGTERM"])
    try:
        assert not attempt.all_finished()
        attempt.on_tick()  # no rank process known here: stop now (SigtermForwarding)
        assert attempt.stop_now == ["SIGTERM"]
        attempt.monitor.ranks[1].finished = True  # its bye after the signal
        assert not attempt.forward.ended_after_the_end(["SIGTERM"], finished=True)
    finally:
        attempt.monitor.close()


def test_a_signal_never_acted_on_leaves_the_ranks_clean_exits_their_own():
    attempt = attempt_with([True, True], ["SIGTERM"])
    try:  # the job ended before the next poll saw the signal
        assert attempt.forward.ended_after_the_end(["SIGTERM"], finished=True)
        assert not attempt.forward.ended_after_the_end(["SIGTERM"], finished=False)
        assert not attempt.forward.ended_after_the_end(["SIGINT"], finished=True)
    finally:
        attempt.monitor.close()


def test_ctrl_c_stops_at_once_even_after_the_end():
    attempt = attempt_with([True, True], ["SIGINT"])
    try:
        attempt.on_tick()
        assert attempt.stop_now == ["SIGINT"]
    finally:
        attempt.monitor.close()


STUCK_REPORT = "ranks stuck in different collectives for more than 2 s: rank 0 waits"


@pytest.mark.parametrize(
    "stalled, stuck, want",
    [
        ([(1, 31.0)], "", (cli.EXIT_STALLED, "rank 1 stalled (no heartbeat for 31 s)")),
        ([], STUCK_REPORT, (cli.EXIT_STALLED, STUCK_REPORT)),
        ([], "", (config.EXIT_PREEMPTED, None)),  # a preemption, and nothing else
    ],
)
def test_a_job_stopped_stalled_or_stuck_is_not_preempted_though_its_ranks_say_so(
    stalled, stuck, want
):
    # The stop's SIGTERM can let stuck ranks agree a step and record a preemption
    # on the way out: the job still ends stalled, with a cause to restart for.
    from hvdkit.launch.processes import Ended

    attempt = attempt_with([False, False], [])
    try:
        assert attempt.decide(Ended(1, stalled, stuck=stuck), 7, []) == want
    finally:
        attempt.monitor.close()


@pytest.mark.parametrize("stalled, stuck", [([(1, 31.0)], ""), ([], STUCK_REPORT)])
def test_a_real_sigterm_whose_ranks_recorded_a_step_is_a_preemption_though_a_rank_looked_stuck(
    stalled, stuck
):
    # hvdkitrun was sent SIGTERM and passed it on; a stuck report came while the ranks
    # agreed their step: the job was preempted (75, the step on disk), not "interrupted" (143).
    from hvdkit.launch.processes import Ended

    attempt = attempt_with([False, False], ["SIGTERM"])
    try:
        ended = Ended(75, stalled, stuck=stuck)
        assert attempt.decide(ended, 7, []) == (config.EXIT_PREEMPTED, None)
        lines = attempt.job.out.launcher_lines
        assert [ln for ln in lines if "preempted" in ln] == [
            "hvdkitrun: preempted: every rank stopped after step 7, which the checkpoint "
            "holds; run the same command again to resume from it."
        ]
    finally:
        attempt.monitor.close()


class _Child:
    """A horovodrun that ended with ``returncode`` (as ``processes.supervise`` reports it)."""

    def __init__(self, returncode: int):
        self.returncode = returncode


@pytest.mark.parametrize(
    "signals, returncode, finished, expected",
    [
        (["SIGTERM"], 0, [True, True], 0),  # after the end: complete
        (["SIGTERM"], 1, [True, True], 143),  # a rank failed on its way out: not complete
        (["SIGTERM"], 0, [True, False], 143),  # a rank had not finished
        (["SIGINT"], 0, [True, True], 130),  # Ctrl-C after the last poll: still interrupted
        (["SIGTERM", "SIGHUP"], 0, [True, True], 143),  # named by the first signal
    ],
)
def test_how_an_attempt_that_got_a_signal_ends(
    monkeypatch, signals, returncode, finished, expected
):
    from hvdkit.launch import processes

    attempt = attempt_with(finished, signals)
    monkeypatch.setattr(
        processes, "spawn", lambda cmd, env: SimpleNamespace(stdout=None, stderr=None)
    )
    monkeypatch.setattr(
        attempt.job.out, "pump", lambda *a: SimpleNamespace(join=lambda timeout=None: None)
    )
    monkeypatch.setattr(processes, "supervise", lambda *a, **k: processes.Ended(returncode))
    monkeypatch.setattr(processes, "stop", lambda known: [])
    code, cause = attempt.run()  # the signal came after the last poll: never acted on
    assert (code, cause) == (expected, None)
    said = list(attempt.job.out.launcher_lines)
    assert ("the job is complete" in said[-1]) == (expected == 0), said


def test_a_workers_program_has_finished_once_each_of_its_ranks_said_bye():
    from hvdkit.launch import worker
    from hvdkit.launch.heartbeat import RankStatus

    def monitor(*done):
        return SimpleNamespace(
            ranks={r: RankStatus(r, "h", 0.0, finished=d) for r, d in enumerate(done)}
        )

    assert worker._finished(monitor(True, True))
    assert not worker._finished(monitor(True, False))
    assert not worker._finished(monitor())  # no heartbeat yet: nothing has finished


# ------------------------------------------------------------------ Open MPI's btl flag


def test_mpirun_btl_leaves_ofi_out_on_one_host_and_the_users_choice_alone():
    from hvdkit.launch.transport import mpirun_btl

    assert mpirun_btl(True, {}) == "^openib,ofi"
    assert mpirun_btl(False, {}) is None  # across machines: Horovod's own flag
    assert mpirun_btl(True, {"OMPI_MCA_btl": "self,tcp"}) == ""  # theirs: no flag over it
    assert mpirun_btl(False, {"OMPI_MCA_btl": "self,tcp"}) == ""
    assert mpirun_btl(True, {"OMPI_MCA_btl": ""}) == "^openib,ofi"  # empty: not a choice


def test_the_hvdkitrun_command_passes_the_btl_rule_to_the_wrapper_under_mpi_only(monkeypatch):
    monkeypatch.delenv("OMPI_MCA_btl", raising=False)
    local = [("localhost", 2)]

    def wrapper_args(cmd):  # the wrapper's own arguments, before "--"
        return cmd[cmd.index("hvdkit.launch.guarded_horovodrun") + 1 : cmd.index("--")]

    assert wrapper_args(cli._horovodrun_command("mpi", 2, local, 30, ["prog"])) == [
        "",
        "--btl",
        "^openib,ofi",
    ]
    assert wrapper_args(cli._horovodrun_command("gloo", 2, local, 30, ["prog"])) == [""]
    two_hosts = [("localhost", 1), ("10.9.9.9", 1)]
    assert wrapper_args(cli._horovodrun_command("mpi", 2, two_hosts, 30, ["prog"])) == [""]
    monkeypatch.setenv("OMPI_MCA_btl", "self,vader")
    assert wrapper_args(cli._horovodrun_command("mpi", 2, local, 30, ["prog"])) == ["", "--btl", ""]


def test_use_mpirun_btl_replaces_or_drops_horovods_btl_flag(monkeypatch):
    from horovod.runner import mpi_run

    from hvdkit import _compat

    assert mpi_run._OMPI_FLAGS == ["-mca pml ob1", "-mca btl ^openib"]  # Horovod 0.28.1's
    monkeypatch.setattr(mpi_run, "_OMPI_FLAGS", list(mpi_run._OMPI_FLAGS))
    _compat.use_mpirun_btl("^openib,ofi")
    # what horovodrun --mpi builds its mpirun command from, told it is Open MPI
    monkeypatch.setattr(mpi_run, "is_open_mpi", lambda env=None: True)
    flags, _, impl = mpi_run._get_mpi_implementation_flags(False)
    assert (impl, flags) == ("OpenMPI", ["-mca pml ob1", "-mca btl ^openib,ofi"])
    _compat.use_mpirun_btl("")
    assert mpi_run._OMPI_FLAGS == ["-mca pml ob1"]


def test_layout_variables_of_hvdkitruns_environment_do_not_reach_the_ranks(monkeypatch):
    from horovod.runner import gloo_run
    from horovod.runner.common.util.hosts import SlotInfo

    from hvdkit import _compat

    # the variables horovodrun --gloo sets per rank, as Horovod 0.28.1 builds them
    slot = SlotInfo("h", rank=1, local_rank=1, cross_rank=0, size=2, local_size=2, cross_size=1)
    assert set(gloo_run.create_slot_env_vars(slot)) == set(_compat.HOROVODRUN_LAYOUT_VARIABLES)
    for name in _compat.HOROVODRUN_LAYOUT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOROVOD_SIZE", "7")
    monkeypatch.setenv("HOROVOD_RANK", "0")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "2")  # a setting, not a layout: passed on
    for transport in ("gloo", "mpi"):
        env, left = cli._ranks_env(transport, "ab" * 16, None, 60.0)
        assert left == ["HOROVOD_RANK=0", "HOROVOD_SIZE=7"], transport
        assert not set(env) & set(_compat.HOROVODRUN_LAYOUT_VARIABLES), transport
        assert env["HOROVOD_CYCLE_TIME"] == "2", transport
    for name in ("HOROVOD_SIZE", "HOROVOD_RANK"):
        monkeypatch.delenv(name)
    assert cli._ranks_env("gloo", "ab" * 16, None, 60.0)[1] == []


# ------------------------------------------------------------ the supervision's waits
class _QuietMonitor:
    def silent_ranks(self, stall_s):
        return []

    def stuck_report(self, stuck_s):
        return ""


def _supervise_in_thread(child, **kwargs) -> threading.Thread:
    from hvdkit.launch import processes

    t = threading.Thread(
        target=lambda: processes.supervise(child, _QuietMonitor(), 60, [], **kwargs), daemon=True
    )
    t.start()
    return t


def _child_waiting_for(path) -> subprocess.Popen:
    return subprocess.Popen(["sh", "-c", f'while [ ! -e "{path}" ]; do sleep 0.01; done; exit 3'])


def test_supervise_sees_its_childs_exit_without_waiting_for_the_next_poll(tmp_path):
    # An hour between looks: only the child's exit (its pidfd) can end the wait.
    gate, ticks = tmp_path / "gate", []

    def tick():
        ticks.append(1)
        gate.touch()  # the child may exit now, while supervise waits its hour

    child = _child_waiting_for(gate)
    t = _supervise_in_thread(child, on_tick=tick, poll_s=3600)
    t.join(120)
    assert not t.is_alive(), "supervise waited for its poll, not for the child's exit"
    assert (child.returncode, len(ticks)) == (3, 1)


def test_supervise_looks_again_as_soon_as_a_tick_asks(tmp_path):
    gate, ticks = tmp_path / "gate", []

    def tick():
        ticks.append(1)
        if len(ticks) == 5:
            gate.touch()
        return 0.001  # the next look in 1 ms, not in an hour

    child = _child_waiting_for(gate)
    t = _supervise_in_thread(child, on_tick=tick, poll_s=3600)
    t.join(120)
    assert not t.is_alive()
    assert child.returncode == 3 and len(ticks) >= 5


class _StoppingMonitor:
    """One rank (``pid``): silent for 31 s (``stalled``), else waiting in a collective too long."""

    def __init__(self, pid: int, stalled: bool):
        self.pid, self.stalled = pid, stalled

    def silent_ranks(self, stall_s):
        return [(0, 31.0)] if self.stalled else []

    def stuck_report(self, stuck_s):
        return "" if self.stalled else "ranks stuck in different collectives for more than 2 s"

    def local_pids(self):
        return {0: self.pid}


@pytest.mark.parametrize(
    "stalled, elastic, want",
    [(True, False, (-9, False)), (False, True, (-9, False)), (False, False, (75, True))],
    ids=["stalled", "stuck-elastic", "stuck-restarts-whole"],
)
def test_a_worker_kills_a_stalled_or_elastic_stuck_rank_without_a_sigterm(
    tmp_path, stalled, elastic, want
):
    # SIGTERM asks an hvdkit rank for a preemption: a frozen rank, or a stuck one of an
    # elastic job (a lost rank: the others go on), must never get one (it would note it
    # and exit 75). A stuck rank of a job that restarts whole gets the stop's SIGTERM,
    # as under hvdkitrun: its ranks may checkpoint a common step for the restart.
    from hvdkit.launch import processes, worker

    ready, termed = tmp_path / "ready", tmp_path / "termed"
    script = f'trap "touch {termed}; exit 75" TERM; touch {ready}; while :; do sleep 0.05; done'
    child = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    run = worker._ProgramRun(None, {"rank": 0}, [])
    run.child, run.monitor = child, _StoppingMonitor(child.pid, stalled)
    run.elastic = object() if elastic else None  # (only whether there is one counts here)
    for _ in range(12000):  # the trap is set: the child's SIGTERM would be seen
        if ready.exists() or child.poll() is not None:
            break
        time.sleep(0.01)
    ended = processes.supervise(child, run.monitor, 2.0, [], on_stop=run._on_stop)
    assert (child.returncode, termed.exists()) == want
    assert (bool(ended.stalled), bool(ended.stuck)) == (stalled, not stalled)


def test_a_wakeup_from_another_thread_ends_the_wait_and_is_cleared(tmp_path):
    from hvdkit.launch.wakeup import Wakeup

    gate, ticks, wake = tmp_path / "gate", [], Wakeup()
    woken_twice = threading.Event()

    def tick():
        ticks.append(1)
        if len(ticks) < 3:
            for _ in range(100_000):  # more sets than a pipe holds: never blocks
                wake.set()
        else:
            woken_twice.set()
            gate.touch()

    child = _child_waiting_for(gate)
    t = _supervise_in_thread(child, on_tick=tick, poll_s=3600, wake=wake)
    t.join(120)
    assert not t.is_alive() and woken_twice.is_set()
    # each wake was taken by one look: the third tick came from the second set, and the
    # wait after it ended with the child, not with a wake left over
    assert (child.returncode, len(ticks)) == (3, 3)
    wake.close()


def test_the_handover_awaits_ready_for_a_join_and_for_each_new_world(tmp_path, monkeypatch):
    from hvdkit._comm import meeting
    from hvdkit.launch.handover import ElasticHandover

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    first = ElasticHandover({"rank": 0, "round": 0}, {})
    assert not first.awaits_ready()  # a first round says nothing before Horovod starts
    first.hand_over({"rank": 0, "size": 3, "round": 2, "lost": True}, {})
    assert first.awaits_ready()
    meeting.write(first.folder, meeting.READY, "1")  # an older round's ready
    assert first.newly_ready() == 1 and first.awaits_ready()
    meeting.write(first.folder, meeting.READY, "2")
    assert first.newly_ready() == 2 and not first.awaits_ready()
    joiner = ElasticHandover({"rank": 3, "round": 5, "join": True}, {})
    assert joiner.awaits_ready()
    meeting.write(joiner.folder, meeting.FINISHED, "5")
    assert joiner.newly_finished() == 5 and not joiner.awaits_ready()
    first.close()
    joiner.close()


def test_elastic_md_states_the_workers_look_while_its_program_is_to_say_ready():
    from pathlib import Path

    from hvdkit.launch import worker

    page = " ".join((Path(__file__).resolve().parents[2] / "docs/elastic.md").read_text().split())
    assert f"looks every {worker.READY_POLL_S * 1000:.0f} ms while its program is to" in page

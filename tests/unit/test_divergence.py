"""Stuck-rank reporting and the rank-local branches fixed for issue 10, in one process."""

from __future__ import annotations

import time

import pytest

from hvdkit import config
from hvdkit._comm import progress as _progress
from hvdkit.errors import ConfigurationError
from hvdkit.launch import heartbeat
from hvdkit.launch.heartbeat import HeartbeatMonitor, RankStatus
from hvdkit.launch.rounds import Event, Registration, Report
from hvdkit.launch.scheduler import _exit_report

REG = Registration(None, "127.0.0.1", "vm", 100, rank=0, round=1)  # whose exit it is


# ------------------------------------------------------------------ what a rank reports
def test_progress_reports_the_oldest_collective_waited_in():
    done = _progress.status()[_progress.COMPLETED]
    outer = _progress.enter("gradient allreduce", step=12)
    time.sleep(0.01)
    inner = _progress.enter("grouped_allreduce #3")
    s = _progress.status()
    assert s[_progress.WAITING] == "gradient allreduce (step 12)"
    assert s[_progress.WAITED_S] >= 0.0
    _progress.leave(inner)
    _progress.leave(outer)
    s = _progress.status()
    assert _progress.WAITING not in s
    assert s[_progress.COMPLETED] == done + 2
    _progress.leave(outer)  # a second leave of the same token counts nothing
    assert _progress.status()[_progress.COMPLETED] == done + 2


# ------------------------------------------------------------------ what the launcher decides
@pytest.fixture
def monitor():
    m = HeartbeatMonitor("token")
    yield m
    m.close()


def beat(monitor, rank, finished=False, **info):
    monitor.ranks[rank] = RankStatus(
        pid=100 + rank, host="h", last_seen=time.monotonic(), finished=finished, info=info
    )


def test_ranks_in_different_collectives_are_named(monitor):
    beat(monitor, 0, cc=10, w="gradient allreduce (step 3)", ws=25.0)
    beat(monitor, 1, cc=11, w="allreduce 'extra'", ws=24.0)
    report = monitor.stuck_report(20)
    assert report.startswith("ranks stuck in different collectives for more than 20 s: ")
    assert "rank 0 waits in gradient allreduce (step 3) for 25 s" in report
    assert "rank 1 waits in allreduce 'extra' for 24 s" in report


def test_rank_outside_any_collective_is_named(monitor):
    beat(monitor, 0, cc=7)
    beat(monitor, 1, cc=8, w="gradient allreduce (step 3)", ws=24.0)
    assert monitor.stuck_report(20) == ""  # within the grace that lets silence win
    beat(monitor, 1, cc=8, w="gradient allreduce (step 3)", ws=21.0 + heartbeat.STUCK_GRACE_S)
    report = monitor.stuck_report(20)
    assert "rank 0 is in no hvdkit collective (busy in its own code; 7 done)" in report
    assert "rank 1 waits in gradient allreduce (step 3) for 26 s" in report


def test_waits_shorter_than_the_timeout_and_finished_ranks_are_no_stall(monitor):
    beat(monitor, 0, cc=7)
    beat(monitor, 1, cc=8, w="gradient allreduce (step 3)", ws=5.0)
    assert monitor.stuck_report(20) == ""
    beat(monitor, 1, finished=True, cc=8, w="allreduce 'x'", ws=500.0)  # said bye
    assert monitor.stuck_report(20) == ""


def test_a_silent_rank_is_frozen_not_stuck(monitor):
    # a SIGSTOPped rank's last report said "waiting"; its silence, not that
    # report, is the cause (silent_ranks names it once the timeout passes)
    beat(monitor, 0, cc=9, w="gradient allreduce (step 7)", ws=25.0)
    beat(monitor, 1, cc=8, w="gradient allreduce (step 6)", ws=0.5)
    monitor.ranks[1].last_seen -= 15.0
    assert monitor.stuck_report(20) == ""
    assert monitor.silent_ranks(20) == []
    monitor.ranks[1].last_seen -= 10.0
    assert [r for r, _ in monitor.silent_ranks(20)] == [1]


# ------------------------------------------------------------------ rank-local branches
@pytest.mark.parametrize("value", ["two", "2.0", "0", "-1"])
def test_malformed_launcher_size_is_refused(monkeypatch, value):
    # Before: a malformed size fell back to a job of size 1, every rank alone.
    for var in config.LAUNCHER_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(config.OMPI_SIZE, value)
    with pytest.raises(ConfigurationError, match=f"OMPI_COMM_WORLD_SIZE='{value}'"):
        config.launched_size()


def test_well_formed_launcher_size(monkeypatch):
    for var in config.LAUNCHER_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    assert config.launched_size() is None
    monkeypatch.setenv(config.HOROVOD_SIZE, "4")
    assert config.launched_size() == 4


def test_doings_name_every_live_rank(monitor):
    beat(monitor, 0, cc=7)
    beat(monitor, 1, cc=8, w="gradient allreduce (step 3)", ws=30.0)
    beat(monitor, 2, finished=True, cc=9)
    assert monitor.doings() == {
        0: "is in no hvdkit collective (busy in its own code; 7 done)",
        1: "waits in gradient allreduce (step 3) for 30 s",
    }


def test_a_worker_answers_describe_for_its_running_round_only(monitor):
    # The scheduler asks every worker what its ranks do when one reports stuck
    # ranks: a worker's monitor sees only the ranks on its own machine.
    import socket

    from hvdkit.launch import protocol
    from hvdkit.launch.worker import _Inbox, _Running

    beat(monitor, 0, cc=7)
    a, b = socket.socketpair()
    sched, worker = protocol.Channel(a), protocol.Channel(b)
    inbox = _Inbox(worker)
    running = _Running(2, [], monitor)
    reasons = running.reasons
    inbox.running(running)
    sched.send(type="preempt", round=1, reason="old")  # an earlier round's: ignored
    sched.send(type="describe", round=1)  # an earlier round: no answer
    sched.send(type="preempt", round=2, reason="the scheduler received SIGTERM")
    sched.send(type="describe", round=2)
    answer = sched.recv(deadline=time.monotonic() + 60)
    assert answer == {
        "type": "state",
        "round": 2,
        "ranks": {"0": "is in no hvdkit collective (busy in its own code; 7 done)"},
    }
    inbox.running(None)
    sched.send(type="describe", round=2)  # the round ended: no answer, nothing queued
    sched.send(type="done", code=0)
    assert inbox.next() == {"type": "done", "code": 0}
    assert reasons == []
    assert running.preempt == ["the scheduler received SIGTERM"]  # read before the answer
    a.close()
    b.close()


@pytest.mark.parametrize(
    "msg",
    [
        {"type": "state", "round": "1", "ranks": {"0": "x"}},
        {"type": "state", "round": 1, "ranks": ["x"]},
        {"type": "state", "round": 1, "ranks": {"zero": "x", "-1": "y"}},
    ],
)
def test_a_malformed_state_answer_is_ignored(msg):
    from hvdkit.launch.scheduler import Scheduler

    sched = Scheduler("127.0.0.1", 0, 1, "token", 10)
    try:
        sched._record_doings(msg)
        sched._record_doings({"type": "state", "round": 1, "ranks": {"1": "waits in x for 3 s"}})
        assert sched._doings == {1: {1: "waits in x for 3 s"}}
    finally:
        sched.door.sock.close()


@pytest.mark.parametrize(
    "msg",
    [
        {"type": "exit", "code": "not a number", "round": 0},
        {"type": "exit", "code": None, "tail": 5},
        {"type": "exit", "code": [1], "tail": "x"},
    ],
)
def test_malformed_exit_report_is_a_failure_not_a_dead_listener(msg):
    # Before: int(msg["code"]) raised in the listener thread, which died, and
    # the scheduler waited for this worker forever.
    report = _exit_report(REG, msg)
    assert report.code == -1 and report.event is Event.FAILED
    assert "malformed exit report" in report.detail
    assert isinstance(report.tail, tuple)


def test_well_formed_exit_report():
    msg = {"type": "exit", "code": 3, "detail": "exit code 3", "round": 1, "tail": ["a", "b"]}
    assert _exit_report(REG, msg) == Report(REG, 1, 3, "exit code 3", ("a", "b"))


# ------------------------------------------------------------------ the goodbye datagram
@pytest.mark.parametrize(
    ("how", "bye"),
    [("clean", True), ("exit0", True), ("exit3", False), ("exit_text", False), ("raised", False)],
)
def test_bye_only_at_a_clean_exit(monkeypatch, how, bye):
    # a rank that fails must not say goodbye: the launcher would take it for
    # one that finished, and blame the ranks that then lost it
    import sys

    monkeypatch.setattr(sys, "excepthook", lambda *a: None)
    monkeypatch.setattr(sys, "exit", lambda status=None: None)
    sent = []
    at_exit = heartbeat._bye_if_clean_exit(lambda **extra: sent.append(extra))
    if how == "exit0":
        sys.exit(0)
    elif how == "exit3":
        sys.exit(3)
    elif how == "exit_text":
        sys.exit("fatal: no data")
    elif how == "raised":
        sys.excepthook(RuntimeError, RuntimeError("x"), None)
    at_exit()
    assert sent == ([{"bye": True}] if bye else [])

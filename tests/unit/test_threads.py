"""Horovod's threads ahead of TensorFlow's compute (hvdkit/_comm/threads.py): which, what policy.

The multi-process side (the threads Horovod starts get SCHED_RR under Gloo,
never under MPI) is checked in tests/multiproc/overlap_worker.py.
"""

from __future__ import annotations

import ctypes
import os
import threading

import pytest

from hvdkit import config
from hvdkit._comm import threads as _threads
from hvdkit.errors import ConfigurationError

PR_SET_NAME = 15


class Parked:
    """A thread that names itself and waits until released; its kernel id in ``tid``."""

    def __init__(self, name: str | None = None):
        self.ready, self.release = threading.Event(), threading.Event()
        self.name = name
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        if self.name:
            ctypes.CDLL(None).prctl(PR_SET_NAME, self.name.encode(), 0, 0, 0)
        self.tid = threading.get_native_id()
        self.ready.set()
        self.release.wait(60)

    def __enter__(self):
        self.thread.start()
        self.ready.wait(60)
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.thread.join(60)


def test_threads_started_since_a_snapshot_leave_out_tensorflows():
    before = _threads.thread_ids()
    assert threading.get_native_id() in before
    with Parked("gloo_loop") as comm, Parked("tf_Compute") as compute, Parked() as plain:
        got = _threads.started_since(before)
    assert comm.tid in got and got[comm.tid] == "gloo_loop"
    assert plain.tid in got
    assert compute.tid not in got
    assert threading.get_native_id() not in got


permitted = os.geteuid() == 0


@pytest.mark.skipif(not permitted, reason="NOT TESTED here: SCHED_RR needs root (CI runs as root)")
def test_favour_gives_sched_rr_and_unfavour_takes_it_back():
    with Parked() as comm, Parked() as bystander:
        said = _threads.favour([comm.tid])
        assert said == "SCHED_RR priority 1 for 1 of Horovod's threads"
        assert os.sched_getscheduler(comm.tid) == os.SCHED_RR
        assert os.sched_getparam(comm.tid).sched_priority == _threads.PRIORITY
        assert os.sched_getscheduler(bystander.tid) == os.SCHED_OTHER
        assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER
        _threads.unfavour([comm.tid])
        assert os.sched_getscheduler(comm.tid) == os.SCHED_OTHER


def test_threads_that_ended_are_skipped(monkeypatch):
    def gone(tid, policy, param):
        raise ProcessLookupError(3, "No such process")

    monkeypatch.setattr(os, "sched_setscheduler", gone)
    assert _threads.favour([11, 12]) == "SCHED_RR priority 1 for 0 of Horovod's threads"
    _threads.unfavour([11, 12])  # no error either


def test_favour_without_permission_changes_nothing_and_says_why(monkeypatch):
    calls = []

    def refuse(tid, policy, param):
        calls.append(tid)
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    said = _threads.favour([11, 12])
    assert calls == [11]  # the first refusal stops the attempt
    assert "not permitted" in said and "ulimit -r" in said and "CAP_SYS_NICE" in said


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(None, None), ("", None), ("1", "1"), ("0", "0"), ("auto", "auto"), (" auto ", "auto")],
)
def test_comm_priority_setting(monkeypatch, raw, expected):
    # None: unset, the backend picks auto across hosts and 0 on one machine
    if raw is None:
        monkeypatch.delenv(config.COMM_PRIORITY, raising=False)
    else:
        monkeypatch.setenv(config.COMM_PRIORITY, raw)
    assert config.comm_priority() == expected


@pytest.mark.parametrize("raw", ["yes", "2", "on", "true", "AUTO"])
def test_comm_priority_refuses_anything_but_0_1_or_auto(monkeypatch, raw):
    monkeypatch.setenv(config.COMM_PRIORITY, raw)
    with pytest.raises(ConfigurationError) as info:
        config.comm_priority()
    said = str(info.value)
    assert said.startswith(f"HVDKIT_COMM_PRIORITY={raw!r} is not 0, 1 or auto; auto (the"), said

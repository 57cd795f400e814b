"""The Checkpointer's save schedule alone (hvdkit/fault/_save_schedule.py): its two pure
decisions, and the schedule's state in a size-1 runtime with a hand-driven clock.

The Checkpointer's use of it (saves at those steps, the broadcast of rank 0's decision) is
in tests/unit/test_checkpoint.py and tests/test_checkpoint_mp.py.
"""

from __future__ import annotations

import time

import pytest

from hvdkit.errors import ConfigurationError
from hvdkit.fault._save_schedule import SaveSchedule, steps_due, time_due


def test_steps_due_when_a_multiple_lies_between_the_last_step_and_this_one():
    every = 5
    due = [step for step in range(1, 21) if steps_due(every, step - 1, step)]
    assert due == [5, 10, 15, 20]
    # a sink of 3 steps at a time: 3, 6, 9, ... crosses 5 at 6, 10 at 12 (9 -> 12), 15 at 15
    sinks = [s for s in range(3, 22, 3) if steps_due(every, s - 3, s)]
    assert sinks == [6, 12, 15, 21]
    assert not steps_due(every, 10, 10)  # the same step twice: saved once


@pytest.mark.parametrize(
    ("now", "last_save", "rate", "expected"),
    [
        (70.0, 0.0, 5.0, (True, 80)),  # 60 s passed; 5 steps/s: 30 steps = 6 s ahead
        (30.0, 0.0, 5.0, (False, 80)),
        (70.0, 0.0, 0.01, (True, 51)),  # slower than a step per decision: the next step
        (70.0, 0.0, 1000.0, (True, 6050)),
    ],
)
def test_time_due_decides_about_ten_times_per_interval(now, last_save, rate, expected):
    check_time = now - 2.0  # the last decision 2 s ago, `rate` steps/s since
    check_step = 50 - round(rate * 2.0)
    assert time_due(60.0, 50, now, last_save, check_step, check_time) == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(every_steps=0), "every_steps=0 must be a positive number"),
        (dict(every_steps=1.5), "every_steps=1.5 must be a positive number"),
        (dict(every_seconds=0), "every_seconds=0 must be a positive number"),
        (dict(every_seconds="1"), "every_seconds='1' must be a positive number"),
    ],
)
def test_a_bad_interval_is_refused_naming_it(kwargs, message):
    args = {"every_steps": None, "every_seconds": None, **kwargs}
    with pytest.raises(ConfigurationError, match=message):
        SaveSchedule(**args)


@pytest.fixture
def clock(monkeypatch):
    """time.monotonic under the test's control: ``clock[0]`` seconds."""
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    return now


def test_every_seconds_saves_once_the_interval_passed_and_restart_counts_anew(local_runtime, clock):
    schedule = SaveSchedule(None, 10.0)
    saves = []
    for step in range(1, 62):  # one step per 0.5 s
        clock[0] += 0.5
        if schedule.due(step):
            saves.append(step)
            schedule.saved()
    # decisions at step 1, then 2 steps/s * 10 s / 10 = 2 steps apart: the odd steps;
    # the first odd step 10 s after the last save (or the start) saves
    assert saves == [21, 41, 61]
    schedule.restart(100)  # a restore at step 100: counts from now
    clock[0] += 9.5
    assert not schedule.due(101)
    clock[0] += 0.5
    assert schedule.due(102)


def test_every_steps_and_every_seconds_together(local_runtime, clock):
    schedule = SaveSchedule(4, 3600.0)
    assert [s for s in range(1, 13) if schedule.due(s)] == [4, 8, 12]
    schedule.restart(6)  # after a restore at step 6, the next multiple is 8
    assert [s for s in range(7, 13) if schedule.due(s)] == [8, 12]

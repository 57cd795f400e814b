"""HVDKIT_COMM_PRIORITY=auto's trial (hvdkit._comm.priority_trial) on a simulated job, no clock.

The simulated job takes steps whose length depends on the setting in force
when each step begins; the trial's waits advance the simulated time.
"""

from __future__ import annotations

import re
import threading

import pytest

from hvdkit._comm import priority_trial as pt


class Job:
    """Training steps of ``off_s``/``on_s`` seconds, the threads favoured or not."""

    def __init__(self, off_s: float, on_s: float, pause_in_window: int | None = None):
        self.off_s, self.on_s = off_s, on_s
        self.t = 0.0
        self.favoured = False
        self.switches: list[bool] = []
        self.done = 0
        self.step_ends = None  # no step traced yet
        self.pause_in_window = pause_in_window  # a 30 s pause inside this window (0-based)
        self.lines: list[str] = []

    def steps(self):
        if self.t >= 0.5 and self.step_ends is None:  # traced: the counter exists
            self.step_ends = self.t + self._length()
        if self.step_ends is None:
            return None
        while self.t >= self.step_ends:
            self.done += 1
            self.step_ends += self._length()
        return self.done

    def _length(self) -> float:
        pause = 0.0
        if self.pause_in_window is not None and len(self.switches) == self.pause_in_window + 2:
            pause, self.pause_in_window = 30.0, None  # (+2: the permission probe's switches)
        return pause + (self.on_s if self.favoured else self.off_s)

    def favour(self) -> str:
        self.favoured = True
        self.switches.append(True)
        return "SCHED_RR priority 1 for 3 of Horovod's threads"

    def unfavour(self) -> None:
        self.favoured = False
        self.switches.append(False)

    def wait(self, seconds: float) -> bool:
        self.t += seconds
        return False

    def trial(self, **kw) -> pt.PriorityTrial:
        return pt.PriorityTrial(
            self.steps,
            favour=kw.get("favour", self.favour),
            unfavour=self.unfavour,
            report=self.lines.append,
            clock=lambda: self.t,
            wait=self.wait,
        )


@pytest.mark.parametrize(
    ("off_s", "on_s", "kept"),
    [
        (0.416, 0.397, True),  # 4.6 % faster with SCHED_RR (overlap.py at 1 Gbit/s): kept
        (0.300, 0.295, False),  # 1.7 % faster: within the margin, the normal policy
        (0.416, 0.370, True),  # 11 % faster: kept
        (0.252, 0.277, False),  # 10 % slower (a core-bound link): the normal policy
        (0.300, 0.300, False),  # a tie keeps Horovod's own policy
        (0.010, 0.009, True),  # short steps: the windows last a second, not four steps
    ],
)
def test_the_faster_setting_is_kept_and_the_windows_time_each_step(off_s, on_s, kept):
    job = Job(off_s, on_s)
    trial = job.trial()
    trial.run()
    want_kept = on_s < off_s * (1 - pt.MARGIN)
    assert kept == want_kept  # the table's own arithmetic, against the margin
    assert trial.decision is kept and job.favoured is kept
    # the permission probe (on, off), the six windows, then the decision
    assert job.switches == [True, False, *pt.ORDER, kept]
    assert [f for f, _ in trial.windows] == list(pt.ORDER)
    for favoured, per_step in trial.windows:  # each window's steps, within the poll's error
        assert per_step == pytest.approx(on_s if favoured else off_s, rel=0.01)
    assert len(job.lines) == 1 and job.lines[0].startswith(
        "auto: SCHED_RR kept for Horovod's threads: " if kept else "auto: normal policy kept: "
    ), job.lines
    said = re.fullmatch(
        r"auto: .*: ([\d.]+) ms per step with SCHED_RR, ([\d.]+) ms without "
        rf"\(median of {pt.ROUNDS} windows each\)",
        job.lines[0],
    )
    assert said, job.lines
    assert float(said[1]) == pytest.approx(on_s * 1e3, rel=0.01), job.lines
    assert float(said[2]) == pytest.approx(off_s * 1e3, rel=0.01), job.lines


def test_warm_up_steps_are_not_timed():
    job = Job(0.3, 0.3)
    trial = job.trial()
    trial.run()
    # the first window begins after the warm-up and one more (the step in flight)
    timed = sum(1 for _ in trial.windows)
    assert timed == len(pt.ORDER)
    assert job.done >= pt.WARMUP_STEPS + len(pt.ORDER) * (pt.MIN_WINDOW_STEPS + 1)


@pytest.mark.parametrize("window", [1, 2, 5])  # an "on" window each: 2, 5; "on" then: 1
def test_one_pause_in_a_window_does_not_decide(window):
    # evaluation or a checkpoint stalls the steps of one window for 30 s
    job = Job(0.416, 0.370, pause_in_window=window)
    trial = job.trial()
    trial.run()
    slow = [s for s in (s for _, s in trial.windows) if s > 1.0]
    assert len(slow) == 1, trial.windows  # the pause landed in one window
    assert trial.decision is True and job.favoured


def test_without_permission_nothing_is_tried():
    job = Job(0.4, 0.1)
    said = "Horovod's threads keep the normal policy: setting SCHED_RR was not permitted (...)"
    trial = job.trial(favour=lambda: said)
    trial.run()
    assert trial.decision is False and trial.windows == [] and job.t == 0.0
    assert job.lines == [f"auto: {said}"]


def test_a_stopped_trial_ends_and_reports_nothing():
    job = Job(0.4, 0.3)
    trial = job.trial()
    trial.stop()  # Horovod shut down before the first step
    trial.run()
    assert trial.decision is None and trial.windows == [] and job.lines == []
    assert job.switches == [False]  # stop() put them back; nothing was tried


def test_a_trial_stopped_in_a_favoured_window_puts_the_threads_back():
    job = Job(0.4, 0.3)
    trial = job.trial()
    real_wait = job.wait

    def wait(seconds):  # Horovod shuts down in the first window with SCHED_RR
        if job.switches[-1] and len(trial.windows) == 1:
            trial.stop()
        return real_wait(seconds)

    trial.wait = wait
    trial.run()
    assert trial.decision is None and [f for f, _ in trial.windows] == [False]
    assert job.switches == [True, False, False, True, False]  # probe, window 1, 2, stop
    assert job.lines == []


def test_stop_waits_for_the_trials_thread_and_has_the_last_switch():
    """Threaded: no switch of the trial's thread comes after stop() returned."""
    job = Job(0.4, 0.3)
    trial = job.trial()
    in_window = threading.Event()
    release = threading.Event()
    real_wait = job.wait

    def wait(seconds):  # the thread pauses in its first SCHED_RR window until released
        if job.switches[-1] and trial.windows:
            in_window.set()
            release.wait()
        return real_wait(seconds)

    trial.wait = wait
    trial.start()
    assert in_window.wait(60)
    release.set()  # the thread may now switch again, unless stop() came first
    trial.stop()
    after_stop = list(job.switches)
    assert after_stop[-1] is False and not trial._thread.is_alive()
    assert job.switches == after_stop and trial.decision is None


def test_the_order_has_each_setting_rounds_times_and_starts_without_it():
    assert pt.ORDER.count(True) == pt.ORDER.count(False) == pt.ROUNDS
    assert pt.ORDER[0] is False and pt.ORDER[-1] is True

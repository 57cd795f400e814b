"""``HVDKIT_COMM_PRIORITY=auto``: try Horovod's threads first, keep whichever trains faster.

Horovod's threads on ``SCHED_RR`` (:mod:`hvdkit._comm.threads`) hide more of the
gradient allreduce where the wire bounds it and cost steps where the core
does (``benchmarks/overlap.py``, one core per simulated host: 0.89-0.95x the
step at 1 Gbit/s, 1.06-1.10x at 10 Gbit/s). Which one a job has is not known
before it trains, so a :class:`PriorityTrial` measures it on the job's own
steps: after :data:`WARMUP_STEPS` it times windows of training steps (each at
least :data:`MIN_WINDOW_STEPS` steps and :data:`MIN_WINDOW_S` seconds), the
threads on the normal policy and on ``SCHED_RR`` in turn, :data:`ROUNDS` of
each in the order off, on, on, off, off, on (drift in the machine's load
weighs on both alike), and keeps ``SCHED_RR`` only if its median window is
at least :data:`MARGIN` faster. Ties keep the normal policy, Horovod's own.

The steps are counted by the gradient allreduce's progress marker
(:mod:`hvdkit._comm.graph_progress`), read from the trial's thread: ``fit``,
``hvdkit.sink`` and custom ``tf.function`` loops are measured alike, with no
call in the step. The first step after a switch is not timed (it ran partly
under the other setting). Each rank decides from its own clock; all ranks
switch at the same step counts, so they time the same windows of the same
job. A pause in training (evaluation, a checkpoint) lengthens one window; the
median of three keeps it from deciding.

No TensorFlow here: the step counter, the clock and the two settings are
given.

Example::

    trial = PriorityTrial(steps_done, favour=on, unfavour=off, report=print)
    trial.start()          # a daemon thread; the report says what was kept, and why
    ...
    trial.stop()           # Horovod shuts down: the threads go back to the normal policy
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["PriorityTrial", "ORDER"]

WARMUP_STEPS = 5  # the first steps trace and warm up: not timed
MIN_WINDOW_STEPS = 4
MIN_WINDOW_S = 1.0  # with POLL_S, the window's ends are found within 0.5 % of it
ORDER = (False, True, True, False, False, True)  # off, on, on, off, off, on: ROUNDS of each
ROUNDS = ORDER.count(True)
MARGIN = 0.03  # SCHED_RR must be this much faster: ties keep the normal policy
POLL_S = 0.005  # inside a window
IDLE_POLL_S = 0.05  # before the first step and during the warm-up: nothing is timed yet
STOP_JOIN_S = 5.0  # the trial's thread ends within a poll once stopped; this only bounds a bug


@dataclass
class PriorityTrial:
    """Time training steps with Horovod's threads favoured and not; keep the faster.

    Args:
        steps: the number of training steps done so far, or None before the
            first one was traced (``hvdkit._comm.graph_progress.steps_done``).
        favour: put Horovod's threads on ``SCHED_RR``; returns a line saying
            what happened (``"... not permitted ..."`` ends the trial).
        unfavour: put them back on the normal policy.
        report: called once with the decision's line.
        clock, wait: time source and a sleep that returns early once the
            trial is stopped (tests give simulated ones).
    """

    steps: Callable[[], int | None]
    favour: Callable[[], str]
    unfavour: Callable[[], None]
    report: Callable[[str], None]
    clock: Callable[[], float] = time.monotonic
    wait: Callable[[float], bool] | None = None
    windows: list[tuple[bool, float]] = field(default_factory=list)  # (favoured, s per step)
    decision: bool | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self):
        if self.wait is None:
            self.wait = self._stop.wait

    def start(self) -> threading.Thread:
        self._thread = threading.Thread(target=self.run, name="hvdkit-priority-trial", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        """End the trial where it is (Horovod shuts down) and put the threads back.

        Whatever the trial was trying or had kept, the threads end on the normal
        policy: Gloo's socket loops outlive Horovod's shutdown (an elastic job
        starts new ones in each world), and one left on ``SCHED_RR`` would keep it
        for the life of the process. The trial's thread is waited for first, so
        no switch of its comes after this one.
        """
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(STOP_JOIN_S)
        self.unfavour()

    def run(self) -> None:
        """The whole trial; returns when decided, refused or stopped."""
        if self._stop.is_set():
            return
        said = self.favour()
        if "not permitted" in said:
            self.decision = False
            self.report(f"auto: {said}")
            return
        self.unfavour()
        first = self._step_after(None, IDLE_POLL_S)
        if first is None or self._step_after(first + WARMUP_STEPS - 1, IDLE_POLL_S) is None:
            return
        for favoured in ORDER:
            (self.favour if favoured else self.unfavour)()
            per_step = self._window()
            if per_step is None:
                return
            self.windows.append((favoured, per_step))
        on = statistics.median(s for f, s in self.windows if f)
        off = statistics.median(s for f, s in self.windows if not f)
        self.decision = on < off * (1 - MARGIN)
        (self.favour if self.decision else self.unfavour)()
        kept = "SCHED_RR kept for Horovod's threads" if self.decision else "normal policy kept"
        self.report(
            f"auto: {kept}: {on * 1e3:.1f} ms per step with SCHED_RR, {off * 1e3:.1f} ms "
            f"without (median of {ROUNDS} windows each)"
        )

    def _step_after(self, count: int | None, poll_s: float = POLL_S) -> int | None:
        """Wait until the counter exists and passes ``count``; the count seen, None if stopped."""
        while not self._stop.is_set():
            now = self.steps()
            if now is not None and (count is None or now > count):
                return now
            self.wait(poll_s)
        return None

    def _window(self) -> float | None:
        """Seconds per step over one window, from the first step that began after the switch."""
        begin = self._step_after(self.steps())  # the step in flight ran partly before it
        if begin is None:
            return None
        t0 = self.clock()
        count = begin
        while True:
            count = self._step_after(count)
            if count is None:
                return None
            elapsed = self.clock() - t0
            if count - begin >= MIN_WINDOW_STEPS and elapsed >= MIN_WINDOW_S:
                return elapsed / (count - begin)

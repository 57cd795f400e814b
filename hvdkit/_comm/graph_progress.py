"""Progress markers of the gradient allreduce inside the graph, without a Python call.

A rank stuck in its gradient allreduce must be named by the launcher
(:mod:`hvdkit._comm.progress`). The allreduce runs inside ``tf.function``, so the
markers are graph ops. They update three int64 variables on the CPU (entries,
exits, the step of the last entry); the heartbeat thread reads them each time
it builds a status (once a second) through the probe registered here, so a
wait is timed from the first status that sees it. A
``tf.numpy_function`` marker would take the GIL twice per step: measured at a
median 1.05x, and up to 1.29x, of a small model's step time
(docs/performance.md).

    token = waiting(step)           # before the allreduce; ``step`` may be None
    ... allreduce, its inputs depending on ``token`` ...
    done(token, reduced)            # after it
"""

from __future__ import annotations

import threading
import time

import tensorflow as tf

from . import progress as _progress

WHAT = "gradient allreduce"
_lock = threading.Lock()
_counters: tuple[tf.Variable, tf.Variable, tf.Variable] | None = None


class _Probe:
    """Reads the counters for :func:`hvdkit._comm.progress.status` (heartbeat thread)."""

    def __init__(self, counters):
        self._counters = counters
        self._last = (0, 0, -1)
        self._since: tuple[int, float] = (0, 0.0)  # (entry count, first seen in it)
        self._lag = 0  # entries that failed (forget): they never count as left

    def _read(self) -> tuple[int, int, int]:
        try:
            self._last = tuple(int(v.numpy()) for v in self._counters)
        except Exception:  # TensorFlow shutting down at exit: keep the last reading
            pass
        return self._last

    def forget(self) -> None:
        """Horovod was shut down (:func:`hvdkit._comm.progress.forget_waits`): the allreduces
        entered so far failed, and will never be left. A wait that no status saw before
        would otherwise be timed from the first status after, and grow while the rank
        rejoins."""
        entered, left, _ = self._read()
        self._lag = entered - left

    def __call__(self) -> tuple[int, list[tuple[str, float]]]:
        entered, left, step = self._read()
        if entered - self._lag <= left:
            if entered <= left:
                self._lag = 0
            return left, []
        if self._since[0] != entered:  # a new allreduce: its wait starts now (within a beat)
            self._since = (entered, time.monotonic())
        return left, [(_progress.label(WHAT, None if step < 0 else step), self._since[1])]


def _variables() -> tuple[tf.Variable, tf.Variable, tf.Variable]:
    global _counters
    with _lock:
        if _counters is None:
            with tf.init_scope(), tf.device("/CPU:0"):
                _counters = tuple(
                    tf.Variable(value, dtype=tf.int64, trainable=False, name=f"hvdkit_{name}")
                    for name, value in (("entered", 0), ("left", 0), ("step", -1))
                )
            _progress.add_probe(_Probe(_counters))
        return _counters


def steps_done() -> int | None:
    """Gradient allreduces this process finished so far; None before the first was built.

    Read from other threads (the heartbeat's probe, :mod:`hvdkit._comm.priority_trial`).
    """
    counters = _counters
    if counters is None:
        return None
    try:
        return int(counters[1].numpy())
    except Exception:  # TensorFlow shutting down at exit
        return None


def waiting(step) -> tf.Tensor:
    """Graph op: the gradient allreduce (of ``step``, or ``None``) starts now. Returns a token."""
    entered, _, step_var = _variables()
    step = tf.constant(-1, tf.int64) if step is None else tf.cast(step, tf.int64)
    with tf.device("/CPU:0"):
        with tf.control_dependencies([step_var.assign(step)]):
            return entered.assign_add(1)


def done(token: tf.Tensor, reduced: list) -> tf.Tensor:
    """Graph op: the allreduce started at ``token`` has produced every tensor of ``reduced``."""
    _, left, _ = _variables()
    with tf.device("/CPU:0"), tf.control_dependencies([token, *reduced]):
        return left.assign_add(1)

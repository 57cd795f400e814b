"""The loop sink: ``sink_size`` steps per host call, in one ``tf.function``.

A sink runs its steps in a ``tf.while_loop`` over a dataset iterator. Inside
the loop each step records, in two host counters, that its batch arrived and
that its step finished; that is how an error is pinned to a step and blamed
on the input pipeline or on the step. The time each step waits for its batch
is summed per call and compared with the call's wall time, to warn when the
input pipeline is slower than training.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from .. import _compat, runtime
from .._validate import check_int, is_int
from ..errors import ConfigurationError, InputPipelineError

# A sink that spent at least this fraction of its wall time, and at least
# SLOW_INPUT_MIN_SECONDS, waiting for batches triggers a SlowInputWarning;
# repeated at most once a minute. The floor keeps toy steps of microseconds,
# where reading any batch costs as much as the step, from warning.
SLOW_INPUT_FRACTION = 0.2
SLOW_INPUT_MIN_SECONDS = 0.02
SLOW_INPUT_REPEAT_SECONDS = 60.0


class SlowInputWarning(UserWarning):
    """A sink spent a large part of its time waiting for the input pipeline.

    Silence it where that is expected::

        warnings.filterwarnings("ignore", category=hvdkit.sink.SlowInputWarning)
    """


class SinkLoop:
    """``sink_size`` steps of ``step_fn`` per call, in one ``tf.function`` over an iterator.

    Shared by :class:`DataSink` (which owns its iterator) and :func:`train`
    (Keras passes the iterator of its fit call).
    """

    def __init__(
        self,
        step_fn: Callable,
        sink_size: int,
        *,
        jit_compile: bool,
        autograph: bool,
        unpack: bool,
        return_all: bool = False,
        slow_input_fraction: float | None = SLOW_INPUT_FRACTION,
        counted_from: str = "since the sink was created",
    ):
        self.sink_size = sink_size
        self.return_all = return_all
        self.slow_input_fraction = slow_input_fraction
        self.counted_from = counted_from
        self.first_epoch: int | None = None  # set by train(): calls are epochs
        self.calls = 0
        self.steps_done = 0
        self.last_input_wait = 0.0
        self.last_wall_time = 0.0
        self._last_warning: float | None = None
        self._returns_none = False
        # Host counters that survive a failed call: batches fetched, steps finished.
        with tf.init_scope(), tf.device("/cpu:0"):
            self._fetched = tf.Variable(0, dtype=tf.int64, trainable=False)
            self._done = tf.Variable(0, dtype=tf.int64, trainable=False)

        def call_step(batch):
            out = step_fn(*batch) if unpack and isinstance(batch, tuple) else step_fn(batch)
            self._returns_none = out is None
            out = () if out is None else tf.nest.map_structure(tf.convert_to_tensor, out)
            # `finished` exists after the outputs; with a control dependency on
            # the call, which waits for its stateful ops (optimizer updates),
            # a step counts as done only when all of it is. Collectives are
            # not stateful ops: the outputs or the updates cover them. On the
            # host, so that reading it does not wait for a GPU stream to drain.
            flat_out = tf.nest.flatten(out, expand_composites=True)
            with tf.device("/cpu:0"), tf.control_dependencies(flat_out):
                finished = tf.identity(tf.constant(True))
            return out, finished

        # XLA, when asked for, compiles the step only: iterator ops have no XLA kernels.
        self._step = tf.function(call_step, jit_compile=jit_compile, autograph=autograph)
        # A closure, not the bound method: TensorFlow's retracing warning counts
        # traces per Python function, and every sink traces its own loop once.
        self._function = tf.function(
            lambda iterator: self._sink(iterator), autograph=False, reduce_retracing=True
        )

    def reset_counters(self) -> None:
        self._fetched.assign(0)
        self._done.assign(0)
        self.calls = self.steps_done = 0

    # ----------------------------------------------------------- graph
    def _one_step(self, iterator, i):
        with tf.control_dependencies([i]):
            t0 = tf.timestamp()
        with tf.control_dependencies([t0]):
            batch = iterator.get_next()
        with tf.control_dependencies(tf.nest.flatten(batch, expand_composites=True)):
            t1 = tf.timestamp()
            fetched = self._fetched.assign_add(1)
        with tf.control_dependencies([fetched]):
            out, finished = self._step(batch)
        with tf.control_dependencies([finished, fetched]):
            # Read `finished` as data: once TensorFlow inlines the call, a
            # control dependency on it waits only for the call's stateful ops.
            tick = self._done.assign_add(tf.cast(finished, tf.int64))
        return out, t1 - t0, tick

    def _sink(self, iterator):
        out, wait, tick = self._one_step(iterator, tf.constant(0))
        if self.return_all:
            out = tf.nest.map_structure(
                lambda t: tf.TensorArray(t.dtype, size=self.sink_size, infer_shape=False).write(
                    0, t
                ),
                out,
            )
        if self.sink_size > 1:

            def body(i, kept, wait):
                out, step_wait, tick = self._one_step(iterator, i)
                if self.return_all:
                    out = tf.nest.map_structure(lambda ta, t: ta.write(i, t), kept, out)
                with tf.control_dependencies([tick]):
                    return i + 1, out, wait + step_wait

            invariants = None
            if not self.return_all:
                # Shapes may change between steps (a last, partial batch).
                relax = lambda t: tf.TensorShape(
                    None if t.shape.rank is None else [None] * t.shape.rank
                )
                invariants = (tf.TensorShape([]), tf.nest.map_structure(relax, out), wait.shape)
            _, out, wait = tf.while_loop(
                lambda i, *_: i < self.sink_size,
                body,
                (tf.constant(1), out, wait),
                shape_invariants=invariants,
                parallel_iterations=1,
            )
        if self.return_all:
            out = tf.nest.map_structure(lambda ta: ta.stack(), out)
        return out, wait

    # ----------------------------------------------------------- host
    def __call__(self, iterator):
        started = time.perf_counter()
        try:
            out, wait = self._function(iterator)
        except tf.errors.OpError as exc:
            error = self._attribute(exc)
            if error is exc:
                raise
            raise error from exc
        self.last_wall_time = time.perf_counter() - started
        self.last_input_wait = float(wait)
        self.calls += 1
        self.steps_done += self.sink_size
        self._check_input_speed()
        return None if self._returns_none else out

    def _where(self, step: int) -> str:
        call = f"call {self.calls + 1}"
        if self.first_epoch is not None:
            call += f", epoch {self.first_epoch + self.calls + 1}"
        return (
            f"step {step} (0-based, counted {self.counted_from}), which is step "
            f"{step - self.steps_done + 1} of {self.sink_size} in {call}"
        )

    def _attribute(self, exc: tf.errors.OpError) -> BaseException:
        """The error to raise for ``exc``: an InputPipelineError, or ``exc`` with a note."""
        done, fetched = int(self._done.numpy()), int(self._fetched.numpy())
        where = self._where(done)
        earlier = done - self.steps_done
        self.calls += 1
        self.steps_done = done
        who, aftermath = "", ""
        if runtime.size() > 1:
            # The ranks run in lockstep: the others are blocked in this step's
            # collectives and would wait for this rank forever. Shutting the
            # runtime down makes their collectives fail at once instead.
            who = f"rank {runtime.rank()}: "
            aftermath = (
                " hvdkit shut this rank's runtime down, so that the other ranks' "
                "collectives fail at the same step instead of waiting; restart the job."
            )
            runtime.shutdown()
        if fetched > done:
            exc.add_note(f"hvdkit: {who}raised by the training step at {where}.{aftermath}")
            return exc
        if isinstance(exc, tf.errors.OutOfRangeError):
            cause = "the dataset produced no elements"
        else:
            cause = f"TensorFlow reported {type(exc).__name__}: {exc.message.strip()}"
        return InputPipelineError(
            f"{who}the input pipeline failed at {where}; the {earlier} step(s) before it "
            f"in this call were applied.{aftermath} {cause}\nFix the failing record or map "
            "function (the next call continues after the failed element), or skip bad "
            "records with dataset.ignore_errors() before batching.",
            step=done,
        )

    def _check_input_speed(self) -> None:
        # The first call includes tracing and the pipeline's start-up.
        if self.slow_input_fraction is None or self.calls < 2:
            return
        wait, wall = self.last_input_wait, self.last_wall_time
        if wait < SLOW_INPUT_MIN_SECONDS or wait < self.slow_input_fraction * wall:
            return
        now = time.monotonic()
        if self._last_warning is not None and now - self._last_warning < SLOW_INPUT_REPEAT_SECONDS:
            return
        self._last_warning = now
        who = f"rank {runtime.rank()}: " if runtime.size() > 1 else ""
        warnings.warn(
            SlowInputWarning(
                f"hvdkit: {who}the sink waited {wait:.3f} s for input data during "
                f"{self.sink_size} steps that took {wall:.3f} s ({100 * wait / wall:.0f}%): "
                "the input pipeline is slower than training. Speed it up: "
                "map(..., num_parallel_calls=tf.data.AUTOTUNE), cache() after decoding, "
                "hvdkit.sink.prefetch_to_device(...) as the last stage. (Repeated at most "
                f"once every {SLOW_INPUT_REPEAT_SECONDS:.0f} s.)"
            ),
            stacklevel=4,
        )


def check_sink_size(sink_size: Any, allow_whole: bool, fix: str) -> int:
    if allow_whole and is_int(sink_size) and sink_size == -1:
        return -1  # the whole dataset per epoch
    message = f"sink_size={sink_size!r} is not valid; {fix}"
    return check_int("sink_size", sink_size, minimum=1, message=message)


def resolve_jit(jit_compile: bool | None, what: str) -> bool:
    if jit_compile is None:
        return False
    if not isinstance(jit_compile, bool):
        raise ConfigurationError(
            f"{what}: jit_compile={jit_compile!r} must be True, False or None."
        )
    _compat.refuse_jit_in_job(
        what, jit_compile, runtime.size(), "Pass jit_compile=False (or None)."
    )
    return jit_compile

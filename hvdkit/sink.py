"""Sink mode: many training steps per host call, with the next batches already staged.

MindSpore's sink mode removes host round trips in three ways; hvdkit maps
each onto TensorFlow, on CPU and GPU, in one process or many:

===========  ==========================================  ===============================
MindSpore    what it does                                hvdkit
===========  ==========================================  ===============================
data sink    a device-side queue, filled while the       :func:`prefetch_to_device`, the
             current step runs                           last stage of a tf.data pipeline
graph sink   the whole step is one compiled graph        ``tf.function`` (every path below)
loop sink    ``sink_size`` steps per host call; the      :func:`data_sink` (functional),
             host loop and callbacks run once per sink   :func:`train` (Keras)
===========  ==========================================  ===============================

A sink runs its steps in a ``tf.while_loop`` over a dataset iterator that
lives as long as the sink, so successive calls continue where the last one
stopped and the dataset is traversed endlessly (it cycles at its end).
Inside the loop each step records, in two host counters, that its batch
arrived and that its step finished; that is how an error is pinned to a step
and blamed on the input pipeline or on the step. The time each step waits
for its batch is summed per sink and compared with the sink's wall time, to
warn when the input pipeline is slower than training.
"""

from __future__ import annotations

import numbers
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from . import _compat, collectives, runtime
from .errors import ConfigurationError, InputPipelineError, ShardingError

__all__ = ["SlowInputWarning", "prefetch_to_device", "DataSink", "data_sink", "train"]

# A sink that spent at least this fraction of its wall time, and at least
# SLOW_INPUT_MIN_SECONDS, waiting for batches triggers a SlowInputWarning;
# repeated at most once a minute. The floor keeps toy steps of microseconds,
# where reading any batch costs as much as the step, from warning.
SLOW_INPUT_FRACTION = 0.2
SLOW_INPUT_MIN_SECONDS = 0.02
SLOW_INPUT_REPEAT_SECONDS = 60.0

_INFINITE = int(tf.data.INFINITE_CARDINALITY)
_UNKNOWN = int(tf.data.UNKNOWN_CARDINALITY)

# Datasets made by prefetch_to_device -> (source, device, buffer_size), so a
# sink can put its .repeat() before the device stage, which must stay last.
_STAGED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model -> (compile token, steps, jit_compile, _SinkLoop): train() called once
# per epoch (a new shard each epoch) reuses the traced loop.
_KERAS_LOOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class SlowInputWarning(UserWarning):
    """A sink spent a large part of its time waiting for the input pipeline.

    Silence it where that is expected::

        warnings.filterwarnings("ignore", category=hvdkit.sink.SlowInputWarning)
    """


# --------------------------------------------------------------------------- data sink
def prefetch_to_device(
    dataset: tf.data.Dataset, device: str | None = None, buffer_size: int | None = None
) -> tf.data.Dataset:
    """Last stage of a tf.data pipeline: stage upcoming batches on ``device``.

    While a step runs, the next ``buffer_size`` batches are produced and, for
    a GPU, copied to it (TensorFlow's ``prefetch_to_device``, which is
    ``copy_to_device`` followed by ``prefetch``), so the copy overlaps with
    compute. For the CPU the batches already are where the step reads them
    and the stage is ``dataset.prefetch(buffer_size)``.

    Keep it last: a sink that needs to repeat the dataset rebuilds this stage
    after its ``.repeat()``.

    Args:
        dataset: the batched pipeline; elements keep their structure and shapes.
        device: ``"/gpu:0"``, ``"/cpu:0"``, ... ``None`` picks this process's
            GPU (``local_rank() % visible GPUs``; after ``hvdkit.init()``
            pinned one GPU per process that is ``/gpu:0``) when there is one,
            else the CPU.
        buffer_size: batches to stage (>= 1); ``None`` lets tf.data choose.

    Returns:
        A ``tf.data.Dataset`` with the same elements as ``dataset``.

    Raises:
        ConfigurationError: ``dataset`` is not a ``tf.data.Dataset``, ``device``
            is not a CPU or a visible GPU, or ``buffer_size`` is not a
            positive int.

    Example:
        >>> ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
        >>> ds = hvdkit.sink.prefetch_to_device(ds)   # GPU if present, else CPU
        >>> next(iter(ds))[0].device                  # on a CPU-only machine
        '/job:localhost/replica:0/task:0/device:CPU:0'
    """
    _check_dataset(dataset, "prefetch_to_device")
    if buffer_size is not None and (
        isinstance(buffer_size, bool)
        or not isinstance(buffer_size, numbers.Integral)
        or buffer_size < 1
    ):
        raise ConfigurationError(
            f"prefetch_to_device: buffer_size={buffer_size!r} must be a positive int "
            "(batches to stage), or None to let tf.data choose."
        )
    target = _resolve_device(device)
    if tf.DeviceSpec.from_string(target).device_type == "CPU":
        staged = dataset.prefetch(tf.data.AUTOTUNE if buffer_size is None else buffer_size)
    else:  # pragma: no cover - needs a GPU
        staged = dataset.apply(tf.data.experimental.prefetch_to_device(target, buffer_size))
    _STAGED[staged] = (dataset, target, buffer_size)
    return staged


def _resolve_device(device: str | None) -> str:
    gpus = tf.config.list_logical_devices("GPU")
    if device is None:
        if not gpus:
            return "/device:CPU:0"
        local = runtime.local_rank() if runtime.is_initialized() else 0
        return gpus[local % len(gpus)].name
    try:
        spec = tf.DeviceSpec.from_string(device)
    except (TypeError, ValueError):
        spec = None
    kind = (spec.device_type or "").upper() if spec is not None else ""
    if kind not in ("CPU", "GPU"):
        raise ConfigurationError(
            f"prefetch_to_device: device={device!r} is not a CPU or GPU device name; "
            "use e.g. '/gpu:0' or '/cpu:0', or None for this process's GPU (else CPU)."
        )
    index = spec.device_index or 0
    if kind == "GPU" and index >= len(gpus):
        raise ConfigurationError(
            f"prefetch_to_device: device={device!r}, but this process sees "
            f"{len(gpus)} GPU(s) {[g.name for g in gpus]}; pass one of those, '/cpu:0', "
            "or device=None (hvdkit.init() pins one GPU per process as /gpu:0)."
        )
    return tf.DeviceSpec(device_type=kind, device_index=index).to_string()


def _endless(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """``dataset`` repeated forever, cycling at its end, device stage kept last."""
    staged = _STAGED.get(dataset)
    if staged is not None:
        source, device, buffer_size = staged
        return prefetch_to_device(_endless(source), device, buffer_size)
    if int(dataset.cardinality()) == _INFINITE:
        return dataset
    return dataset.repeat()


def _check_dataset(dataset: Any, what: str) -> None:
    if not isinstance(dataset, tf.data.Dataset):
        raise ConfigurationError(
            f"{what} needs a tf.data.Dataset of batches; got {type(dataset).__name__}. "
            "Wrap arrays as tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)."
        )


def _describe_length(n: int) -> str:
    return {_INFINITE: "infinite", _UNKNOWN: "unknown"}.get(n, str(n))


def _agreed_length(dataset: tf.data.Dataset, what: str) -> int:
    """This rank's number of batches, after checking that every rank has the same.

    Runs an allgather, so every rank must call it together.
    """
    n = int(dataset.cardinality())
    lengths = collectives.allgather_object(n) if runtime.size() > 1 else [n]
    if len(set(lengths)) > 1:
        listing = ", ".join(f"rank {r}: {_describe_length(k)}" for r, k in enumerate(lengths))
        hint = ""
        if _UNKNOWN in lengths:
            hint = (
                " Where the length is unknown (after filter(), for example), state it "
                "with dataset.apply(tf.data.experimental.assert_cardinality(n))."
            )
        raise ShardingError(
            f"{what}: the ranks' datasets have different numbers of batches ({listing}). "
            "Every rank must run the same number of steps per sink, or the ranks with "
            "more steps wait forever in the gradient allreduce. Give every rank an equal "
            "shard (hvdkit.data.shard or shard_indices with mode='pad' or 'drop') and "
            f"the same batch size.{hint}"
        )
    return n


# --------------------------------------------------------------------------- loop sink
class _SinkLoop:
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
                relax = lambda t: tf.TensorShape(  # noqa: E731
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


def _check_sink_size(sink_size: Any, allow_whole: bool, fix: str) -> int:
    valid = (
        isinstance(sink_size, numbers.Integral)
        and not isinstance(sink_size, bool)
        and (sink_size >= 1 or (allow_whole and sink_size == -1))
    )
    if not valid:
        raise ConfigurationError(f"sink_size={sink_size!r} is not valid; {fix}")
    return int(sink_size)


def _resolve_jit(jit_compile: bool | None, what: str) -> bool:
    if jit_compile is None:
        return False
    if not isinstance(jit_compile, bool):
        raise ConfigurationError(
            f"{what}: jit_compile={jit_compile!r} must be True, False or None."
        )
    if jit_compile and runtime.size() > 1:
        raise ConfigurationError(
            f"{what}: jit_compile=True in a job of {runtime.size()} processes: the "
            "gradient allreduce (Horovod 0.28.1) has no XLA kernels. Pass "
            "jit_compile=False (or None)."
        )
    return jit_compile


class DataSink:
    """``sink_size`` steps of ``fn`` per call, over batches of a dataset that never runs out.

    Built by :func:`data_sink`; see there for the arguments. Each call runs
    ``sink_size`` steps inside one ``tf.function`` (a graph loop: no Python
    per step) and returns the last step's outputs, or all of them stacked.

    Attributes:
        sink_size: steps per call.
        calls: calls made so far (failed ones included).
        steps_done: steps finished so far, over all calls.
        last_input_wait: seconds the last call's steps waited for their batches.
        last_wall_time: seconds the last call took, measured on the host.

    Raises (when called):
        InputPipelineError: the input pipeline failed; the message quotes
            TensorFlow's error and names the step. The next call continues
            after the failed element.
        tf.errors.OpError: ``fn`` itself failed; TensorFlow's error, with a
            note naming the step.
    """

    def __init__(
        self,
        fn: Callable,
        dataset: tf.data.Dataset,
        sink_size: int = 1,
        *,
        jit_compile: bool | None = None,
        return_all: bool = False,
        slow_input_fraction: float | None = SLOW_INPUT_FRACTION,
    ):
        if not callable(fn):
            raise ConfigurationError(
                f"data_sink: fn={fn!r} is not callable; pass the training step, a "
                "function of one batch's elements."
            )
        _check_dataset(dataset, "data_sink")
        sink_size = _check_sink_size(
            sink_size, False, "data_sink needs an int >= 1 (steps per call)."
        )
        if slow_input_fraction is not None and not 0 < slow_input_fraction <= 1:
            raise ConfigurationError(
                f"data_sink: slow_input_fraction={slow_input_fraction!r} must be in (0, 1], "
                "or None to never warn."
            )
        jit = _resolve_jit(jit_compile, "data_sink")
        if _agreed_length(dataset, "data_sink") == 0:
            raise ConfigurationError(
                "data_sink: the dataset is empty (0 batches), so there is nothing to cycle "
                "through; check the shard and batch size (a batch larger than the shard "
                "with drop_remainder=True leaves nothing)."
            )
        self.fn = fn
        self.dataset = dataset
        self._loop = _SinkLoop(
            fn,
            sink_size,
            jit_compile=jit,
            autograph=True,
            unpack=True,
            return_all=return_all,
            slow_input_fraction=slow_input_fraction,
        )
        self._iterator = iter(_endless(dataset))

    def __call__(self):
        return self._loop(self._iterator)

    @property
    def sink_size(self) -> int:
        return self._loop.sink_size

    @property
    def calls(self) -> int:
        return self._loop.calls

    @property
    def steps_done(self) -> int:
        return self._loop.steps_done

    @property
    def last_input_wait(self) -> float:
        return self._loop.last_input_wait

    @property
    def last_wall_time(self) -> float:
        return self._loop.last_wall_time


def data_sink(
    fn: Callable,
    dataset: tf.data.Dataset,
    sink_size: int = 1,
    *,
    jit_compile: bool | None = None,
    return_all: bool = False,
    slow_input_fraction: float | None = SLOW_INPUT_FRACTION,
) -> DataSink:
    """Make a callable that runs ``fn`` on ``sink_size`` consecutive batches per call.

    The functional form of sink mode (MindSpore's ``data_sink``). Each call
    runs the steps in one ``tf.function``, a graph loop over an iterator that
    lives as long as the returned object: successive calls continue where the
    last one stopped and cycle at the dataset's end, so ``k`` calls run
    ``k * sink_size`` steps on batches ``0, 1, ..., L-1, 0, 1, ...`` (``L``
    batches per pass; a reshuffling dataset reshuffles on each pass).
    Collectives inside ``fn`` (a ``DistributedGradientTape``, a
    ``DistributedOptimizer``) run once per step, inside the loop.

    Every rank must call this together: it checks, with an allgather, that
    every rank's dataset has the same number of batches.

    Args:
        fn: the step. A dataset element that is a tuple ``(x, y)`` is passed
            as ``fn(x, y)``, anything else (a dict, a tensor) as ``fn(element)``.
            It may return ``None``, a tensor or a nest of tensors. Variables it
            creates on its first step (an unbuilt model or optimizer) are fine.
        dataset: a ``tf.data.Dataset`` of batches, finite or infinite; end it
            with :func:`prefetch_to_device` to stage batches on the device.
        sink_size: steps per call (>= 1).
        jit_compile: compile ``fn`` with XLA. ``None`` means ``False``. ``True``
            is refused in a job of more than one process (Horovod's collectives
            have no XLA kernels), and ``fn`` must then not call hvdkit
            collectives.
        return_all: return every step's outputs stacked on a new first axis
            (``[sink_size, ...]``; every step's outputs must have the same
            shape) instead of the last step's.
        slow_input_fraction: warn (:class:`SlowInputWarning`) when a call,
            after the first, spent at least this fraction of its wall time
            waiting for batches. ``None`` never warns.

    Returns:
        A :class:`DataSink`; calling it returns ``fn``'s outputs of the last
        step (or all steps), as tensors.

    Raises:
        ConfigurationError: ``fn`` is not callable, ``dataset`` is not a
            ``tf.data.Dataset`` or is empty, ``sink_size < 1``, or
            ``jit_compile=True`` in a multi-process job.
        ShardingError: the ranks' datasets have different numbers of batches;
            the message gives each rank's count.

    Example:
        >>> @tf.function
        ... def train_step(x, y):
        ...     with tf.GradientTape() as tape:
        ...         loss = loss_fn(y, model(x, training=True))
        ...     tape = hvdkit.DistributedGradientTape(tape)         # hvdkit
        ...     opt.apply(tape.gradient(loss, model.trainable_variables),
        ...               model.trainable_variables)
        ...     return loss
        >>> sink = hvdkit.sink.data_sink(train_step, ds, sink_size=100)   # hvdkit
        >>> for _ in range(10):       # 1000 steps, 10 host calls
        ...     loss = sink()
    """
    return DataSink(
        fn,
        dataset,
        sink_size,
        jit_compile=jit_compile,
        return_all=return_all,
        slow_input_fraction=slow_input_fraction,
    )


# --------------------------------------------------------------------------- Keras
def _keras_loop(model: keras.Model, steps: int, jit: bool) -> _SinkLoop:
    token = _compat.keras_compile_token(model)
    cached = _KERAS_LOOPS.get(model)
    if cached is not None and cached[0] is token and cached[1:3] == (steps, jit):
        return cached[3]
    model_ref = weakref.ref(model)  # the cache must not keep the model alive
    loop = _SinkLoop(
        lambda data: model_ref().train_step(data),
        steps,
        jit_compile=jit,
        autograph=False,  # as Keras: train_step is plain TensorFlow code
        unpack=False,
        counted_from="since this train() call began",
    )
    _KERAS_LOOPS[model] = (token, steps, jit, loop)
    return loop


def train(
    model: keras.Model,
    epochs: int,
    dataset: tf.data.Dataset,
    callbacks: list[keras.callbacks.Callback] | None = None,
    dataset_sink_mode: bool = True,
    sink_size: int = -1,
    **fit_kwargs: Any,
) -> keras.callbacks.History:
    """Train a compiled Keras model in sink mode, with MindSpore's meaning of the arguments.

    In sink mode every epoch is **one sink**: one host call that runs its
    steps in a graph loop, so ``on_train_batch_*`` and ``on_epoch_*``
    callbacks, the progress bar and the epoch's logged loss come once per sink.

    * ``sink_size=-1``: an epoch (one sink) is the whole dataset, ``L`` steps.
    * ``sink_size=N > 0``: an epoch is ``N`` steps; the next epoch continues
      where the last stopped and the dataset cycles at its end, so epoch ``e``
      (0-based) trains on batches ``e*N .. e*N+N-1`` modulo ``L``.
    * ``dataset_sink_mode=False``: plain ``model.fit(dataset, epochs=...,
      callbacks=...)``; ``sink_size`` is ignored.

    It is ``model.fit(dataset.repeat(), epochs=epochs, steps_per_epoch=S,
    callbacks=callbacks, **fit_kwargs)`` with ``steps_per_execution=S``,
    where ``S`` is ``sink_size`` or ``L``, and with hvdkit's sink loop in
    place of Keras's for that call (it pins errors to a step and measures the
    wait for input); the model's ``steps_per_execution`` and compiled
    functions are restored afterwards. With validation data, evaluation also
    runs ``S`` steps per call.

    Every rank must call this together: the per-rank dataset lengths are
    compared (allgather) before training, in both modes.

    Args:
        model: a compiled ``keras.Model`` (``run_eagerly=False``; in a job of
            several processes ``jit_compile=False``).
        epochs: as ``fit``'s: train until this epoch (with ``initial_epoch=``).
        dataset: a ``tf.data.Dataset`` of batches (``(x, y)`` or
            ``(x, y, sample_weight)``), finite or, with ``sink_size > 0``,
            infinite or of unknown length.
        callbacks: Keras callbacks, as for ``fit``.
        dataset_sink_mode: ``True`` for sink mode.
        sink_size: ``-1`` (whole dataset per epoch) or steps per epoch (>= 1).
        **fit_kwargs: passed to ``fit`` (``verbose``, ``initial_epoch``,
            ``validation_data``, ...); not ``steps_per_epoch`` in sink mode.

    Returns:
        The ``History`` returned by ``fit``.

    Raises:
        ConfigurationError: the model is not compiled, runs eagerly or uses
            XLA in a multi-process job; ``sink_size`` is 0 or below -1;
            ``sink_size=-1`` with a dataset of infinite or unknown length;
            ``steps_per_epoch`` given in sink mode.
        ShardingError: the ranks' datasets have different numbers of batches.
        InputPipelineError: the input pipeline failed during training; the
            message names the step and quotes TensorFlow's error.

    Example:
        >>> model.compile(optimizer=hvdkit.DistributedOptimizer(opt), loss=loss)
        >>> hist = hvdkit.sink.train(model, 10, ds, callbacks=cbs, sink_size=100)
        >>> len(hist.history["loss"])   # one entry per sink = per epoch
        10
    """
    if not isinstance(model, keras.Model):
        raise ConfigurationError(f"train needs a keras.Model; got {type(model).__name__}.")
    if not getattr(model, "compiled", False):
        raise ConfigurationError(
            "train: the model is not compiled; call model.compile(optimizer=..., loss=...) first."
        )
    _check_dataset(dataset, "train")
    sink_size = _check_sink_size(
        sink_size, True, "use -1 (an epoch is the whole dataset) or a number of steps >= 1."
    )
    if dataset_sink_mode and "steps_per_epoch" in fit_kwargs:
        raise ConfigurationError(
            f"train: steps_per_epoch={fit_kwargs['steps_per_epoch']!r} conflicts with sink "
            f"mode, where an epoch is one sink of sink_size steps (sink_size={sink_size}). "
            "Pass sink_size=<steps per epoch> instead, or dataset_sink_mode=False."
        )
    length = _agreed_length(dataset, "train")
    # A dataset brings its own order; Keras would warn that shuffle=True is ignored.
    fit_kwargs.setdefault("shuffle", False)
    if not dataset_sink_mode:
        return model.fit(dataset, epochs=epochs, callbacks=callbacks, **fit_kwargs)

    if model.run_eagerly:
        raise ConfigurationError(
            "train: the model was compiled with run_eagerly=True, but sink mode runs its "
            "steps in a graph loop. Compile with run_eagerly=False, or pass "
            "dataset_sink_mode=False to debug eagerly."
        )
    if sink_size > 0:
        steps = sink_size
    elif length > 0:
        steps = length
    else:
        raise ConfigurationError(
            f"train: sink_size=-1 makes an epoch the whole dataset, but its length is "
            f"{_describe_length(length)}"
            + (" (it has no batches)" if length == 0 else "")
            + ". Pass sink_size=<steps per epoch>, or state a finite length with "
            "dataset.apply(tf.data.experimental.assert_cardinality(n))."
        )
    jit = bool(model.jit_compile)
    if jit and runtime.size() > 1:
        raise ConfigurationError(
            f"train: the model is compiled with jit_compile=True in a job of "
            f"{runtime.size()} processes, but Horovod 0.28.1's gradient allreduce has no "
            "XLA kernels (Keras's jit_compile='auto' picks XLA when a GPU is visible). "
            "Compile with model.compile(..., jit_compile=False)."
        )
    loop = _keras_loop(model, steps, jit)
    loop.reset_counters()
    loop.first_epoch = int(fit_kwargs.get("initial_epoch", 0))
    with _compat.keras_train_function(model, loop, steps):
        return model.fit(
            _endless(dataset),
            epochs=epochs,
            steps_per_epoch=steps,
            callbacks=callbacks,
            **fit_kwargs,
        )

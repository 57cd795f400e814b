"""The functional form of sink mode: :func:`data_sink` (MindSpore's ``data_sink``)."""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

from ..errors import ConfigurationError
from .loop import SLOW_INPUT_FRACTION, SinkLoop, check_sink_size, resolve_jit
from .pipeline import agreed_length, check_dataset, endless

JIT_LEVELS = ("", "O0", "O1", "O2")  # MindSpore's compile levels: all one tf.function graph here
EXC_MODES = ("auto", "sink", "no_sink")


class JitConfig:
    """MindSpore's ``JitConfig`` for :func:`data_sink`'s ``jit_config=``: "compile the step".

    In MindSpore, ``data_sink(fn, ds, jit_config=None)`` runs ``fn`` eagerly
    (PyNative) and a ``JitConfig`` compiles it into a graph at a given level.
    hvdkit's :func:`data_sink` always runs the steps in one ``tf.function``
    graph loop, so every level below means the same here: a traced graph, no
    XLA. XLA is ``data_sink(..., jit_compile=True)`` (one process only).

    Args:
        jit_level: ``""``, ``"O0"``, ``"O1"`` or ``"O2"`` (MindSpore's levels).
        exc_mode: ``"auto"``, ``"sink"`` or ``"no_sink"``; the loop always sinks.

    Raises:
        ConfigurationError: another level or mode, or any other option
            (MindSpore's other options have no TensorFlow meaning).

    Example:
        >>> jit = hvdkit.sink.JitConfig()        # hvdkit: was ms.JitConfig()
        >>> run = hvdkit.sink.data_sink(train_step, ds, sink_size=100, jit_config=jit)
    """

    def __init__(self, jit_level: str = "O1", exc_mode: str = "auto", **options):
        if jit_level not in JIT_LEVELS:
            raise ConfigurationError(
                f"JitConfig: jit_level={jit_level!r} is not one of {JIT_LEVELS}; every level "
                "runs the step as one tf.function graph in hvdkit."
            )
        if exc_mode not in EXC_MODES:
            raise ConfigurationError(f"JitConfig: exc_mode={exc_mode!r} is not one of {EXC_MODES}.")
        if options:
            raise ConfigurationError(
                f"JitConfig: {sorted(options)} have no TensorFlow equivalent; drop them. XLA "
                "is data_sink(..., jit_compile=True) (one process only)."
            )
        self.jit_level, self.exc_mode = jit_level, exc_mode

    def __repr__(self) -> str:
        return f"JitConfig(jit_level={self.jit_level!r}, exc_mode={self.exc_mode!r})"


def check_jit_config(jit_config) -> None:
    """``None`` or a :class:`JitConfig`; anything else is refused with the hvdkit equivalent."""
    if jit_config is None or isinstance(jit_config, JitConfig):
        return
    raise ConfigurationError(
        f"data_sink: jit_config={jit_config!r} is not a hvdkit.sink.JitConfig. MindSpore's "
        "ms.JitConfig(...) becomes hvdkit.sink.JitConfig(...) (or leave jit_config out: "
        "hvdkit always runs the steps as one tf.function graph); XLA is jit_compile=True."
    )


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
        jit_config: JitConfig | None = None,
    ):
        check_jit_config(jit_config)
        if not callable(fn):
            raise ConfigurationError(
                f"data_sink: fn={fn!r} is not callable; pass the training step, a "
                "function of one batch's elements."
            )
        check_dataset(dataset, "data_sink")
        sink_size = check_sink_size(
            sink_size, False, "data_sink needs an int >= 1 (steps per call)."
        )
        if slow_input_fraction is not None and not 0 < slow_input_fraction <= 1:
            raise ConfigurationError(
                f"data_sink: slow_input_fraction={slow_input_fraction!r} must be in (0, 1], "
                "or None to never warn."
            )
        jit = resolve_jit(jit_compile, "data_sink")
        if agreed_length(dataset, "data_sink") == 0:
            raise ConfigurationError(
                "data_sink: the dataset is empty (0 batches), so there is nothing to cycle "
                "through; check the shard and batch size (a batch larger than the shard "
                "with drop_remainder=True leaves nothing)."
            )
        self.fn = fn
        self.dataset = dataset
        self._loop = SinkLoop(
            fn,
            sink_size,
            jit_compile=jit,
            autograph=True,
            unpack=True,
            return_all=return_all,
            slow_input_fraction=slow_input_fraction,
        )
        self._iterator = iter(endless(dataset))

    def __call__(self):
        return self._loop(self._iterator)

    # Read-only views of the loop's bookkeeping (see Attributes above).
    sink_size = property(lambda self: self._loop.sink_size)
    calls = property(lambda self: self._loop.calls)
    steps_done = property(lambda self: self._loop.steps_done)
    last_input_wait = property(lambda self: self._loop.last_input_wait)
    last_wall_time = property(lambda self: self._loop.last_wall_time)


def data_sink(
    fn: Callable,
    dataset: tf.data.Dataset,
    sink_size: int = 1,
    *,
    jit_compile: bool | None = None,
    return_all: bool = False,
    slow_input_fraction: float | None = SLOW_INPUT_FRACTION,
    jit_config: JitConfig | None = None,
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
        jit_config: MindSpore's argument, as a :class:`JitConfig` (or
            ``None``). The steps always run as one ``tf.function`` graph, so
            it changes nothing; ``jit_compile`` is the XLA switch.

    Returns:
        A :class:`DataSink`; calling it returns ``fn``'s outputs of the last
        step (or all steps), as tensors.

    Raises:
        ConfigurationError: ``fn`` is not callable, ``dataset`` is not a
            ``tf.data.Dataset`` or is empty, ``sink_size < 1``,
            ``jit_compile=True`` in a multi-process job, or ``jit_config`` is
            not a :class:`JitConfig`.
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
        jit_config=jit_config,
    )

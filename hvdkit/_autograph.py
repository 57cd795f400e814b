"""hvdkit's functions are never rewritten by AutoGraph.

A user's ``tf.function`` converts, with AutoGraph, every function it calls
from a module TensorFlow does not list as its own or Keras's: without this,
each of hvdkit's (the optimizer's ``apply``, ``DistributedGradientTape``,
the collectives, and the forty helpers behind them) would be parsed,
rewritten, written to a temporary file and loaded again, the first time each
process traces them.
Measured (a 2-rank job, a Dense model, one custom training step): tracing
the step took 2.7 CPU-seconds per rank with hvdkit's optimizer converted
and 0.06 with it kept as it is, and the trace left about 45 generated files
in the temporary folder (removed at exit, unless the process is killed).
Converted, hvdkit's own argument checks were also traced wrongly, and its
``ConfigurationError`` came out wrapped in a ``StagingError``.

hvdkit's code has no Python control flow on tensors (its branches are
``tf.cond`` / ``keras.ops.cond``), so it needs no conversion: Keras's ``fit``
already runs it unconverted. Every function a user may call inside a
``tf.function`` is marked with :func:`not_converted`; what it calls is then
not converted either (AutoGraph does not descend into a function it left
alone).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def not_converted(fn: F) -> F:
    """``fn``, marked so that AutoGraph calls it as it is.

    Example:
        >>> @not_converted
        ... def reduce_gradients(grads): ...
    """
    import tensorflow as tf  # here, as in _compat: layer 1 never imports TensorFlow itself

    return tf.autograph.experimental.do_not_convert(fn)

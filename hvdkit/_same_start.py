"""Ranks that start apart: a check at the first gradient reduction of each variable list.

Data parallelism is one model only if every rank starts from the same weights.
A script that builds its model on every rank and never broadcasts rank 0's
(the Keras guide's custom loop does not) trains as many models as ranks,
averaging gradients of different points, and nothing fails. Horovod does not
check this; hvdkit does, once per variable list and process:

1. At the first reduction of a list of variables (``DistributedOptimizer``,
   ``DistributedGradientTape``, ``reduce_gradients(..., variables=...)``),
   each rank reduces two float64 fingerprints per variable (its sum and a
   position-weighted sum) with one ``Max`` allreduce of ``[f, -f]``: the
   spread of every fingerprint over the ranks, 2 x 8 bytes a variable. Inside
   a ``tf.function`` this runs eagerly while the step is traced (every rank
   traces its first step at the same point), so a job whose ranks agree pays
   this once and nothing per step.
2. If they differ, the rank may be about to broadcast after its first step
   (Horovod's own TF2 examples broadcast after the first ``apply_gradients``;
   ``BroadcastGlobalVariablesCallback`` does when the model was not built
   before ``fit``). So the check is repeated at the second reduction, in the
   graph (a ``tf.cond`` on a step counter: one small op per step from then on,
   in such jobs only). Still different there: ``HVDKIT_SAME_START`` decides,
   ``error`` (the default) raises on every rank, ``warn`` logs on every rank
   and trains on, ``off`` never checks.

Elastic jobs skip it: every new world starts from a broadcast of the committed
state, and a newcomer's first reduction is not its peers' first.

Equal means equal to within ``RTOL`` of the fingerprint's magnitude: ranks on
different CPUs may sum the same weights in another order.
"""

from __future__ import annotations

import logging
import sys
import weakref

import tensorflow as tf

from . import collectives, config, runtime
from ._comm import meeting as _meeting
from ._comm.fingerprints import POSITION_WEIGHTS  # position i weighs (i % 97) + 1
from .errors import ConfigurationError

logger = logging.getLogger("hvdkit")

RTOL = 1e-6  # relative spread of a fingerprint still counted as equal
_SHOWN = 5  # variables named in a message

# ids of a variable list -> (weak references to the variables, its check): the check
# is True (passed, or off) or the step counter of the deferred graph check. The weak
# references tell a list apart from a later one whose variables reuse freed ids.
_checks: dict[tuple[int, ...], tuple[list, object]] = {}


def state(variables) -> object:
    """The check of ``variables``: ``None`` (not made), ``True`` (done) or its step counter."""
    entry = _checks.get(tuple(id(v) for v in variables))
    if entry is None or any(ref() is not v for ref, v in zip(entry[0], variables, strict=True)):
        return None
    return entry[1]


def _remember(variables, value) -> None:
    _checks[tuple(id(v) for v in variables)] = ([weakref.ref(v) for v in variables], value)


def fingerprints(variables) -> tuple[tf.Tensor, tf.Tensor]:
    """``(f, scale)``: per variable [sum, weighted sum] (float64, shape ``[2n]``) and magnitudes."""
    sums, scales = [], []
    for v in variables:
        x = tf.reshape(tf.cast(tf.convert_to_tensor(v), tf.float64), [-1])
        w = tf.cast(tf.range(tf.size(x)) % POSITION_WEIGHTS + 1, tf.float64)
        sums += [tf.reduce_sum(x), tf.reduce_sum(x * w)]
        a = tf.reduce_sum(tf.abs(x))
        scales += [a, a * POSITION_WEIGHTS]
    return tf.stack(sums), tf.stack(scales)


def _differing(variables, process_set, name: str) -> tf.Tensor:
    """Per variable: whether the ranks (of ``process_set``) hold different values. Shape ``[n]``."""
    f, scale = fingerprints(variables)
    both = collectives.allreduce(
        tf.concat([f, -f, scale], 0), op=collectives.Max, name=name, process_set=process_set
    )
    k = len(variables) * 2
    spread = both[:k] + both[k : 2 * k]  # max - min
    bad = spread > RTOL * both[2 * k :]
    return tf.reduce_any(tf.reshape(bad, [-1, 2]), axis=1)


def _message(differing: str, n: int) -> str:
    return (
        f"hvdkit: the {n} ranks hold different weights at their first two gradient reductions "
        f"({differing}), so each trains its own model. Broadcast rank 0's weights after "
        "building the model and before training: hvdkit.broadcast_variables(model.variables, "
        "root_rank=0) in a custom loop, or hvdkit.callbacks.BroadcastGlobalVariablesCallback(0) "
        f"in fit. {config.SAME_START}=warn trains on anyway (docs/training.md)."
    )


def _names(names: list[str]) -> str:
    more = len(names) - _SHOWN
    return ", ".join(names[:_SHOWN]) + (f" and {more} more" if more > 0 else "")


def check(variables, process_set, n: int) -> list[tf.Operation]:
    """Check, once, that the ``n`` ranks reducing gradients of ``variables`` hold equal ones.

    Sources that are not variables (tensors a tape watched) are left out.
    Returns the ops the gradient allreduces must wait for (the deferred check
    in a graph: when it fails, no rank has started a gradient allreduce that
    its peers will never join), or ``[]``.

    Raises:
        ConfigurationError: eagerly, when the ranks differ at the second reduction
            (in a graph: ``tf.errors.InvalidArgumentError`` with the same message).
    """
    variables = [v for v in variables if hasattr(v, "assign") and hasattr(v, "dtype")]
    if not variables or state(variables) is True:
        return []
    mode = config.same_start()
    if mode == "off" or _meeting.enabled():
        _remember(variables, True)
        return []
    if state(variables) is None:
        with tf.init_scope():  # eagerly, even while a tf.function is traced
            if not bool(tf.reduce_any(_differing(variables, process_set, "hvdkit.same_start"))):
                _remember(variables, True)
                return []
            counter = tf.Variable(0, dtype=tf.int64, trainable=False, name="same_start")
            _remember(variables, counter)
    counter = state(variables)
    names = [
        getattr(v, "path", None) or getattr(v, "name", str(i)) for i, v in enumerate(variables)
    ]
    if tf.executing_eagerly():  # a loop without tf.function: plain Python
        if int(counter.numpy()) == 1:
            bad = _differing(variables, process_set, "hvdkit.same_start_2").numpy()
            _remember(variables, True)
            if bad.any():
                text = _message(_names([m for m, b in zip(names, bad, strict=True) if b]), n)
                if mode == "error":
                    raise ConfigurationError(text)
                logger.warning(text)
            return []
        counter.assign_add(1)
        return []

    def second():
        bad = _differing(variables, process_set, "hvdkit.same_start_2")
        differing = tf.strings.reduce_join(tf.boolean_mask(tf.constant(names), bad), separator=", ")
        text = _message("listed after this message", n)
        if mode == "error":
            ok = tf.logical_not(tf.reduce_any(bad))
            with tf.control_dependencies([tf.debugging.Assert(ok, [text, differing])]):
                return tf.identity(ok)
        return tf.cond(
            tf.reduce_any(bad),
            lambda: _print_warning(text, differing),
            lambda: tf.constant(True),
        )

    verdict = tf.cond(tf.equal(counter, 1), second, lambda: tf.constant(True))
    with tf.control_dependencies([verdict]):
        return [counter.assign_add(1).op]


def _print_warning(text: str, differing: tf.Tensor) -> tf.Tensor:
    tf.print(
        f"[rank {runtime.rank()}] WARNING:", text, "Differing:", differing, output_stream=sys.stderr
    )
    return tf.constant(False)


def reset() -> None:
    """Forget which variable lists were checked (tests; a new job in the same process)."""
    _checks.clear()

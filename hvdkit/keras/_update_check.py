"""Weights a plain Keras optimizer updates with gradients no hvdkit reduction averaged.

The mistake: a job of several ranks trains with a Keras optimizer that is not
wrapped (``model.compile(optimizer="adam")`` after ``hvdkit.init()``, one of a
GAN's two optimizers unwrapped, a custom loop with a plain ``tf.GradientTape``
and ``optimizer.apply``). Each rank then trains its own model on its share of
the data, exits 0, and nothing else notices. This module tells the user on the
first step, naming the optimizer, its variables and the fix.

Where the check sits, from Keras 3's own paths (``keras/src/``):

* every update of a Keras optimizer goes through ``Optimizer.apply``:
  ``Trainer.train_step`` calls ``optimizer.apply_gradients``, which calls
  ``apply``; custom loops call either; ``LossScaleOptimizer.apply`` ends in its
  inner optimizer's ``apply``. ``DistributedOptimizer`` overrides ``apply`` and
  updates through the optimizer it holds, inside :func:`updates.reducing`;
* Keras offers no hook there: callbacks exist in ``fit`` only and run after
  the step (a custom loop has none), and ``Optimizer`` has no registry of
  listeners. A callback hvdkit installs would miss custom loops and the
  optimizers a ``train_step`` holds (a GAN's two); comparing the weights at the
  end of ``fit`` would cost a collective and come after the whole run. So
  :func:`install` (at ``hvdkit.init()``) wraps the public
  ``keras.optimizers.Optimizer.apply`` once for the process, as
  ``keras/callbacks.py`` wraps ``BackupAndRestore.on_train_begin``;
* inside a ``tf.function`` the wrapper runs once, while the step is traced:
  no collective and no op is added to the step. Eagerly it costs a few
  dictionary look-ups per update until it has decided for that optimizer.

What counts as reduced, for each variable with a gradient:

1. its gradient went through ``reduce_gradients(..., variables=...)``
   (``DistributedOptimizer``, ``DistributedGradientTape``), recorded in
   :mod:`hvdkit._comm.updates`, or it is local on purpose
   (``PartialDistributedGradientTape``'s local layers; ``local_layers=`` of
   ``PartialDistributedOptimizer`` updates inside ``reducing``);
2. inside a ``tf.function``: the gradient tensor depends, through data edges,
   on a Horovod collective's output (``hvdkit.grouped_allreduce(grads)`` by
   hand, ``reduce_gradients`` without ``variables=``);
3. eagerly: an hvdkit collective completed since this optimizer's last update
   (the values carry no history; the first eager update is therefore never
   judged, the second is).

Otherwise the job is told, per ``HVDKIT_UNREDUCED_UPDATE``: ``warn`` (the
default) logs once per optimizer on rank 0, ``error`` raises
:class:`~hvdkit.errors.ConfigurationError` on every rank that does it, ``off``
skips the check. A job of one rank is never checked. What this misses
(docs/divergence.md): a forward pass that itself runs a collective
(``SyncBatchNormalization``, an allreduce of the loss that the gradients
depend on) makes every gradient count as reduced by rules 2 and 3, and an
optimizer that overrides ``apply`` without calling Keras's is not seen.

The same wrapper runs the same-start check of ``reduce_gradients`` calls that
named no variables (their variables are known only here), and records the
variables every optimizer updates for the end-of-job fingerprint
(:func:`write_fingerprint`, ``hvdkitrun --check-weights``).
"""

from __future__ import annotations

import atexit
import functools
import logging
import weakref

import keras
import tensorflow as tf

from .. import _same_start, config, runtime
from .._autograph import not_converted
from .._comm import fingerprints as _fingerprints
from .._comm import progress as _progress
from .._comm import updates
from ..errors import ConfigurationError

logger = logging.getLogger("hvdkit")

_SHOWN = 4  # variables named in the message
_keras_apply = None  # Keras's own Optimizer.apply, once wrapped
_warned: dict[int, weakref.ref] = {}  # optimizers already named on rank 0
# id(optimizer) -> (weak reference, eager collectives completed at its last update)
_eager_seen: dict[int, tuple[weakref.ref, int]] = {}


def install() -> None:
    """Wrap ``keras.optimizers.Optimizer.apply`` with the check (once per process).

    With ``HVDKIT_WEIGHTS_DIR`` set (by ``hvdkitrun --check-weights``) the
    rank also writes its weights' fingerprint there at exit (the launcher compares
    them only when the job ended 0).
    """
    global _keras_apply
    if _keras_apply is not None:
        return
    cls = keras.optimizers.Optimizer
    _keras_apply = cls.apply

    @functools.wraps(_keras_apply)
    @not_converted  # a user's tf.function leaves it (and Keras's apply behind it) as it is
    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if trainable_variables is not None:
            trainable_variables = list(trainable_variables)
        grads = _checked(self, grads, trainable_variables)
        return _keras_apply(self, grads, trainable_variables)

    cls.apply = apply
    folder = config.get(config.WEIGHTS_DIR)
    if folder:
        atexit.register(write_fingerprint, folder)


def _checked(optimizer, grads: list, variables: list | None) -> list:
    """The gradients to apply (after the same-start check's ops, where it added any)."""
    if variables is None:
        variables = list(getattr(optimizer, "_trainable_variables", None) or [])
    updates.mark_trained(variables)
    if not runtime.is_initialized() or runtime.size() == 1:
        return grads
    waits = []
    here = tf.compat.v1.get_default_graph()  # a reduction traced elsewhere is not this update's
    for process_set, n, where in updates.pending_unlisted():
        if where is here:
            waits += _same_start.check(variables, process_set, n)
    if waits:
        with tf.control_dependencies(waits):
            grads = [tf.identity(g) if isinstance(g, tf.Tensor) else g for g in grads]
    if updates.in_reducing():
        return grads
    mode = config.unreduced_update()
    if mode == "off" or len(grads) != len(variables):
        return grads
    pairs = [
        (g, v)
        for g, v in zip(grads, variables, strict=True)
        if g is not None and not updates.is_reduced(v) and not updates.is_local(v)
    ]
    if not pairs:
        return grads
    if tf.executing_eagerly():
        done = _progress.completed_eagerly()
        ref, before = _eager_seen.get(id(optimizer), (None, None))
        _eager_seen[id(optimizer)] = (weakref.ref(optimizer), done)
        if ref is None or ref() is not optimizer or done != before:  # first, or a collective
            return grads
        unreduced = [v for _, v in pairs]
    else:
        downstream = _downstream_of_collectives(tf.compat.v1.get_default_graph())
        unreduced = [v for g, v in pairs if not _tensors(g) <= downstream]
    if unreduced:
        _report(optimizer, unreduced, mode)
    return grads


def _tensors(g) -> set:
    """The graph tensors of a gradient (an ``IndexedSlices`` has two)."""
    if isinstance(g, tf.IndexedSlices):
        return {g.values.ref(), g.indices.ref()}
    return {tf.convert_to_tensor(g).ref()}


def _downstream_of_collectives(graph) -> set:
    """Refs of every tensor of ``graph`` computed from a Horovod collective's output."""
    frontier = [op for op in graph.get_operations() if op.type.startswith("Horovod")]
    seen_ops = set(frontier)
    found = set()
    while frontier:
        op = frontier.pop()
        for t in op.outputs:
            found.add(t.ref())
            for consumer in t.consumers():
                if consumer not in seen_ops:
                    seen_ops.add(consumer)
                    frontier.append(consumer)
    return found


def _report(optimizer, variables: list, mode: str) -> None:
    names = [getattr(v, "path", None) or getattr(v, "name", "?") for v in variables]
    more = len(names) - _SHOWN
    shown = ", ".join(names[:_SHOWN]) + (f" and {more} more" if more > 0 else "")
    text = (
        f"hvdkit: the Keras optimizer {type(optimizer).__name__} {optimizer.name!r} updates "
        f"{len(variables)} trainable variables ({shown}) with gradients that no hvdkit "
        f"reduction averaged, so each of the {runtime.size()} ranks trains its own model on "
        "its share of the data. Wrap it: hvdkit.DistributedOptimizer(optimizer) before "
        "model.compile or optimizer.apply, or reduce in a custom loop with tape = "
        "hvdkit.DistributedGradientTape(tape) (layers kept local on purpose: "
        "hvdkit.PartialDistributedGradientTape / PartialDistributedOptimizer(local_layers=...)). "
        f"{config.UNREDUCED_UPDATE}=error stops the job instead, =off skips this check "
        "(docs/divergence.md)."
    )
    if mode == "error":
        raise ConfigurationError(text)
    ref = _warned.get(id(optimizer))
    if runtime.rank() == 0 and (ref is None or ref() is not optimizer):
        _warned[id(optimizer)] = weakref.ref(optimizer)
        logger.warning(text)


def write_fingerprint(folder: str) -> None:
    """Write this rank's fingerprint of the weights its optimizers trained, at exit."""
    if not runtime.is_initialized():
        return
    variables = updates.trained()
    rows = []
    if variables:
        f, scale = _same_start.fingerprints(variables)
        f, scale = f.numpy().tolist(), scale.numpy().tolist()
        for i, v in enumerate(variables):
            name = getattr(v, "path", None) or getattr(v, "name", str(i))
            rows.append((name, f[2 * i], f[2 * i + 1], scale[2 * i]))
    try:
        _fingerprints.write(folder, runtime.rank(), rows)
    except OSError as exc:  # the job's result stands; the launcher names this rank as silent
        logger.warning("hvdkit: cannot write the weight fingerprint into %s: %s", folder, exc)


def reset() -> None:
    """Forget the optimizers already named (tests)."""
    _warned.clear()
    _eager_seen.clear()

"""Gradient averaging for Keras 3: ``DistributedOptimizer`` and ``DistributedGradientTape``.

Horovod 0.28.1's own wrapper does not average under Keras 3 (see
:mod:`hvdkit._compat`). ``DistributedOptimizer`` instead *holds* the user's
optimizer, as Keras's ``LossScaleOptimizer`` does, and overrides ``apply``,
the single entry point that ``model.fit``, ``train_on_batch``,
``apply_gradients`` and custom loops all go through.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import keras
import tensorflow as tf

from . import _compat, _same_start, collectives, process_sets, runtime
from ._autograph import not_converted
from ._comm import buckets as _buckets
from ._comm import graph_progress as _graph_progress
from ._comm import meeting as _meeting
from ._comm import op_names as _op_names
from ._comm import updates as _updates
from ._comm.compression import Compression, Compressor
from ._validate import check_int
from .backends import ReduceOp
from .errors import ConfigurationError

_compat.require_keras3()

__all__ = ["DistributedOptimizer", "DistributedGradientTape", "reduce_gradients"]

_GRADIENT_OPS = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM)

# A DistributedOptimizer's gradient allreduce also carries a one-hot marker of
# the optimizer's step (iterations modulo _STEP_MARKER_SLOTS), fused into the
# same allreduce. If ranks at different steps get paired (an optimizer
# restored or stepped on one rank only), the reduced marker differs from the
# expected value on every rank and every rank raises instead of averaging
# gradients of different steps. A skew by an exact multiple of the slot count
# goes unnoticed.
_STEP_MARKER_SLOTS = 64


def _step_marker(step: tf.Tensor, dtype: tf.DType) -> tf.Tensor:
    slot = tf.cast(tf.convert_to_tensor(step) % _STEP_MARKER_SLOTS, tf.int32)
    return tf.one_hot(slot, _STEP_MARKER_SLOTS, dtype=dtype)


def _check_step_marker(
    step: tf.Tensor, reduced: tf.Tensor, op: ReduceOp, n: int | None = None
) -> tf.Operation:
    """Fail on every rank (of the ``n`` that reduce) unless all reduced the same step."""
    n = n or runtime.size()
    # all ranks put 1 in the same slot; Adasum of equal vectors is that vector
    full = float(n) if op == ReduceOp.SUM else 1.0
    step = tf.convert_to_tensor(step)
    slot = tf.cast(step % _STEP_MARKER_SLOTS, tf.int32)
    got = tf.cast(tf.gather(reduced, slot), tf.float32)
    # Only string and int32 data keep Assert a plain op: with other dtypes
    # TensorFlow guards it with a tf.cond, one more function call (If op) in
    # every training step (docs/performance.md). The step is shown modulo 2**31.
    return tf.debugging.Assert(
        got > full * (1.0 - 0.5 / n),
        [
            f"hvdkit: gradient allreduces of different optimizer steps were paired across "
            f"ranks (rank {runtime.rank()} of {n} is at step",
            tf.cast(step % 2**31, tf.int32),
            "and another rank is not). An optimizer was restored, rebuilt or stepped on "
            "some ranks only: broadcast its state from one rank "
            "(BroadcastGlobalVariablesCallback / broadcast_variables) and step it on every "
            "rank (see docs/divergence.md).",
        ],
        name="hvdkit_gradient_step_check",
    )


def _check_reduction_args(op, compression, what: str) -> None:
    if op not in _GRADIENT_OPS:
        raise ConfigurationError(
            f"{what}: op={op!r} is not a gradient reduction; use hvdkit.Average "
            "(the default), hvdkit.Sum or hvdkit.Adasum."
        )
    if not (hasattr(compression, "compress") and hasattr(compression, "decompress")):
        raise ConfigurationError(
            f"{what}: compression={compression!r} is not a compressor; use "
            "hvdkit.Compression.none or hvdkit.Compression.fp16."
        )


@not_converted
def reduce_gradients(
    grads: Sequence[tf.Tensor | tf.IndexedSlices | None],
    *,
    op: ReduceOp = ReduceOp.AVERAGE,
    compression: type[Compressor] = Compression.none,
    sparse_as_dense: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    step: tf.Tensor | int | None = None,
    bucket_bytes: int | None = None,
    groups: int | list | None = None,
    num_groups: int = 0,
    variables: Sequence | None = None,
    process_set: process_sets.ProcessSet | None = None,
) -> list[tf.Tensor | tf.IndexedSlices | None]:
    """Average (or sum) gradients over all ranks, in buckets that overlap the backward pass.

    ``None`` entries stay ``None``. Dense gradients go out in buckets, each
    one ``grouped_allreduce`` that starts as soon as its gradients exist
    (inside a ``tf.function``, while the backward pass computes the rest):
    by default the list is walked from its end (the last layer, whose
    gradient is ready first) and a bucket is closed at ``bucket_bytes``
    (:mod:`hvdkit._comm.buckets`). ``tf.IndexedSlices`` (embedding gradients) are
    allgathered, or densified first with ``sparse_as_dense=True``. With
    ``step`` (``DistributedOptimizer`` passes its ``iterations``) the first
    bucket also carries a marker of it: if the ranks are at different steps,
    every rank raises ``tf.errors.InvalidArgumentError`` before any reduced
    gradient is returned.

    Args:
        grads: gradients in the model's order (``model.trainable_variables``).
        op, compression, sparse_as_dense, device_dense, device_sparse: as in
            :class:`DistributedOptimizer`.
        step: the optimizer step to check across ranks, or ``None``.
        bucket_bytes: bytes per bucket; ``0`` = one allreduce per gradient (as
            Horovod without ``groups``); a size larger than all gradients = a
            single allreduce. ``None`` reads ``HVDKIT_BUCKET_BYTES``, else
            ``hvdkit.config.DEFAULT_BUCKET_BYTES`` (4 MiB).
        groups, num_groups: Horovod's explicit grouping instead of
            ``bucket_bytes``: an int splits the gradients into that many
            allreduces, lists of variables are reduced together.
        variables: the variable of each gradient (for list ``groups``, and for
            the check that every rank starts from the same weights:
            :mod:`hvdkit._same_start`, once per variable list). Without it the
            check runs when a Keras optimizer next applies the gradients
            (:mod:`hvdkit.keras._update_check`).
        process_set: reduce within this registered set only (``Average``
            divides by its size; the buckets stay within it). On a rank
            outside the set, or for a set of one rank, the gradients are
            returned as they are (Horovod's rule).

    Returns:
        A list of the same length and shapes as ``grads``.

    Example:
        >>> grads = tape.gradient(loss, model.trainable_variables)
        >>> grads = hvdkit.reduce_gradients(grads, bucket_bytes=8 << 20)
    """
    _compat.refuse_xla("hvdkit gradient reduction")
    grouping = _buckets.check_groups(groups, num_groups, "reduce_gradients")
    bucket_bytes = _buckets.resolve_bucket_bytes(bucket_bytes, "reduce_gradients")
    ps = process_sets.resolve(process_set, "reduce_gradients", member=False)
    n = len(ps.ranks) if ps.process_set_id else runtime.size()
    if n == 1 or not ps.included():
        if variables is not None:  # a rank outside the set, or a set of one: local by design
            _updates.mark_local(variables)
        return list(grads)
    if variables is None:  # checked at the optimizer's update, which names them
        _updates.note_unlisted(ps, n, tf.compat.v1.get_default_graph())
    else:
        _updates.mark_reduced(variables)
        waits = _same_start.check(variables, ps, n)
        if waits:  # only in a job whose ranks differed at their first reduction
            with tf.control_dependencies(waits):
                grads = [tf.identity(g) if isinstance(g, tf.Tensor) else g for g in grads]
    if op is ReduceOp.ADASUM:
        collectives.check_adasum(ps, "reduce_gradients")
    out: list = list(grads)
    dense_idx = []
    for i, g in enumerate(grads):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            if sparse_as_dense:
                out[i] = tf.convert_to_tensor(g)
                dense_idx.append(i)
            else:
                if op is ReduceOp.ADASUM:
                    collectives.allreduce(g, op=op)  # Horovod's error: densify them
                with tf.device(device_sparse):
                    values = collectives.allgather(g.values, process_set=ps)
                    indices = collectives.allgather(g.indices, process_set=ps)
                    if op == ReduceOp.AVERAGE:
                        values = values / tf.cast(n, values.dtype)
                out[i] = tf.IndexedSlices(values, indices, dense_shape=g.dense_shape)
        else:
            dense_idx.append(i)
    if not dense_idx and step is None:
        return out
    with tf.device(device_dense):
        packed = {i: compression.compress(tf.convert_to_tensor(out[i])) for i in dense_idx}
        if grouping is None:
            sizes = [_nbytes(packed[i][0]) for i in dense_idx]
            buckets = [[dense_idx[k] for k in b] for b in _buckets.by_bytes(sizes, bucket_bytes)]
        else:
            buckets = _buckets.horovod_groups(grouping, dense_idx, variables)
        reduced = _reduce_buckets(buckets or [[]], packed, op, step, compression, ps)
    for i, r in reduced.items():
        out[i] = r
    return out


def _nbytes(t: tf.Tensor) -> int:
    """Bytes of a gradient (its static shape; unknown dimensions count as 1)."""
    return t.shape.num_elements() * t.dtype.size if t.shape.is_fully_defined() else t.dtype.size


def _reduce_buckets(
    buckets: list[list[int]],
    packed: dict,
    op: ReduceOp,
    step,
    compression: type[Compressor],
    ps: process_sets.ProcessSet,
) -> dict:
    """One grouped allreduce per bucket; the step marker rides in the first.

    The buckets' inputs depend on nothing but their own gradients (and the
    progress token, which depends on nothing), so each allreduce starts as
    soon as its bucket exists. Every output waits for the step check, which
    needs only the first bucket: no rank applies gradients of a mismatched
    step, and the optimizer updates the variables of early buckets while later
    ones are still on the wire (the progress marker waits for every bucket).
    """
    token = _graph_progress.waiting(step)
    call = _op_names.stable_name("gradients")  # rank-stable Horovod names (see _op_names)
    results: dict[int, tf.Tensor] = {}
    finished = []  # one output of every bucket, for the progress marker
    marker = None
    for b, bucket in enumerate(buckets):
        tensors = [packed[i][0] for i in bucket]
        if b == 0 and step is not None:
            tensors.append(_step_marker(step, tensors[0].dtype if tensors else tf.float32))
        with tf.control_dependencies([token]):
            tensors = [tf.identity(t) for t in tensors]
        reduced = collectives.grouped_allreduce(
            tensors,
            op=op,
            name=None if call is None else f"{call}.{b}",
            ignore_name_scope=True,
            process_set=ps,
        )
        if b == 0 and step is not None:
            marker = reduced.pop()
        finished.append(marker if not reduced else reduced[0])
        results.update(zip(bucket, reduced, strict=True))
    _graph_progress.done(token, finished)  # stateful: tf.function runs it
    n = len(ps.ranks) if ps.process_set_id else runtime.size()
    # hvdkit.elastic: a rank that trains before it has the job's state (Horovod's elastic
    # example does) meets ranks at another step; traced again with the check once it has it
    unchecked = step is None or _meeting.state_pending()
    checks = [] if unchecked else [_check_step_marker(step, marker, op, n)]
    with tf.control_dependencies(checks):
        return {i: tf.identity(compression.decompress(r, packed[i][1])) for i, r in results.items()}


# Horovod's DistributedOptimizer arguments that hvdkit does not implement.
_HOROVOD_ONLY_ARGUMENTS = (
    "gradient_predivide_factor",
    "scale_local_gradients",
)


def _refuse_extra_arguments(kwargs: dict) -> None:
    """Only `name` belongs to the wrapper; say where anything else should go."""
    if not kwargs:
        return
    horovod_only = sorted(k for k in kwargs if k in _HOROVOD_ONLY_ARGUMENTS)
    if horovod_only:
        raise ConfigurationError(
            f"DistributedOptimizer does not support Horovod's {horovod_only} "
            "(the predivide factor is not implemented in hvdkit); drop them."
        )
    raise ConfigurationError(
        f"DistributedOptimizer got {sorted(kwargs)}: these are options of the wrapped Keras "
        "optimizer. Set them when creating it, e.g. "
        "DistributedOptimizer(keras.optimizers.SGD(learning_rate=0.1, clipnorm=1.0))."
    )


# --------------------------------------------------------------- loss scaling
# Keras's LossScaleOptimizer decides from the gradients it is given whether to
# apply a step and how to change the loss scale. Around a DistributedOptimizer
# (which `model.compile` builds by itself under a "mixed_float16" policy) those
# are each rank's *local* gradients: a step that overflows on one rank only is
# skipped there, and that rank never joins the gradient allreduce the others
# wait in. Keras 3 has no hook between computing and applying gradients, so
# hvdkit routes LossScaleOptimizer's apply, for a DistributedOptimizer inside
# only, through `_loss_scaled_apply`: reduce first, decide from the averaged
# gradients (identical on every rank), then apply them without reducing again.
_LSO = keras.optimizers.LossScaleOptimizer


def _loss_scaled_apply(lso, keras_apply, grads, trainable_variables=None):
    dist = lso.inner_optimizer
    if not isinstance(dist, DistributedOptimizer):
        return keras_apply(lso, grads, trainable_variables)
    grads = list(grads)
    if trainable_variables is None:
        trainable_variables = lso._trainable_variables
    trainable_variables = list(trainable_variables)
    if not dist.built:
        with keras.name_scope(dist.name, caller=dist):
            dist.build(trainable_variables)
    if dist.backward_passes_per_step == 1:
        grads = dist.reduce(grads, trainable_variables)
        finite = lso.check_finite(grads)  # the same averaged gradients on every rank
    else:
        # Gradients are accumulated locally and reduced every k passes, so only
        # the decision is collective: skip on every rank if any rank overflowed.
        local = tf.cast(lso.check_finite(grads), tf.int32)
        finite = collectives.allreduce(tf.reshape(local, [1]), op=ReduceOp.MIN)[0] > 0
    with dist._reduced_upstream(dist.backward_passes_per_step == 1):
        keras.ops.cond(
            finite,
            lambda: lso._stateful_handle_finite_grads(grads, trainable_variables),
            lso._stateful_handle_non_finite_grads,
        )


def route_loss_scaling() -> None:
    """Send Keras's LossScaleOptimizer around a DistributedOptimizer through hvdkit (once).

    Called by :func:`hvdkit.init`; a DistributedOptimizer built without it
    calls it too. The patch itself, on Keras's private API, is
    :func:`hvdkit._compat.route_loss_scale_apply`.
    """
    _compat.route_loss_scale_apply(_loss_scaled_apply)


_LOADING_NOTE = (
    "an hvdkit.DistributedOptimizer: load with hvdkit.load_model(path), which works even "
    "after keras.saving.get_custom_objects().clear(), or import hvdkit before "
    "keras.models.load_model and keep its registration"
)


@keras.saving.register_keras_serializable(package="hvdkit", name="DistributedOptimizer")
class DistributedOptimizer(keras.optimizers.Optimizer):
    """Wraps a Keras 3 optimizer so that gradients are averaged over all ranks.

    Use it exactly where the original optimizer was used: ``model.compile``,
    ``optimizer.apply_gradients(zip(grads, vars))`` or
    ``optimizer.apply(grads, vars)``. The wrapped optimizer keeps its
    configuration (learning-rate schedules included) and its state; this
    object forwards ``learning_rate``, ``iterations`` and ``scale_loss`` to it.

    Args:
        optimizer: a ``keras.optimizers.Optimizer`` instance, or a name such
            as ``"adam"``.
        name: optional name of the wrapper.
        op: ``hvdkit.Average`` (default), ``hvdkit.Sum``, or ``hvdkit.Adasum``
            (Horovod's delta rule: each rank applies its own gradients with
            the wrapped optimizer, and every ``backward_passes_per_step``
            steps the change of the weights since the last exchange is
            Adasum-reduced and becomes every rank's change; MPI only, the
            whole job, a power of 2 ranks. Horovod's advice on the learning
            rate: do not scale it by ``size()``; see docs/porting-horovod.md).
        compression: ``hvdkit.Compression.none`` or ``.fp16`` (float32
            gradients sent as float16).
        backward_passes_per_step: accumulate gradients locally over this many
            calls, then reduce once and apply once. The wrapped optimizer's
            ``iterations`` counts applied updates only.
        average_aggregated_gradients: divide the accumulated gradients by
            ``backward_passes_per_step`` (so k passes on batch B equal one
            step on batch k*B with a mean loss). ``None`` (default): ``True``,
            and ``False`` with ``Adasum``, which accumulates no gradients
            (``True`` with it is refused, as Horovod).
        sparse_as_dense: densify ``tf.IndexedSlices`` gradients before
            reducing (faster for small embeddings).
        device_dense, device_sparse: TF devices for the reduction (Horovod's
            arguments); ``""`` lets TensorFlow choose.
        bucket_bytes: gradients go out in buckets of this many bytes, last
            layer first, each starting while the backward pass still runs;
            ``0`` = one allreduce per gradient. ``None``: ``HVDKIT_BUCKET_BYTES``
            or 4 MiB (docs/performance.md, "Overlap").
        groups: Horovod's explicit grouping instead of ``bucket_bytes``: an
            int splits the gradients (in model order) into that many
            allreduces; a list of lists of variables reduces each list together
            and every other gradient alone. ``num_groups`` is its older name.
        process_set: reduce the gradients within this registered
            :class:`~hvdkit.ProcessSet` only; a rank outside it applies its
            own gradients (Horovod's rule). Not saved with the model.

    Raises:
        ConfigurationError: ``optimizer`` is not a Keras 3 optimizer, is already
            distributed, or another argument is out of range.

    Example:
        >>> opt = keras.optimizers.Adam(1e-3 * hvdkit.size())     # hvdkit: scale lr
        >>> opt = hvdkit.DistributedOptimizer(opt)                 # hvdkit: wrap
        >>> model.compile(optimizer=opt, loss="mse")
    """

    def __new__(cls, optimizer=None, *args, **kwargs):
        if isinstance(optimizer, _LSO):
            # DistributedOptimizer(LossScaleOptimizer(opt)) becomes
            # LossScaleOptimizer(DistributedOptimizer(opt)): one structure for
            # both orders, which `model.compile` does not wrap a second time.
            if optimizer.built:
                raise ConfigurationError(
                    "DistributedOptimizer got a LossScaleOptimizer that is already built "
                    "(it holds a loss scale); wrap it before the first training step."
                )
            inner = cls(optimizer.inner_optimizer, *args, **kwargs)
            return _LSO(
                inner,
                initial_scale=optimizer.initial_scale,
                dynamic_growth_steps=optimizer.dynamic_growth_steps,
                name=optimizer.name,
            )
        return super().__new__(cls)

    def __init__(
        self,
        optimizer,
        name: str | None = None,
        *,
        op: ReduceOp = ReduceOp.AVERAGE,
        compression: type[Compressor] = Compression.none,
        backward_passes_per_step: int = 1,
        average_aggregated_gradients: bool | None = None,
        sparse_as_dense: bool = False,
        device_dense: str = "",
        device_sparse: str = "",
        bucket_bytes: int | None = None,
        groups: int | list | None = None,
        num_groups: int = 0,
        process_set: process_sets.ProcessSet | None = None,
        **kwargs,
    ):
        if isinstance(optimizer, (str, dict)):  # "adam", or a serialized optimizer
            optimizer = keras.optimizers.get(optimizer)
        if isinstance(optimizer, DistributedOptimizer):
            raise ConfigurationError(
                "the optimizer is already an hvdkit.DistributedOptimizer; wrap the "
                "plain Keras optimizer once."
            )
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            hint = ""
            if hasattr(optimizer, "apply_gradients"):
                hint = (
                    " It looks like a tf.keras 2 / tf.compat.v1 optimizer: create it "
                    "from `keras.optimizers` (Keras 3) instead."
                )
            raise ConfigurationError(
                "DistributedOptimizer wraps a Keras 3 optimizer such as "
                f"keras.optimizers.SGD(0.01); got {type(optimizer).__module__}."
                f"{type(optimizer).__qualname__}.{hint}"
            )
        _check_reduction_args(op, compression, "DistributedOptimizer")
        if op is ReduceOp.ADASUM and average_aggregated_gradients:
            raise ConfigurationError(
                "DistributedOptimizer(op=hvdkit.Adasum) does not support "
                "average_aggregated_gradients=True (as Horovod): Adasum exchanges the change of "
                "the weights, not accumulated gradients. Drop the argument."
            )
        if average_aggregated_gradients is None:
            average_aggregated_gradients = op is not ReduceOp.ADASUM
        if process_set is not None:
            process_sets.resolve(process_set, "DistributedOptimizer", member=False)
        backward_passes_per_step = check_int(
            "backward_passes_per_step",
            backward_passes_per_step,
            minimum=1,
            message=f"backward_passes_per_step={backward_passes_per_step!r} must be an int >= 1.",
        )
        _refuse_extra_arguments(kwargs)
        groups = _buckets.check_groups(groups, num_groups, "DistributedOptimizer")
        _buckets.check_bucket_bytes(bucket_bytes, "DistributedOptimizer")
        super().__init__(learning_rate=0.0, name=name or f"Distributed{optimizer.name}")
        self.inner_optimizer = optimizer
        self.op = op
        self.compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.average_aggregated_gradients = average_aggregated_gradients
        self.sparse_as_dense = sparse_as_dense
        self.device_dense = device_dense
        self.device_sparse = device_sparse
        self.bucket_bytes = bucket_bytes
        self.groups = groups
        self.process_set = process_set
        self._adasum_start: list = []  # the weights at the last Adasum exchange
        self._accumulators: list = []
        self._pass_counter = None
        self._skip_reduce = False
        route_loss_scaling()  # already done by hvdkit.init(); here if it was not called

    # ------------------------------------------------------------- state
    @_compat.no_automatic_dependency_tracking
    def build(self, var_list):
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        if self.op is ReduceOp.ADASUM:
            self._pass_counter = self.add_variable(
                shape=(), dtype="int", initializer="zeros", name="hvdkit_pass_counter"
            )
            self._adasum_start = [
                self.add_variable_from_reference(v, name="hvdkit_adasum_start") for v in var_list
            ]
        elif self.backward_passes_per_step > 1:
            self._pass_counter = self.add_variable(
                shape=(), dtype="int", initializer="zeros", name="hvdkit_pass_counter"
            )
            self._accumulators = [
                self.add_variable_from_reference(v, name="hvdkit_grad_accumulator")
                for v in var_list
            ]
        super().build(var_list)

    @property
    def variables(self):
        own = ([self._pass_counter] if self._pass_counter is not None else []) + list(
            self._accumulators or self._adasum_start
        )
        return own + list(self.inner_optimizer.variables)

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self.inner_optimizer.learning_rate = value

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    # ------------------------------------------------------------- updates
    @contextlib.contextmanager
    def _reduced_upstream(self, skip: bool = True):
        """While active, `apply` takes its gradients as already reduced."""
        before, self._skip_reduce = self._skip_reduce, skip
        try:
            yield
        finally:
            self._skip_reduce = before

    @not_converted
    def reduce(self, grads, variables=None):
        """The allreduce step alone: returns the averaged (or summed) gradients."""
        if self._skip_reduce:
            return list(grads)
        return reduce_gradients(
            grads,
            step=self.iterations,
            bucket_bytes=self.bucket_bytes,
            groups=self.groups,
            variables=variables,
            op=self.op,
            compression=self.compression,
            sparse_as_dense=self.sparse_as_dense,
            device_dense=self.device_dense,
            device_sparse=self.device_sparse,
            process_set=self.process_set,
        )

    @not_converted
    def apply_gradients(self, grads_and_vars):
        grads, variables = zip(*grads_and_vars, strict=True)
        self.apply(grads, variables)
        return self.iterations  # the wrapped optimizer's count of applied updates

    @not_converted
    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ConfigurationError(
                    "DistributedOptimizer.apply(grads) without variables needs a built "
                    "optimizer: call optimizer.build(model.trainable_variables) first, or "
                    "pass the variables."
                )
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise ConfigurationError(
                f"got {len(grads)} gradients for {len(trainable_variables)} variables; "
                "pass one gradient (or None) per variable."
            )
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
        with _updates.reducing():  # the wrapped optimizer's update is not the unreduced mistake
            if self.op is ReduceOp.ADASUM and not self._skip_reduce:
                self._adasum_apply(grads, trainable_variables)
            elif self.backward_passes_per_step == 1:
                reduced = self.reduce(grads, trainable_variables)
                self.inner_optimizer.apply(reduced, trainable_variables)
            else:
                self._accumulate_and_maybe_apply(grads, trainable_variables)

    def _adasum_apply(self, grads, trainable_variables):
        """Horovod's Adasum optimizer: step locally, exchange the weights' change every k steps.

        At the first step the start weights are taken; each step the wrapped
        optimizer applies this rank's own gradients; every
        ``backward_passes_per_step``-th step each rank's change since the
        start (``w - start``) is Adasum-reduced, added to the start, and
        becomes every rank's weights.
        """
        index = {id(v): i for i, v in enumerate(self._trainable_variables)}
        starts = [self._adasum_start[index[id(v)]] for v in trainable_variables]
        k = self.backward_passes_per_step
        ps = process_sets.resolve(self.process_set, "DistributedOptimizer", member=False)
        waits = []
        if runtime.size() > 1:
            collectives.check_adasum(ps, "DistributedOptimizer")
            # Adasum exchanges the change of the weights: ranks that start apart stay apart
            waits = _same_start.check(trainable_variables, ps, runtime.size())
        first = tf.equal(self._pass_counter.value, 0)
        with tf.control_dependencies(waits):
            for start, v in zip(starts, trainable_variables, strict=True):
                start.assign(tf.where(first, v.value, start.value))
        self.inner_optimizer.apply(grads, trainable_variables)

        def exchange():
            deltas = [v.value - s.value for v, s in zip(trainable_variables, starts, strict=True)]
            call = _op_names.stable_name("adasum")
            reduced = collectives.grouped_allreduce(
                deltas, op=ReduceOp.ADASUM, name=call, ignore_name_scope=True
            )
            for v, s, d in zip(trainable_variables, starts, reduced, strict=True):
                s.assign_add(d)
                v.assign(s.value)
            return tf.constant(True)

        keras.ops.cond(
            tf.equal(self._pass_counter.value % k, k - 1), exchange, lambda: tf.constant(False)
        )
        self._pass_counter.assign_add(1)

    def _accumulate_and_maybe_apply(self, grads, trainable_variables):
        index = {id(v): i for i, v in enumerate(self._trainable_variables)}
        pairs = [
            (self._accumulators[index[id(v)]], g, v)
            for g, v in zip(grads, trainable_variables, strict=True)
            if g is not None
        ]
        for acc, g, _ in pairs:
            acc.assign_add(tf.convert_to_tensor(g))
        self._pass_counter.assign_add(1)
        k = self.backward_passes_per_step

        def apply_now():
            scale = 1.0 / k if self.average_aggregated_gradients else 1.0
            summed = [acc.value * tf.cast(scale, acc.dtype) for acc, _, _ in pairs]
            variables = [v for _, _, v in pairs]
            self.inner_optimizer.apply(self.reduce(summed, variables), variables)
            # Every accumulator restarts from zero, including those of variables
            # that got no gradient in this last pass (nothing leaks into the next
            # window; such a variable's earlier passes are not applied).
            for acc in self._accumulators:
                acc.assign(tf.zeros_like(acc.value))
            return tf.constant(True)

        keras.ops.cond(
            tf.equal(self._pass_counter.value % k, 0), apply_now, lambda: tf.constant(False)
        )

    # ------------------------------------------------------------- config
    def get_config(self):
        return {
            "name": self.name,
            "optimizer": _compat.serialize_keras_object(self.inner_optimizer),
            "op": self.op.value,
            "compression": self.compression.name,
            "backward_passes_per_step": self.backward_passes_per_step,
            "average_aggregated_gradients": self.average_aggregated_gradients,
            "sparse_as_dense": self.sparse_as_dense,
            "device_dense": self.device_dense,
            "device_sparse": self.device_sparse,
            "bucket_bytes": self.bucket_bytes,
            # lists of variables do not serialize; the loaded optimizer uses bucket_bytes
            "groups": self.groups if isinstance(self.groups, int) else None,
            # Shown by Keras in its error when the class is not registered (e.g. after
            # keras.saving.get_custom_objects().clear()): says how to load the file.
            "loading": _LOADING_NOTE,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        config.pop("loading", None)
        inner = _compat.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        config["op"] = ReduceOp(config.get("op", "average"))
        config["compression"] = Compression.by_name(config.get("compression", "none"))
        return cls(inner, **config)


class DistributedGradientTape:
    """A ``tf.GradientTape`` whose ``gradient()`` returns rank-averaged gradients.

    Holds the tape it wraps and forwards everything else to it.

    Args:
        tape: the ``tf.GradientTape`` that recorded the forward pass.
        op, compression, sparse_as_dense, device_dense, device_sparse,
            bucket_bytes, groups, num_groups, process_set: as in
            :class:`DistributedOptimizer` (``Adasum`` here reduces the gradients
            themselves, as Horovod's tape does).
            The buckets overlap the backward pass when ``gradient()`` is called
            inside a ``tf.function`` (eagerly, the tape computes every gradient
            before the first bucket can leave).

    Example:
        >>> with tf.GradientTape() as tape:
        ...     loss = loss_fn(y, model(x, training=True))
        >>> tape = hvdkit.DistributedGradientTape(tape)            # hvdkit
        >>> grads = tape.gradient(loss, model.trainable_variables)  # averaged
        >>> optimizer.apply(grads, model.trainable_variables)
    """

    def __init__(
        self,
        tape: tf.GradientTape,
        *,
        op: ReduceOp = ReduceOp.AVERAGE,
        compression: type[Compressor] = Compression.none,
        sparse_as_dense: bool = False,
        device_dense: str = "",
        device_sparse: str = "",
        bucket_bytes: int | None = None,
        groups: int | list | None = None,
        num_groups: int = 0,
        process_set: process_sets.ProcessSet | None = None,
    ):
        if not isinstance(tape, tf.GradientTape):
            raise ConfigurationError(
                f"DistributedGradientTape wraps a tf.GradientTape; got {type(tape).__name__}."
            )
        _check_reduction_args(op, compression, "DistributedGradientTape")
        _buckets.check_bucket_bytes(bucket_bytes, "DistributedGradientTape")
        self._tape = tape
        self._reduce_kwargs = dict(
            groups=_buckets.check_groups(groups, num_groups, "DistributedGradientTape"),
            bucket_bytes=bucket_bytes,
            op=op,
            compression=compression,
            sparse_as_dense=sparse_as_dense,
            device_dense=device_dense,
            device_sparse=device_sparse,
            process_set=process_set,
        )

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._tape, name)

    @not_converted
    def gradient(self, target, sources, output_gradients=None, **kwargs):
        """Like ``tf.GradientTape.gradient``, then reduced over ranks (same structure)."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        flat = tf.nest.flatten(grads)
        variables = tf.nest.flatten(sources)
        reduced = reduce_gradients(flat, variables=variables, **self._reduce_kwargs)
        return tf.nest.pack_sequence_as(grads, reduced)

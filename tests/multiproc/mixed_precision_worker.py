"""Mixed precision and rank-local branches on 2 ranks.

The claim: under ``mixed_float16``, whether a step is applied and the loss
scale are decided from the averaged gradients, so a batch that overflows on
ONE rank only skips that step on every rank, exactly as 1 process training on
the whole batch skips it. Overflow is injected through the data: a sample of
1e6 (infinite in float16) sits in rank 1's half of chosen global batches, so
the single-process reference (plain Keras, no collectives, computed here on
the full batches) sees the same overflow at the same steps.
"""

import os
import sys
import warnings

import keras
import numpy as np
import tensorflow as tf

import hvdkit as hvd

from _harness import Checks

hvd.init()
r, n = hvd.rank(), hvd.size()
c = Checks(r, sys.argv[1])
RTOL = 1e-3  # float16 arithmetic

rng = np.random.default_rng(0)
N, GLOBAL_BATCH, EPOCHS = 64, 16, 3
STEPS_PER_EPOCH = N // GLOBAL_BATCH
X = rng.normal(size=(N, 8)).astype("float32")
Y = (X @ rng.normal(size=(8, 3)) > 0).argmax(1).astype("int32")
HALF = GLOBAL_BATCH // n
BAD_BATCHES = {1}  # overflow in rank 1's half of the 2nd batch of every epoch
X_BAD = X.copy()
for b in BAD_BATCHES:
    X_BAD[b * GLOBAL_BATCH + HALF] = 1e6  # infinite in float16
EXPECTED_SKIPS = [e * STEPS_PER_EPOCH + b for e in range(EPOCHS) for b in sorted(BAD_BATCHES)]
MINE = np.concatenate(
    [np.arange(b + r * HALF, b + (r + 1) * HALF) for b in range(0, N, GLOBAL_BATCH)]
)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_model(seed=0, built=True):
    keras.utils.set_random_seed(seed)
    layers = [
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(3, dtype="float32"),  # float32 logits, as Keras advises
    ]
    return keras.Sequential(([keras.Input((8,))] if built else []) + layers)


def weights(model):
    return [w.numpy() for w in model.weights]


def assert_close(got, want, rtol=RTOL, atol=1e-4):  # atol: near-zero weights
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def assert_same_on_all_ranks(ws, label):
    flat = np.concatenate([np.asarray(w, np.float64).ravel() for w in ws])
    both = hvd.allgather(flat[None])
    if not np.array_equal(both[0], both[1]):
        raise AssertionError(f"{label}: ranks differ, max |diff| {np.abs(both[0] - both[1]).max()}")


def lso_of(opt):
    """The LossScaleOptimizer holding the loss scale (outermost)."""
    assert isinstance(opt, keras.optimizers.LossScaleOptimizer), type(opt)
    return opt


class Trace(keras.callbacks.Callback):
    """Per step: applied-update count and loss scale; per epoch: same weights on all ranks."""

    def __init__(self, check_ranks):
        super().__init__()
        self.check_ranks = check_ranks
        self.iterations, self.scales, self.epochs_checked = [], [], 0

    def on_train_batch_end(self, batch, logs=None):
        opt = lso_of(self.model.optimizer)
        self.iterations.append(int(opt.iterations.numpy()))
        self.scales.append(float(opt.dynamic_scale.numpy()))

    def on_epoch_end(self, epoch, logs=None):
        if self.check_ranks:
            assert_same_on_all_ranks(weights(self.model), f"epoch {epoch}")
            self.epochs_checked += 1


def skipped(iterations):
    """Steps whose update was not applied (the applied count did not grow)."""
    before = [0, *iterations[:-1]]
    return [i for i, (a, b) in enumerate(zip(before, iterations, strict=True)) if a == b]


def fit_traced(make_opt, x, y, batch_size, check_ranks):
    """A fresh model compiled with ``make_opt()``, fit EPOCHS epochs in order: (model, Trace)."""
    model = make_model()
    model.compile(optimizer=make_opt(), loss=LOSS)
    trace = Trace(check_ranks=check_ranks)
    model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[trace],
    )
    return model, trace


def fit_pair(make_opt_dist, make_opt_ref, policy="mixed_float16", x=X_BAD):
    """(2-rank model, its trace, 1-process reference model, its trace)."""
    keras.mixed_precision.set_global_policy(policy)
    try:
        model, trace = fit_traced(make_opt_dist, x[MINE], Y[MINE], HALF, check_ranks=True)
        ref, ref_trace = fit_traced(make_opt_ref, x, Y, GLOBAL_BATCH, check_ranks=False)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return model, trace, ref, ref_trace


def check_fit_against_reference(model, trace, ref, ref_trace, label):
    assert trace.epochs_checked == EPOCHS
    assert skipped(trace.iterations) == EXPECTED_SKIPS, (label, skipped(trace.iterations))
    assert skipped(ref_trace.iterations) == EXPECTED_SKIPS, skipped(ref_trace.iterations)
    assert trace.iterations == ref_trace.iterations
    assert trace.scales == ref_trace.scales, (trace.scales, ref_trace.scales)  # exactly
    assert_close(weights(model), weights(ref))
    all_scales = hvd.allgather_object(trace.scales)
    assert all_scales[0] == all_scales[1]
    c.record(f"{label}_skipped", skipped(trace.iterations))
    c.record(f"{label}_scales", trace.scales)


SGD = lambda: keras.optimizers.SGD(0.1)

with c.check("fit_auto_wrapped_loss_scaling_one_rank_overflows"):
    # Keras wraps the DistributedOptimizer in its LossScaleOptimizer at compile.
    model, trace, ref, ref_trace = fit_pair(lambda: hvd.DistributedOptimizer(SGD()), SGD)
    assert isinstance(model.optimizer.inner_optimizer, hvd.DistributedOptimizer)
    check_fit_against_reference(model, trace, ref, ref_trace, "auto")

with c.check("fit_explicit_lso_around_distributed_optimizer"):
    lso = keras.optimizers.LossScaleOptimizer
    model, trace, ref, ref_trace = fit_pair(
        lambda: lso(hvd.DistributedOptimizer(SGD()), dynamic_growth_steps=2),
        lambda: lso(SGD(), dynamic_growth_steps=2),
    )
    assert any(b > a for a, b in zip(trace.scales[:-1], trace.scales[1:], strict=True))  # grew
    check_fit_against_reference(model, trace, ref, ref_trace, "lso_outside")

with c.check("fit_distributed_optimizer_around_lso"):
    lso = keras.optimizers.LossScaleOptimizer
    model, trace, ref, ref_trace = fit_pair(
        lambda: hvd.DistributedOptimizer(lso(SGD(), dynamic_growth_steps=2)),
        lambda: lso(SGD(), dynamic_growth_steps=2),
    )
    # one structure for both orders: compile did not wrap a second time
    assert isinstance(model.optimizer, lso)
    assert isinstance(model.optimizer.inner_optimizer, hvd.DistributedOptimizer)
    check_fit_against_reference(model, trace, ref, ref_trace, "dist_outside")

with c.check("fit_mixed_bfloat16_equals_single_process"):
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = make_model()
        model.compile(optimizer=hvd.DistributedOptimizer(SGD()), loss=LOSS)
        model.fit(X[MINE], Y[MINE], batch_size=HALF, epochs=EPOCHS, shuffle=False, verbose=0)
        ref = make_model()
        ref.compile(optimizer=SGD(), loss=LOSS)
        ref.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert not isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    assert_same_on_all_ranks(weights(model), "bfloat16")
    assert_close(weights(model), weights(ref), rtol=2e-2, atol=2e-3)  # bfloat16: 8-bit mantissa


def custom_loop(model, opt, xs, ys, batch, tape_wrapper, check_ranks):
    @tf.function
    def train_step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
            scaled = opt.scale_loss(loss)
        tape = tape_wrapper(tape)
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply(grads, model.trainable_variables)

    iterations, scales = [], []
    for _ in range(EPOCHS):
        for b in range(0, len(xs), batch):
            train_step(xs[b : b + batch], ys[b : b + batch])
            iterations.append(int(opt.iterations.numpy()))
            scales.append(float(opt.dynamic_scale.numpy()))
        if check_ranks:
            assert_same_on_all_ranks(weights(model), "custom loop epoch")
    return iterations, scales


def _identity(tape):
    return tape


def check_custom_loop(make_opt, tape_wrapper, label):
    keras.mixed_precision.set_global_policy("mixed_float16")
    lso = keras.optimizers.LossScaleOptimizer
    try:
        model = make_model()
        it, sc = custom_loop(model, make_opt(), X_BAD[MINE], Y[MINE], HALF, tape_wrapper, True)
        ref = make_model()
        ref_it, ref_sc = custom_loop(
            ref, lso(SGD(), dynamic_growth_steps=2), X_BAD, Y, GLOBAL_BATCH, _identity, False
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert skipped(it) == EXPECTED_SKIPS == skipped(ref_it), (skipped(it), skipped(ref_it))
    assert sc == ref_sc, (sc, ref_sc)
    assert_close(weights(model), weights(ref))
    c.record(f"{label}_skipped", skipped(it))


with c.check("custom_loop_gradient_tape_and_scale_loss"):
    lso = keras.optimizers.LossScaleOptimizer
    check_custom_loop(
        lambda: lso(SGD(), dynamic_growth_steps=2), hvd.DistributedGradientTape, "tape"
    )

with c.check("custom_loop_lso_around_distributed_optimizer"):
    lso = keras.optimizers.LossScaleOptimizer
    check_custom_loop(
        lambda: lso(hvd.DistributedOptimizer(SGD()), dynamic_growth_steps=2), _identity, "opt"
    )

with c.check("fit_lso_with_backward_passes_per_step_2"):
    # Gradients accumulate locally; only the skip decision is collective (a Min
    # allreduce per pass). A pass that overflows on rank 1 only is skipped on
    # both: the loss scale halves at the same steps on both ranks.
    lso = keras.optimizers.LossScaleOptimizer
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        dist = hvd.DistributedOptimizer(SGD(), backward_passes_per_step=2)
        model, trace = fit_traced(
            lambda: lso(dist, dynamic_growth_steps=2), X_BAD[MINE], Y[MINE], HALF, check_ranks=True
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert trace.epochs_checked == EPOCHS
    halved = [i for i in range(1, len(trace.scales)) if trace.scales[i] == trace.scales[i - 1] / 2]
    assert halved == EXPECTED_SKIPS, (halved, trace.scales)
    assert trace.scales[0] == 2.0**15  # step 0 was finite: no halving before it
    all_scales = hvd.allgather_object(trace.scales)
    assert all_scales[0] == all_scales[1]
    assert int(dist.iterations.numpy()) > 0  # updates were applied

with c.check("optimizers_at_different_steps_fail_on_every_rank"):
    # An optimizer restored on one rank only: its gradient allreduce would
    # average gradients of different steps. The fused step marker stops it.
    model = make_model()
    opt = hvd.DistributedOptimizer(SGD())
    opt.build(model.trainable_variables)
    opt.iterations.assign(7 if r == 1 else 3)
    before = weights(model)
    grads = [tf.ones_like(v) for v in model.trainable_variables]
    try:
        opt.apply(grads, model.trainable_variables)
    except tf.errors.InvalidArgumentError as e:
        assert "different optimizer steps" in str(e), str(e)[:500]
        assert f"rank {r} of 2 is at step" in str(e), str(e)[:500]
    else:
        raise AssertionError("no error for optimizers at different steps")
    assert all(np.array_equal(a, b) for a, b in zip(before, weights(model), strict=True))
    # and at the same step it is no error
    opt.iterations.assign(5)
    opt.apply(grads, model.trainable_variables)
    assert int(opt.iterations.numpy()) == 6

with c.check("broadcast_callback_model_built_on_rank0_only"):
    # rank 0 restored a built model; rank 1's model is built by its first batch.
    model = make_model(seed=10 + r, built=(r == 0))
    model.compile(optimizer=hvd.DistributedOptimizer(SGD()), loss=LOSS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(
            X[MINE],
            Y[MINE],
            batch_size=HALF,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)],
        )
    assert_same_on_all_ranks(weights(model), "after broadcast")


def write_tfrecords(folder, counts):
    files = []
    for i, k in enumerate(counts):
        path = os.path.join(folder, f"part{i}.tfrecord")
        with tf.io.TFRecordWriter(path) as w:
            for j in range(k):
                w.write(f"{i}:{j}".encode())
        files.append(path)
    return files


with c.check("shard_files_called_with_other_arguments_on_one_rank"):
    # rank 1 deliberately evaluates shard 0 (as rank 0 does); before, rank 0
    # waited in an allgather of record counts that rank 1 never joined.
    folder = os.path.join(sys.argv[1], "records")
    if r == 0:
        os.makedirs(folder, exist_ok=True)
        write_tfrecords(folder, [3, 5, 2, 4])
    hvd.barrier()
    files = sorted(os.path.join(folder, f) for f in os.listdir(folder))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = hvd.data.shard(files) if r == 0 else hvd.data.shard(files, num_shards=2, shard_id=0)
    got = sorted(x.decode() for x in ds.as_numpy_iterator())
    # shard 0 reads files 0 and 2 (3 + 2 records) padded to the larger share (5 + 4)
    assert len(got) == 9, got
    assert set(got) == {f"0:{j}" for j in range(3)} | {f"2:{j}" for j in range(2)}, got
    assert hvd.allgather_object(got)[0] == hvd.allgather_object(got)[1]

with c.check("still_in_step_after_all_checks"):
    assert hvd.allreduce(np.array([1.0]), op=hvd.Sum)[0] == 2.0

c.finish()

"""Sink mode on 2 ranks: equivalence with plain steps, length checks, XLA.

Each rank trains on its half of every global batch (as in training_worker.py),
so 2 ranks must end with the weights of 1 process on the whole batch. The
sink's weights are compared with the same distributed step run from a plain
Python loop (rtol 1e-6) and with a single-process reference computed here
without collectives (rtol 1e-5).

An input error on one rank is in sink_input_error_worker.py.

Usage: sink_worker.py OUTDIR
"""

import sys

import keras
import numpy as np
import tensorflow as tf

import hvdkit as hvd
from hvdkit import sink

from _harness import Checks

hvd.init()
r, n = hvd.rank(), hvd.size()
c = Checks(r, sys.argv[1])

rng = np.random.default_rng(0)
X = rng.normal(size=(64, 8)).astype("float32")
Y = (X @ rng.normal(size=(8, 3)) > 0).argmax(1).astype("int32")
GLOBAL_BATCH = 16
HALF = GLOBAL_BATCH // n
MINE = np.concatenate(
    [np.arange(b + r * HALF, b + (r + 1) * HALF) for b in range(0, 64, GLOBAL_BATCH)]
)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)]
    )


def weights(model):
    return [w.numpy() for w in model.weights]


def assert_close(got, want, rtol):
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol / 10)


def assert_same_on_all_ranks(ws, label):
    flat = np.concatenate([w.ravel() for w in ws]).astype(np.float64)
    both = hvd.allgather(flat[None])
    assert np.array_equal(both[0], both[1]), f"{label}: weights differ across ranks"


def my_batches():
    """This rank's 4 batches of HALF rows, in global-batch order."""
    return tf.data.Dataset.from_tensor_slices((X[MINE], Y[MINE])).batch(HALF)


def step_for(model, opt, distributed=True):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        if distributed:
            tape = hvd.DistributedGradientTape(tape)  # an allreduce inside the sink's loop
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    return step


# ---------------------------------------------------------------- data_sink
with c.check("data_sink_equals_plain_distributed_steps"):
    k, s = 3, 3  # 9 steps over 4 batches: across the dataset's end twice
    # single process on whole global batches, no collectives
    ref = make_model()
    ref_step = step_for(ref, keras.optimizers.Adam(0.01), distributed=False)
    full = iter(tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH).repeat())
    for _ in range(k * s):
        ref_step(*next(full))
    # the same distributed step, from a plain Python loop
    plain = make_model()
    plain_step = step_for(plain, keras.optimizers.Adam(0.01))
    halves = iter(my_batches().repeat())
    for _ in range(k * s):
        plain_step(*next(halves))
    # the sink
    model, opt = make_model(), keras.optimizers.Adam(0.01)
    run = sink.data_sink(step_for(model, opt), my_batches(), sink_size=s)
    losses = [float(run()) for _ in range(k)]
    assert int(opt.iterations.numpy()) == k * s and run.steps_done == k * s
    assert_close(weights(model), weights(plain), rtol=1e-6)
    assert_close(weights(model), weights(ref), rtol=1e-5)
    assert_same_on_all_ranks(weights(model), "data_sink")
    c.record("data_sink_losses", losses)

with c.check("data_sink_distributed_optimizer_in_the_loop"):
    ref = make_model()
    ref_opt = keras.optimizers.SGD(0.1, momentum=0.9)
    ref_step = step_for(ref, ref_opt, distributed=False)
    full = iter(tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH).repeat())
    for _ in range(8):
        ref_step(*next(full))
    model = make_model()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    run = sink.data_sink(step_for(model, opt, distributed=False), my_batches(), sink_size=4)
    for _ in range(2):
        run()
    assert_close(weights(model), weights(ref), rtol=1e-5)
    assert_same_on_all_ranks(weights(model), "data_sink DistributedOptimizer")

# ---------------------------------------------------------------- Keras train()


class Count(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batch_ends, self.epoch_ends = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.batch_ends.append(batch)

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_ends.append(epoch)


def compiled():
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss=LOSS)
    return model


for sink_size, epochs in ((3, 3), (-1, 2)):
    with c.check(f"keras_train_sink_size_{sink_size}_equals_fit"):
        model, count = compiled(), Count()
        hist = sink.train(
            model,
            epochs,
            my_batches(),
            callbacks=[
                hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                hvd.callbacks.MetricAverageCallback(),
                count,
            ],
            sink_size=sink_size,
            verbose=0,
        )
        steps = sink_size if sink_size > 0 else 4
        # without sink mode, over the same batches
        plain = compiled()
        plain.fit(
            my_batches().repeat(), epochs=epochs, steps_per_epoch=steps, shuffle=False, verbose=0
        )
        assert_close(weights(model), weights(plain), rtol=1e-6)
        ref = make_model()
        ref.compile(optimizer=keras.optimizers.Adam(0.01), loss=LOSS)
        ref.fit(
            tf.data.Dataset.from_tensor_slices((X, Y)).batch(GLOBAL_BATCH).repeat(),
            epochs=epochs,
            steps_per_epoch=steps,
            verbose=0,
        )
        assert_close(weights(model), weights(ref), rtol=1e-5)
        assert_same_on_all_ranks(weights(model), f"train sink_size={sink_size}")
        assert count.batch_ends == [steps - 1] * epochs  # once per sink
        assert count.epoch_ends == list(range(epochs))
        assert len(hist.history["loss"]) == epochs
        assert int(model.optimizer.iterations.numpy()) == epochs * steps
        c.record(f"train_{sink_size}_loss", hist.history["loss"])

# ---------------------------------------------------------------- refusals
with c.check("unequal_per_rank_lengths_refused"):
    uneven = tf.data.Dataset.range(10 if r == 0 else 8).batch(2)  # 5 and 4 batches
    for call in (
        lambda: sink.data_sink(lambda b: b, uneven, 2),
        lambda: sink.train(compiled(), 1, uneven),
        lambda: sink.train(compiled(), 1, uneven, dataset_sink_mode=False),
    ):
        try:
            call()
        except hvd.ShardingError as exc:
            assert "(rank 0: 5, rank 1: 4)" in str(exc), str(exc)
        else:
            raise AssertionError("unequal lengths were not refused")
    unknown = uneven.filter(lambda b: True) if r == 1 else uneven
    try:
        sink.data_sink(lambda b: b, unknown, 2)
    except hvd.ShardingError as exc:
        assert "(rank 0: 5, rank 1: unknown)" in str(exc) and "assert_cardinality" in str(exc)
    else:
        raise AssertionError("an unknown length next to a known one was not refused")

with c.check("jit_compile_refused_in_a_multi_process_job"):
    try:
        sink.data_sink(lambda b: b, my_batches(), 2, jit_compile=True)
    except hvd.ConfigurationError as exc:
        assert "jit_compile=True in a job of 2 processes" in str(exc), str(exc)
    else:
        raise AssertionError("jit_compile=True was accepted")
    model = make_model()
    model.compile(optimizer="sgd", loss=LOSS, jit_compile=True)
    try:
        sink.train(model, 1, my_batches())
    except hvd.ConfigurationError as exc:
        assert "jit_compile=False" in str(exc), str(exc)
    else:
        raise AssertionError("a model compiled with jit_compile=True was accepted")

c.finish()

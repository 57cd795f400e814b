"""Gradient buckets on 2 ranks: exact against one process, and issued before the backward pass ends.

Every bucket setting (one allreduce per gradient, small buckets, Horovod's
``groups`` as an int and as lists of variables, the default single bucket of
a small model) must give the weights of one process training on the whole
batch, on every path that reduces gradients: ``fit``,
``fit(steps_per_execution)``, ``hvdkit.sink.train``, a custom ``tf.function``
loop with ``DistributedOptimizer`` or ``DistributedGradientTape``; with
fp16 compression, sparse gradients, ``backward_passes_per_step`` and mixed
precision. The number of grouped allreduces in the traced step is checked
against the plan, and the overlap itself as a fact of the graph: the first
bucket's allreduce does not depend on the first layer's gradient.
"""

import os
import sys

import keras
import numpy as np
import tensorflow as tf
from _equal import assert_close, assert_same_on_all_ranks, my_rows, weights

import hvdkit as hvd
from hvdkit import runtime, sink
from hvdkit._comm import buckets as _buckets
from hvdkit._comm import threads as _threads

from _harness import Checks

hvd.init()
r, n = hvd.rank(), hvd.size()
c = Checks(r, sys.argv[1])

rng = np.random.default_rng(1)
X = rng.normal(size=(64, 8)).astype("float32")
Y = (X @ rng.normal(size=(8, 3)) > 0).argmax(1).astype("int32")
GLOBAL_BATCH, EPOCHS = 16, 2
HALF = GLOBAL_BATCH // n
MINE = my_rows(len(X), GLOBAL_BATCH, r, n)
Xr, Yr = X[MINE], Y[MINE]
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
GROUPED_OP = "HorovodGroupedAllreduce"


def make_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(32, activation="tanh"),
            keras.layers.Dense(32, activation="tanh"),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )


# gradient bytes of make_model(), in model order: kernel, bias of each layer
SIZES = [8 * 32 * 4, 32 * 4, 32 * 32 * 4, 32 * 4, 32 * 16 * 4, 16 * 4, 16 * 3 * 4, 3 * 4]


def sgd():
    return keras.optimizers.SGD(0.1, momentum=0.9)


def reference(epochs=EPOCHS, opt=sgd, batch=GLOBAL_BATCH):
    model = make_model()
    model.compile(optimizer=opt(), loss=LOSS)
    model.fit(X, Y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return weights(model)


def custom_step(model, opt, tape_wrapper=None, seen=None):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        if tape_wrapper is not None:
            tape = tape_wrapper(tape)
        grads = tape.gradient(loss, model.trainable_variables)
        if seen is not None:  # tracing records the gradient tensors (graph checks)
            seen[:] = grads
        opt.apply(grads, model.trainable_variables)
        return loss

    return step


def grouped_ops(step):
    graph = step.get_concrete_function(
        tf.TensorSpec([HALF, 8], tf.float32), tf.TensorSpec([HALF], tf.int32)
    ).graph
    return graph, [op for op in graph.get_operations() if op.type == GROUPED_OP]


def run_custom(step):
    for _ in range(EPOCHS):
        for b in range(0, len(Xr), HALF):
            step(Xr[b : b + HALF], Yr[b : b + HALF])


REF = reference()
model0 = make_model()
VARS = model0.trainable_variables
SETTINGS = {
    # name: (DistributedOptimizer kwargs, the buckets expected, in issue order)
    "per_gradient": ({"bucket_bytes": 0}, _buckets.by_bytes(SIZES, 0)),
    "small_buckets": ({"bucket_bytes": 1024}, _buckets.by_bytes(SIZES, 1024)),
    "default": ({}, [list(range(7, -1, -1))]),
    "groups_3": ({"groups": 3}, [[0, 1, 2], [3, 4, 5], [6, 7]]),
    "num_groups_2": ({"num_groups": 2}, [[0, 1, 2, 3], [4, 5, 6, 7]]),
}
assert len(SETTINGS["per_gradient"][1]) == 8 and SETTINGS["small_buckets"][1] == [
    [7, 6, 5, 4],
    [3, 2],
    [1, 0],
]

for name, (kwargs, expected) in SETTINGS.items():
    with c.check(f"fit_{name}_equals_single_process"):
        model = make_model()
        model.compile(optimizer=hvd.DistributedOptimizer(sgd(), **kwargs), loss=LOSS)
        model.fit(Xr, Yr, batch_size=HALF, epochs=EPOCHS, shuffle=False, verbose=0)
        assert_close(weights(model), REF)
        assert_same_on_all_ranks(weights(model), name)

    with c.check(f"custom_loop_{name}_equals_single_process_with_planned_buckets"):
        model = make_model()
        step = custom_step(model, hvd.DistributedOptimizer(sgd(), **kwargs))
        _, ops = grouped_ops(step)
        assert len(ops) == len(expected), (len(ops), expected)
        # each allreduce carries its bucket's tensors (+ the step marker in the first)
        widths = sorted(len(op.inputs) for op in ops)
        want = sorted(len(b) + (k == 0) for k, b in enumerate(expected))
        assert widths == want, (widths, want)
        run_custom(step)
        assert_close(weights(model), REF)

with c.check("groups_as_lists_of_variables"):
    model = make_model()
    v = model.trainable_variables
    opt = hvd.DistributedOptimizer(sgd(), groups=[[v[0], v[2]], [v[7]]])
    step = custom_step(model, opt)
    _, ops = grouped_ops(step)
    # [v0, v2], [v7], then every other gradient alone: 2 + 5 allreduces
    assert len(ops) == 7, len(ops)
    run_custom(step)
    assert_close(weights(model), REF)

with c.check("gradient_tape_buckets_equal_single_process"):
    for kwargs in ({"bucket_bytes": 0}, {"groups": 2}, {}):
        model = make_model()
        tape = lambda t, kw=kwargs: hvd.DistributedGradientTape(t, **kw)
        run_custom(custom_step(model, sgd(), tape_wrapper=tape))
        assert_close(weights(model), REF)

with c.check("first_bucket_leaves_before_the_first_layer_gradient_exists"):
    # The ordering fact behind the overlap: in the traced step, the allreduce
    # of the first bucket (the last layer's gradients) has no path from the
    # op that computes the first layer's kernel gradient, the last one the
    # backward pass produces; so TensorFlow can run it while that gradient is
    # still being computed. With a single bucket there is such a path.
    def ancestors(op):
        seen, todo = set(), [op]
        while todo:
            o = todo.pop()
            for dep in [t.op for t in o.inputs] + list(o.control_inputs):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    def first_layer_grad_op_in_ancestors(kwargs):
        model, grads = make_model(), []
        step = custom_step(model, hvd.DistributedOptimizer(sgd(), **kwargs), seen=grads)
        graph, ops = grouped_ops(step)
        first_layer = grads[0].op
        assert first_layer.graph is graph
        # the allreduce whose inputs include the last layer's bias gradient
        last = [op for op in ops if any(grads[7].op in ancestors(i.op) | {i.op} for i in op.inputs)]
        assert len(last) == 1, last
        return [first_layer in ancestors(op) for op in ops], first_layer in ancestors(last[0])

    per_op, first = first_layer_grad_op_in_ancestors({"bucket_bytes": 0})
    assert not first, "the last layer's allreduce waits for the first layer's gradient"
    assert sum(per_op) == 1, per_op  # only the first layer's own kernel allreduce waits for it
    per_op, first = first_layer_grad_op_in_ancestors({"bucket_bytes": 1 << 30})
    assert per_op == [True] and first  # the single allreduce waits for the whole backward pass

with c.check("fit_steps_per_execution_buckets_equals_single_process"):
    model = make_model()
    model.compile(
        optimizer=hvd.DistributedOptimizer(sgd(), bucket_bytes=0),
        loss=LOSS,
        steps_per_execution=2,
    )
    model.fit(Xr, Yr, batch_size=HALF, epochs=EPOCHS, shuffle=False, verbose=0)
    assert_close(weights(model), REF)

with c.check("sink_train_buckets_equals_single_process"):
    model = make_model()
    model.compile(optimizer=hvd.DistributedOptimizer(sgd(), bucket_bytes=0), loss=LOSS)
    batches = tf.data.Dataset.from_tensor_slices((Xr, Yr)).batch(HALF)
    sink.train(model, EPOCHS, batches, sink_size=-1, verbose=0)
    assert_close(weights(model), REF)

with c.check("fp16_buckets_close_to_fp32"):
    model = make_model()
    opt = hvd.DistributedOptimizer(sgd(), bucket_bytes=0, compression=hvd.Compression.fp16)
    model.compile(optimizer=opt, loss=LOSS)
    model.fit(Xr, Yr, batch_size=HALF, epochs=EPOCHS, shuffle=False, verbose=0)
    assert_close(weights(model), REF, rtol=5e-3, atol=5e-3)
    assert_same_on_all_ranks(weights(model), "fp16 buckets")

with c.check("backward_passes_per_step_buckets_equals_larger_batch"):
    ref = reference(epochs=EPOCHS, batch=2 * GLOBAL_BATCH)
    model = make_model()
    opt = hvd.DistributedOptimizer(sgd(), bucket_bytes=0, backward_passes_per_step=2)
    model.compile(optimizer=opt, loss=LOSS)
    model.fit(Xr, Yr, batch_size=HALF, epochs=EPOCHS, shuffle=False, verbose=0)
    assert_close(weights(model), ref)

with c.check("sparse_and_dense_gradients_in_buckets"):
    ids = rng.integers(0, 20, size=(64, 4)).astype("int32")

    def emb_model():
        keras.utils.set_random_seed(3)
        return keras.Sequential(
            [
                keras.Input((4,), dtype="int32"),
                keras.layers.Embedding(20, 8),
                keras.layers.Flatten(),
                keras.layers.Dense(16, activation="tanh"),
                keras.layers.Dense(3),
            ]
        )

    want = emb_model()
    want.compile(optimizer=sgd(), loss=LOSS)
    want.fit(ids, Y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    got = emb_model()
    got.compile(optimizer=hvd.DistributedOptimizer(sgd(), bucket_bytes=0), loss=LOSS)
    got.fit(ids[MINE], Yr, batch_size=HALF, epochs=EPOCHS, shuffle=False, verbose=0)
    assert_close(weights(got), weights(want))

with c.check("mixed_precision_buckets_decide_on_averaged_gradients"):
    # A sample of 1e6 (infinite in float16) in rank 1's half of the first global
    # batch: every rank must skip that step, as one process on the whole batch does.
    x_bad = X.copy()
    x_bad[HALF] = 1e6
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        want = make_model()
        want.compile(optimizer=sgd(), loss=LOSS)
        want.fit(x_bad, Y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
        got = make_model()
        got.compile(optimizer=hvd.DistributedOptimizer(sgd(), bucket_bytes=0), loss=LOSS)
        assert isinstance(got.optimizer, keras.optimizers.LossScaleOptimizer)
        got.fit(x_bad[MINE], Yr, batch_size=HALF, epochs=1, shuffle=False, verbose=0)
        steps = len(X) // GLOBAL_BATCH
        assert int(want.optimizer.iterations.numpy()) == steps - 1  # the reference skipped one
        assert int(got.optimizer.iterations.numpy()) == steps - 1
        assert_close(weights(got), weights(want), rtol=1e-3, atol=1e-4)
        assert_same_on_all_ranks(weights(got), "mixed precision buckets")
    finally:
        keras.mixed_precision.set_global_policy("float32")

with c.check("ranks_that_built_different_optimizers_and_layers_first_still_pair"):
    # Keras numbers optimizer and layer names per process: rank 0 builds one more
    # of each first, so every name scope in its train step differs from rank 1's.
    if r == 0:
        keras.optimizers.SGD()
        make_model()
    model = make_model()
    opt = hvd.DistributedOptimizer(sgd(), bucket_bytes=0)
    names = hvd.allgather_object(opt.name)
    assert names[0] != names[1], names  # the situation this check is about
    model.compile(optimizer=opt, loss=LOSS)
    model.fit(Xr, Yr, batch_size=HALF, epochs=EPOCHS, shuffle=False, verbose=0)
    assert_close(weights(model), REF)

with c.check("sync_batch_norm_trains_like_one_process_after_different_layers_were_built"):
    # SyncBatchNormalization's allreduces (forward, and backward through its
    # gradient) must pair although rank 0 numbered its layers differently.
    def bn_model(layer):
        keras.utils.set_random_seed(5)
        return keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16), layer(), keras.layers.Dense(3)]
        )

    want = bn_model(lambda: keras.layers.BatchNormalization(momentum=0.5))
    want.compile(optimizer=sgd(), loss=LOSS)
    want.fit(X, Y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    if r == 0:
        bn_model(hvd.SyncBatchNormalization)  # one more of each layer on rank 0
    got = bn_model(lambda: hvd.SyncBatchNormalization(momentum=0.5))
    names = hvd.allgather_object(got.layers[1].name)
    assert names[0] != names[1], names
    got.compile(optimizer=hvd.DistributedOptimizer(sgd()), loss=LOSS)
    got.fit(Xr, Yr, batch_size=HALF, epochs=EPOCHS, shuffle=False, verbose=0)
    assert_close(weights(got), weights(want), rtol=1e-4, atol=1e-5)
    assert_same_on_all_ranks(weights(got), "sync batch norm")

with c.check("horovod_threads_on_the_normal_policy_by_default"):
    # HVDKIT_COMM_PRIORITY unset on one machine: off (its =1 and =auto: tests/test_threads_mp.py)
    backend = runtime.backend()
    alive = _threads.thread_ids()
    assert backend.comm_priority == "off", backend.comm_priority
    assert [t for t in backend.comm_threads if t in alive], backend.comm_threads
    assert {os.sched_getscheduler(t) for t in alive} == {os.SCHED_OTHER}

with c.check("step_check_raises_on_every_rank_with_buckets"):
    # last: a rank one step ahead makes every rank raise, whatever the bucket
    model = make_model()
    opt = hvd.DistributedOptimizer(sgd(), bucket_bytes=0)
    step = custom_step(model, opt)
    step(Xr[:HALF], Yr[:HALF])
    if r == 1:
        opt.iterations.assign_add(1)
    try:
        step(Xr[:HALF], Yr[:HALF])
    except tf.errors.InvalidArgumentError as e:
        assert "different optimizer steps" in str(e), e
    else:
        raise AssertionError("ranks at different steps reduced gradients without an error")

c.finish()

"""Process sets, Adasum, the partial tape and BestModelCheckpoint on 2 ranks, as Horovod's.

argv: outdir. The run sets HOROVOD_DYNAMIC_PROCESS_SETS=1. Each rank is the
only member of its own set ({0} and {1}: two data-parallel groups), beside
the global set and a set {0, 1} equal to the job. Adasum's numbers are
checked against Horovod's own allreduce (``horovod.tensorflow``, called
directly as the oracle in the same job); under Gloo Adasum must be refused.
"""

import os
import sys

import horovod.tensorflow as oracle  # Horovod itself, for Adasum's expected numbers
import keras
import numpy as np
import tensorflow as tf

import hvdkit as hvd

from _harness import Checks

sets = [hvd.ProcessSet([0]), hvd.ProcessSet([1]), hvd.ProcessSet([1, 0])]
hvd.init(process_sets=sets)
r, n = hvd.rank(), hvd.size()
c = Checks(r, sys.argv[1])
TRANSPORT = "mpi" if "OMPI_COMM_WORLD_SIZE" in os.environ else "gloo"
assert n == 2
mine, other, world = sets[r], sets[1 - r], sets[2]


def expect(error, fragment, call):
    try:
        call()
    except error as e:
        assert fragment in str(e), (fragment, str(e))
        return e
    raise AssertionError(f"no {error.__name__} for: {fragment}")


with c.check("static_sets_rank_size_included"):
    assert sorted([sets[0].process_set_id, sets[1].process_set_id]) == [1, 2], sets
    assert (mine.rank(), mine.size(), mine.included()) == (0, 1, True)
    assert (other.size(), other.included()) == (1, False)
    expect(hvd.ConfigurationError, f"rank {r} is not in ProcessSet", other.rank)
    assert world.process_set_id == 0 and world.ranks == [0, 1]  # equal to the job: global
    assert (world.rank(), world.size()) == (r, 2)
    assert hvd.global_process_set.ranks == [0, 1] and hvd.global_process_set.size() == 2
    assert int(hvd.size_op(mine.process_set_id)) == 1 and int(hvd.size_op()) == 2
    assert int(hvd.process_set_included_op(mine.process_set_id)) == 1
    assert int(hvd.process_set_included_op(other.process_set_id)) == 0
    assert int(hvd.process_set_included_op(0)) == 1

with c.check("collectives_in_own_set_see_only_this_rank"):
    x = tf.constant([1.0, 2.0]) * (r + 1)  # rank 0 [1, 2], rank 1 [2, 4]
    assert hvd.allreduce(x, op=hvd.Sum, process_set=mine).numpy().tolist() == x.numpy().tolist()
    assert hvd.allreduce(x, process_set=mine).numpy().tolist() == x.numpy().tolist()  # /1
    assert hvd.allgather(x, process_set=mine).numpy().tolist() == x.numpy().tolist()
    assert hvd.broadcast(x, r, process_set=mine).numpy().tolist() == x.numpy().tolist()
    got, splits = hvd.alltoall(x, splits=[2], process_set=mine)
    assert got.numpy().tolist() == x.numpy().tolist() and splits.numpy().tolist() == [2]
    assert hvd.reducescatter(x, op=hvd.Sum, process_set=mine).numpy().tolist() == [
        1.0 * (r + 1),
        2.0 * (r + 1),
    ]
    g = hvd.grouped_allreduce([x, tf.constant([r])], op=hvd.Sum, process_set=mine)
    assert g[1].numpy().tolist() == [r]
    assert hvd.allgather_object({"r": r}, process_set=mine) == [{"r": r}]
    assert hvd.broadcast_object(r * 10, root_rank=r, process_set=mine) == r * 10
    v = tf.Variable([float(r)])
    hvd.broadcast_variables([v], root_rank=r, process_set=mine)
    assert v.numpy().tolist() == [float(r)]
    hvd.barrier(process_set=mine)
    f = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, process_set=mine))
    assert f(x).numpy().tolist() == x.numpy().tolist()
    # the same calls over the global set and the set equal to the job: both ranks
    for ps in (hvd.global_process_set, world, None):
        assert hvd.allreduce(x, op=hvd.Sum, process_set=ps).numpy().tolist() == [3.0, 6.0]
    assert hvd.allgather(x, process_set=world).numpy().tolist() == [1.0, 2.0, 2.0, 4.0]
    assert hvd.allgather_object(r, process_set=world) == [0, 1]

with c.check("collective_on_a_set_this_rank_is_not_in_is_refused"):
    x = np.array([1.0])
    for call in (
        lambda: hvd.allreduce(x, process_set=other),
        lambda: hvd.allgather(x, process_set=other),
        lambda: hvd.broadcast(x, 1 - r, process_set=other),
        lambda: hvd.allgather_object(1, process_set=other),
        lambda: hvd.barrier(process_set=other),
    ):
        expect(hvd.ConfigurationError, f"rank {r} is not in ProcessSet", call)
    # Horovod's class for it too (its test_horovod_allreduce_process_set_id_error)
    for call in (
        lambda: hvd.allreduce(x, process_set=other),
        lambda: hvd.allgather(x, process_set=other),
    ):
        expect(tf.errors.InvalidArgumentError, f"rank {r} is not in ProcessSet", call)
    fake = hvd.ProcessSet([0])
    fake.process_set_id = 10  # an id set by hand: Horovod's ValueError, ours too
    expect(
        ValueError,
        "process_set_id=10 is not a registered process set",
        lambda: hvd.allreduce(x, process_set=fake),
    )
    expect(
        hvd.ConfigurationError,
        f"root_rank={1 - r} is not in",
        lambda: hvd.broadcast(x, 1 - r, process_set=mine),
    )
    expect(
        hvd.ConfigurationError,
        "is not an hvdkit.ProcessSet",
        lambda: hvd.allreduce(x, process_set=[0]),
    )
    # every rank is still in step: a global collective after the refusals
    assert hvd.allreduce(np.array([1.0]), op=hvd.Sum).tolist() == [2.0]

with c.check("dynamic_sets_remove_use_add_again"):
    first = sets[0]
    assert hvd.remove_process_set(first) is True  # every rank calls it
    assert first.process_set_id is None and hvd.remove_process_set(first) is False
    if r == 0:
        expect(
            hvd.ConfigurationError,
            "was removed with remove_process_set",
            lambda: hvd.allreduce(np.ones(1), process_set=first),
        )
    again = hvd.add_process_set([0])
    assert again.process_set_id not in (None, 0, sets[1].process_set_id), again
    expect(hvd.ConfigurationError, "already holds ranks [0]", lambda: hvd.add_process_set([0]))
    expect(hvd.ConfigurationError, "outside the job's ranks", lambda: hvd.add_process_set([0, 2]))
    if r == 0:
        assert hvd.allreduce(np.array([5.0]), op=hvd.Sum, process_set=again).tolist() == [5.0]
    assert hvd.add_process_set([0, 1]).process_set_id == 0  # the job itself: the global set
    assert hvd.remove_process_set(hvd.global_process_set) is False
    if r == 0:  # the set {0} is now `again` on every rank
        mine = again
    else:
        other = again
    assert hvd.allreduce(np.array([1.0]), op=hvd.Sum).tolist() == [2.0]


def model_and_data(seed=7):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    rng = np.random.default_rng(100 + r)  # different rows on each rank
    x = rng.normal(size=(8, 3)).astype("float32")
    y = rng.normal(size=(8, 2)).astype("float32")
    return model, x, y


def local_gradients(model, x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    return tape.gradient(loss, model.trainable_variables)


with c.check("optimizer_and_tape_reduce_within_the_set"):
    model, x, y = model_and_data()
    w0 = [v.numpy() for v in model.trainable_variables]
    mine_grads = [g.numpy() for g in local_gradients(model, x, y)]
    both = [hvd.allreduce(g) for g in mine_grads]  # the job's average (numpy in, out)
    # the tape and reduce_gradients within this rank's own set: its own gradients
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    tape = hvd.DistributedGradientTape(tape, process_set=mine)
    for got, want in zip(tape.gradient(loss, model.trainable_variables), mine_grads, strict=True):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)
    for ps, want_all in ((mine, mine_grads), (world, both), (None, both), (other, mine_grads)):
        got = hvd.reduce_gradients([tf.constant(g) for g in mine_grads], process_set=ps)
        for g, want in zip(got, want_all, strict=True):
            np.testing.assert_allclose(g.numpy(), want, rtol=1e-6)
    # one SGD step in the optimizer: own set -> own gradients; the job -> averaged
    for ps, grads in ((mine, mine_grads), (world, both)):
        for v, w in zip(model.trainable_variables, w0, strict=True):
            v.assign(w)
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), process_set=ps)
        opt.apply(local_gradients(model, x, y), model.trainable_variables)
        for v, w, g in zip(model.trainable_variables, w0, grads, strict=True):
            np.testing.assert_allclose(v.numpy(), w - 0.1 * g, rtol=1e-5, atol=1e-7)
    # in fit, each group trains alone: the two ranks end with different weights
    for v, w in zip(model.trainable_variables, w0, strict=True):
        v.assign(w)
    model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), process_set=mine), "mse")
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    kernels = hvd.allgather(model.trainable_variables[0].numpy()[None])
    assert not np.allclose(kernels[0], kernels[1]), "the groups were averaged together"


def adasum_of_two(a, b):
    """Adasum's rule for two vectors (its paper): each keeps what the other lacks."""
    dot = float(np.dot(a.ravel(), b.ravel()))
    return (1 - dot / (2 * np.dot(a.ravel(), a.ravel()))) * a + (
        1 - dot / (2 * np.dot(b.ravel(), b.ravel()))
    ) * b


with c.check("adasum_allreduce_is_horovods"):
    rng = np.random.default_rng(11 + r)
    a = rng.normal(size=(4, 3))
    b = rng.normal(size=(5,)).astype("float32")
    if TRANSPORT == "gloo":
        for call in (
            lambda: hvd.allreduce(a, op=hvd.Adasum),
            lambda: hvd.grouped_allreduce([a, b], op=hvd.Adasum),
            lambda: hvd.reduce_gradients([tf.constant(b)], op=hvd.Adasum),
        ):
            e = expect(hvd.NotSupportedError, "needs MPI", call)
            assert isinstance(e, NotImplementedError) and "over gloo" in str(e), e
    else:
        got = hvd.allreduce(a, op=hvd.Adasum)
        want = oracle.allreduce(tf.constant(a), op=oracle.Adasum).numpy()
        np.testing.assert_array_equal(got, want)
        both = hvd.allgather(a[None])
        np.testing.assert_allclose(got, adasum_of_two(both[0], both[1]), rtol=1e-10)
        ga, gb = hvd.grouped_allreduce([a, b], op=hvd.Adasum)
        np.testing.assert_array_equal(gb, oracle.allreduce(tf.constant(b), op=oracle.Adasum))
        np.testing.assert_array_equal(ga, want)
        in_fn = tf.function(lambda t: hvd.allreduce(t, op=hvd.Adasum))(tf.constant(b))
        np.testing.assert_array_equal(in_fn, oracle.allreduce(tf.constant(b), op=oracle.Adasum))
    sparse = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([r]))
    expect(
        hvd.NotSupportedError,
        "Adasum does not support tf.IndexedSlices",
        lambda: hvd.allreduce(sparse, op=hvd.Adasum),
    )
    expect(
        hvd.NotSupportedError,
        "whole job only",
        lambda: hvd.allreduce(a, op=hvd.Adasum, process_set=mine),
    )

with c.check("adasum_optimizer_is_horovods_delta_rule"):
    expect(
        hvd.ConfigurationError,
        "average_aggregated_gradients=True",
        lambda: hvd.DistributedOptimizer(
            keras.optimizers.SGD(0.1), op=hvd.Adasum, average_aggregated_gradients=True
        ),
    )
    model, x, y = model_and_data()
    w0 = [v.numpy() for v in model.trainable_variables]
    opt = hvd.DistributedOptimizer(
        keras.optimizers.SGD(0.1), op=hvd.Adasum, backward_passes_per_step=2
    )
    if TRANSPORT == "gloo":
        expect(
            hvd.NotSupportedError,
            "needs MPI",
            lambda: opt.apply(local_gradients(model, x, y), model.trainable_variables),
        )
    else:
        # the oracle: two local SGD steps on this rank's halves, then Horovod's Adasum of
        # each rank's change of the weights, added to the start
        local = [tf.Variable(w) for w in w0]
        ref = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        for half in (slice(0, 4), slice(4, 8)):
            ref.set_weights([v.numpy() for v in local])
            for v, g in zip(local, local_gradients(ref, x[half], y[half]), strict=True):
                v.assign_sub(0.1 * g)
        want = [
            w + oracle.allreduce(tf.constant(v.numpy() - w), op=oracle.Adasum).numpy()
            for v, w in zip(local, w0, strict=True)
        ]
        opt.apply(local_gradients(model, x[:4], y[:4]), model.trainable_variables)
        after_one = [v.numpy() for v in model.trainable_variables]
        opt.apply(local_gradients(model, x[4:], y[4:]), model.trainable_variables)
        for v, w in zip(model.trainable_variables, want, strict=True):
            np.testing.assert_allclose(v.numpy(), w, rtol=1e-5, atol=1e-6)
        kernels = hvd.allgather(model.trainable_variables[0].numpy()[None])
        np.testing.assert_array_equal(kernels[0], kernels[1])  # one model again after the exchange
        # after the first, local step the ranks had moved apart (no exchange yet)
        firsts = hvd.allgather(after_one[0][None])
        assert not np.allclose(firsts[0], firsts[1])


def body_and_head(seed=3):
    keras.utils.set_random_seed(seed)
    body, head = keras.layers.Dense(4, name="body"), keras.layers.Dense(2, name="head")
    model = keras.Sequential([keras.Input((3,)), body, head])
    return model, body, head


with c.check("partial_tape_keeps_local_layers_local"):
    model, body, head = body_and_head()
    _, x, y = model_and_data()
    variables = model.trainable_variables
    local = [g.numpy() for g in local_gradients(model, x, y)]
    averaged = [hvd.allreduce(g) for g in local]
    n_body = len(body.trainable_variables)

    def partial_gradients(**kwargs):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        tape = hvd.PartialDistributedGradientTape(tape, **kwargs)
        return [g.numpy() for g in tape.gradient(loss, variables)], tape, loss

    got, _, _ = partial_gradients(local_layers=[head])  # Horovod's default: scaled by 1/size
    for i, g in enumerate(got):
        want = averaged[i] if i < n_body else local[i] / n
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-7)
    got, _, _ = partial_gradients(local_layers=head, scale_local_gradients=False)
    for i, g in enumerate(got):
        np.testing.assert_allclose(g, averaged[i] if i < n_body else local[i], rtol=1e-5)
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[head])
    mine_pairs, shared_pairs = tape.get_local_and_global_gradients(loss, variables)
    assert [v.path for v, _ in mine_pairs] == [v.path for v in head.trainable_variables]
    assert [v.path for v, _ in shared_pairs] == [v.path for v in body.trainable_variables]
    tape.register_local_source(body.trainable_variables[1])  # the body's bias stays local too
    got = tape.gradient(loss, variables)
    np.testing.assert_allclose(got[1].numpy(), local[1] / n, rtol=1e-5)
    # errors: not a layer; a layer of another model
    expect(
        hvd.ConfigurationError,
        "local_layers must be Keras layers; got str",
        lambda: hvd.PartialDistributedGradientTape(tf.GradientTape(), local_layers=["head"]),
    )
    stray = keras.layers.Dense(2, name="stray")
    stray.build((None, 4))
    with tf.GradientTape() as t2:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    expect(
        hvd.ConfigurationError,
        "local layer 'stray' has no trainable variable",
        lambda: hvd.PartialDistributedGradientTape(t2, local_layers=[stray]).gradient(
            loss, variables
        ),
    )

    # a few training steps in a tf.function: the body stays one model, the heads part ways
    opt = keras.optimizers.SGD(0.1)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
        tape = hvd.PartialDistributedGradientTape(tape, local_layers=[head])
        opt.apply(tape.gradient(loss, variables), variables)

    for _ in range(3):
        step(x, y)
    bodies = hvd.allgather(body.kernel.numpy()[None])
    heads = hvd.allgather(head.kernel.numpy()[None])
    np.testing.assert_array_equal(bodies[0], bodies[1])
    assert not np.allclose(heads[0], heads[1]), "the local heads were averaged"

with c.check("partial_optimizer_keeps_local_layers_local"):
    model, body, head = body_and_head()
    _, x, y = model_and_data()
    w0 = [v.numpy() for v in model.trainable_variables]
    local = [g.numpy() for g in local_gradients(model, x, y)]
    averaged = [hvd.allreduce(g) for g in local]
    n_body = len(body.trainable_variables)
    for scale, kind in ((True, "scaled"), (False, "as is")):
        for v, w in zip(model.trainable_variables, w0, strict=True):
            v.assign(w)
        opt = hvd.PartialDistributedOptimizer(
            keras.optimizers.SGD(0.1), local_layers=[head], scale_local_gradients=scale
        )
        opt.apply(local_gradients(model, x, y), model.trainable_variables)
        for i, (v, w) in enumerate(zip(model.trainable_variables, w0, strict=True)):
            g = averaged[i] if i < n_body else local[i] / (n if scale else 1)
            np.testing.assert_allclose(v.numpy(), w - 0.1 * g, rtol=1e-5, atol=1e-7, err_msg=kind)
    # register_local_var: the body's bias stays local too
    for v, w in zip(model.trainable_variables, w0, strict=True):
        v.assign(w)
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=head)
    opt.register_local_var(body.trainable_variables[1])
    opt.apply(local_gradients(model, x, y), model.trainable_variables)
    np.testing.assert_allclose(model.trainable_variables[0].numpy(), w0[0] - 0.1 * averaged[0])
    np.testing.assert_allclose(
        model.trainable_variables[1].numpy(), w0[1] - 0.1 * local[1] / n, rtol=1e-5
    )
    # in fit: the body stays one model, the heads part ways
    for v, w in zip(model.trainable_variables, w0, strict=True):
        v.assign(w)
    model.compile(
        hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[head]), "mse"
    )
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    bodies = hvd.allgather(body.trainable_variables[0].numpy()[None])
    heads = hvd.allgather(head.trainable_variables[0].numpy()[None])
    np.testing.assert_array_equal(bodies[0], bodies[1])
    assert not np.allclose(heads[0], heads[1]), "the local heads were averaged"
    # BroadcastGlobalVariablesCallback(local_variables=): the local head keeps each rank's own
    keras.utils.set_random_seed(10 + r)  # a different start on each rank
    model, body, head = body_and_head(seed=10 + r)
    model.compile(keras.optimizers.SGD(0.0), "mse")
    before = [v.numpy() for v in head.variables]
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=head.kernel)
    callback.register_local_var(head.bias)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])  # lr 0: no change
    for v, b in zip(head.variables, before, strict=True):
        np.testing.assert_array_equal(v.numpy(), b)
    bodies = hvd.allgather(body.kernel.numpy()[None])
    np.testing.assert_array_equal(bodies[0], bodies[1])  # rank 0's
    expect(
        hvd.ConfigurationError,
        "local_variables must be variables; got str",
        lambda: hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=["w"]),
    )
    expect(
        hvd.ConfigurationError,
        "only hvdkit.Average and hvdkit.Sum",
        lambda: hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum),
    )
    expect(
        hvd.ConfigurationError,
        "PartialDistributedOptimizer: local_layers must be Keras layers",
        lambda: hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[1]),
    )

with c.check("best_model_checkpoint_decides_job_wide_rank0_writes"):
    model, x, y = model_and_data()
    model.compile(keras.optimizers.SGD(0.05), "mse")
    rng = np.random.default_rng(50 + r)  # each rank's validation rows differ
    xv, yv = rng.normal(size=(6, 3)).astype("float32"), rng.normal(size=(6, 2)).astype("float32")
    path = os.path.join(sys.argv[1], f"best-rank{r}.keras")
    cb = hvd.callbacks.BestModelCheckpoint(filepath=path)
    assert (cb.monitor, cb.save_best_only, cb.save_weights_only) == ("val_loss", True, False)
    hist = model.fit(
        x,
        y,
        validation_data=(xv, yv),
        epochs=4,
        batch_size=8,
        shuffle=False,
        verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), cb],
    )
    per_rank = hvd.allgather(np.array([hist.history["val_loss"]]))  # this rank's own losses
    job = per_rank.mean(axis=0)
    np.testing.assert_allclose(cb.best, job.min(), rtol=1e-5)  # the job's best, on both ranks
    assert hvd.allgather_object(cb.best) == [cb.best, cb.best]
    assert os.path.exists(path) == (r == 0), (r, path)  # rank 0 writes, rank 1 never
    if r == 0:
        best = keras.models.load_model(path)
        assert best.count_params() == model.count_params()
    unset = hvd.callbacks.BestModelCheckpoint()
    expect(
        hvd.ConfigurationError,
        "BestModelCheckpoint has no filepath",
        lambda: model.fit(x, y, epochs=1, verbose=0, callbacks=[unset]),
    )

c.finish()

"""Horovod's elastic state classes and callbacks on 2 ranks (not an elastic job): as Horovod's.

argv: outdir. What Horovod's own ``test_elastic_state`` cases check (sync
takes rank 0's values, restore undoes what came after the last commit,
commit keeps the new values), for ``KerasState``, ``TensorFlowState`` and
``ObjectState``; then ``@hvdkit.elastic.run`` with the three Keras state
callbacks, started from a commit in the middle of an epoch.
"""

import sys

import keras
import numpy as np
import tensorflow as tf

import hvdkit as hvd

from _harness import Checks

hvd.init()
r, n = hvd.rank(), hvd.size()
c = Checks(r, sys.argv[1])
assert n == 2
V = 1.0 if r == 0 else 2.0
OTHER = [np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), np.zeros(2, np.float32)]


def allclose(got, want):
    assert all(np.allclose(a, b) for a, b in zip(got, want, strict=True)), (got, want)


with c.check("keras_state_sync_restore_commit"):
    model = keras.Sequential([keras.layers.Dense(2, activation="softmax")])
    model.build((2, 2))
    model.set_weights([np.full((2, 2), V, np.float32), np.full(2, V, np.float32)])
    state = hvd.elastic.KerasState(model, keras.optimizers.Adam(0.001), batch=20 + r, epoch=10 + r)
    state.sync()
    synced = model.get_weights()
    allclose(synced, [np.ones((2, 2)), np.ones(2)])  # rank 0's
    assert (state.batch, state.epoch) == (20, 10)
    assert [int(v.numpy()) for v in state.optimizer.variables[:1]] == [0]  # built, rank 0's
    model.set_weights(OTHER)
    state.batch, state.epoch = 21, 11
    state.restore()
    allclose(model.get_weights(), synced)
    assert (state.batch, state.epoch) == (20, 10)
    model.set_weights(OTHER)
    state.batch, state.epoch = 21, 11
    state.commit()  # not an elastic job: no decision with the other ranks
    state.restore()
    allclose(model.get_weights(), OTHER)
    assert (state.batch, state.epoch, state._commits) == (21, 11, 1)

with c.check("tensorflow_and_object_state"):
    variables = [tf.Variable(np.full((2, 2), V)), tf.Variable(np.full(2, V))]
    ts = hvd.elastic.TensorFlowState(variables, batch=20 + r)
    ts.sync()
    allclose([v.numpy() for v in variables], [np.ones((2, 2)), np.ones(2)])
    variables[0].assign(np.full((2, 2), 5.0))
    ts.batch = 7
    ts.restore()
    assert variables[0].numpy().tolist() == [[1.0, 1.0], [1.0, 1.0]] and ts.batch == 20
    obj = hvd.elastic.ObjectState(epoch=r, names=["a", "b"][: r + 1])
    obj.sync()
    assert (obj.epoch, obj.names) == (0, ["a"])
    obj.epoch = 4
    obj.commit()
    obj.epoch = 9
    obj.restore()
    assert obj.epoch == 4
    with_hvd_args = hvd.elastic.ObjectState(hvd.broadcast_object, hvd.rank, step=r)
    with_hvd_args.sync()  # Horovod's positional bcast_object, get_rank
    assert with_hvd_args.step == 0

with c.check("run_with_state_callbacks_resumes_mid_epoch_exactly"):
    keras.utils.set_random_seed(1 + r)  # different start on each rank: sync must even it
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    net.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss="mse")
    x = np.random.default_rng(r).normal(size=(64, 3)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, x.sum(1, keepdims=True))).repeat().batch(4)
    state = hvd.elastic.KerasState(net, batch=0, epoch=0)
    state.batch, state.epoch = 3, 1  # as if a reset came after 3 batches of epoch 1
    state.commit()
    resets = []
    state.register_reset_callbacks([lambda: resets.append(1)])
    seen = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((state.epoch, state.batch))

    callbacks = [
        hvd.elastic.UpdateEpochStateCallback(state),
        hvd.elastic.UpdateBatchStateCallback(state),
        hvd.elastic.CommitStateCallback(state, batches_per_commit=4),
        Count(),
    ]

    @hvd.elastic.run
    def train(state):
        state.model.fit(
            ds, steps_per_epoch=10, epochs=4 - state.epoch, callbacks=callbacks, verbose=0
        )
        return "done"

    assert train(state) == "done" and resets == []
    # epoch 1: batches 4..10 (7 left), then epochs 2 and 3 whole: 27 batches, not 30
    assert len(seen) == 27 and int(net.optimizer.iterations.numpy()) == 27, seen
    assert seen[:2] == [(1, 4), (1, 5)] and seen[6] == (1, 10) and seen[7] == (2, 1), seen
    assert (state.epoch, state.batch) == (4, 0)
    # commits: one at start, every 4 batches (counted from each fit's start) and each epoch's end
    assert state._commits == 1 + 27 // 4 + 3, state._commits
    flat = np.concatenate([w.ravel() for w in net.get_weights()])
    both = hvd.allgather_object(flat.tolist())
    np.testing.assert_array_equal(both[0], both[1])  # synced first, same gradients after

with c.check("keras_state_with_a_sampler_commits_its_position"):
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    sampler = hvd.data.ShardSampler(40, shuffle=True, seed=3)  # 20 samples a rank
    sampler.advance(2 * r)  # the ranks disagree before the sync
    state = hvd.elastic.KerasState(net, sampler=sampler, epoch=0)
    state.sync()  # rank 0's position (0), on every rank
    assert (sampler.position, sampler.cursor) == (0, 0)
    sampler.advance(8)
    state.commit()
    sampler.advance(4)
    state.restore()
    assert (sampler.position, sampler.cursor) == (8, 16)  # the commit's, not 12
    state.sync()  # same world: the same shards and position
    assert (sampler.num_shards, sampler.shard_id, sampler.position) == (2, r, 8)
    first = sampler.indices()[sampler.position]
    seen = hvd.allgather_object(int(first))
    assert len(set(seen)) == 2  # each rank reads its own shard on from there

with c.check("bad_input_is_refused"):
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    for call, words in [
        (lambda: hvd.elastic.KerasState(unbuilt), "must be a built keras.Model"),
        (lambda: hvd.elastic.TensorFlowState(), "pass the list of variables"),
        (lambda: hvd.elastic.CommitStateCallback(state, 0), "batches_per_commit=0"),
        (lambda: state.register_reset_callbacks([3]), "3 is not callable"),
        (lambda: hvd.elastic.run(lambda s: s)(object()), "neither an hvdkit.Checkpointer"),
    ]:
        try:
            call()
        except (hvd.ConfigurationError, hvd.NotSupportedError) as e:
            assert words in str(e), (words, str(e))
        else:
            raise AssertionError(f"not refused: {words}")

c.finish()

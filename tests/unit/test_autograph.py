"""AutoGraph converts none of hvdkit's functions: in a tf.function, or as its datasets read.

Each conversion parses and rewrites the function and writes it to a temporary file
(hvdkit/_autograph.py has the measured cost). The spy counts the functions AutoGraph
converts (its private ``_convert_actual``: if TensorFlow renames it, this test fails at
``monkeypatch.setattr`` and must be pointed at the new name).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from datafiles import mnist_ids, write_mnist
from tensorflow.python.autograph.impl import api as autograph_api

import hvdkit


@pytest.fixture
def converted(monkeypatch):
    """The qualified names of the functions AutoGraph converts while the test runs."""
    names: list[str] = []
    convert = autograph_api._convert_actual

    def spy(entity, program_ctx):
        names.append(f"{getattr(entity, '__module__', '?')}.{entity.__qualname__}")
        return convert(entity, program_ctx)

    monkeypatch.setattr(autograph_api, "_convert_actual", spy)
    return names


def test_a_custom_training_step_converts_only_the_users_own_function(local_runtime, converted):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    opt = hvdkit.DistributedOptimizer(keras.optimizers.SGD(0.5))
    opt.build(model.trainable_variables)
    partial = hvdkit.PartialDistributedOptimizer(keras.optimizers.SGD(0.5))
    partial.build(model.trainable_variables)
    before = [w.numpy() for w in model.trainable_variables]

    @tf.function
    def step(x):
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_sum(model(x))
        grads = hvdkit.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
        again = hvdkit.PartialDistributedGradientTape(tape).gradient(
            loss, model.trainable_variables
        )
        reduced = hvdkit.reduce_gradients(grads, variables=model.trainable_variables)
        opt.apply(reduced, model.trainable_variables)
        opt.apply_gradients(zip(again, model.trainable_variables, strict=True))
        partial.apply(grads, model.trainable_variables)
        ranks = hvdkit.rank() + hvdkit.size() + hvdkit.local_rank() + hvdkit.local_size()
        ranks += hvdkit.cross_rank() + hvdkit.cross_size() + int(hvdkit.is_initialized())
        ranks += int(hvdkit.global_process_set.included())
        ops = hvdkit.rank_op() + hvdkit.size_op() + hvdkit.local_rank_op()
        ops += hvdkit.local_size_op() + hvdkit.process_set_included_op()
        summed = hvdkit.allreduce(loss, op=hvdkit.Sum) + hvdkit.broadcast(loss, 0)
        return summed + tf.reduce_sum(hvdkit.allgather(tf.reshape(loss, [1]))), ranks, ops

    x = np.ones((4, 3), "float32")
    loss = float(tf.reduce_sum(model(x)))
    total, ranks, ops = step(x)

    assert converted == [f"{__name__}.{step.python_function.__qualname__}"], converted
    assert int(ranks) == 0 + 1 + 0 + 1 + 0 + 1 + 1 + 1
    assert int(ops) == 0 + 1 + 0 + 1 + 1
    # the step really ran (size 1: the collectives return their input): the loss three
    # times, and three SGD updates (apply, apply_gradients, the partial optimizer) of the
    # bias by 0.5 x its gradient, 4 per output (a batch of 4)
    np.testing.assert_allclose(float(total), 3 * loss, rtol=1e-6)
    np.testing.assert_allclose(model.trainable_variables[1].numpy(), before[1] - 6.0)


def test_patch_ops_in_a_dataset_map_and_a_step_convert_only_the_users_functions(converted):
    image = np.arange(2 * 6 * 4 * 3, dtype="float32").reshape(2, 6, 4, 3)

    def split_and_join(x):
        patches = hvdkit.ops.slice_patches(x, 2, 2)  # [4 * batch, 3, 2, 3]
        return hvdkit.ops.merge_patches(patches, 2, 2)

    joined = next(iter(tf.data.Dataset.from_tensors(image).map(split_and_join))).numpy()

    @tf.function
    def halves(x):
        return hvdkit.ops.slice_inputs(x, (1, 2, 1, 1), rank=1, size=2)

    half = halves(image).numpy()

    assert sorted(name.rsplit(".", 1)[-1] for name in converted) == ["halves", "split_and_join"]
    assert not [name for name in converted if name.startswith("hvdkit")], converted
    np.testing.assert_array_equal(joined, image)  # merge undoes slice
    np.testing.assert_array_equal(half, image[:, 3:])  # rank 1 of 2: the lower half


@pytest.mark.parametrize("shuffle", [False, True])
def test_reading_a_shard_of_a_dataset_converts_nothing(tmp_path, converted, shuffle):
    write_mnist(tmp_path, "train", n=11)
    ds = hvdkit.data.MnistDataset(
        str(tmp_path), usage="train", num_shards=2, shard_id=1, shuffle=shuffle
    )
    ids = sorted(mnist_ids(np.stack([image for image, _ in ds.as_numpy_iterator()])).tolist())
    assert converted == [], converted
    # the shard's records (train ids are their indices): 6 of 11, as shard_indices says
    want = hvdkit.data.shard_indices(11, 2, 1, shuffle=shuffle)
    assert len(want) == 6 and ids == sorted(want.tolist()), (ids, want)

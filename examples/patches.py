"""Patch parallelism: every rank trains on its own patch of every large image.

    .venv/bin/horovodrun -np 2 --gloo .venv/bin/python examples/patches.py
    .venv/bin/python examples/patches.py          # one process: whole images

The images (synthetic 256 x 256 "scenes" with horizontal or vertical stripes
under noise) are cut into a 1 x size() grid: with 2 ranks, rank 0 sees the
left half of every image and rank 1 the right half. All ranks read the same
images in the same order (one shuffle seed), one model is shared, and its
gradients are averaged over the patches with ``hvdkit.DistributedOptimizer``.
At the end the ranks' logits for each test image are averaged, so the job
predicts from the whole image. Lines that differ from single-process code are
marked ``# hvdkit:``. Exits 1 if the test accuracy is below ``--min-accuracy``.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import hvdkit  # hvdkit
import hvdkit.ops  # hvdkit

SIZE = 256  # image height and width


def make_scene(i):
    """Image ``i`` (the same on every rank): class 0 horizontal, class 1 vertical stripes."""
    label = tf.cast(i % 2, tf.int32)
    seed = tf.stack([i, tf.constant(7, tf.int64)])
    period = tf.random.stateless_uniform([], seed, 6.0, 14.0)
    wave = 0.5 + 0.5 * tf.sin(2 * np.pi * tf.range(SIZE, dtype=tf.float32) / period)
    stripes = tf.where(
        label == 0, wave[:, None] * tf.ones([1, SIZE]), wave[None, :] * tf.ones([SIZE, 1])
    )
    noise = tf.random.stateless_uniform([SIZE, SIZE, 3], seed + 1, 0.0, 0.8)
    return stripes[..., None] * 0.6 + noise, label


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=96, help="training images")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8, help="images per step (every rank)")
    p.add_argument("--min-accuracy", type=float, default=0.9)
    args = p.parse_args()

    hvdkit.init()  # hvdkit: start the runtime (size 1 without a launcher)
    rank, size = hvdkit.rank(), hvdkit.size()  # hvdkit
    grid = (1, size)  # hvdkit: one patch column per rank; rank r takes patch r

    ids = tf.data.Dataset.range(args.images)
    ids = hvdkit.ops.replicated_shuffle(ids, args.images, seed=1000)  # hvdkit: same order
    train = ids.map(make_scene, num_parallel_calls=2)
    train = train.map(hvdkit.ops.rank_patch(*grid))  # hvdkit: keep this rank's patch
    train = train.batch(args.batch_size).prefetch(2)

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((None, None, 3)),  # any patch size
            keras.layers.Conv2D(8, 3, activation="tanh"),
            keras.layers.MaxPooling2D(4),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.GlobalMaxPooling2D(),
            keras.layers.Dense(2),
        ]
    )
    # The ranks see patches of the same images, so the global batch is still
    # batch_size images: the learning rate is not scaled with size().
    opt = hvdkit.DistributedOptimizer(keras.optimizers.Adam(0.01))  # hvdkit: average grads
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=False,  # hvdkit: Horovod's collectives have no XLA kernels
    )
    if rank == 0:
        patch = train.element_spec[0].shape[1:3].as_list()
        print(f"{size} rank(s), grid {grid[0]}x{grid[1]}, patches {patch} of {SIZE}x{SIZE}")
    model.fit(
        train,
        epochs=args.epochs,
        verbose=2 if rank == 0 else 0,  # hvdkit: print the loss from rank 0 only
        callbacks=[
            hvdkit.callbacks.BroadcastGlobalVariablesCallback(0),  # hvdkit: same start
            hvdkit.callbacks.MetricAverageCallback(),  # hvdkit: loss averaged over patches
        ],
    )

    test = tf.data.Dataset.range(10_000, 10_064).map(make_scene)
    labels = np.array([int(i % 2) for i in range(10_000, 10_064)])
    test = test.map(hvdkit.ops.rank_patch(*grid)).batch(16)  # hvdkit
    logits = model.predict(test, verbose=0)
    logits = hvdkit.allreduce(logits, op=hvdkit.Average)  # hvdkit: combine the patches
    accuracy = float((logits.argmax(1) == labels).mean())
    if rank == 0:
        print(f"test accuracy (logits averaged over the {size} patch(es)): {accuracy:.4f}")
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())

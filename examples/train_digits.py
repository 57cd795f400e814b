"""The main job: data-parallel training of a Keras MLP on scikit-learn's digits.

Runs as is in one process, or under a launcher with N processes:

    horovodrun -np 2 --gloo python examples/train_digits.py

Lines that differ from single-process Keras code are marked ``# hvdkit:``.
Each rank trains on its own shard of the training set (a new shuffle every
epoch, agreed by all ranks without communication) in sink mode: an epoch's
steps run in one host call (``hvdkit.sink.train``); gradients are averaged,
metrics are averaged, only rank 0 prints. Exits 1 if the held-out accuracy is
below ``--min-accuracy``.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import hvdkit  # hvdkit
import hvdkit.sink  # hvdkit


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=2e-3, help="for one rank; scaled by size()")
    p.add_argument("--min-accuracy", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    hvdkit.init()  # hvdkit: start the runtime (size 1 without a launcher)
    rank, size = hvdkit.rank(), hvdkit.size()  # hvdkit

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")  # [1797, 64], pixel values 0..16
    y = digits.target.astype("int32")
    order = np.random.default_rng(12345).permutation(len(x))  # fixed train/test split
    test_idx, train_idx = order[:360], order[360:]

    keras.utils.set_random_seed(args.seed)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    opt = keras.optimizers.Adam(args.lr * size)  # hvdkit: scale lr with the global batch
    opt = hvdkit.DistributedOptimizer(opt)  # hvdkit: average gradients over ranks
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    callbacks = [
        hvdkit.callbacks.BroadcastGlobalVariablesCallback(0),  # hvdkit: same start
        hvdkit.callbacks.MetricAverageCallback(),  # hvdkit: report job-wide metrics
    ]
    if rank == 0:
        print(
            f"training on {len(train_idx)} digits with {size} process(es), "
            f"{-(-len(train_idx) // size)} per process per epoch (pad mode: equal shards)",
            flush=True,
        )
    for epoch in range(args.epochs):
        # hvdkit: this rank's shard; same length on every rank, reshuffled per epoch
        mine = train_idx[
            hvdkit.data.shard_indices(
                len(train_idx), size, rank, shuffle=True, seed=args.seed, epoch=epoch
            )
        ]
        ds = tf.data.Dataset.from_tensor_slices((x[mine], y[mine])).batch(args.batch_size)
        ds = hvdkit.sink.prefetch_to_device(ds)  # hvdkit: stage the next batches
        # hvdkit: sink mode; the epoch (the whole shard) runs in one host call
        hist = hvdkit.sink.train(
            model, epoch + 1, ds, callbacks, sink_size=-1, initial_epoch=epoch, verbose=0
        )
        if rank == 0:  # hvdkit: print from one rank only
            logs = {k: v[-1] for k, v in hist.history.items()}
            print(
                f"epoch {epoch + 1:2d}/{args.epochs}  loss {logs['loss']:.4f}  "
                f"accuracy {logs['accuracy']:.4f}",
                flush=True,
            )

    # Held-out accuracy: each rank scores a disjoint part, counts are summed.
    part = test_idx[hvdkit.data.shard_indices(len(test_idx), size, rank, mode="uneven")]  # hvdkit
    pred = model.predict(x[part], verbose=0).argmax(1)
    correct, total = hvdkit.allreduce(  # hvdkit: exact job-wide counts
        np.array([(pred == y[part]).sum(), len(part)], np.int64), op=hvdkit.Sum
    )
    accuracy = correct / total
    if rank == 0:
        print(f"held-out accuracy {accuracy:.4f} ({correct}/{total} test digits)", flush=True)
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())

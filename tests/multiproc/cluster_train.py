"""The training functions tests/test_spark.py and tests/test_ray.py hand to the engines.

``train`` is the main job's MLP on scikit-learn's digits with
``hvdkit.Checkpointer``: it resumes exactly after a lost node. ``hold_at``
makes the first attempt of rank ``size - 1`` (or of the rank on host
``hold_on``) stop at that step, once its checkpoint is on disk, and write
``<ckpt>/holding`` with the step and its pid (the test then kills that rank's
node, or freezes the rank: an ordering, not a sleep). ``whole_batch`` trains
on fixed global batches, each rank on its half: 2 ranks must end with the
weights of 1 process on the whole batch.
"""

from __future__ import annotations


def _digits():
    import numpy as np
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")  # [1797, 64]
    y = digits.target.astype("int32")
    order = np.random.default_rng(12345).permutation(len(x))
    return x, y, order[:360], order[360:]  # held-out, training


def _model(size: int):
    import keras

    import hvdkit

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )
    opt = hvdkit.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9))  # hvdkit
    model.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def fingerprint(model) -> str:
    import hashlib

    import numpy as np

    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    return hashlib.sha256(weights.tobytes()).hexdigest()[:16]


def train(
    ckpt: str, epochs: int = 6, every: int = 5, hold_at: int | None = None, hold_on: str = ""
) -> dict:
    import os
    import time

    import keras

    import hvdkit

    hvdkit.init()
    rank, size = hvdkit.rank(), hvdkit.size()
    x, y, test, train_idx = _digits()
    model = _model(size)
    sampler = hvdkit.data.ShardSampler(len(train_idx), shuffle=True, seed=1)
    saver = hvdkit.Checkpointer(ckpt, model=model, sampler=sampler, every_steps=every)
    resumed = saver.restore()
    holding = os.path.join(ckpt, "holding")
    # the rank that holds: the last one, or (hold_on) the one on that host
    mine = os.uname().nodename == hold_on if hold_on else rank == size - 1
    hold = hold_at is not None and resumed == 0 and mine

    first_step_at = []  # the time of this attempt's first step (benchmarks/cluster_recovery.py)

    def maybe_hold(batch, logs):
        if not first_step_at:
            first_step_at.append(time.time())
        if hold and saver.step >= hold_at:
            saver.wait()  # this rank's part of the checkpoint is on disk
            with open(holding + ".tmp", "w") as f:
                f.write(f"{saver.step} {os.getpid()}")
            os.replace(holding + ".tmp", holding)  # the test reads it whole
            while True:  # the test kills this rank's node now
                time.sleep(0.1)

    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        model.fit(
            sampler.dataset((x[train_idx], y[train_idx])).batch(32),
            initial_epoch=epoch,
            epochs=epoch + 1,
            shuffle=False,
            verbose=0,
            callbacks=[
                hvdkit.data.ShardPositionCallback(sampler, 32),
                saver.callback(),
                keras.callbacks.LambdaCallback(on_train_batch_end=maybe_hold),
            ],
        )
    _, accuracy = model.evaluate(x[test], y[test], verbose=0)
    return dict(
        rank=rank,
        size=size,
        local_rank=hvdkit.local_rank(),
        local_size=hvdkit.local_size(),
        host=os.uname().nodename,
        resumed_from=resumed,
        step=saver.step,
        accuracy=float(accuracy),
        fingerprint=fingerprint(model),
        first_step_at=first_step_at[0] if first_step_at else None,
    )


def whole_batch(steps: int = 20, batch: int = 64) -> list:

    import hvdkit

    hvdkit.init()
    rank, size = hvdkit.rank(), hvdkit.size()
    x, y, _, train_idx = _digits()
    take = []
    per = batch // size
    for b in range(steps):  # global batch b: rows b*batch..; this rank's part of it
        take.extend(train_idx[b * batch + rank * per : b * batch + (rank + 1) * per])
    model = _model(size)
    hvdkit.callbacks.BroadcastGlobalVariablesCallback(0)
    model.fit(x[take], y[take], batch_size=per, epochs=1, shuffle=False, verbose=0)
    return [w.tolist() for w in model.get_weights()]


def parquet_rows(path: str) -> list:
    """docs/spark.md's pattern: this rank's files of a DataFrame written as Parquet."""
    import glob

    import pyarrow.parquet as pq

    import hvdkit

    hvdkit.init()
    files = sorted(glob.glob(f"{path}/part-*.parquet"))
    mine = hvdkit.data.shard_indices(len(files), hvdkit.size(), hvdkit.rank())
    table = pq.read_table([files[i] for i in mine])  # this rank's rows
    return [len(files), sorted(table["id"].to_pylist())]


def unshipped_train(folder: str):
    """A training function the driver imports from ``folder``, which the cluster's workers lack.

    As a user's ``train.py`` beside the driver: pickled by its module's name, so a
    rank cannot load it unless the module is shipped with the job.
    """
    import importlib
    import os
    import sys

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "user_mod_unshipped.py"), "w") as f:
        f.write("def train():\n    return 1\n")
    sys.path.insert(0, folder)
    return importlib.import_module("user_mod_unshipped").train

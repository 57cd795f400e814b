"""The training functions tests/test_spark.py and tests/test_ray.py hand to the engines.

``train`` is the main job's MLP on scikit-learn's digits with
``hvdkit.Checkpointer``: it resumes exactly after a lost node. ``hold_at``
makes the first attempt of rank ``size - 1`` stop at that step, once its
checkpoint is on disk, and write ``<ckpt>/holding`` (the test then kills that
rank's node: an ordering, not a sleep). ``whole_batch`` trains on fixed
global batches, each rank on its half: 2 ranks must end with the weights of
1 process on the whole batch.
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


def train(ckpt: str, epochs: int = 6, every: int = 5, hold_at: int | None = None) -> dict:
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
    hold = hold_at is not None and resumed == 0 and rank == size - 1

    def maybe_hold(batch, logs):
        if hold and saver.step >= hold_at:
            saver.wait()  # this rank's part of the checkpoint is on disk
            with open(holding, "w") as f:
                f.write(str(saver.step))
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

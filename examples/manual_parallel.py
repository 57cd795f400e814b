"""Manual data parallelism: the step slices the global batch by rank itself.

    horovodrun -np 2 --gloo python examples/manual_parallel.py

Every rank reads the *same* global batch; the training step keeps rows
``[rank * B/size, (rank + 1) * B/size)``, computes its local loss, and
``hvdkit.allreduce`` turns the local losses into the global one (the value
that is reported, identical on all ranks). Gradients are averaged explicitly
with ``hvdkit.grouped_allreduce``. The script then trains the same model the
automatic way (``DistributedOptimizer`` + ``model.fit`` on pre-sharded data)
and exits 1 unless both reach the same weights.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import hvdkit

GLOBAL_BATCH, STEPS = 32, 20


def make_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((10,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )


def main() -> int:
    hvdkit.init()  # hvdkit
    rank, size = hvdkit.rank(), hvdkit.size()  # hvdkit
    if GLOBAL_BATCH % size:
        raise SystemExit(f"the global batch {GLOBAL_BATCH} must divide by the {size} ranks")
    local = GLOBAL_BATCH // size
    rng = np.random.default_rng(7)  # same data on every rank
    x = rng.normal(size=(GLOBAL_BATCH * STEPS, 10)).astype("float32")
    y = (x @ rng.normal(size=(10, 1)) + 0.1).astype("float32")
    mse = keras.losses.MeanSquaredError()

    # --- manual: the step slices the global batch by rank
    model, opt = make_model(), keras.optimizers.SGD(0.05)

    @tf.function
    def manual_step(xb, yb):
        start = rank * local  # hvdkit: this rank's slice of the global batch
        xs, ys = xb[start : start + local], yb[start : start + local]
        with tf.GradientTape() as tape:
            local_loss = mse(ys, model(xs, training=True))
        global_loss = hvdkit.allreduce(local_loss, op=hvdkit.Average)  # hvdkit
        grads = tape.gradient(local_loss, model.trainable_variables)
        grads = hvdkit.grouped_allreduce(grads, op=hvdkit.Average)  # hvdkit
        opt.apply(grads, model.trainable_variables)
        return global_loss

    for step in range(STEPS):
        batch = slice(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH)
        loss = manual_step(x[batch], y[batch])
        if rank == 0 and step % 5 == 0:
            print(f"manual step {step:2d}  global loss {float(loss):.4f}", flush=True)
    manual = [w.numpy() for w in model.weights]

    # --- automatic: pre-sharded data, DistributedOptimizer + fit
    mine = np.concatenate(
        [
            np.arange(b + rank * local, b + (rank + 1) * local)
            for b in range(0, len(x), GLOBAL_BATCH)
        ]
    )
    auto_model = make_model()
    auto_model.compile(optimizer=hvdkit.DistributedOptimizer(keras.optimizers.SGD(0.05)), loss=mse)
    auto_model.fit(x[mine], y[mine], batch_size=local, epochs=1, shuffle=False, verbose=0)
    auto = [w.numpy() for w in auto_model.weights]

    worst = max(float(np.abs(a - b).max()) for a, b in zip(manual, auto, strict=True))
    same_everywhere = hvdkit.allgather(np.array([worst]))
    if rank == 0:
        print(f"max |manual - automatic| weight difference: {same_everywhere.max():.2e}")
    return 0 if same_everywhere.max() < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())

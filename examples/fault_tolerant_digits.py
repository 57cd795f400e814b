"""Fault-tolerant data-parallel training: kill a rank, the job resumes exactly.

The Keras MLP of ``train_digits.py``, trained with ``model.fit`` and saved by
``hvdkit.Checkpointer`` every few steps (weights, optimizer, data position,
random state). Try it:

    hvdkitrun -np 2 --max-restarts 2 --checkpoint-dir /tmp/ft python \\
        examples/fault_tolerant_digits.py /tmp/ft --step-sleep 0.2
    # in another shell, halfway:  kill -9 <pid of one rank>

``hvdkitrun`` restarts the job, ``restore()`` picks up the newest complete
checkpoint and every rank continues from it: the run ends with the same
weights as one that was never killed (compare the printed fingerprint), and
every training sample was trained once per epoch. Run the same command
without ``--max-restarts`` after a failure and it resumes the same way.
Lines that differ from single-process Keras code are marked ``# hvdkit:``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
from sklearn.datasets import load_digits

import hvdkit  # hvdkit


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ckpt", help="checkpoint folder (kept across restarts)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--every", type=int, default=5, help="save every N steps")
    p.add_argument(
        "--step-sleep", type=float, default=0.0, help="seconds per step, to kill one by hand"
    )
    args = p.parse_args()

    hvdkit.init()  # hvdkit
    rank, size = hvdkit.rank(), hvdkit.size()  # hvdkit

    digits = load_digits()
    x = (digits.data / 16.0).astype("float32")  # [1797, 64]
    y = digits.target.astype("int32")

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dropout(0.1, seed=1),  # its random state is checkpointed too
            keras.layers.Dense(10),
        ]
    )
    opt = hvdkit.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9))  # hvdkit
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # hvdkit: this rank's share of every epoch, resumable mid-epoch
    sampler = hvdkit.data.ShardSampler(len(x), shuffle=True, seed=1)
    # hvdkit: the whole training state, saved by rank 0, restored on every rank
    ckpt = hvdkit.Checkpointer(args.ckpt, model=model, sampler=sampler, every_steps=args.every)
    step = ckpt.restore()  # hvdkit: 0 on a fresh start
    if rank == 0:
        # hvdkit: hvdkitrun's restarts, or how often Slurm requeued the job
        restart = os.environ.get("HVDKIT_RESTART_COUNT") or os.environ.get(
            "SLURM_RESTART_COUNT", "0"
        )
        print(f"attempt {restart}: {size} rank(s), resuming from step {step}", flush=True)

    slow = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: time.sleep(args.step_sleep)
    )
    for epoch in range(sampler.epoch, args.epochs):  # hvdkit: was range(epochs)
        sampler.set_epoch(epoch)  # hvdkit
        model.fit(
            sampler.dataset((x, y)).batch(args.batch_size),  # hvdkit: this rank's batches
            initial_epoch=epoch,
            epochs=epoch + 1,
            shuffle=False,  # the sampler's order
            verbose=0,
            callbacks=[
                hvdkit.data.ShardPositionCallback(sampler, args.batch_size),  # hvdkit
                ckpt.callback(),  # hvdkit: save on schedule
                slow,
            ],
        )
        if rank == 0:
            loss = model.evaluate(x, y, verbose=0)
            print(f"epoch {epoch + 1}/{args.epochs}  loss on all digits {loss:.4f}", flush=True)

    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    fingerprint = hashlib.sha256(weights.tobytes()).hexdigest()[:16]
    if rank == 0:
        print(f"done at step {ckpt.step}; weights fingerprint {fingerprint}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

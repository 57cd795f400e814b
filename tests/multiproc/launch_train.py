"""A small deterministic training run used by the launcher tests.

    <launcher> python launch_train.py OUTDIR [--steps N]
        [--fault kill|stop|exit --fault-rank R --fault-step S]

Writes OUTDIR/pid.rank<r> at start, OUTDIR/trained.rank<r> after its third step
and OUTDIR/weights.rank<r>.npy at the end.
"""

import argparse
import os
import signal
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import hvdkit

p = argparse.ArgumentParser()
p.add_argument("outdir")
p.add_argument("--steps", type=int, default=12)
p.add_argument("--fault", choices=["kill", "stop", "exit"])
p.add_argument("--fault-rank", type=int, default=1)
p.add_argument("--fault-step", type=int, default=4)
p.add_argument("--step-sleep", type=float, default=0.05)
args = p.parse_args()

hvdkit.init()
r = hvdkit.rank()
with open(os.path.join(args.outdir, f"pid.rank{r}"), "w") as f:
    f.write(str(os.getpid()))
print(
    f"rank {r} of {hvdkit.size()} (local {hvdkit.local_rank()}/{hvdkit.local_size()}) "
    f"pid {os.getpid()}",
    flush=True,
)

keras.utils.set_random_seed(0)
model = keras.Sequential(
    [keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)]
)
opt = hvdkit.DistributedOptimizer(keras.optimizers.SGD(0.1))
rng = np.random.default_rng(r)
x = rng.normal(size=(args.steps, 8, 4)).astype("float32")
y = x.sum(-1, keepdims=True)


@tf.function
def step(xb, yb):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(xb) - yb))
    opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    return loss


for s in range(args.steps):
    if args.fault and r == args.fault_rank and s == args.fault_step:
        print(f"rank {r}: injecting fault '{args.fault}' at step {s}", flush=True)
        if args.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif args.fault == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            sys.exit(7)
    loss = step(x[s], y[s])
    if s == 2:  # a test may wait for this instead of sleeping: the job is training
        open(os.path.join(args.outdir, f"trained.rank{r}"), "w").close()
    time.sleep(args.step_sleep)
print(f"rank {r} final loss {float(loss):.6f}", flush=True)
np.save(
    os.path.join(args.outdir, f"weights.rank{r}.npy"),
    np.concatenate([w.numpy().ravel() for w in model.weights]),
)

"""A small custom training loop whose ranks take different paths at step 3.

    hvdkitrun -np 2 python divergence_prog.py MODE [--sleep S] [--watch S]

MODE:
  extra             rank 1 calls one extra allreduce ('extra') at step 3
  skip              rank 1 skips step 3 (its gradient allreduce included)
  gather_vs_reduce  rank 0 calls allgather ('g'), rank 1 allreduce ('r')
  rank0_section     rank 0 runs a rank-0-only section of --sleep seconds at step 3

At the divergence each rank starts a watch thread that prints
``WATCH EXPIRED`` after --watch seconds: a test that finds no such line knows
the job ended within that time of the divergence (an ordering fact, not a
wall-clock measurement of the test).
"""

import argparse
import threading
import time

import keras
import numpy as np
import tensorflow as tf

import hvdkit as hvd

p = argparse.ArgumentParser()
p.add_argument("mode", choices=["extra", "skip", "gather_vs_reduce", "rank0_section", "none"])
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--watch", type=float, default=3600.0)
p.add_argument("--steps", type=int, default=8)
args = p.parse_args()

hvd.init()
r = hvd.rank()
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
x = np.random.default_rng(r).normal(size=(8, 4)).astype("float32")
y = np.zeros((8, 2), "float32")


@tf.function
def train_step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x) - y) ** 2)
    opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)


def watch(seconds):
    def expire():
        time.sleep(seconds)
        print(f"[rank {r}] WATCH EXPIRED after {seconds:g} s", flush=True)

    threading.Thread(target=expire, daemon=True).start()


for step in range(args.steps):
    if step == 3:
        print(f"[rank {r}] diverging at step 3 ({args.mode})", flush=True)
        watch(args.watch)
        if args.mode == "extra" and r == 1:
            hvd.allreduce(np.ones(1), name="extra")
        if args.mode == "skip" and r == 1:
            continue
        if args.mode == "gather_vs_reduce":
            if r == 0:
                hvd.allgather(np.ones((1, 2)), name="g")
            else:
                hvd.allreduce(np.ones(2), name="r")
        if args.mode == "rank0_section" and r == 0:
            time.sleep(args.sleep)
            print(f"[rank {r}] rank-0-only section done", flush=True)
    train_step()

final = hvd.allgather(np.concatenate([w.numpy().ravel() for w in model.weights])[None], name="w")
assert np.array_equal(final[0], final[1])
print(f"[rank {r}] finished {int(opt.iterations.numpy())} steps", flush=True)

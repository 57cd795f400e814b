"""A seeded custom-loop training that checkpoints and resumes exactly, for the restart tests.

    <launcher> python restart_train.py OUTDIR CKPTDIR [--epochs E] [--samples N]
        [--batch B] [--every K] [--fault ATTEMPT:KIND:RANK:STEP ...] [--hold ATTEMPT:RANK:STEP]

Keeps its own small checkpoint (weights, epoch, global data cursor, the ids
trained so far, world size) so the launcher tests do not depend on
``hvdkit.Checkpointer``. The data position is global: (epoch, samples of the
epoch's permutation consumed by the whole job); each step takes the next
``B * size`` samples and rank r trains on its ``B`` of them, so after a
restart with fewer ranks the rest of the epoch is re-sharded over the ranks
that are there. The learning rate is ``LR * size`` (the documented hook for
a changed world size: read ``hvdkit.size()`` at start).

Faults (on the attempt ``HVDKIT_RESTART_COUNT`` == ATTEMPT only): ``kill``
(SIGKILL itself), ``stop`` (SIGSTOP itself), ``exit`` (exit 3), ``exit0``
(``os._exit(0)``), before global step STEP on rank RANK. ``--hold``: rank
RANK writes OUTDIR/held and sleeps (heartbeats go on) at step STEP.

Writes OUTDIR/attempt<n>.rank<r>.json at start, OUTDIR/weights.rank<r>.npy
and (rank 0) OUTDIR/trained.json (ids per epoch, from the checkpointed state)
at the end.
"""

import argparse
import hashlib
import json
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
p.add_argument("ckptdir")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--samples", type=int, default=48)
p.add_argument("--batch", type=int, default=4, help="per rank")
p.add_argument("--every", type=int, default=2, help="checkpoint every K global steps")
p.add_argument("--lr", type=float, default=0.05)
p.add_argument("--fault", action="append", default=[])
p.add_argument("--hold")
p.add_argument("--step-sleep", type=float, default=0.0)
args = p.parse_args()

hvdkit.init()
r, size = hvdkit.rank(), hvdkit.size()
attempt = int(os.environ.get("HVDKIT_RESTART_COUNT", "0"))
faults = {}
for f in args.fault:
    a, kind, fr, fs = f.split(":")
    faults[(int(a), int(fr), int(fs))] = kind
hold = tuple(map(int, args.hold.split(":"))) if args.hold else None


# ------------------------------------------------------------------ checkpoint (rank 0 writes)
# Laid out as hvdkit.Checkpointer lays out its own (ckpt-<step>/manifest.json with a
# self-checksum), so the launcher reports the step a restart resumes from.
def newest_checkpoint():
    best = None
    for name in sorted(os.listdir(args.ckptdir)):
        path = os.path.join(args.ckptdir, name, "manifest.json")
        if name.startswith("ckpt-") and os.path.exists(path):
            with open(path) as fh:
                m = json.load(fh)
            if best is None or m["step"] > best["step"]:
                best = m
    return best


def save(step, epoch, cursor, trained):
    final = os.path.join(args.ckptdir, f"ckpt-{step:010d}")
    tmp = os.path.join(args.ckptdir, f".tmp-ckpt-{step:010d}")
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "weights.npz"), "wb") as fh:
        np.savez(fh, *[v.numpy() for v in model.weights])
        fh.flush()
        os.fsync(fh.fileno())
    body = dict(step=step, epoch=epoch, cursor=cursor, size=size, trained=trained)
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    with open(os.path.join(tmp, "manifest.json"), "w") as fh:
        json.dump({**body, "manifest_sha256": digest}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.rename(tmp, final)


# ------------------------------------------------------------------ model and data
keras.utils.set_random_seed(0)
model = keras.Sequential(
    [keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)]
)
data_rng = np.random.default_rng(1234)
X = data_rng.normal(size=(args.samples, 4)).astype("float32")
Y = X.sum(-1, keepdims=True)

state = newest_checkpoint()
if state is None:
    step, epoch, cursor, trained, old_size = 0, 0, 0, {}, size
else:
    with np.load(os.path.join(args.ckptdir, f"ckpt-{state['step']:010d}", "weights.npz")) as z:
        for v, k in zip(
            model.weights, sorted(z.files, key=lambda s: int(s.split("_")[1])), strict=True
        ):
            v.assign(z[k])
    step, epoch, cursor = state["step"], state["epoch"], state["cursor"]
    trained, old_size = state["trained"], state["size"]
lr = args.lr * size  # hvdkit: the hook for a changed world size
opt = hvdkit.DistributedOptimizer(keras.optimizers.SGD(lr))
info = dict(
    attempt=attempt, rank=r, size=size, old_size=old_size, resumed_from=step, lr=lr, pid=os.getpid()
)
with open(os.path.join(args.outdir, f"attempt{attempt}.rank{r}.json"), "w") as fh:
    json.dump(info, fh)
print(
    f"rank {r} of {size}: attempt {attempt} resumes at step {step} (epoch {epoch}, "
    f"cursor {cursor}; checkpoint written by {old_size} ranks; lr {lr:g})",
    flush=True,
)


@tf.function
def train_step(xb, yb, ids):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(xb) - yb))
    opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    return loss, ids  # the ids this step trained on, as seen by the step


per_step = args.batch * size
loss = None
while epoch < args.epochs:
    perm = np.random.default_rng(1000 + epoch).permutation(args.samples)
    while cursor + per_step <= args.samples:
        kind = faults.get((attempt, r, step))
        if kind:
            print(f"rank {r}: injecting fault '{kind}' at step {step}", flush=True)
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif kind == "exit0":
                sys.stdout.flush()
                os._exit(0)
            else:
                sys.exit(3)
        if hold == (attempt, r, step):
            print(f"rank {r}: holding at step {step}", flush=True)
            open(os.path.join(args.outdir, "held"), "w").close()
            while True:
                time.sleep(1)
        mine = perm[cursor + r * args.batch : cursor + (r + 1) * args.batch]
        loss, ids = train_step(X[mine], Y[mine], tf.constant(mine, tf.int64))
        step_ids = hvdkit.allgather(ids).numpy().tolist()
        trained.setdefault(str(epoch), []).extend(step_ids)
        cursor += per_step
        step += 1
        if args.step_sleep:
            time.sleep(args.step_sleep)
        if step % args.every == 0:
            if r == 0:
                save(step, epoch, cursor, trained)
            hvdkit.barrier()  # no rank runs ahead of a checkpoint being written
    epoch, cursor = epoch + 1, 0

hvdkit.barrier()
final = "none (resumed after the last step)" if loss is None else f"{float(loss):.6f}"
print(f"rank {r} done at step {step}, final loss {final}", flush=True)
np.save(
    os.path.join(args.outdir, f"weights.rank{r}.npy"),
    np.concatenate([w.numpy().ravel() for w in model.weights]),
)
if r == 0:
    with open(os.path.join(args.outdir, "trained.json"), "w") as fh:
        json.dump(trained, fh)

"""Training throughput of hvdkit against its peers, side by side in one run.

    .venv/bin/python benchmarks/training.py [--steps 150] [--rounds 2]

Variants (small CNN on 32x32x3 synthetic images, batch 64 per process, SGD):

  single        1 process, TensorFlow's default threads (all cores), plain Keras fit
  hvdkit_fit    2 processes under horovodrun, hvdkit.DistributedOptimizer + model.fit
  hvdkit_spe    the same with steps_per_execution=25 (25 steps per host call, as sink mode)
  hvdkit_loop   2 processes, custom tf.function loop with hvdkit.DistributedGradientTape
  horovod_loop  2 processes, custom loop with horovod.tensorflow.grouped_allreduce (the peer)
  horovod_ds    the same reading each batch from a tf.data iterator, as fit does (the
                like-for-like baseline of hvdkit_fit and hvdkit_spe)
  mwms          2 processes, tf.distribute.MultiWorkerMirroredStrategy custom loop (the peer;
                Keras 3's fit fails under MWMS in TF 2.21)

Multi-process variants use 1 intra-op thread per process. Each variant runs
in its own processes; rounds interleave the variants to spread machine noise,
and the best round counts. Prints a table of images/s and the ratios the
foundation issue sets targets for; writes bench_results/training.json.
This is a benchmark, not a test: nothing here fails on a slow machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from _common import REPO, job_env

BIN = Path(sys.executable).parent
BATCH, IMAGE = 64, (32, 32, 3)


# ----------------------------------------------------------------- worker side
def build_model(keras):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input(IMAGE),
            keras.layers.Conv2D(16, 3, strides=2, activation="relu"),
            keras.layers.Conv2D(32, 3, strides=2, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )


def custom_step(tf, model, opt, loss_fn, next_batch, gradients):
    """The custom loop's ``tf.function`` step, as a Horovod or hvdkit user writes it.

    ``next_batch() -> (x, y)``; ``gradients(tape, loss, variables)`` returns the
    reduced gradients (Horovod's ``grouped_allreduce`` after ``tape.gradient``,
    or hvdkit's ``DistributedGradientTape``).
    """

    @tf.function
    def step():
        xb, yb = next_batch()
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        opt.apply(gradients(tape, loss, model.trainable_variables), model.trainable_variables)
        return loss

    return step


def horovod_gradients(hvd):
    """``custom_step``'s ``gradients`` for the raw Horovod loop (``horovod.tensorflow``)."""
    return lambda tape, loss, variables: hvd.grouped_allreduce(
        tape.gradient(loss, variables), op=hvd.Average
    )


def hvdkit_gradients(hvdkit):
    """``custom_step``'s ``gradients`` through ``hvdkit.DistributedGradientTape``."""
    return lambda tape, loss, variables: hvdkit.DistributedGradientTape(tape).gradient(
        loss, variables
    )


def worker(variant: str, steps: int, warmup: int, out: str) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    multi = variant != "single"
    if multi:
        tf.config.threading.set_intra_op_parallelism_threads(1)
    rank, size, sync = 0, 1, lambda: None
    strategy = None
    if variant.startswith("hvdkit"):
        import hvdkit as hvd

        hvd.init(intra_op_threads=1)
        rank, size, sync = hvd.rank(), hvd.size(), hvd.barrier
    elif variant in ("horovod_loop", "horovod_ds"):
        import horovod.tensorflow as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        sync = lambda: hvd.allreduce(tf.zeros([1]), op=hvd.Sum)
    elif variant == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        size = strategy.num_replicas_in_sync

    rng = np.random.default_rng(rank)
    x = rng.random((BATCH, *IMAGE), dtype=np.float32)
    y = rng.integers(0, 10, BATCH).astype("int32")
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    if strategy is not None:
        # Keras 3's model.fit fails under MWMS in TF 2.21 ("Attempt to convert
        # a value (PerReplica...)"), so the peer is TF's documented custom loop.
        with strategy.scope():
            model = build_model(keras)
            opt = keras.optimizers.SGD(0.01)
        ds = tf.data.Dataset.from_tensors((x, y)).repeat().unbatch().batch(BATCH * size)
        batches = iter(strategy.experimental_distribute_dataset(ds))

        @tf.function
        def mwms_step(batch):
            def replica_step(xb, yb):
                with tf.GradientTape() as tape:
                    per_example = keras.losses.sparse_categorical_crossentropy(
                        yb, model(xb, training=True), from_logits=True
                    )
                    loss = tf.nn.compute_average_loss(per_example, global_batch_size=BATCH * size)
                grads = tape.gradient(loss, model.trainable_variables)
                opt.apply(grads, model.trainable_variables)
                return loss

            return strategy.run(replica_step, args=batch)

        def run(n):
            for _ in range(n):
                loss = mwms_step(next(batches))
            strategy.experimental_local_results(loss)[0].numpy()
    elif variant in ("single", "hvdkit_fit", "hvdkit_spe"):
        ds = tf.data.Dataset.from_tensors((x, y)).repeat()
        model = build_model(keras)
        opt = keras.optimizers.SGD(0.01)
        if variant != "single":
            opt = hvd.DistributedOptimizer(opt)
        spe = 25 if variant == "hvdkit_spe" else 1
        model.compile(optimizer=opt, loss=loss_fn, steps_per_execution=spe)
        # One fit call of warm-up + timed steps, timed between two batch ends:
        # a fit call also creates and deletes its tf.data iterator, and that
        # deletion can wait for tf.data's autotuning thread (up to seconds
        # with 2 busy processes on 2 cores; see docs/performance.md), a cost
        # per fit call (per epoch), not per step. It is reported on its own.
        ends = []
        marks = keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: ends.append((batch, time.perf_counter()))
        )
        model.fit(ds, steps_per_epoch=warmup, epochs=1, verbose=0)  # build and trace
        model.fit(ds, steps_per_epoch=warmup + steps, epochs=1, verbose=0, callbacks=[marks])
        t_return = time.perf_counter()
        first, start = next((b, t) for b, t in ends if b >= warmup - 1)
        last, stop = ends[-1]
        if rank == 0:
            result = {
                "images_per_s": BATCH * size * (last - first) / (stop - start),
                "after_last_step_ms": 1000 * (t_return - stop),
            }
            Path(out).write_text(json.dumps(result))
        return
    else:
        model = build_model(keras)
        opt = keras.optimizers.SGD(0.01)
        xt, yt = tf.constant(x), tf.constant(y)
        # horovod_ds reads its batches as fit does: from a tf.data iterator
        ds = tf.data.Dataset.from_tensors((x, y))
        batches = iter(ds.repeat()) if variant == "horovod_ds" else None

        if variant == "horovod_ds":
            next_batch = lambda: next(batches)
        else:
            next_batch = lambda: (xt, yt)
        grads = hvdkit_gradients(hvd) if variant == "hvdkit_loop" else horovod_gradients(hvd)
        step = custom_step(tf, model, opt, loss_fn, next_batch, grads)

        def run(n):
            for _ in range(n):
                loss = step()
            float(loss)

    run(warmup)
    sync()
    t0 = time.perf_counter()
    run(steps)
    sync()
    elapsed = time.perf_counter() - t0
    if rank == 0:
        Path(out).write_text(json.dumps({"images_per_s": BATCH * size * steps / elapsed}))


# ----------------------------------------------------------------- driver side
def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def launch(variant: str, transport: str | None, steps: int, warmup: int, tmp: Path) -> dict:
    out = tmp / f"{variant}-{transport}.json"
    out.unlink(missing_ok=True)
    env = job_env()
    me = [
        sys.executable,
        __file__,
        "--worker",
        variant,
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--out",
        str(out),
    ]
    if variant == "single":
        subprocess.run(me, env=env, check=True, timeout=900)
    elif variant == "mwms":
        ports = free_ports(2)
        cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
        procs = []
        for i in range(2):
            tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
            procs.append(subprocess.Popen(me, env=dict(env, TF_CONFIG=tf_config)))
        codes = [p.wait(timeout=900) for p in procs]
        if any(codes):
            raise RuntimeError(f"mwms workers exited with {codes}")
    else:
        cmd = [str(BIN / "horovodrun"), "-np", "2", f"--{transport}", *me]
        subprocess.run(cmd, env=env, check=True, timeout=900, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker")
    p.add_argument("--out")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.warmup, args.out)
        return

    runs = [
        ("single", None),
        ("hvdkit_fit", "gloo"),
        ("hvdkit_spe", "gloo"),
        ("hvdkit_loop", "gloo"),
        ("horovod_loop", "gloo"),
        ("horovod_ds", "gloo"),
        ("mwms", None),
        ("hvdkit_fit", "mpi"),
        ("hvdkit_spe", "mpi"),
        ("hvdkit_loop", "mpi"),
        ("horovod_loop", "mpi"),
        ("horovod_ds", "mpi"),
    ]
    tmp = REPO / "bench_results"
    tmp.mkdir(exist_ok=True)
    best: dict[str, float] = {}
    teardown: dict[str, list[float]] = {}  # ms from a fit's last step to its return
    for rnd in range(args.rounds):
        for variant, transport in runs:
            key = variant if transport is None else f"{variant}/{transport}"
            got = launch(variant, transport, args.steps, args.warmup, tmp)
            ips = got["images_per_s"]
            best[key] = max(best.get(key, 0.0), ips)
            extra = ""
            if "after_last_step_ms" in got:
                teardown.setdefault(key, []).append(got["after_last_step_ms"])
                extra = f"  (fit returned {got['after_last_step_ms']:.0f} ms after its last step)"
            print(f"round {rnd + 1}: {key:20s} {ips:8.0f} img/s{extra}", flush=True)

    # (name, numerator, denominator, target from the foundation issue)
    ratio_defs = []
    for t in ("gloo", "mpi"):
        ratio_defs += [
            (f"hvdkit_fit/{t} / mwms", f"hvdkit_fit/{t}", "mwms", 1.2),
            (f"hvdkit_loop/{t} / horovod_loop/{t}", f"hvdkit_loop/{t}", f"horovod_loop/{t}", 0.97),
            (f"hvdkit_fit/{t} / horovod_loop/{t}", f"hvdkit_fit/{t}", f"horovod_loop/{t}", 0.97),
            (f"hvdkit_fit/{t} / single", f"hvdkit_fit/{t}", "single", 1.0),
            (f"hvdkit_spe/{t} / horovod_loop/{t}", f"hvdkit_spe/{t}", f"horovod_loop/{t}", 0.97),
            (f"hvdkit_fit/{t} / horovod_ds/{t}", f"hvdkit_fit/{t}", f"horovod_ds/{t}", 0.97),
            (f"hvdkit_spe/{t} / horovod_ds/{t}", f"hvdkit_spe/{t}", f"horovod_ds/{t}", 0.97),
            (f"hvdkit_spe/{t} / single", f"hvdkit_spe/{t}", "single", 1.0),
            (f"horovod_loop/{t} / single", f"horovod_loop/{t}", "single", None),
        ]
    ratios = {name: best[a] / best[b] for name, a, b, _ in ratio_defs}

    print(f"\n{'variant':24s} {'images/s':>10s}")
    for key, ips in best.items():
        print(f"{key:24s} {ips:10.0f}")
    print(f"\n{'ratio':40s} {'value':>7s} {'target':>8s}")
    for name, _, _, target in ratio_defs:
        shown = f">= {target:g}" if target else "-"
        print(f"{name:40s} {ratios[name]:7.3f} {shown:>8s}")
    result = {
        "config": {
            "batch_per_process": BATCH,
            "image": IMAGE,
            "steps": args.steps,
            "rounds": args.rounds,
            "cores": os.cpu_count(),
        },
        "images_per_s": best,
        "ratios": ratios,
        "fit_return_after_last_step_ms": teardown,
    }
    (tmp / "training.json").write_text(json.dumps(result, indent=2))
    print(f"\nwrote {tmp / 'training.json'}")


if __name__ == "__main__":
    main()

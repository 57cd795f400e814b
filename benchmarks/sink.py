"""Training steps/s in sink mode against a plain loop and Keras steps_per_execution.

    .venv/bin/python benchmarks/sink.py [--mlp-steps 600] [--lenet-steps 100]

Workloads, batch 32 per process, SGD, synthetic data held in memory:

  mlp     2-layer MLP (784 -> 128 -> 10) on flattened 28x28 inputs
  lenet   LeNet-5 on 32x32x1 inputs

Variants, all reading the same tf.data pipeline (``prefetch_to_device`` last):

  plain       a Python loop calling a tf.function step once per batch
  data_sink   hvdkit.sink.data_sink(step, ds, sink_size=N): one call per N steps
  sink_train  hvdkit.sink.train(model, ..., sink_size=N): Keras, one epoch per N
              steps (MLP only: LeNet is compute-bound and it runs data_sink's loop)
  keras_spe   model.fit(..., steps_per_execution=N): Keras's own multi-step loop

for N in 1, 10, 100, 1000, with 1 process (TensorFlow's default threads) and
with 2 processes under ``horovodrun --gloo`` (1 intra-op thread each; the step
averages gradients with hvdkit). After a warm-up call that traces, a timed run
makes enough calls for ``--*-steps`` steps; a figure is the best of 2 runs
(N=1000: of 1 run, one call). Prints a table and the targets of the sink-mode
issue, writes bench_results/sink.json and the plot docs/sink_bench.svg.
A benchmark, not a test: nothing fails on a slow machine. About 6 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _common import best_seconds, job_env  # benchmarks/ is the script's folder
from _svg import Series, legend

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
BATCH = 32
VARIANTS = ("data_sink", "sink_train", "keras_spe")


# ----------------------------------------------------------------- worker side
def build(keras, workload: str):
    keras.utils.set_random_seed(0)
    if workload == "lenet":
        from lenet_sink import lenet5  # examples/ is on sys.path (see main)

        return lenet5()
    return keras.Sequential(
        [keras.Input((784,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)]
    )


def worker(out: str, mlp_steps: int, lenet_steps: int, sizes: list[int]) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import hvdkit

    hvdkit.init()
    results: dict[str, float] = {}
    # LeNet is compute-bound (about 10 ms a step here): sink_train runs the
    # same loop as data_sink, and leaving it out saves a third of the run.
    measure("mlp", mlp_steps, sizes, results, VARIANTS)
    measure("lenet", lenet_steps, sizes, results, ("data_sink", "keras_spe"))
    if hvdkit.rank() == 0:
        Path(out).write_text(json.dumps(results))


def measure(workload: str, min_steps: int, sizes: list[int], results: dict, variants) -> None:
    import keras
    import numpy as np
    import tensorflow as tf

    import hvdkit
    from hvdkit import sink

    rank, size = hvdkit.rank(), hvdkit.size()
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    shape = (784,) if workload == "mlp" else (32, 32, 1)
    rng = np.random.default_rng(rank)
    x = rng.random((64 * BATCH, *shape), dtype=np.float32)
    y = rng.integers(0, 10, 64 * BATCH).astype("int32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).cache()
    ds = sink.prefetch_to_device(ds)
    endless = ds.repeat()

    def step_for(model, opt):
        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            tape = hvdkit.DistributedGradientTape(tape)
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            return loss

        return step

    def compiled(n):
        model = build(keras, workload)
        opt = hvdkit.DistributedOptimizer(keras.optimizers.SGD(0.01))
        model.compile(optimizer=opt, loss=loss_fn, steps_per_execution=n, jit_compile=False)
        return model

    # the plain loop does not depend on N
    step = step_for(build(keras, workload), keras.optimizers.SGD(0.01))
    batches = iter(endless)

    def plain(calls):
        for _ in range(calls):
            loss = step(*next(batches))
        float(loss)

    plain(5)
    results[f"{workload}/plain"] = min_steps / best_seconds(lambda: plain(min_steps), 2)

    for n in sizes:
        calls = max(1, -(-min_steps // n))
        runs = 1 if n >= 1000 else 2  # N=1000: a warm-up call and one timed call
        run_sink = sink.data_sink(
            step_for(build(keras, workload), keras.optimizers.SGD(0.01)), ds, n
        )
        model_t, model_k = compiled(1), compiled(n)  # train() sets steps_per_execution

        def data_sink(calls, run_sink=run_sink):
            for _ in range(calls):
                loss = run_sink()
            float(loss)

        def sink_train(calls, model_t=model_t, n=n):
            sink.train(model_t, calls, ds, sink_size=n, verbose=0)

        def keras_spe(calls, model_k=model_k, n=n):
            model_k.fit(endless, epochs=1, steps_per_epoch=calls * n, shuffle=False, verbose=0)

        runners = {"data_sink": data_sink, "sink_train": sink_train, "keras_spe": keras_spe}
        for name in variants:
            runners[name](1)  # warm-up: traces
            seconds = best_seconds(lambda run=runners[name], calls=calls: run(calls), runs)
            results[f"{workload}/{name}/{n}"] = calls * n / seconds
        if rank == 0:
            row = "  ".join(f"{v} {results[f'{workload}/{v}/{n}']:7.0f}" for v in variants)
            print(f"[{size} proc] {workload} N={n:4d}  {row}", flush=True)


# ----------------------------------------------------------------- driver side
def run_worker(procs: int, out: Path, args) -> dict:
    out.unlink(missing_ok=True)
    env = job_env(REPO, REPO / "examples")
    me = [sys.executable, __file__, "--worker", "--out", str(out)]
    me += ["--mlp-steps", str(args.mlp_steps), "--lenet-steps", str(args.lenet_steps)]
    me += ["--sink-sizes", args.sink_sizes]
    if procs == 1:
        env["HVDKIT_BACKEND"] = "local"
        subprocess.run(me, env=env, check=True, timeout=900)
    else:
        cmd = [str(BIN / "horovodrun"), "-np", str(procs), "--gloo", *me]
        subprocess.run(cmd, env=env, check=True, timeout=900)
    return json.loads(out.read_text())


def svg_plot(table: dict, sizes: list[int], path: Path) -> None:
    """Steps/s against N (log scale), one panel per workload and process count."""
    colors = {"plain": "#888888", "data_sink": "#1f77b4", "sink_train": "#2ca02c"}
    colors["keras_spe"] = "#d62728"
    panels = [(w, p) for p in (1, 2) for w in ("mlp", "lenet")]
    pw, ph, ml, mt = 300, 220, 60, 30
    width, height = ml + len(panels) * (pw + ml), mt + ph + 90
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]
    for i, (workload, procs) in enumerate(panels):
        x0 = ml + i * (pw + ml)
        rows = table[procs]
        drawn = [v for v in VARIANTS if f"{workload}/{v}/{sizes[0]}" in rows]
        top = max(rows[f"{workload}/{v}/{n}"] for v in drawn for n in sizes)
        top = 1.1 * max(top, rows[f"{workload}/plain"])
        xs = {n: x0 + 20 + k * (pw - 40) / (len(sizes) - 1) for k, n in enumerate(sizes)}

        def yv(v, top=top):
            return mt + ph - v / top * ph

        parts.append(
            f'<rect x="{x0}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>'
        )
        parts.append(
            f'<text x="{x0 + pw / 2}" y="{mt - 10}" text-anchor="middle" font-weight="bold">'
            f"{workload}, {procs} process{'es' if procs > 1 else ''}</text>"
        )
        for k in range(5):
            v = top * k / 4
            parts.append(
                f'<text x="{x0 - 5}" y="{yv(v) + 4:.1f}" text-anchor="end">{v:.0f}</text>'
                f'<line x1="{x0}" x2="{x0 + pw}" y1="{yv(v):.1f}" y2="{yv(v):.1f}" stroke="#eee"/>'
            )
        for n, xn in xs.items():
            parts.append(f'<text x="{xn:.1f}" y="{mt + ph + 15}" text-anchor="middle">N={n}</text>')
        plain = rows[f"{workload}/plain"]
        parts.append(
            f'<line x1="{x0}" x2="{x0 + pw}" y1="{yv(plain):.1f}" y2="{yv(plain):.1f}" '
            f'stroke="{colors["plain"]}" stroke-dasharray="5,4" stroke-width="2"/>'
        )
        for v in drawn:
            pts = " ".join(f"{xs[n]:.1f},{yv(rows[f'{workload}/{v}/{n}']):.1f}" for n in sizes)
            parts.append(
                f'<polyline points="{pts}" fill="none" stroke="{colors[v]}" stroke-width="2"/>'
            )
            for n in sizes:
                parts.append(
                    f'<circle cx="{xs[n]:.1f}" cy="{yv(rows[f"{workload}/{v}/{n}"]):.1f}" r="3" '
                    f'fill="{colors[v]}"/>'
                )
        if i == 0:
            parts.append(
                f'<text x="{x0 - 45}" y="{mt + ph / 2}" transform="rotate(-90 {x0 - 45} '
                f'{mt + ph / 2})" text-anchor="middle">training steps/s</text>'
            )
    labels = {
        "plain": "plain tf.function loop (dashed)",
        "data_sink": "hvdkit data_sink",
        "sink_train": "hvdkit sink.train (Keras)",
        "keras_spe": "Keras fit(steps_per_execution=N)",
    }
    keys = ["plain", *VARIANTS]
    shown = [Series(labels[v], colors[v], [], dash=v == "plain") for v in keys]
    parts += legend(ml, mt + ph + 50, shown, len(shown), 260)
    parts.append(
        f'<text x="{ml}" y="{height - 10}" fill="#555">N = sink_size = steps_per_execution; '
        "batch 32 per process; CPU, 2 cores; LeNet: no sink_train (benchmarks/sink.py)</text>"
    )
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out")
    p.add_argument("--mlp-steps", type=int, default=600, help="timed steps per run, at least")
    p.add_argument("--lenet-steps", type=int, default=100, help="timed steps per run, at least")
    p.add_argument("--sink-sizes", default="1,10,100,1000")
    p.add_argument("--plot", default=str(REPO / "docs" / "sink_bench.svg"))
    args = p.parse_args()
    sizes = [int(n) for n in args.sink_sizes.split(",")]
    if args.worker:
        worker(args.out, args.mlp_steps, args.lenet_steps, sizes)
        return

    results_dir = REPO / "bench_results"
    results_dir.mkdir(exist_ok=True)
    started = time.perf_counter()
    table = {procs: run_worker(procs, results_dir / f"sink-{procs}.json", args) for procs in (1, 2)}

    print("\ntraining steps/s (batch 32 per process; '-' = not measured)")
    print(
        f"{'workload':8s} {'procs':>5s} {'N':>5s} {'plain':>7s}"
        + "".join(f" {v:>11s}" for v in VARIANTS)
    )
    targets = []
    for procs, rows in table.items():
        for workload in ("mlp", "lenet"):
            plain = rows[f"{workload}/plain"]
            for n in sizes:
                v = {name: rows.get(f"{workload}/{name}/{n}") for name in VARIANTS}
                cells = "".join(f" {v[k]:11.0f}" if v[k] else f" {'-':>11s}" for k in VARIANTS)
                print(f"{workload:8s} {procs:5d} {n:5d} {plain:7.0f}{cells}")
                if workload == "mlp" and n == 100:
                    targets.append(
                        (f"mlp {procs}p N=100: data_sink / plain", v["data_sink"] / plain, 3)
                    )
                for name in ("data_sink", "sink_train"):
                    if v[name]:
                        label = f"{workload} {procs}p N={n}: {name} / keras_spe"
                        targets.append((label, v[name] / v["keras_spe"], 1))
    print(f"\n{'target':45s} {'ratio':>7s} {'goal':>5s}  met")
    for name, ratio, goal in targets:
        print(f"{name:45s} {ratio:7.2f} {goal:>5d}  {'yes' if ratio >= goal else 'NO'}")
    result = {
        "config": {
            "batch_per_process": BATCH,
            "sink_sizes": sizes,
            "mlp_steps": args.mlp_steps,
            "lenet_steps": args.lenet_steps,
            "cores": os.cpu_count(),
            "seconds": round(time.perf_counter() - started, 1),
        },
        "steps_per_s": {str(procs): rows for procs, rows in table.items()},
        "targets": [{"name": n, "ratio": r, "goal": g} for n, r, g in targets],
    }
    (results_dir / "sink.json").write_text(json.dumps(result, indent=2))
    svg_plot(table, sizes, Path(args.plot))
    took = time.perf_counter() - started
    print(f"\nwrote {results_dir / 'sink.json'} and {args.plot} in {took:.0f} s")


if __name__ == "__main__":
    main()

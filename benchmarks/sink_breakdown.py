"""Where a 2-process training step goes, with and without sink mode, per transport.

    .venv/bin/python benchmarks/sink_breakdown.py [--steps 600] [--sink-size 100] [--rounds 2]

The workload of benchmarks/sink.py's MLP (784 -> 128 -> 10, 102k parameters,
batch 32 per process, SGD, a cached and prefetched in-memory tf.data input),
2 processes under ``hvdkitrun`` with 1 intra-op thread each, run three times:
with no transport flag (what ``hvdkitrun`` picks on this machine now), with
``--gloo`` and with ``--mpi``. Each job measures, all ranks in step:

  plain       steps/s of a Python loop calling the tf.function step per batch
  data_sink   steps/s of hvdkit.sink.data_sink(step, ds, sink_size=N)
  compute     ms per step of the same data_sink whose step does not reduce its
              gradients (forward, backward, update), less the input wait
  allreduce   ms per step of the gradient reduction alone: N calls of
              hvdkit.reduce_gradients on the step's gradient shapes in one
              tf.function loop (the DistributedGradientTape path)
  input wait  DataSink.last_input_wait / N: time the sink's steps waited for
              their batches (median call)

and derives the host dispatch per step = 1/plain - 1/data_sink (what sink mode
removes) and "other" = data_sink's step - compute - input wait - allreduce
(what the parts do not explain: negotiation beyond the reduction alone, scheduling of two
processes on shared cores; negative when compute and allreduce overlap).
Each figure is the best of 3 timed repeats; with --rounds R the three jobs
are interleaved R times and the median round counts. Prints a table, writes
bench_results/sink_breakdown.json and draws docs/sink_breakdown.svg.
A benchmark, not a test: nothing here fails on a slow machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _common import REPO, best_seconds, job_env
from _svg import Series, document, legend

BIN = Path(sys.executable).parent
BATCH = 32
LAUNCHES = (("default", []), ("gloo", ["--gloo"]), ("mpi", ["--mpi"]))
PARTS = ("dispatch", "compute", "allreduce", "input_wait", "other")  # ms per step


# ----------------------------------------------------------------- worker side
def worker(out: str, steps: int, n: int) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    import hvdkit
    from hvdkit import sink

    hvdkit.init(intra_op_threads=1)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(hvdkit.rank())
    x = rng.random((64 * BATCH, 784), dtype=np.float32)
    y = rng.integers(0, 10, 64 * BATCH).astype("int32")
    ds = sink.prefetch_to_device(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).cache())

    def new_step(reduce: bool):
        keras.utils.set_random_seed(0)
        layers = keras.layers
        model = keras.Sequential(
            [keras.Input((784,)), layers.Dense(128, activation="relu"), layers.Dense(10)]
        )
        opt = keras.optimizers.SGD(0.01)

        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            if reduce:
                tape = hvdkit.DistributedGradientTape(tape)
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            return loss

        return step, model

    def warm_then_time(run) -> float:
        run()  # warm-up: traces
        return best_seconds(run, repeats=3)

    calls = max(1, -(-steps // n))
    total = calls * n

    step, model = new_step(reduce=True)
    batches = iter(ds.repeat())

    def plain():
        for _ in range(total):
            loss = step(*next(batches))
        float(loss)

    def sink_runner(reduce: bool):
        run_sink = sink.data_sink(new_step(reduce)[0], ds, n)
        waits = []

        def run():
            for _ in range(calls):
                loss = run_sink()
                waits.append(run_sink.last_input_wait)
            float(loss)

        return run, waits

    with_reduce, waits = sink_runner(reduce=True)
    without_reduce, _ = sink_runner(reduce=False)
    grads = [tf.random.normal(v.shape, seed=1) for v in model.trainable_variables]

    @tf.function
    def reductions():
        acc = tf.constant(0.0)
        for _ in tf.range(n):
            acc += hvdkit.reduce_gradients(grads)[0][0, 0]
        return acc

    def allreduce_only():
        for _ in range(calls):
            acc = reductions()
        float(acc)

    plain_s = warm_then_time(plain) / total
    sink_s = warm_then_time(with_reduce) / total
    compute_s = warm_then_time(without_reduce) / total
    allreduce_s = warm_then_time(allreduce_only) / total
    wait_s = statistics.median(waits[-calls:]) / n
    if hvdkit.rank() == 0:
        result = {
            "transport": "mpi" if hvdkit.mpi_enabled() else "gloo",
            "plain_steps_per_s": 1 / plain_s,
            "data_sink_steps_per_s": 1 / sink_s,
            "ms": {
                "dispatch": 1000 * (plain_s - sink_s),
                "compute": 1000 * (compute_s - wait_s),
                "allreduce": 1000 * allreduce_s,
                "input_wait": 1000 * wait_s,
                "other": 1000 * (sink_s - compute_s - allreduce_s),  # parts sum to a step
            },
        }
        Path(out).write_text(json.dumps(result))


# ----------------------------------------------------------------- driver side
def launch(flags: list[str], out: Path, args) -> dict:
    out.unlink(missing_ok=True)
    me = [sys.executable, __file__, "--worker", "--out", str(out)]
    me += ["--steps", str(args.steps), "--sink-size", str(args.sink_size)]
    cmd = [str(BIN / "hvdkitrun"), "-np", "2", *flags, "--no-prefix", *me]
    proc = subprocess.run(cmd, env=job_env(), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    result = json.loads(out.read_text())
    picked = [ln for ln in proc.stderr.splitlines() if ln.startswith("hvdkitrun: transport ")]
    result["announced"] = picked[0] if picked else ""
    return result


def median_round(rounds: list[dict]) -> dict:
    """The round whose data_sink steps/s is the median (odd count) or the lower middle."""
    ordered = sorted(rounds, key=lambda r: r["data_sink_steps_per_s"])
    return ordered[(len(ordered) - 1) // 2]


def svg(rows: dict[str, dict], n: int, path: Path) -> None:
    """Stacked bars of ms per step: plain and data_sink, per launch."""
    colors = {
        "dispatch": "#888888",
        "compute": "#1f77b4",
        "allreduce": "#d62728",
        "input_wait": "#2ca02c",
        "other": "#ff7f0e",
    }
    bars = []
    for launch_name, r in rows.items():
        name = f"default ({r['transport']})" if launch_name == "default" else launch_name
        ms = {k: max(0.0, v) for k, v in r["ms"].items()}
        sink_parts = {k: ms[k] for k in PARTS if k != "dispatch"}
        bars.append((f"{name}: plain", {"dispatch": ms["dispatch"], **sink_parts}))
        bars.append((f"{name}: data_sink N={n}", sink_parts))
    top = max(sum(p.values()) for _, p in bars) * 1.1
    ml, mt, bw, gap, ph = 180, 30, 420, 8, 22
    height = mt + len(bars) * (ph + gap) + 80
    parts = [f'<text x="{ml}" y="18" font-weight="bold">ms per training step, 2 processes</text>']
    for i, (label, p) in enumerate(bars):
        y, x = mt + i * (ph + gap), ml
        parts.append(f'<text x="{ml - 6}" y="{y + 15}" text-anchor="end">{label}</text>')
        for k in PARTS:
            w = bw * p.get(k, 0.0) / top
            if w > 0:
                parts.append(
                    f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{ph}" fill="{colors[k]}"/>'
                )
                x += w
        parts.append(f'<text x="{x + 4:.1f}" y="{y + 15}">{sum(p.values()):.2f}</text>')
    keys = [Series(k.replace("_", " "), colors[k], []) for k in PARTS]
    parts += legend(ml, mt + len(bars) * (ph + gap) + 20, keys, len(keys), 90)
    foot = "MLP 784-128-10, batch 32 per process, CPU, 2 cores (benchmarks/sink_breakdown.py)"
    path.write_text(document(ml + bw + 80, height, parts, footnote=foot))


def report(rows: dict[str, dict], n: int, load: float) -> None:
    """Print the table of steps/s and ms per step, and the goals of sink mode."""
    print(f"\nMLP, 2 processes, sink_size={n}; ms per step (load average at the start {load:.1f})")
    head = f"{'launch':8s} {'plain/s':>8s} {'sink/s':>8s} {'ratio':>6s}"
    print(head + "".join(f" {k:>10s}" for k in PARTS))
    for name, r in rows.items():
        ratio = r["data_sink_steps_per_s"] / r["plain_steps_per_s"]
        cells = "".join(f" {r['ms'][k]:10.3f}" for k in PARTS)
        print(
            f"{name:8s} {r['plain_steps_per_s']:8.0f} {r['data_sink_steps_per_s']:8.0f} "
            f"{ratio:6.2f}{cells}"
        )
    default = rows["default"]
    best = max(rows["gloo"]["data_sink_steps_per_s"], rows["mpi"]["data_sink_steps_per_s"])
    print(
        f"\ndefault launch: data_sink / plain = "
        f"{default['data_sink_steps_per_s'] / default['plain_steps_per_s']:.2f} (goal >= 1.5); "
        f"data_sink / better transport's = {default['data_sink_steps_per_s'] / best:.2f} "
        f"(goal >= 0.97); {default['announced']}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out")
    p.add_argument("--steps", type=int, default=600, help="timed steps per repeat, at least")
    p.add_argument("--sink-size", type=int, default=100)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--plot", default=str(REPO / "docs" / "sink_breakdown.svg"))
    p.add_argument("--from-json", help="re-print and re-draw a saved run; measure nothing")
    args = p.parse_args()
    if args.worker:
        worker(args.out, args.steps, args.sink_size)
        return
    if args.sink_size < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--steps, --sink-size and --rounds must be at least 1")

    results_dir = REPO / "bench_results"
    results_dir.mkdir(exist_ok=True)
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        report(saved["rows"], saved["config"]["sink_size"], saved["load_average_at_start"])
        svg(saved["rows"], saved["config"]["sink_size"], Path(args.plot))
        print(f"drew {args.plot}")
        return
    load = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {name: [] for name, _ in LAUNCHES}
    for rnd in range(args.rounds):
        for name, flags in LAUNCHES:
            r = launch(flags, results_dir / f"sink_breakdown-{name}.json", args)
            runs[name].append(r)
            print(
                f"round {rnd + 1}: {name:8s} plain {r['plain_steps_per_s']:6.0f} steps/s, "
                f"data_sink {r['data_sink_steps_per_s']:6.0f}  {r['announced']}",
                flush=True,
            )
    rows = {name: median_round(rs) for name, rs in runs.items()}

    n = args.sink_size
    report(rows, n, load)
    result = {
        "config": {"steps": args.steps, "sink_size": n, "rounds": args.rounds, "batch": BATCH},
        "load_average_at_start": load,
        "rows": rows,
        "all_rounds": runs,
    }
    (results_dir / "sink_breakdown.json").write_text(json.dumps(result, indent=2))
    svg(rows, n, Path(args.plot))
    print(f"wrote {results_dir / 'sink_breakdown.json'} and {args.plot}")


if __name__ == "__main__":
    main()

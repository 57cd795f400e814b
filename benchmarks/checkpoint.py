"""Checkpoint cost: write and restore time against model size, and the training overhead.

Run in one process (a job of size 1; under a launcher rank 0 writes and
``restore`` adds the broadcast)::

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python benchmarks/checkpoint.py \
        [--sizes 1,10,50,200] [--repeats 3] [--dir /tmp/hvdkit-ckpt-bench]

For each model size (MB of float32 weights: one Dense layer of 1024 outputs;
the optimizer is SGD with momentum, so a checkpoint holds about twice the
model) it times :meth:`hvdkit.Checkpointer.save` (write, fsync, rename,
checksum) synchronously (``background=False``), then the pause the same save
costs with the default background write (the in-memory copy; training goes
on while a thread writes; the second save of a Checkpointer, whose snapshot
buffers exist; the first one's is reported too) and the time until that
write is on disk, and
:meth:`~hvdkit.Checkpointer.restore` into a fresh model (read, verify,
assign), keeping the median of ``--repeats``.

Throughput overhead at one checkpoint per minute is measured by interval
extrapolation: a small model trains ``--steps`` steps with ``fit`` twice, once
without checkpoints and once saving every ``--every`` steps; the extra time
per save, divided by 60 s, is the fraction of training time a one-per-minute
schedule costs. For the large models the same division is done with the
measured write time (a save blocks the step it follows; other ranks wait in
their next allreduce, so the cost is the same on every rank).

Prints a table, writes bench_results/checkpoint.json and docs/checkpoint_bench.svg.
A benchmark, not a test: nothing fails on a slow machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import keras
import numpy as np

import hvdkit

REPO = Path(__file__).resolve().parents[1]
OUTPUTS = 1024


def make_model(megabytes: float, seed: int = 0) -> keras.Model:
    inputs = max(1, int(megabytes * 1e6 / 4 / OUTPUTS))
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((inputs,)), keras.layers.Dense(OUTPUTS)])
    model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "mse")
    model.optimizer.build(model.trainable_variables)
    return model


def nbytes(variables) -> int:
    return sum(int(np.prod(v.shape)) * 4 for v in variables)


def time_save_restore(megabytes: float, root: Path, repeats: int) -> dict:
    model = make_model(megabytes)
    writes, restores, pauses, durable, first_pauses = [], [], [], [], []
    for rep in range(repeats):
        folder = root / f"{megabytes}mb-{rep}"
        ckpt = hvdkit.Checkpointer(folder, model=model, keep=1, background=False)
        start = time.perf_counter()
        ckpt.save(1)
        writes.append(time.perf_counter() - start)
        # The same save written in the background: the pause is what training waits.
        # The first save also allocates the snapshot's buffers; later saves reuse them.
        bg = hvdkit.Checkpointer(root / f"{megabytes}mb-bg-{rep}", model=model, keep=1)
        start = time.perf_counter()
        bg.save(1)
        first_pauses.append(time.perf_counter() - start)
        bg.wait()
        start = time.perf_counter()
        bg.save(2)
        pauses.append(time.perf_counter() - start)
        bg.wait()
        durable.append(time.perf_counter() - start)
        shutil.rmtree(bg.directory)
        fresh = make_model(megabytes, seed=rep + 1)
        start = time.perf_counter()
        assert hvdkit.Checkpointer(folder, model=fresh, keep=1).restore() == 1
        restores.append(time.perf_counter() - start)
        np.testing.assert_array_equal(
            fresh.layers[0].kernel.numpy()[:2], model.layers[0].kernel.numpy()[:2]
        )
        del fresh
        shutil.rmtree(folder)
    ckpt_bytes = nbytes(model.variables) + nbytes(model.optimizer.variables)
    write = statistics.median(writes)
    return {
        "model_mb": round(nbytes(model.variables) / 1e6, 2),
        "checkpoint_mb": round(ckpt_bytes / 1e6, 2),
        "write_s": write,
        "background_pause_s": statistics.median(pauses),
        "background_pause_ratio": statistics.median(pauses) / write,
        "background_first_pause_s": statistics.median(first_pauses),
        "background_durable_s": statistics.median(durable),
        "restore_s": statistics.median(restores),
        "write_mb_per_s": ckpt_bytes / 1e6 / write,
        "overhead_per_minute_pct": 100 * write / 60,
    }


def training_overhead(root: Path, megabytes: float, steps: int, every: int) -> dict:
    """Seconds per save inside fit, from a run with and one without checkpoints."""
    model = make_model(megabytes)
    width = model.inputs[0].shape[1]
    x = np.random.default_rng(0).normal(size=(steps * 8, width)).astype("float32")
    y = np.zeros((steps * 8, OUTPUTS), "float32")
    model.fit(x[:16], y[:16], batch_size=8, verbose=0)  # trace once

    def run(callbacks):
        start = time.perf_counter()
        model.fit(x, y, batch_size=8, verbose=0, shuffle=False, callbacks=callbacks)
        return time.perf_counter() - start

    plain_runs, ckpt_runs = [], []
    for rep in range(2):  # interleaved, best of 2 each
        plain_runs.append(run([]))
        ckpt = hvdkit.Checkpointer(root / f"train-{rep}", model=model, every_steps=every, keep=2)
        ckpt_runs.append(run([ckpt.callback()]))
        ckpt.wait()  # the last background write (after training: not counted)
        shutil.rmtree(root / f"train-{rep}")
    plain, with_ckpt = min(plain_runs), min(ckpt_runs)
    saves = steps // every
    per_save = max(with_ckpt - plain, 0.0) / saves
    return {
        "model_mb": megabytes,
        "steps": steps,
        "saves": saves,
        "plain_s": plain,
        "with_checkpoints_s": with_ckpt,
        "seconds_per_save": per_save,
        "overhead_per_minute_pct": 100 * per_save / 60,
    }


def svg_plot(rows: list[dict], path: Path) -> None:
    width, height, left, right, top, bottom = 560, 320, 60, 20, 30, 50
    xs = [np.log10(r["model_mb"]) for r in rows]
    ymax = max(max(r["write_s"], r["restore_s"], r["background_durable_s"]) for r in rows) * 1.15
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1

    def px(x):
        return left + (x - x0) / (x1 - x0) * (width - left - right)

    def py(y):
        return height - bottom - y / ymax * (height - top - bottom)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{width / 2}" y="18" text-anchor="middle">hvdkit.Checkpointer: '
        "seconds per save and restore (1 process)</text>",
        f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" '
        f'y2="{height - bottom}" stroke="black"/>',
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="black"/>',
        f'<text x="{width / 2}" y="{height - 12}" text-anchor="middle">model size (MB of '
        "weights; the checkpoint holds ~2x with SGD momentum), log scale</text>",
    ]
    for i in range(5):
        v = ymax * i / 4
        parts.append(
            f'<text x="{left - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{v:.2f}</text>'
            f'<line x1="{left}" y1="{py(v):.1f}" x2="{width - right}" y2="{py(v):.1f}" '
            'stroke="#ddd"/>'
        )
    for r, x in zip(rows, xs, strict=True):
        parts.append(
            f'<text x="{px(x):.1f}" y="{height - bottom + 16}" text-anchor="middle">'
            f"{r['model_mb']:g}</text>"
        )
    lines = (
        ("write_s", "#c0392b", "save (synchronous)"),
        ("restore_s", "#2471a3", "restore"),
        ("background_pause_s", "#1e8449", "training pause per save (background write)"),
    )
    for n, (key, color, label) in enumerate(lines):
        pts = " ".join(f"{px(x):.1f},{py(r[key]):.1f}" for r, x in zip(rows, xs, strict=True))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>')
        for r, x in zip(rows, xs, strict=True):
            parts.append(f'<circle cx="{px(x):.1f}" cy="{py(r[key]):.1f}" r="3" fill="{color}"/>')
        y_label = top + 14 + 16 * n
        parts.append(f'<text x="{left + 10}" y="{y_label}" fill="{color}">{label}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,10,50,200", help="model sizes in MB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default="/tmp/hvdkit-ckpt-bench")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--train-mb", type=float, default=4.0)
    p.add_argument("--json", default=str(REPO / "bench_results" / "checkpoint.json"))
    p.add_argument("--plot", default=str(REPO / "docs" / "checkpoint_bench.svg"))
    args = p.parse_args()
    hvdkit.init()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rows = [time_save_restore(float(s), root, args.repeats) for s in args.sizes.split(",")]
    train = training_overhead(root, args.train_mb, args.steps, args.every)
    shutil.rmtree(root, ignore_errors=True)

    print(
        f"{'model MB':>9} {'ckpt MB':>8} {'save s':>8} {'bg pause s':>11} {'pause/save':>11} "
        f"{'1st pause s':>12} "
        f"{'bg on disk s':>13} {'restore s':>10} {'MB/s':>7} {'overhead @1/min':>16}"
    )
    for r in rows:
        print(
            f"{r['model_mb']:9.1f} {r['checkpoint_mb']:8.1f} {r['write_s']:8.3f} "
            f"{r['background_pause_s']:11.3f} {100 * r['background_pause_ratio']:10.1f}% "
            f"{r['background_first_pause_s']:12.3f} "
            f"{r['background_durable_s']:13.3f} "
            f"{r['restore_s']:10.3f} {r['write_mb_per_s']:7.0f} "
            f"{r['overhead_per_minute_pct']:15.2f}%"
        )
    print(
        f"in fit ({train['model_mb']:g} MB model, {train['steps']} steps, {train['saves']} saves): "
        f"{train['plain_s']:.2f} s plain, {train['with_checkpoints_s']:.2f} s with checkpoints -> "
        f"{train['seconds_per_save']:.3f} s per save = "
        f"{train['overhead_per_minute_pct']:.2f}% at one checkpoint per minute"
    )
    out = {
        "backend": hvdkit.backend_name(),
        "size": hvdkit.size(),
        "save_restore": rows,
        "training_overhead": train,
        "note": "median of repeats; overhead = seconds per save / 60 s",
    }
    Path(args.json).parent.mkdir(exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    svg_plot(rows, Path(args.plot))
    print(f"wrote {args.json} and {args.plot}")


if __name__ == "__main__":
    main()

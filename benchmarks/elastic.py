"""Time from a worker's death to the survivors' next training step, in-process (hvdkit.elastic).

    python benchmarks/elastic.py [--repeats 3]

Runs the scheduler/worker launch with ``HVDKIT_ELASTIC=1``, 3 workers and
``HVDKIT_MIN_WORKERS=2`` on this file in worker mode: a small Keras model
trained with ``model.fit`` inside ``@hvdkit.elastic.run``, a Checkpointer
saving every 10 steps. At step 20 rank 2 writes the time and SIGKILLs its
worker (its own process dies with it). The two survivors go on in their
processes. Prints a table (seconds after the death, median over the runs)
and writes ``bench_results/elastic.json``. The phases, per survivor:

* ``detected``: death -> its collective fails (Gloo sees the peer's
  connection close, the scheduler's word ends its connections, or Gloo's
  timeout passes);
* ``rejoin``: leaving Horovod, waiting for the scheduler's new world (via
  the worker), and starting Horovod again in it (``hvdkit.init()``);
* ``roll_back``: the last save's state from memory, broadcast from rank 0,
  the sampler re-sharded;
* ``first_step``: the training function called again: Keras traces its
  train function anew and takes the first step of the new world;
* ``total``: death -> the slowest survivor's first step is done.

It also draws the last run as a timeline, ``docs/elastic_timeline.svg``: every
step each process took (its end time, as recorded by the process) around
the death, and each survivor's phases.

Compare with ``benchmarks/restart.py`` (the whole job restarted). Wall-clock
times on a shared machine; never a pass/fail gate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, job_env, write_results
from _svg import document

DIE_AT, EVERY, STEPS = 20, 10, 40
PHASES = ["detected", "rejoin", "roll_back", "first_step", "total"]
CLUSTER = REPO / "examples" / "cluster"


def worker(outdir: Path) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np

    import hvdkit

    hvdkit.init()
    keras.utils.set_random_seed(0)
    n = 8 * 3 * STEPS
    x = np.random.default_rng(0).normal(size=(n, 32)).astype("float32")
    y = (x[:, :4].sum(1) > 0).astype("int32")
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(64, "relu"), keras.layers.Dense(2)]
    )
    model.compile(
        hvdkit.DistributedOptimizer(keras.optimizers.SGD(0.01)),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    sampler = hvdkit.data.ShardSampler(n, shuffle=True, seed=1)
    ckpt = hvdkit.Checkpointer(outdir / "ckpt", model=model, sampler=sampler, every_steps=EVERY)
    marks: dict = {"steps": []}  # steps: [end time, step] of every step this process took
    first_rank = hvdkit.rank()

    def keep(name: str) -> None:
        (outdir / f"{name}.{first_rank}.json").write_text(json.dumps(marks))

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            marks["steps"].append([time.time(), ckpt.step])
            if "entered" in marks and "first_step" not in marks:
                marks["first_step"] = time.time()
                keep("marks")
            first = os.environ.get("HVDKIT_RESTART_COUNT", "0") == "0"
            if ckpt.step == DIE_AT and hvdkit.rank() == 2 and first and "entered" not in marks:
                (outdir / "death").write_text(repr(time.time()))
                keep("marks")
                os.kill(os.getppid(), signal.SIGKILL)
                time.sleep(60)

    calls = []

    @hvdkit.elastic.run
    def train(state):
        if calls:
            marks["entered"] = time.time()
        calls.append(1)
        for epoch in range(sampler.epoch, 1):
            sampler.set_epoch(epoch)
            model.fit(
                sampler.dataset((x, y)).batch(8),
                initial_epoch=epoch,
                epochs=epoch + 1,
                verbose=0,
                callbacks=[ckpt.callback(batch_size=8), Clock()],
            )

    train(ckpt)
    keep("marks")  # every step, for the timeline


def one_run(port: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="hvdkit-elastic-bench-") as tmp:
        outdir = Path(tmp)
        env = job_env(
            HVDKIT_ELASTIC="1",
            HVDKIT_SCHED_PORT=str(port),
            HVDKIT_JOB_TOKEN="bench-" + os.urandom(8).hex(),
            HVDKIT_WORKER_NUM="3",
            HVDKIT_MIN_WORKERS="2",
            HVDKIT_SCHED_TIMEOUT="120",
        )
        sched = subprocess.Popen(
            [str(CLUSTER / "run_scheduler.sh")],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        workers = subprocess.Popen(
            [str(CLUSTER / "run_workers.sh"), "3", sys.executable, __file__, "--worker", tmp],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        out = workers.communicate(timeout=900)[0]
        sched_out = sched.communicate(timeout=120)[0]
        if sched.returncode != 0 or not (outdir / "death").exists():
            raise SystemExit(f"the run failed:\n{sched_out[-3000:]}\n{out[-3000:]}")
        death = float((outdir / "death").read_text())
        marks = [json.loads((outdir / f"marks.{r}.json").read_text()) for r in (0, 1, 2)]
    said = re.findall(r"\[rank (\d)\].*?([\d.]+) s to rejoin, ([\d.]+) s to roll back", out)
    split = {int(r): (float(a), float(b)) for r, a, b in said}
    rows = []
    for rank, m in enumerate(marks[:2]):
        rejoin, roll_back = split[rank]
        rows.append(
            {
                "detected": m["entered"] - death - rejoin - roll_back,
                "rejoin": rejoin,
                "roll_back": roll_back,
                "first_step": m["first_step"] - m["entered"],
            }
        )
    result = {ph: statistics.mean(r[ph] for r in rows) for ph in PHASES[:-1]}
    result["total"] = max(m["first_step"] for m in marks[:2]) - death
    # how each survivor left the old world: its collective failed by itself, or the
    # scheduler's word made it fail (hvdkit.elastic ended its connections)
    result["lines"] = [ln.strip() for ln in out.splitlines() if "s to rejoin" in ln]
    result["left_at_the_word"] = sum("the scheduler's word" in ln for ln in result["lines"])
    result["timeline"] = {
        "death": death,
        "steps": [m["steps"] for m in marks],
        "survivors": [
            {**row, "entered": m["entered"]} for row, m in zip(rows, marks[:2], strict=True)
        ],
    }
    return result


PHASE_COLORS = {  # the survivors' phases in the timeline
    "detected": ("#f5b041", "collective fails"),
    "rejoin": ("#af7ac5", "rejoin: new world, Horovod"),
    "roll_back": ("#52be80", "roll back + broadcast"),
    "first_step": ("#2e86c1", "first step (traced again)"),
}


def timeline_svg(run: dict, path: Path) -> None:
    """Draw one run: x is seconds after the death, one row per process of the first world."""
    tl = run["timeline"]
    death = tl["death"]
    t_lo, t_hi = -0.5, math.ceil(2 * (run["total"] + 0.5)) / 2
    width, left, right, top, row_h = 760, 110, 20, 44, 46
    height = top + 3 * row_h + 120

    def px(t: float) -> float:
        return left + (t - t_lo) / (t_hi - t_lo) * (width - left - right)

    parts = [
        f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="13" font-weight="bold">'
        "A worker dies; the survivors go on in their processes (a real run, 3 workers)</text>",
    ]
    for k in range(int(2 * t_lo), int(2 * t_hi) + 1):  # a tick every 0.5 s
        x = px(k / 2)
        parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top - 6}" y2="{top + 3 * row_h}" stroke="#eee"/>'
            f'<text x="{x:.1f}" y="{top + 3 * row_h + 14}" text-anchor="middle">{k / 2:+g} s</text>'
        )
    for rank, steps in enumerate(tl["steps"]):
        y = top + rank * row_h
        name = f"rank {rank}" + (" (killed)" if rank == 2 else "")
        parts.append(f'<text x="10" y="{y + 20}">{name}</text>')
        for (t0, _), (t1, step) in zip(steps, steps[1:], strict=False):
            a, b = max(t0 - death, t_lo), t1 - death
            if b <= t_lo or a >= t_hi or b - a > 0.5:
                continue  # outside the picture, or the gap of a recovery (drawn as phases)
            fill = "#1a5276" if step % EVERY == 0 else "#aed6f1"
            parts.append(
                f'<rect x="{px(a):.1f}" y="{y + 8}" width="{max(px(b) - px(a) - 0.6, 0.6):.1f}" '
                f'height="18" fill="{fill}"/>'
            )
        if rank < 2:
            s = tl["survivors"][rank]
            t = s["entered"] - s["roll_back"] - s["rejoin"] - s["detected"] - death
            for phase in PHASES[:-1]:
                color = PHASE_COLORS[phase][0]
                parts.append(
                    f'<rect x="{px(t):.1f}" y="{y + 8}" width="{px(t + s[phase]) - px(t):.1f}" '
                    f'height="18" fill="{color}"/>'
                )
                t += s[phase]
    x0 = px(0)
    parts.append(
        f'<line x1="{x0:.1f}" x2="{x0:.1f}" y1="{top - 8}" y2="{top + 3 * row_h}" '
        'stroke="#c0392b" stroke-width="2"/>'
        f'<text x="{x0 + 4:.1f}" y="{top + 2 * row_h + 40}" fill="#c0392b">SIGKILL of its worker '
        f"(step {DIE_AT})</text>"
    )
    legend_y = top + 3 * row_h + 40
    items = [("#aed6f1", "a training step"), ("#1a5276", f"a step with a save (every {EVERY})")]
    items += [(color, f"{label}: {run[ph]:.2f} s") for ph, (color, label) in PHASE_COLORS.items()]
    for k, (color, label) in enumerate(items):
        lx, ly = 20 + (k % 3) * 245, legend_y + (k // 3) * 20
        parts.append(
            f'<rect x="{lx}" y="{ly - 10}" width="14" height="12" fill="{color}"/>'
            f'<text x="{lx + 20}" y="{ly}">{label}</text>'
        )
    note = (
        f"Death to the slower survivor's first step: {run['total']:.2f} s (phases: the "
        "survivors' mean). benchmarks/elastic.py, a 2-core machine."
    )
    path.write_text(document(width, height, parts, footnote=note))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", metavar="OUTDIR", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=29650)
    p.add_argument("--plot", default=str(REPO / "docs" / "elastic_timeline.svg"))
    args = p.parse_args()
    if args.worker:
        worker(Path(args.worker))
        return
    t0 = time.time()
    runs = [one_run(args.port + i) for i in range(args.repeats)]
    med = {ph: statistics.median(run[ph] for run in runs) for ph in PHASES}
    print(
        f"\nseconds after a worker's death, survivors in-process (3 workers -> 2, "
        f"{args.repeats} runs, median; survivors' mean per phase)"
    )
    print("".join(f"{ph:>12}" for ph in PHASES))
    print("".join(f"{med[ph]:12.2f}" for ph in PHASES))
    print("total per run: " + ", ".join(f"{run['total']:.2f}" for run in runs))
    print(
        "survivors that left at the scheduler's word (not by their own failed collective), "
        "per run: " + ", ".join(f"{run['left_at_the_word']}/2" for run in runs)
    )
    timeline_svg(runs[-1], Path(args.plot))
    for run in runs[:-1]:
        del run["timeline"]  # the JSON keeps the drawn run's
    out = write_results(
        "elastic",
        {
            "what": "seconds from a worker's SIGKILL to the survivors' first step, in-process",
            "machine": f"{os.cpu_count()} cores, shared",
            "phases": PHASES,
            "median": med,
            "runs": runs,
        },
    )
    print(f"\nwrote {out} and {args.plot} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()

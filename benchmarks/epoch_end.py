"""How long Keras's ``fit`` takes to return after its last callback, tf.data's autotuner on or off.

    .venv/bin/python benchmarks/epoch_end.py                  # 4 processes, ~4 min on 2 cores
    .venv/bin/python benchmarks/epoch_end.py --epochs 100 --record NAME

No hvdkit in the measured processes: plain TensorFlow and Keras. Each
process trains a small dense model with ``fit`` once per epoch over a
``tf.data`` pipeline (``from_tensor_slices``, a ``map`` with
``num_parallel_calls=AUTOTUNE``, ``batch``), one intra-op thread, a callback
that sleeps ``--step-sleep`` seconds after each batch (a step that leaves the
CPU free, as on an accelerator), and measures each epoch's wait from
``on_train_end`` to ``fit``'s return, where Keras drops the epoch's
iterator. Half of the processes run the pipeline as is (tf.data's autotuner
on, TensorFlow's default), half with ``Options().autotune.enabled = False``;
they run at the same time, so they share the machine's load.

What it showed (docs/performance-record.md): now and then the return waits,
and every such wait ends when the iterator is 10 ms · (2^k − 1) old, the end
of one of the autotuner's optimisation periods (they start at 10 ms and
double), never with the autotuner off. The table: per variant, epochs, the
waits over 0.5 s, their length, and the iterator's age at the return.
Results: a table, and bench_results/epoch_end.json (``--record NAME`` also
keeps it as benchmarks/records/NAME.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

from _common import REPO, job_env, steal_share, write_record, write_results

from hvdkit.launch.transport import cpu_ticks

WAIT_S = 0.5  # a return slower than this counts as a wait
PERIOD_MIN_MS = 10  # the autotuner's first optimisation period (it doubles after each)

CHILD = r"""
import json, sys, time
import numpy as np
import tensorflow as tf
import keras

tf.config.threading.set_intra_op_parallelism_threads(1)
autotune, sleep = sys.argv[1] == "on", float(sys.argv[4])
epochs, batches = int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
x = rng.normal(size=(16 * batches, 8)).astype("float32")
y = rng.integers(0, 3, 16 * batches).astype("int32")
layers = [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)]
model = keras.Sequential(layers)
model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


class Clock(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.begin = time.monotonic()

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(sleep)

    def on_train_end(self, logs=None):
        self.end = time.monotonic()


clock = Clock()
for epoch in range(epochs):
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    ds = ds.map(lambda a, b: (a, b), num_parallel_calls=tf.data.AUTOTUNE).batch(16)
    if not autotune:
        options = tf.data.Options()
        options.autotune.enabled = False
        ds = ds.with_options(options)
    model.fit(ds, epochs=1, verbose=0, shuffle=False, callbacks=[clock])
    done = time.monotonic()
    line = {"epoch": epoch, "wait_s": done - clock.end, "age_s": done - clock.begin}
    print(json.dumps(line), flush=True)
"""


def period_end_ms(age_s: float) -> int:
    """The end of the autotuner's optimisation period that ``age_s`` falls in, in ms.

    The periods start at :data:`PERIOD_MIN_MS` and double, so they end at
    10 ms · (2^k − 1). Example: ``period_end_ms(20.4)`` is 20470.
    """
    k = math.ceil(math.log2(age_s * 1000 / PERIOD_MIN_MS + 1))
    return PERIOD_MIN_MS * (2**k - 1)


def summarize(epochs: list[dict]) -> dict:
    """The waits of one variant's epochs (``wait_s``, ``age_s`` each)."""
    waits = [e for e in epochs if e["wait_s"] > WAIT_S]
    return {
        "epochs": len(epochs),
        "waits": len(waits),
        "wait_s": sorted(round(e["wait_s"], 2) for e in waits),
        "median_return_s": statistics.median(e["wait_s"] for e in epochs),
        # how far each wait's end lies from the end of an optimisation period
        "off_period_end_ms": [
            round(e["age_s"] * 1000 - period_end_ms(e["age_s"] - 0.05)) for e in waits
        ],
    }


def table(summary: dict) -> str:
    lines = [
        "| tf.data autotuner | processes | epochs | returns that waited over 0.5 s "
        "| their waits, s | median return, s |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("on", "off"):
        s = summary[name]
        waits = ", ".join(f"{w:.2f}" for w in s["wait_s"]) or "–"
        lines.append(
            f"| {name} | {s['processes']} | {s['epochs']} | {s['waits']} | {waits} "
            f"| {s['median_return_s']:.3f} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--processes", type=int, default=4, help="half with the autotuner off")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batches", type=int, default=30, help="batches an epoch")
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument("--record", help="also keep the JSON as benchmarks/records/NAME.json")
    args = p.parse_args()
    if args.processes < 2 or args.processes % 2:
        p.error(f"--processes {args.processes}: give an even number >= 2 (half run each variant)")
    variants = ["on", "off"] * (args.processes // 2)
    ticks, load = cpu_ticks(), os.getloadavg()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, v, str(args.epochs), str(args.batches),
             str(args.step_sleep)],
            env=job_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        for v in variants
    ]  # fmt: skip
    runs: dict[str, list[dict]] = {"on": [], "off": []}
    for v, proc in zip(variants, procs, strict=True):
        out, _ = proc.communicate()
        if proc.returncode:
            print(f"a process with the autotuner {v} failed ({proc.returncode})", file=sys.stderr)
            return 1
        runs[v] += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    summary = {v: {**summarize(runs[v]), "processes": variants.count(v)} for v in runs}
    payload = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip(),
        "args": vars(args),
        "load_avg_start": load,
        "load_avg_end": os.getloadavg(),
        "steal": steal_share(ticks, cpu_ticks()),
        "summary": summary,
        "runs": runs,
    }
    print(table(summary))
    print(f"steal {payload['steal']}, load {load[0]:.1f} -> {payload['load_avg_end'][0]:.1f}")
    out = write_results("epoch_end", payload)
    print(f"wrote {out}")
    if args.record:
        print(f"wrote {write_record(args.record, payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

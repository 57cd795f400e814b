"""hvdkit's per-step tax over raw Horovod, every variant in the same processes.

    .venv/bin/python benchmarks/step_tax.py [--rounds 4] [--steps 200] [--transports gloo,mpi]
    .venv/bin/python benchmarks/step_tax.py --from-json bench_results/step_tax.json

benchmarks/training.py launches each variant as its own job; two jobs of the
same code on this 2-core machine differ by up to ~10 % (which cores they land
on, what else runs), more than the tax being measured. Here one 2-process job
per transport (``hvdkitrun --gloo`` / ``--mpi``) builds every variant, then
times them in interleaved rounds (the order reversed every other round), and
each variant's ratio to the raw Horovod loop is taken within a round:

  horovod_loop     the baseline: a tf.function step per host call reading a
                   tf.data iterator, gradients through horovod.tensorflow's
                   grouped_allreduce (what a Horovod user writes)
  horovod_loop_b   the control: a second, separately built instance of the
                   baseline; its spread around 1.0 is what this machine
                   cannot resolve between two variants of one job
  hvdkit_tape      the same loop with hvdkit.DistributedGradientTape
  keras_horovod@S  Keras fit, steps_per_execution=S, its default train_step, an
                   SGD whose apply() allreduces with Horovod's grouped_allreduce:
                   Keras's own cost, with nothing of hvdkit's in the step
  hvdkit_fit@S     Keras fit, steps_per_execution=S, hvdkit.DistributedOptimizer
  sink_train@S     hvdkit.sink.train with sink_size=S

Small CNN on 32x32x3 synthetic images, batch 64 per process, SGD; one
intra-op thread per process (hvdkit.init's share of 2 cores). Every variant
reads the same tf.data pipeline, ``prefetch(2)`` with autotuning off:
deleting an iterator (once per fit call) can otherwise wait seconds for the
autotuning thread on 2 busy cores (docs/performance.md), outside the timed
window but in the benchmark's length. Fit and sink variants are timed
between two batch (sink) ends inside one call, the loops between two host
syncs.

Also the once-per-job cost of hvdkit's check that the ranks start from equal
weights (hvdkit._same_start) on this model, timed apart from the steps.

Also one plain ``horovodrun`` job per transport runs horovod_loop without
hvdkit imported: its ratio to the hvdkit job's horovod_loop is the cost of
hvdkit's process (its heartbeat thread), measured across jobs, so noisier.

Prints a table, writes bench_results/step_tax.json, draws docs/step_tax.svg.
This is a benchmark, not a test: nothing here fails on a slow machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import REPO, job_env
from _svg import Series, document, legend, line_chart
from training import BATCH, IMAGE, build_model, custom_step, horovod_gradients, hvdkit_gradients

BIN = Path(sys.executable).parent
SIZES = (1, 10, 25, 100)  # steps per host call of the fit and sink variants
KERAS_KINDS = ("keras_horovod", "hvdkit_fit", "sink_train")


# ----------------------------------------------------------------- worker side
SAME_START_KEY = "_same_start_check"  # not a variant: seconds of one check, 5 times


def worker(plain: bool, steps: int, rounds: int, out: str) -> None:
    import horovod.tensorflow as hvd
    import keras
    import numpy as np
    import tensorflow as tf

    if plain:
        tf.config.threading.set_intra_op_parallelism_threads(1)
        hvd.init()
        rank = hvd.rank()
    else:
        import hvdkit

        hvdkit.init()  # 'auto': 1 intra-op thread each for 2 processes on 2 cores
        rank = hvdkit.rank()

    def sync():
        hvd.allreduce(tf.zeros([1]), op=hvd.Sum, name="step_tax_sync").numpy()

    rng = np.random.default_rng(rank)
    x = rng.random((BATCH, *IMAGE), dtype=np.float32)
    y = rng.integers(0, 10, BATCH).astype("int32")
    options = tf.data.Options()
    options.autotune.enabled = False
    ds = tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(2).with_options(options)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    class HorovodSGD(keras.optimizers.SGD):
        """SGD whose apply() first averages the gradients with Horovod's own op."""

        def apply(self, grads, trainable_variables=None):
            grads = hvd.grouped_allreduce(list(grads), op=hvd.Average)
            return super().apply(grads, trainable_variables)

    def loop(kind):
        model, opt = build_model(keras), keras.optimizers.SGD(0.01)
        batches = iter(ds)
        grads = hvdkit_gradients(hvdkit) if kind == "hvdkit_tape" else horovod_gradients(hvd)
        step = custom_step(tf, model, opt, loss_fn, lambda: next(batches), grads)

        def run():
            float(step())  # every rank past the previous variant
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                loss = step()
            float(loss)
            sync()
            return (time.perf_counter() - t0) / steps

        run()  # trace and warm up
        return run

    def keras_variant(kind, size):
        model = build_model(keras)
        if kind == "keras_horovod":
            opt = HorovodSGD(0.01)
        else:
            opt = hvdkit.DistributedOptimizer(keras.optimizers.SGD(0.01))
        model.compile(optimizer=opt, loss=loss_fn, steps_per_execution=size)

        def run():
            ends = []
            hook = lambda batch, logs: ends.append(time.perf_counter())
            sync()
            # one warm-up host call, then `steps` timed steps between two ends
            if kind == "sink_train":
                marks = keras.callbacks.LambdaCallback(on_epoch_end=hook)
                epochs = 1 + steps // size
                hvdkit.sink.train(model, epochs, ds, callbacks=[marks], sink_size=size, verbose=0)
            else:
                marks = keras.callbacks.LambdaCallback(on_train_batch_end=hook)
                model.fit(ds, steps_per_epoch=size + steps, verbose=0, callbacks=[marks])
            return (ends[-1] - ends[0]) / steps

        run()  # trace and warm up
        return run

    variants = {"horovod_loop": loop("horovod_loop")}
    if not plain:
        # the control: a second instance of the baseline, the same code
        variants["horovod_loop_b"] = loop("horovod_loop")
        variants["hvdkit_tape"] = loop("hvdkit_tape")
        for size in SIZES:
            for kind in KERAS_KINDS:
                variants[f"{kind}@{size}"] = keras_variant(kind, size)
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            seconds[name].append(variants[name]())
    if not plain:  # the once-per-job cost of hvdkit's same-start check (not per step)
        from hvdkit import _same_start

        model = build_model(keras)
        seconds[SAME_START_KEY] = []
        for i in range(5):
            sync()
            t0 = time.perf_counter()
            _same_start._differing(model.trainable_variables, None, f"same_start_{i}").numpy()
            seconds[SAME_START_KEY].append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(seconds))


# ----------------------------------------------------------------- driver side
def launch(transport: str, plain: bool, args, tmp: Path) -> dict[str, list[float]]:
    out = tmp / f"step_tax-{transport}{'-plain' if plain else ''}.json"
    out.unlink(missing_ok=True)
    me = [sys.executable, __file__, "--worker", "--out", str(out)]
    me += ["--steps", str(args.steps), "--rounds", str(args.rounds)]
    if plain:
        cmd = [str(BIN / "horovodrun"), "-np", "2", f"--{transport}", *me, "--plain"]
    else:
        cmd = [str(BIN / "hvdkitrun"), "-np", "2", f"--{transport}", *me]
    subprocess.run(cmd, env=job_env(), check=True, timeout=3600, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def summarize(seconds: dict[str, list[float]]) -> dict[str, dict]:
    """Per variant: median ms per step, and its per-round ratios to horovod_loop."""
    base = seconds["horovod_loop"]
    rows = {}
    for name, secs in seconds.items():
        ratios = [b / s for b, s in zip(base, secs, strict=True)]  # > 1: faster than raw
        rows[name] = {
            "ms_per_step": 1000 * statistics.median(secs),
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
    return rows


def draw(results: dict[str, dict], path: Path) -> None:
    colors = {"keras_horovod": "#7f7f7f", "hvdkit_fit": "#1f77b4", "sink_train": "#d62728"}
    parts: list[str] = []
    series_for_legend: list[Series] = []
    for k, (transport, res) in enumerate(results.items()):
        rows = res["variants"]
        series = [
            Series(
                f"{kind} / horovod_loop",
                colors[kind],
                [rows[f"{kind}@{s}"]["ratio_median"] for s in SIZES],
            )
            for kind in KERAS_KINDS
        ]
        series.append(Series("hvdkit_tape / horovod_loop (S=1)", "#2ca02c", [None] * len(SIZES)))
        series[-1].values[0] = rows["hvdkit_tape"]["ratio_median"]
        series.append(Series("0.97 target", "#000", [0.97] * len(SIZES), dash=True))
        parts += line_chart(
            10 + k * 430,
            0,
            420,
            300,
            title=f"2 processes, {transport}: speed / raw Horovod loop",
            x_labels=[str(s) for s in SIZES],
            x_values=list(SIZES),
            y_label="median per-round ratio",
            series=series,
            log_y=False,
            y_range=(0.7, 1.3),
        )
        series_for_legend = series
    parts += legend(20, 320, series_for_legend, columns=3, col_width=280)
    parts.append('<text x="430" y="296" text-anchor="middle">steps per host call (S)</text>')
    footnote = "benchmarks/step_tax.py: all variants in the same 2 processes, interleaved rounds"
    path.write_text(document(880, 380, parts, footnote=footnote))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--plain", action="store_true")
    p.add_argument("--out")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--transports", default="gloo,mpi")
    p.add_argument("--from-json", help="redraw docs/step_tax.svg from a saved step_tax.json")
    args = p.parse_args()
    if args.steps % max(SIZES):
        p.error(f"--steps {args.steps}: use a multiple of {max(SIZES)} (the largest S)")
    if args.worker:
        worker(args.plain, args.steps, args.rounds, args.out)
        return
    if args.from_json:  # redraw the SVG of a saved run
        saved = json.loads(Path(args.from_json).read_text())
        draw({t: saved[t] for t in saved if t != "config"}, REPO / "docs" / "step_tax.svg")
        return

    tmp = REPO / "bench_results"
    tmp.mkdir(exist_ok=True)
    results = {}
    for transport in args.transports.split(","):
        plain_before = launch(transport, True, args, tmp)["horovod_loop"]
        seconds = launch(transport, False, args, tmp)
        check_s = seconds.pop(SAME_START_KEY)
        plain_after = launch(transport, True, args, tmp)["horovod_loop"]
        plain = statistics.median(plain_before + plain_after)
        results[transport] = {
            "variants": summarize(seconds),
            "seconds": seconds,
            "plain_horovod_ms_per_step": 1000 * plain,
            "hvdkit_process_ratio": plain / statistics.median(seconds["horovod_loop"]),
            "same_start_check_ms_once": 1000 * statistics.median(check_s),
        }
        print(f"\n{transport}: ratio to horovod_loop in the same round (> 1 is faster)")
        print(f"{'variant':22s} {'ms/step':>8s} {'median':>7s} {'min':>6s} {'max':>6s}")
        for name, row in results[transport]["variants"].items():
            print(
                f"{name:22s} {row['ms_per_step']:8.2f} {row['ratio_median']:7.3f} "
                f"{row['ratio_min']:6.3f} {row['ratio_max']:6.3f}"
            )
        print(
            f"horovod_loop without hvdkit (plain horovodrun jobs before and after): "
            f"{1000 * plain:.2f} ms/step; in hvdkit's job the same loop ran at "
            f"{results[transport]['hvdkit_process_ratio']:.3f}x that speed (across jobs)"
        )
        print(
            f"same-start check (once per job, at the first reduction; median of 5): "
            f"{results[transport]['same_start_check_ms_once']:.2f} ms"
        )
    config = {"batch_per_process": BATCH, "image": IMAGE, "steps": args.steps}
    config |= {"rounds": args.rounds, "sizes": SIZES}
    (tmp / "step_tax.json").write_text(json.dumps({"config": config, **results}, indent=2))
    draw(results, REPO / "docs" / "step_tax.svg")
    print(f"\nwrote {tmp / 'step_tax.json'} and docs/step_tax.svg")


if __name__ == "__main__":
    main()

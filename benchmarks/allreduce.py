"""Allreduce latency against message size: hvdkit, Horovod (Gloo, MPI) and the Open MPI floor.

    .venv/bin/python benchmarks/allreduce.py [--rounds 2] [--np 2] [--sizes 4K,40K,400K,4M,10M]
    .venv/bin/python benchmarks/allreduce.py --np 4 --rounds 1 --no-knobs

Variants (float32, Average, the same tensor every call):

  floor         mpi4py ``Comm.Allreduce`` on numpy under ``mpirun``: Open MPI's own
                latency on this machine, the lower bound for everything else
  horovod_gloo  ``horovod.tensorflow.allreduce`` inside a ``tf.function`` (as the gradient
                path runs it), ``horovodrun --gloo``
  horovod_mpi   the same under ``horovodrun --mpi``
  hvdkit        ``hvdkit.allreduce`` inside a ``tf.function`` under ``hvdkitrun`` with NO
                transport flag, so it measures whatever ``hvdkitrun`` picks by default
  <t>+<knob>    Horovod on transport <t> with one of Horovod's tuning variables set
                (HOROVOD_CYCLE_TIME, HOROVOD_FUSION_THRESHOLD, HOROVOD_CACHE_CAPACITY,
                HOROVOD_MPI_THREADS_DISABLE); ``--no-knobs`` leaves them out

At 400 KB and 10 MB the TF variants also time a grouped allreduce of the same bytes
split in 8 tensors (``grouped_allreduce``, one fused request as a gradient list is).

Every variant is a fresh job; rounds interleave the variants so that machine
noise (this machine is shared) spreads over all of them, and the median over
rounds of each variant's per-call time counts (each round's figure is itself
the best of 3 timed repeats). Prints a table of milliseconds per call and the
ratios to the floor; writes bench_results/allreduce.json and docs/allreduce_bench.svg
(a run with other --np or --sizes: allreduce_np4.json, allreduce_bench_np4.svg, ...).
This is a benchmark, not a test: nothing here fails on a slow machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import job_env  # benchmarks/ is the script's folder
from _svg import Series, document, legend, line_chart

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
UNITS = {"K": 1000, "M": 1000**2}
KNOB_NAMES = (
    "HOROVOD_CYCLE_TIME",
    "HOROVOD_FUSION_THRESHOLD",
    "HOROVOD_CACHE_CAPACITY",
    "HOROVOD_MPI_THREADS_DISABLE",
)
DEFAULT_SIZES = "4K,40K,400K,4M,10M"
GROUPED_SIZES = ("400K", "10M")
GROUP_PIECES = 8
# (name, launcher, environment); launcher is horovodrun's transport, "hvdkitrun" or "mpirun"
BASE = [
    ("floor", "mpirun", {}),
    ("horovod_gloo", "gloo", {}),
    ("horovod_mpi", "mpi", {}),
    ("hvdkit", "hvdkitrun", {}),
]
KNOBS = [
    ("mpi+cycle0.1", "mpi", {"HOROVOD_CYCLE_TIME": "0.1"}),
    ("mpi+threads_off", "mpi", {"HOROVOD_MPI_THREADS_DISABLE": "1"}),
    ("mpi+cache0", "mpi", {"HOROVOD_CACHE_CAPACITY": "0"}),
    ("mpi+fusion0", "mpi", {"HOROVOD_FUSION_THRESHOLD": "0"}),
    ("gloo+cycle0.1", "gloo", {"HOROVOD_CYCLE_TIME": "0.1"}),
    ("gloo+fusion0", "gloo", {"HOROVOD_FUSION_THRESHOLD": "0"}),
]


def parse_size(text: str) -> int:
    """'4K' -> 4000 bytes, '10M' -> 10_000_000 (decimal units, as the issue states sizes)."""
    text = text.strip().upper()
    if text[-1:] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def parse_sizes(text: str) -> list[str]:
    """``--sizes`` as labels: ``"4k, 10M"`` -> ``["4K", "10M"]``."""
    return [s.strip().upper() for s in text.split(",")]


def calls_for(nbytes: int) -> int:
    """Timed calls per repeat (the same on every rank); few, as a loaded machine is slow."""
    return max(5, min(40, int(1e8 / nbytes)))


# ----------------------------------------------------------------- worker side
def worker(kind: str, sizes: list[str], out: str) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np

    results: dict[str, float] = {}
    if kind == "floor":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank = comm.Get_rank()
        for label in sizes:
            n = parse_size(label) // 4
            src, dst = np.ones(n, np.float32), np.empty(n, np.float32)
            calls = calls_for(4 * n)
            for _ in range(3):
                comm.Allreduce(src, dst, op=MPI.SUM)
            best = math.inf
            for _ in range(3):
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(calls):
                    comm.Allreduce(src, dst, op=MPI.SUM)
                best = min(best, (time.perf_counter() - t0) / calls)
            # the slowest rank decides when a collective is done
            results[label] = comm.allreduce(best, op=MPI.MAX) * 1e3
        transport = "mpi"
    else:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        if kind == "hvdkit":
            import hvdkit as hvd

            hvd.init(intra_op_threads=1)
        else:
            import horovod.tensorflow as hvd

            hvd.init()
        rank = hvd.rank()
        transport = "gloo" if "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ else "mpi"

        @tf.function
        def one(t):
            return hvd.allreduce(t, op=hvd.Average)

        @tf.function
        def grouped(ts):
            return hvd.grouped_allreduce(ts, op=hvd.Average)

        def timeit(fn, arg, calls):
            for _ in range(3):
                fn(arg)
            best = math.inf
            for _ in range(3):
                float(hvd.allreduce(tf.zeros([1]), op=hvd.Sum)[0])  # line the ranks up
                t0 = time.perf_counter()
                for _ in range(calls):
                    r = fn(arg)
                np.asarray(r if not isinstance(r, list) else r[-1])
                best = min(best, (time.perf_counter() - t0) / calls)
            slowest = hvd.allreduce(tf.constant([best], tf.float64), op=hvd.Max)
            return float(slowest[0]) * 1e3

        for label in sizes:
            nbytes = parse_size(label)
            n = nbytes // 4
            calls = calls_for(nbytes)
            results[label] = timeit(one, tf.ones([n]), calls)
            if label in GROUPED_SIZES:
                pieces = [tf.ones([n // GROUP_PIECES]) for _ in range(GROUP_PIECES)]
                results[f"{label}/grouped{GROUP_PIECES}"] = timeit(grouped, pieces, calls)
    if rank == 0:
        knobs = {k: os.environ[k] for k in KNOB_NAMES if k in os.environ}
        Path(out).write_text(json.dumps({"ms": results, "transport": transport, "knobs": knobs}))


# ----------------------------------------------------------------- driver side
def launch(name: str, launcher: str, extra: dict, np_: int, sizes: list[str], tmp: Path) -> dict:
    out = tmp / f"allreduce-{name}.json"
    out.unlink(missing_ok=True)
    env = job_env(**extra)
    kind = {"mpirun": "floor", "hvdkitrun": "hvdkit"}.get(launcher, "horovod")
    me = [sys.executable, __file__, "--worker", kind, "--sizes", ",".join(sizes), "--out", str(out)]
    if launcher == "mpirun":
        mpirun = shutil.which("mpirun") or "mpirun"
        cmd = [mpirun, "-np", str(np_), "--oversubscribe", "--bind-to", "none", *me]
    elif launcher == "hvdkitrun":
        cmd = [str(BIN / "hvdkitrun"), "-np", str(np_), "--no-prefix", *me]
    else:
        cmd = [str(BIN / "horovodrun"), "-np", str(np_), f"--{launcher}", *me]
    subprocess.run(cmd, env=env, check=True, timeout=900, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def run_suffix(np_: int, sizes: list[str]) -> str:
    """What names this run's files: ``""`` for the documented run, else how it differs.

    The default run (2 processes, the default sizes) writes
    ``bench_results/allreduce.json`` and ``docs/allreduce_bench.svg``; any other run
    writes beside them with a suffix, e.g. ``--np 4`` writes ``allreduce_np4.json`` and
    ``allreduce_bench_np4.svg``, so it never overwrites the documented picture.
    """
    suffix = "" if np_ == 2 else f"_np{np_}"
    if sizes != parse_sizes(DEFAULT_SIZES):
        suffix += "_" + "-".join(sizes)
    return suffix


def svg_plot(table: dict, sizes: list[str], np_: int, path: Path) -> None:
    """Milliseconds per allreduce against size, y logarithmic; the floor dashed."""
    colors = {
        "floor": "#000000",
        "horovod_gloo": "#1f77b4",
        "horovod_mpi": "#d62728",
        "hvdkit": "#2ca02c",
    }
    labels = {
        "floor": "Open MPI floor (mpi4py Allreduce)",
        "horovod_gloo": "Horovod over Gloo",
        "horovod_mpi": "Horovod over MPI",
        "hvdkit": "hvdkit default (hvdkitrun)",
    }
    series = [
        Series(labels[n], colors[n], [table[n][s] for s in sizes], dash=n == "floor")
        for n in colors
        if n in table
    ]
    parts = line_chart(
        10,
        12,
        590,
        378,
        title=f"allreduce (float32, Average), {np_} processes, one machine",
        x_labels=[f"{s}B" for s in sizes],
        y_label="ms per call (log scale)",
        series=series,
    )
    parts += legend(70, 400, series, 2, 260)
    foot = (
        "median over rounds of best-of-3; TF variants inside a tf.function; "
        "2-core shared machine (benchmarks/allreduce.py)"
    )
    path.write_text(document(620, 455, parts, foot))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker")
    p.add_argument("--out")
    p.add_argument("--sizes", default=DEFAULT_SIZES)
    p.add_argument("--np", type=int, default=2, dest="np_")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-knobs", action="store_true", help="only the four base variants")
    p.add_argument("--knobs", help="comma-separated subset of the knob variants, e.g. mpi+cycle0.1")
    p.add_argument("--json", help="default: bench_results/allreduce<suffix>.json (run_suffix)")
    p.add_argument("--plot", help="default: docs/allreduce_bench<suffix>.svg (run_suffix)")
    args = p.parse_args()
    sizes = parse_sizes(args.sizes)
    if args.worker:
        worker(args.worker, sizes, args.out)
        return

    chosen = set(args.knobs.split(",")) if args.knobs else {n for n, _, _ in KNOBS}
    variants = BASE + [k for k in KNOBS if k[0] in chosen and not args.no_knobs]
    tmp = REPO / "bench_results"
    tmp.mkdir(exist_ok=True)
    samples: dict[str, dict[str, list[float]]] = {}
    meta: dict[str, dict] = {}
    for rnd in range(args.rounds):
        for name, launcher, extra in variants:
            got = launch(name, launcher, extra, args.np_, sizes, tmp)
            meta[name] = {"transport": got["transport"], "knobs": got["knobs"]}
            for key, ms in got["ms"].items():
                samples.setdefault(name, {}).setdefault(key, []).append(ms)
            shown = " ".join(f"{k}={v:.3f}" for k, v in got["ms"].items())
            print(f"round {rnd + 1}: {name:16s} ({got['transport']}) {shown}", flush=True)

    table = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in samples.items()}
    keys = sizes + [f"{s}/grouped{GROUP_PIECES}" for s in GROUPED_SIZES if s in sizes]
    print(f"\nms per allreduce, {args.np_} processes (median of {args.rounds} rounds)")
    print(f"{'variant':18s}" + "".join(f"{k:>14s}" for k in keys))
    for name, row in table.items():
        cells = (f"{row[k]:14.3f}" if k in row else f"{'-':>14s}" for k in keys)
        print(f"{name:18s}" + "".join(cells))
    ratios = {n: {s: table[n][s] / table["floor"][s] for s in sizes} for n in table}
    print("\nratio to the floor")
    for name, row in ratios.items():
        print(f"{name:18s}" + "".join(f"{row[s]:14.1f}" for s in sizes))

    result = {
        "config": {
            "np": args.np_,
            "sizes": sizes,
            "rounds": args.rounds,
            "cores": os.cpu_count(),
            "load_avg_at_end": os.getloadavg(),
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        },
        "variants": meta,
        "ms": table,
        "ms_all_rounds": samples,
        "ratio_to_floor": ratios,
    }
    suffix = run_suffix(args.np_, sizes)
    out = Path(args.json) if args.json else tmp / f"allreduce{suffix}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")
    plot = Path(args.plot) if args.plot else REPO / "docs" / f"allreduce_bench{suffix}.svg"
    svg_plot(table, sizes, args.np_, plot)
    print(f"wrote {plot}")


if __name__ == "__main__":
    main()

"""Benchmark: slice_patches on 2048 x 2048 x 3 uint8 images inside a tf.data pipeline.

    .venv/bin/python benchmarks/patches.py [--images 48] [--repeats 3]

Every row runs the same pipeline, ``from_tensor_slices(images).map(fn)``,
iterated to the end, and reports input MB/s (one image = 12.6 MB):

* ``identity``: ``tf.identity``, the reference the issue names. TensorFlow
  forwards the buffer without touching it, so this measures the pipeline's
  own cost per element, not memory bandwidth.
* ``copy``: ``tf.raw_ops.DeepCopy``, which reads and writes every byte once:
  the memory-bound reference.
* ``slice_patches`` rows: grids with and without pad. Pad mode copies only the
  patches on the bottom and right edges into padded buffers. A 2 x 1 grid of
  HWC images cuts along the first axis only, where TensorFlow can hand out
  views of the image's buffer instead of copies.

``slice/copy`` is each row's time over the copy row's (target: <= 2). Each
row's time is the best of ``--repeats`` rounds that interleave the rows, so
that load from other processes spreads over all of them. Prints a table and
writes JSON to ``bench_results/patches.json``. Absolute numbers depend on the
machine and its load; nothing here gates CI.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from _common import write_results

from hvdkit.ops import slice_patches

SIDE, CHANNELS = 2048, 3


def cases():
    """(name, map function, grid or None)."""
    yield "identity", tf.identity, None
    yield "copy", lambda x: tf.raw_ops.DeepCopy(x=x), None
    for nh, nw, mode in [
        (1, 2, "pad"),
        (2, 1, "pad"),
        (2, 2, "pad"),
        (4, 4, "pad"),
        (3, 3, "pad"),
        (3, 3, "drop"),
    ]:
        fn = lambda x, nh=nh, nw=nw, mode=mode: tuple(slice_patches(x, nh, nw, mode=mode))
        yield f"slice_patches {nh}x{nw} {mode}", fn, (nh, nw, mode)


def pipeline(images: tf.Tensor, fn) -> tf.data.Dataset:
    ds = tf.data.Dataset.from_tensor_slices(images).map(fn)
    for _ in ds.take(2):  # warm up: trace the map function, touch the buffers
        pass
    return ds


def one_pass(ds: tf.data.Dataset) -> float:
    start = time.perf_counter()
    for _ in ds:
        pass
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=48, help="distinct images per pass")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    rng = np.random.default_rng(0)
    images = tf.constant(rng.integers(0, 256, (args.images, SIDE, SIDE, CHANNELS), np.uint8))
    megabytes = images.numpy().nbytes / 1e6
    named = [(name, grid, pipeline(images, fn)) for name, fn, grid in cases()]
    times = {name: [] for name, _, _ in named}
    # Rounds interleave the rows, so that load from other processes on the
    # machine spreads over all of them instead of hitting one.
    for _ in range(args.repeats):
        for name, _, ds in named:
            times[name].append(one_pass(ds))
    rows = [
        {
            "name": name,
            "grid": grid,
            "seconds_best": min(times[name]),
            "seconds_median": statistics.median(times[name]),
            "mb_per_s": megabytes / min(times[name]),
        }
        for name, grid, _ in named
    ]
    copy = next(r for r in rows if r["name"] == "copy")["seconds_best"]
    identity = next(r for r in rows if r["name"] == "identity")["seconds_best"]
    for row in rows:
        row["ratio_to_copy"] = row["seconds_best"] / copy
        row["ratio_to_identity"] = row["seconds_best"] / identity

    print(
        f"{args.images} images of {SIDE}x{SIDE}x{CHANNELS} uint8 ({megabytes:.0f} MB per pass), "
        f"best of {args.repeats} interleaved rounds"
    )
    print(f"{'pipeline map':<26}{'MB/s':>10}{'slice/copy':>12}{'/identity':>11}")
    for row in rows:
        print(
            f"{row['name']:<26}{row['mb_per_s']:>10.0f}{row['ratio_to_copy']:>12.2f}"
            f"{row['ratio_to_identity']:>11.2f}"
        )
    worst = max(r["ratio_to_copy"] for r in rows if r["grid"])
    print(f"worst slice/copy ratio: {worst:.2f} (target <= 2)")

    out = write_results(
        "patches",
        {
            "benchmark": "slice_patches in tf.data",
            "image_shape": [SIDE, SIDE, CHANNELS],
            "dtype": "uint8",
            "images_per_pass": args.images,
            "repeats": args.repeats,
            "tensorflow": tf.__version__,
            "machine": platform.platform(),
            "cpus": os.cpu_count(),
            "rows": rows,
            "worst_ratio_to_copy": worst,
        },
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

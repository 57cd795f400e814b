"""Bytes read and samples/s of hvdkit's sharder against tf.data's ``Dataset.shard``.

Run under a launcher, one process per rank::

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/horovodrun -np 2 --gloo \
        .venv/bin/python benchmarks/sharding.py [--rounds 5]

Rank 0 writes two file datasets to a temporary directory:

* TFRecord: ``--files`` files of ``--records`` records of ``--record-bytes`` bytes;
* CIFAR-10 binary: the 5 training batch files, ``--cifar-records`` records each.

Every rank then reads one epoch of its share with each variant, all ranks at
the same time; rounds interleave the variants and each keeps its fastest epoch:

  tfrecord  hvdkit.shard(files)            file-level sharding (pad), the default: each rank
                                           counts its files' records, the totals are exchanged
  tfrecord  hvdkit.shard(files, records_per_file)  the same with the counts given
  tfrecord  tf.data ...shard(S, r)         TFRecordDataset(files).shard(S, r)
  tfrecord  tf.data files.shard(S, r)      from_tensor_slices(files).shard(S, r).flat_map(...),
                                           tf.data's own file-level idiom (no equal counts)
  cifar10   hvdkit.Cifar10Dataset          positioned reads of the rank's records only, in
                                           stored order (shuffle=False)
  cifar10   hvdkit.Cifar10Dataset shuffle  the same, in a shuffled order
  cifar10   tf.data ...shard(S, r)         FixedLengthRecordDataset(files).shard(S, r)

Bytes are the growth of ``rchar`` in ``/proc/self/io`` (bytes returned by
read system calls; the page cache is warm, so this is what the process asks
for, not disk traffic). Prints a table and writes bench_results/sharding.json.
A benchmark, not a test: nothing fails on a slow machine.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import tempfile
import time
from pathlib import Path

import numpy as np
import tensorflow as tf

import hvdkit as hvd
import hvdkit.data as hdata

REPO = Path(__file__).resolve().parents[1]
CIFAR_RECORD = 3073
BASELINE = {  # tf.data.Dataset.shard on the same data: the comparison point
    "tfrecord": "tf.data TFRecordDataset(files).shard",
    "cifar10": "tf.data FixedLengthRecordDataset.shard",
}


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar line")


def write_data(root: Path, args) -> dict:
    """TFRecord and CIFAR-10 files under ``root``; returns their sizes in bytes."""
    rng = np.random.default_rng(0)
    tfrecord_dir = root / "tfrecord"
    tfrecord_dir.mkdir()
    payload = rng.integers(0, 256, args.record_bytes, dtype=np.uint8).tobytes()
    for f in range(args.files):
        with tf.io.TFRecordWriter(str(tfrecord_dir / f"part-{f:03d}.tfrecord")) as w:
            for i in range(args.records):
                w.write(struct.pack("<q", f * args.records + i) + payload[8:])
    cifar_dir = root / "cifar-10-batches-bin"
    cifar_dir.mkdir()
    for b in range(1, 6):
        records = rng.integers(0, 256, (args.cifar_records, CIFAR_RECORD), dtype=np.uint8)
        records[:, 0] %= 10
        (cifar_dir / f"data_batch_{b}.bin").write_bytes(records.tobytes())
    (cifar_dir / "test_batch.bin").write_bytes(records[:1].tobytes())

    def total(d, pattern):
        return sum(p.stat().st_size for p in d.glob(pattern))

    return {
        "tfrecord": total(tfrecord_dir, "*.tfrecord"),
        "cifar10": total(cifar_dir, "data_batch_*.bin"),
    }


def decode_cifar(record):
    raw = tf.io.decode_raw(record, tf.uint8)
    image = tf.transpose(tf.reshape(raw[1:], [3, 32, 32]), [1, 2, 0])
    return image, tf.cast(raw[0], tf.int32)


def variants(root: Path, size: int, rank: int, records: int) -> dict:
    files = sorted(str(p) for p in (root / "tfrecord").glob("*.tfrecord"))
    cifar = sorted(str(p) for p in (root / "cifar-10-batches-bin").glob("data_batch_*.bin"))
    return {
        ("tfrecord", "hvdkit.shard(files)"): lambda: hdata.shard(files),
        ("tfrecord", "hvdkit.shard(files, records_per_file)"): lambda: hdata.shard(
            files, records_per_file=records
        ),
        ("tfrecord", "tf.data TFRecordDataset(files).shard"): lambda: tf.data.TFRecordDataset(
            files
        ).shard(size, rank),
        ("tfrecord", "tf.data files.shard + flat_map"): lambda: (
            tf.data.Dataset.from_tensor_slices(files)
            .shard(size, rank)
            .flat_map(tf.data.TFRecordDataset)
        ),
        # usage="train": the same 5 files as the tf.data variant (not test_batch.bin)
        ("cifar10", "hvdkit.Cifar10Dataset"): lambda: hdata.Cifar10Dataset(
            root, "train", num_shards="auto", shuffle=False
        ),
        ("cifar10", "hvdkit.Cifar10Dataset shuffle"): lambda: hdata.Cifar10Dataset(
            root, "train", num_shards="auto", shuffle=True
        ),
        ("cifar10", "tf.data FixedLengthRecordDataset.shard"): lambda: (
            tf.data.FixedLengthRecordDataset(cifar, CIFAR_RECORD)
            .shard(size, rank)
            .map(decode_cifar, num_parallel_calls=tf.data.AUTOTUNE)
        ),
    }


def read_epoch(make) -> tuple[int, int, float, float]:
    """(samples, bytes read, seconds, of which building the dataset) for one epoch."""
    hvd.barrier()  # all ranks read at the same time
    before, t0 = rchar(), time.perf_counter()
    ds = make()
    built = time.perf_counter()
    samples = 0
    for batch in ds.batch(256).prefetch(2):
        samples += int(tf.shape(tf.nest.flatten(batch)[0])[0])
    return samples, rchar() - before, time.perf_counter() - t0, built - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--records", type=int, default=4000)
    parser.add_argument("--record-bytes", type=int, default=3072)
    parser.add_argument("--cifar-records", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "bench_results" / "sharding.json"))
    args = parser.parse_args()

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    root = Path(tempfile.mkdtemp(prefix="hvdkit-bench-sharding-")) if rank == 0 else None
    sizes = write_data(root, args) if rank == 0 else None
    root, sizes = hvd.broadcast_object((root, sizes), root_rank=0)

    runs = variants(root, size, rank, args.records)
    best: dict = {}
    for _ in range(args.rounds):  # rounds interleave the variants to spread machine noise
        for key, make in runs.items():
            run = read_epoch(make)
            if key not in best or run[2] < best[key][2]:
                best[key] = run
    results = []
    for (dataset, name), mine in best.items():
        everyone = hvd.allgather_object(mine)
        results.append(
            {
                "dataset": dataset,
                "variant": name,
                "total_bytes": sizes[dataset],
                "samples": [e[0] for e in everyone],
                "bytes_read": [e[1] for e in everyone],
                "seconds": [e[2] for e in everyone],
                "build_seconds": [e[3] for e in everyone],
                # every rank reads at once: the job's rate is all samples over the slowest rank
                "samples_per_s": sum(e[0] for e in everyone) / max(e[2] for e in everyone),
            }
        )
    hvd.barrier()
    if rank == 0:
        shutil.rmtree(root)
        report(results, args, size)


def report(results: list[dict], args, size: int) -> None:
    baseline = {
        r["dataset"]: r["samples_per_s"] for r in results if r["variant"] in BASELINE.values()
    }
    header = (
        f"{'dataset':9} {'variant':42} {'samples/rank':>13} {'MB read/rank':>15} "
        f"{'read/total':>11} {'build ms':>8} {'samples/s':>10} {'vs tf.shard':>11}"
    )
    print(f"\nsharding benchmark: {size} ranks, best of {args.rounds} epochs\n{header}")
    print("-" * len(header))
    for r in results:
        r["read_fraction"] = [b / r["total_bytes"] for b in r["bytes_read"]]
        r["speed_vs_tf_shard"] = r["samples_per_s"] / baseline[r["dataset"]]
        print(
            f"{r['dataset']:9} {r['variant']:42} {'/'.join(map(str, r['samples'])):>13} "
            f"{'/'.join(f'{b / 1e6:.1f}' for b in r['bytes_read']):>15} "
            f"{'/'.join(f'{x:.2f}' for x in r['read_fraction']):>11} "
            f"{1e3 * max(r['build_seconds']):>8.0f} "
            f"{r['samples_per_s']:>10.0f} {r['speed_vs_tf_shard']:>10.2f}x"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    out.write_text(json.dumps({"ranks": size, "config": config, "results": results}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

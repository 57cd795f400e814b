"""What a process and a job spend after the program's last line, with and without hvdkit's two cuts.

    .venv/bin/python benchmarks/process_end.py              # 5 rounds, ~2 min on 2 cores
    .venv/bin/python benchmarks/process_end.py --rounds 9

1. One process (no launcher) that imports TensorFlow and Keras, calls
   ``hvdkit.init()`` and trains a small CNN for one epoch: the CPU seconds and
   wall seconds from its last line to its end, ``HVDKIT_GC_FREEZE=1`` (the
   default: init() freezes what is alive, runtime._freeze_startup_objects)
   against ``HVDKIT_GC_FREEZE=0``.
2. A 2-rank ``hvdkitrun --mpi`` job on this machine: each rank's
   ``hvdkit.shutdown()`` (Horovod's, with ``MPI_Finalize``) and the wall from
   just before it (the program's work done) to hvdkitrun's exit, with hvdkitrun's one-host btl
   (``^openib,ofi``, launch/transport.mpirun_btl) against Horovod's own
   (``OMPI_MCA_btl=^openib``, which the user's variable selects).

The variants alternate within each round, so they share the machine's state;
read the ratios. The steal share (the host running other guests) is reported.
Results: a table, and bench_results/process_end.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, job_env, steal_share, write_results

from hvdkit import config
from hvdkit.launch.transport import cpu_ticks

ONE_PROCESS = """
import json, resource, sys, time
import keras, numpy as np
import hvdkit
hvdkit.init()
model = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Conv2D(8, 3, activation="relu"),
                          keras.layers.Flatten(), keras.layers.Dense(10)])
model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(np.zeros((256, 16, 16, 3), "float32"), np.zeros(256, "int32"), batch_size=32, verbose=0)
use = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"cpu": use.ru_utime + use.ru_stime, "at": time.time()}), flush=True)
"""

TWO_RANKS = """
import json, os, time
import hvdkit
hvdkit.init()
hvdkit.barrier()
at, t0 = time.time(), time.perf_counter()  # the program's work ends here
hvdkit.shutdown()
print(json.dumps({"shutdown": time.perf_counter() - t0, "at": at}), flush=True)
"""


def one_process(freeze: str) -> dict[str, float]:
    """CPU and wall seconds after the last line of :data:`ONE_PROCESS` with HVDKIT_GC_FREEZE."""
    env = job_env(HVDKIT_GC_FREEZE=freeze)
    for var in config.LAUNCHER_SIZE_VARS:  # a job of size 1
        env.pop(var, None)
    before = os.times()
    proc = subprocess.run(
        [sys.executable, "-c", ONE_PROCESS], capture_output=True, text=True, env=env
    )
    ended = time.time()
    after = os.times()
    if proc.returncode != 0:
        sys.exit(f"the one-process job failed:\n{proc.stderr[-3000:]}")
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    total = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    return {"cpu_after": total - last["cpu"], "wall_after": ended - last["at"]}


def two_ranks(btl: str | None, tmp: Path) -> dict[str, float]:
    """Each rank's shutdown and the wall from its last line to hvdkitrun's exit."""
    env = job_env()
    env.pop("OMPI_MCA_btl", None)
    if btl is not None:
        env["OMPI_MCA_btl"] = btl
    script = tmp / "two_ranks.py"
    script.write_text(TWO_RANKS)
    hvdkitrun = Path(sys.executable).parent / "hvdkitrun"
    proc = subprocess.run(
        [str(hvdkitrun), "-np", "2", "--mpi", sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp,
    )
    ended = time.time()
    if proc.returncode != 0:
        sys.exit(f"the 2-rank job failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    lines = [
        json.loads(line.split("] ", 1)[1]) for line in proc.stdout.splitlines() if '"at"' in line
    ]
    return {
        "shutdown": max(x["shutdown"] for x in lines),
        "wall_after": ended - max(x["at"] for x in lines),
    }


def median(rows: list[dict[str, float]], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {
        "freeze": [],
        "no freeze": [],
        "one-host btl": [],
        "Horovod's btl": [],
    }
    ticks = cpu_ticks()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
            runs["freeze"].append(one_process("1"))
            runs["no freeze"].append(one_process("0"))
            runs["one-host btl"].append(two_ranks(None, Path(tmp)))
            runs["Horovod's btl"].append(two_ranks("^openib", Path(tmp)))
    steal = steal_share(ticks, cpu_ticks())
    summary = {name: {key: median(rows, key) for key in rows[0]} for name, rows in runs.items()}
    print(f"\nmedians of {args.rounds} rounds (steal share {steal}):")
    print("| variant | CPU s after the last line | wall s after the last line | rank shutdown s |")
    print("|---|---|---|---|")
    for name, row in summary.items():
        cells = [row.get("cpu_after", "-"), row["wall_after"], row.get("shutdown", "-")]
        print(f"| {name} | " + " | ".join(str(c) for c in cells) + " |")
    path = write_results(
        "process_end", {"rounds": args.rounds, "steal": steal, "summary": summary, "runs": runs}
    )
    print(f"\n{path.relative_to(REPO)}")


if __name__ == "__main__":
    main()

"""What the benchmarks share: the environment of the jobs they launch, and timing in them.

env = job_env()                            # PYTHONPATH: the repository
env = job_env(REPO, REPO / "examples")     # ... and examples/
env = job_env(HOROVOD_CYCLE_TIME="0.1")    # plus one of Horovod's knobs
seconds = best_seconds(lambda: run(100), repeats=2)   # inside a job, after hvdkit.init()
path = write_results("elastic", {"median": med})   # bench_results/elastic.json
path = write_record("elastic_2026-11-29", payload)  # benchmarks/records/, for the docs
share = steal_share(before, cpu_ticks())   # share of time the host ran others (steal)
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from hvdkit.launch.transport import mpi_root_env

REPO = Path(__file__).resolve().parents[1]


def job_env(*paths: Path, **extra: str) -> dict[str, str]:
    """This process's environment for a launched benchmark job.

    TensorFlow's info logs off, ``PYTHONPATH`` = ``paths`` (default: the
    repository), ``extra`` on top, and, when running as root, Open MPI's
    consent to run as root (``mpirun`` refuses root without it).
    """
    pythonpath = os.pathsep.join(str(p) for p in (paths or (REPO,)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=pythonpath, **extra)
    env.update(mpi_root_env())
    return env


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    """Fewest seconds of ``repeats`` calls of ``run``, every rank starting and ending together.

    Call inside a launched job, after ``hvdkit.init()``; warm up (trace) first.
    """
    import hvdkit

    best = float("inf")
    for _ in range(repeats):
        hvdkit.barrier()
        t0 = time.perf_counter()
        run()
        hvdkit.barrier()
        best = min(best, time.perf_counter() - t0)
    return best


def write_results(name: str, payload: dict) -> Path:
    """Write ``payload`` as indented JSON to ``bench_results/<name>.json``; return the path."""
    out = REPO / "bench_results" / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(payload, indent=2))
    return out


def write_record(name: str, payload: dict) -> Path:
    """Keep ``payload`` as benchmarks/records/<name>.json (a run the docs quote); the path."""
    rec = REPO / "benchmarks" / "records" / f"{name}.json"
    rec.write_text(json.dumps(payload, indent=2))
    return rec


def steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """Share of the time between two ``cpu_ticks()`` that the host ran others (steal).

    On a virtual machine the host may give its cores to other guests; a step
    time measured then measures them too (performance-record.md, runs 8-10).

    Example:
        >>> steal_share([10, 0, 5, 80, 0, 0, 0, 5], [20, 0, 10, 150, 0, 0, 0, 20])
        0.15
    """
    if before is None or after is None or min(len(before), len(after)) < 8:
        return None  # no /proc/stat, or a kernel without the steal column
    if sum(after) <= sum(before):
        return None
    return round((after[7] - before[7]) / (sum(after) - sum(before)), 4)

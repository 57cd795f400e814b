"""Time to train again under random faults, in-process recovery (hvdkit.elastic).

    python benchmarks/chaos.py [--seeds 5] [--first-seed 100] [--keep DIR] [--netns]

Per seed, one job of the scheduler/worker launch (Gloo) on this machine with
``HVDKIT_ELASTIC=1``: 4 workers, ``HVDKIT_MIN_WORKERS=2``,
``HVDKIT_MAX_RESTARTS=3`` (a worker whose program died joins again), a stall
timeout of 8 s. The program is the tests' ``tests/multiproc/ft_train.py
--mode elastic`` (``fit`` inside ``@hvdkit.elastic.run``, 4 epochs of 192
samples, steps of at least 0.2 s) with three faults drawn from the seed,
each at a random step in its own window: a SIGKILL of a rank, a frozen rank
(SIGSTOP) or a lost worker (a new worker is started when the scheduler
reports it). The program records the time of each fault and of every step.

With ``--netns`` (root) every worker runs on its own simulated host (a
network namespace of ``benchmarks/multihost.py``'s lab; the scheduler on a
fifth) and a fourth kind of fault is drawn: a network cut (the rank sets its
host's ``eth0`` down and trains on). Scheduler and worker then hear nothing
from each other; after the silence limit (the stall timeout, at least 10 s)
the scheduler counts the worker lost, the others go on, and the benchmark
brings the link back up and starts a new worker on that host.

Time to train again, per fault: from the fault to the first step the job
trains in a later round (a smaller world, or the same one after a return).
A frozen rank's includes the stall timeout (8 s) its worker waits before
stopping it, a cut the silence limit. Prints each fault and the p50/p95 per
kind and overall, and writes ``bench_results/chaos.json``
(``chaos_netns.json`` with ``--netns``). Wall-clock times on a shared
machine; never a pass/fail gate. The suite's test of the same job with three fixed
faults, one of each kind (tests/test_chaos_three_faults_mp.py), checks the results:
weights equal to a fault-free replay of the job's worlds, every sample
trained. ``--keep DIR`` keeps each job's logs and records.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from _common import REPO, job_env, write_results
from multihost import Lab, preflight, remove_stale_namespaces

FT_TRAIN = REPO / "tests" / "multiproc" / "ft_train.py"
CLUSTER = REPO / "examples" / "cluster"
KINDS = ("kill", "stop", "worker")
NETNS_KINDS = (*KINDS, "cut")  # with --netns: one worker's host loses its network
# the scheduler's line for a lost worker: which host (its address) to start a new one on
LOST = re.compile(r"rank \d+ lost its worker \(pid \d+ on \S+ ([\d.]+)\)")
WINDOWS = (6, 22, 38)  # each fault at a step in [w, w + 6)
STALL_S = 8


def faults_for(seed: int, kinds: tuple[str, ...] = KINDS) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "step": int(rng.integers(w, w + 6)),
            "rank": int(rng.integers(0, 2)),
            "how": str(rng.choice(kinds)),
        }
        for w in WINDOWS
    ]


class Hosts:
    """Where the job's processes run: this machine, or one namespace per worker (``lab``).

    Host 0 runs the scheduler, host i (1..4) the i-th worker and its replacements.
    """

    def __init__(self, lab: Lab | None):
        self.lab = lab
        self.sched_host = lab.addrs[0] if lab else "127.0.0.1"

    def start(self, host: int, cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
        if self.lab is not None:
            return self.lab.start(self.lab.names[host], cmd, env, log)
        return subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)

    def heal(self, addr: str) -> int | None:
        """Bring the host with ``addr`` back on the network; its index (None: this machine)."""
        if self.lab is None or addr not in self.lab.addrs:
            return None
        host = self.lab.addrs.index(addr)
        ns = self.lab.names[host]
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", "up"], check=True)
        return host


def one_job(seed: int, port: int, keep: Path | None, hosts: Hosts) -> dict:
    faults = faults_for(seed, KINDS if hosts.lab is None else NETNS_KINDS)
    if keep is not None:
        folder = keep / f"seed-{seed}"
        folder.mkdir(parents=True, exist_ok=False)
        where = contextlib.nullcontext(str(folder))
    else:
        where = tempfile.TemporaryDirectory(prefix="hvdkit-chaos-bench-")
    with where as tmp:
        out = Path(tmp) / "out"
        out.mkdir()
        env = job_env(
            HVDKIT_SCHED_HOST=hosts.sched_host,
            HVDKIT_SCHED_PORT=str(port),
            HVDKIT_JOB_TOKEN="bench-" + os.urandom(8).hex(),
            HVDKIT_WORKER_NUM="4",
            HVDKIT_MIN_WORKERS="2",
            HVDKIT_MAX_RESTARTS="3",
            HVDKIT_STALL_TIMEOUT=str(STALL_S),
            HVDKIT_SCHED_TIMEOUT="120",
            HVDKIT_ELASTIC="1",
        )
        train = [sys.executable, str(FT_TRAIN), str(out), "--mode", "elastic"]
        train += ["--epochs", "4", "--samples", "192", "--every", "5", "--step-sleep", "0.2"]
        train += ["--faults", json.dumps(faults)]
        started = time.time()
        sched_log = Path(tmp) / "scheduler.log"
        sched = hosts.start(0, [str(CLUSTER / "run_scheduler.sh")], env, sched_log)
        worker_cmd = [str(CLUSTER / "run_workers.sh"), "1", *train]
        workers = [hosts.start(i + 1, worker_cmd, env, Path(tmp) / f"w{i}.log") for i in range(4)]
        replaced = threading.Event()

        def replace_lost_workers():  # one new worker per lost one, on its host
            seen = 0
            while sched.poll() is None:
                lost = LOST.findall(sched_log.read_text())
                for addr in lost[seen:]:
                    host = hosts.heal(addr) or 1 + seen % 4
                    log = Path(tmp) / f"new{seen}.log"
                    workers.append(hosts.start(host, worker_cmd, env, log))
                    seen += 1
                time.sleep(0.2)
            replaced.set()

        threading.Thread(target=replace_lost_workers, daemon=True).start()
        code = sched.wait(timeout=1800)
        replaced.wait(timeout=60)
        for w in list(workers):
            w.wait(timeout=120)
        total = time.time() - started
        fired = [json.loads(p.read_text()) for p in sorted(out.glob("fault-*"))]
        steps = [
            json.loads(line)
            for f in out.glob("ids-*.jsonl")
            for line in f.read_text().splitlines()
            if '"ids"' in line
        ]
    again = []
    for fault in fired:
        later = [s["t"] for s in steps if s["round"] > fault["round"] and s["t"] > fault["t"]]
        again.append({**fault, "train_again_s": (min(later) - fault["t"]) if later else None})
    return {"seed": seed, "exit": code, "job_s": total, "faults": again}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--first-seed", type=int, default=100)
    p.add_argument("--port", type=int, default=29680)
    p.add_argument("--keep", type=Path, help="keep each job's logs in KEEP/seed-N (a new folder)")
    p.add_argument(
        "--netns", action="store_true", help="one namespace host per worker; network cuts too"
    )
    args = p.parse_args()
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    if args.netns:
        preflight(["gloo"])
        remove_stale_namespaces()
        with Lab(5) as lab:
            jobs = [one_job(s, args.port + i, args.keep, Hosts(lab)) for i, s in enumerate(seeds)]
    else:
        jobs = [one_job(s, args.port + i, args.keep, Hosts(None)) for i, s in enumerate(seeds)]
    print(f"\n{'seed':>5} {'exit':>5} {'job s':>7}  faults (kind@step: seconds to train again)")
    for j in jobs:
        said = ", ".join(
            f"{f['how']}@{f['step']}: "
            + ("-" if f["train_again_s"] is None else f"{f['train_again_s']:.1f}")
            for f in j["faults"]
        )
        print(f"{j['seed']:5d} {j['exit']:5d} {j['job_s']:7.1f}  {said}")
    summary = {}
    for kind in (*NETNS_KINDS, "all"):
        times = [
            f["train_again_s"]
            for j in jobs
            for f in j["faults"]
            if f["train_again_s"] is not None and kind in (f["how"], "all")
        ]
        if times:
            summary[kind] = {
                "n": len(times),
                "p50": float(np.percentile(times, 50)),
                "p95": float(np.percentile(times, 95)),
                "max": max(times),
            }
    print(f"\n{'kind':>7} {'n':>3} {'p50 s':>7} {'p95 s':>7} {'max s':>7}")
    for kind, s in summary.items():
        print(f"{kind:>7} {s['n']:3d} {s['p50']:7.2f} {s['p95']:7.2f} {s['max']:7.2f}")
    failed = [j["seed"] for j in jobs if j["exit"] != 0]
    print(f"jobs that did not end with 0: {failed or 'none'}")
    out = write_results(
        "chaos_netns" if args.netns else "chaos",
        {
            "what": "seconds from a fault to the job's first step in its next world",
            "machine": f"{os.cpu_count()} cores, shared",
            "stall_timeout_s": STALL_S,
            "hosts": "a namespace per worker" if args.netns else "processes on this machine",
            "summary": summary,
            "median_job_s": statistics.median(j["job_s"] for j in jobs),
            "jobs": jobs,
        },
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

"""Chaos: faults aimed at each phase of an elastic job, and how each one ended.

    python benchmarks/chaos.py [--seeds 5] [--first-seed 100] [--cells 11] [--keep DIR]
    python benchmarks/chaos.py --phase init [--seeds 3]  # every fault but the first at one phase
    python benchmarks/chaos.py --cut [--seeds 3]        # every fault a cut link, aimed at phases
    python benchmarks/chaos.py --netns [--seeds 5]      # faults at random steps, network cuts too

Per seed, one job of the scheduler/worker launch (Gloo) on this machine with
``HVDKIT_ELASTIC=1``: the phase x fault test's job (tests/test_phases_mp.py:
3 workers, ``HVDKIT_MIN_WORKERS=2``, a stall timeout of 6 s,
tests/multiproc/ft_train.py ``--mode elastic`` with steps of at least
0.25 s). The seed draws ``--cells`` faults, each a phase of
:data:`hvdkit._phases.PHASES` (the first one a phase of training, so that
the next ones find a newcomer whose regrouping they can hit; the faults at
Horovod's start and at the rollback last; the job's end not drawn) and a
kind: a SIGKILL of the process, a freeze (SIGSTOP) or a lost worker (the
process pauses in the phase, its worker is SIGKILLed). The phase hooks aim
each fault: the first process to enter the phase takes it.

Per fault it records how the job came through: ``in-process`` (the others
went on in their processes: the scheduler's "go on in-process"), ``restart``
(the whole job restarted) or ``failure`` (the job ended, or said nothing
for 240 s); and the time to train again: from the fault to the first step of
the job's next world. Prints the faults and, per kind and phase, the counts
and p50/p95, with the machine's load average and steal share; writes
``bench_results/chaos.json``. A seed's job ends at its first restart or
failure (the faults after it are not run). Wall-clock times on a shared
machine; never a pass/fail gate. The test of the same job
(tests/test_phases_mp.py) checks the results: exact samples, weights equal
to a fault-free replay.

With ``--cut`` (root) the phase form runs with the scheduler and every worker on a
simulated host of its own (a network namespace of ``benchmarks/multihost.py``'s
lab) and every fault a cut link: the process waits in its phase while its host's
``eth0`` goes down, then goes on without a network (:class:`CutChain`); the
scheduler counts its worker lost after the silence limit (at least 10 s), the link
comes back, the cut worker's own end is recorded, and a new worker on that host is
the next newcomer. Writes ``bench_results/chaos_cut.json``.

With ``--netns`` (root) the earlier form runs: three faults per seed at random
steps (``ft_train.py --faults``), every worker on its own simulated host (a
network namespace of ``benchmarks/multihost.py``'s lab; the scheduler on a
fifth) and a fourth kind of fault is drawn: a network cut (the rank sets its
host's ``eth0`` down and trains on). Scheduler and worker then hear nothing
from each other; after the silence limit (the stall timeout, at least 10 s)
the scheduler counts the worker lost, the others go on, and the benchmark
brings the link back up and starts a new worker on that host.

In that form the time to train again runs from the fault to the first step
the job trains in a later round; a frozen rank's includes the stall timeout
(8 s there), a cut the silence limit. It prints each fault and the p50/p95
per kind and writes ``bench_results/chaos_netns.json``; the suite's test of
that job with three fixed faults is tests/test_chaos_three_faults_mp.py.
``--keep DIR`` keeps each job's logs and records (both forms).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
from _common import REPO, job_env, steal_share, write_results
from multihost import Lab, preflight, remove_stale_namespaces

sys.path.insert(0, str(REPO / "tests"))  # the phase x fault test's job and its driver
from test_phases_mp import STALL_S as STALL_S_PHASES
from test_phases_mp import Chain, ChainBroken

from hvdkit._phases import PHASES
from hvdkit.launch.transport import cpu_ticks

FT_TRAIN = REPO / "tests" / "multiproc" / "ft_train.py"
CLUSTER = REPO / "examples" / "cluster"
KINDS = ("kill", "stop", "worker")
NETNS_KINDS = (*KINDS, "cut")  # with --netns: one worker's host loses its network
# the scheduler's line for a lost worker: which host (its address) to start a new one on
LOST = re.compile(r"rank \d+ lost its worker \(pid \d+ on \S+ ([\d.]+)\)")
OUTCOMES = ("in-process", "restart", "failure")
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


def seed_folder(keep: Path | None, seed: int):
    """Where a seed's job runs: ``keep/seed-N`` (a new folder, kept), else a temporary one."""
    if keep is None:
        return tempfile.TemporaryDirectory(prefix="hvdkit-chaos-bench-")
    folder = keep / f"seed-{seed}"
    folder.mkdir(parents=True, exist_ok=False)
    return contextlib.nullcontext(str(folder))


def one_job(seed: int, port: int, keep: Path | None, hosts: Hosts) -> dict:
    faults = faults_for(seed, KINDS if hosts.lab is None else NETNS_KINDS)
    with seed_folder(keep, seed) as tmp:
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


# ---------------------------------------------------------------- faults aimed at phases
PHASE_KINDS = ("kill", "stop", "lost")
TRAINING = ("step", "save", "exchange")  # phases of training: the first cell's
LAST = ("init", "rollback")  # last, as in tests/test_phases_mp.py CELLS
CELL_LIMIT_S = 240.0  # a cell whose job says nothing awaited this long: a failure


def cells_for(
    seed: int, count: int, only: str | None = None, kinds: tuple[str, ...] = PHASE_KINDS
) -> list[tuple[str, str]]:
    """``count`` (phase, kind) pairs from ``seed``: a training phase first, no phase twice.

    The phases whose faults once restarted the whole job (``LAST``) come last,
    so that such a restart, which would end the seed's job, hides no other phase.
    With ``only``, every fault after the first is aimed at that phase (each
    at the regrouping in which the last fault's newcomer joins, for a phase of
    a regrouping).
    """
    rng = np.random.default_rng(seed)
    phases = [p for p in PHASES if p != "end"]
    first = str(rng.choice(TRAINING))
    if only is not None:
        order = [first, *[only] * (max(1, count) - 1)]
        return [(str(phase), str(rng.choice(kinds))) for phase in order]
    middle = [p for p in phases if p != first and p not in LAST]
    order = [first, *rng.permutation(middle), *rng.permutation(LAST)][: max(1, count)]
    return [(str(phase), str(rng.choice(kinds))) for phase in order]


class CutChain(Chain):
    """The phase chain with the scheduler and each worker on a simulated host of its own
    (a namespace of ``lab``: host 0 the scheduler's, 1-3 the workers'), where every fault
    is a cut link: the process waits in the phase while its host's link goes down, then
    goes on without a network. When the scheduler has gone on without that worker, the
    link comes back, the cut worker is given :data:`CUT_END_S` to end by itself (what it
    did is recorded), and a new worker starts on that host: the next newcomer.
    """

    def __init__(self, root: Path, lab: Lab, limit_s: float):
        self.lab = lab
        self.host_of = {"scheduler": 0, **{f"worker{i}": i + 1 for i in range(3)}}
        self.cut = ""  # the job's process (a worker shell) whose host's link is cut

        def where(name: str) -> list[str]:  # a new worker: on the cut worker's host
            host = self.host_of.setdefault(name, self.host_of.get(self.cut, 0))
            return ["ip", "netns", "exec", lab.names[host]]

        super().__init__(root, limit_s, where, HVDKIT_SCHED_HOST=lab.addrs[0])

    def _name_of(self, pid: int) -> str:
        """The job's process (its name) that is ``pid`` or started it (a worker shell's child)."""
        for name, proc in self.job.procs.items():
            with contextlib.suppress(psutil.Error):
                kids = psutil.Process(proc.pid).children(recursive=True)
                if pid == proc.pid or pid in [k.pid for k in kids]:
                    return name
        raise ChainBroken(f"pid {pid} is none of the job's processes")

    def _link(self, state: str) -> None:
        ns = self.lab.names[self.host_of[self.cut]]
        subprocess.run(["ip", "-n", ns, "link", "set", "eth0", state], check=True)

    def act(self, how: str, phase: str, hit: dict, worker: int) -> None:
        if how != "cut":
            raise ValueError(f"CutChain aims cut links only, not {how!r}")
        self.cut = self._name_of(worker)
        self._link("down")
        (self.traps / f"release.{hit['pid']}").touch()

    def after_lost(self, how: str, phase: str, worker: int, cell: dict) -> None:
        self._link("up")
        shell = self.job.procs[self.cut]  # run_workers.sh: it ends with its worker
        try:
            shell.wait(timeout=CUT_END_S)
            cell["cut_worker"] = f"ended by itself ({shell.returncode})"
        except subprocess.TimeoutExpired:
            cell["cut_worker"] = f"still running {CUT_END_S:g} s after the link came back: killed"
            with contextlib.suppress(psutil.Error):
                for p in [*psutil.Process(worker).children(recursive=True), psutil.Process(worker)]:
                    with contextlib.suppress(psutil.Error):
                        p.kill()
        self._new_worker()


CUT_END_S = 60.0  # how long a cut worker may take to end once its link is back


def phase_job(
    seed: int, cells: int, keep: Path | None, only: str | None = None, lab: Lab | None = None
) -> dict:
    """One job, the seed's faults one after another; each fault's outcome and time.

    With ``lab``: every worker on a host of its own and every fault a cut link."""
    plan = cells_for(seed, cells, only, ("cut",) if lab is not None else PHASE_KINDS)
    with seed_folder(keep, seed) as tmp:
        started = time.time()
        if lab is None:
            chain = Chain(Path(tmp) / "job", limit_s=CELL_LIMIT_S)
        else:
            chain = CutChain(Path(tmp) / "job", lab, CELL_LIMIT_S)
        done, code = [], None
        try:
            for i, (phase, how) in enumerate(plan):
                try:
                    cell = chain.fault(phase, how)
                except ChainBroken as exc:  # (in this fault, or in waiting for its world)
                    failed = (
                        chain.cells[i] if len(chain.cells) > i else {"phase": phase, "how": how}
                    )
                    done.append({**failed, "outcome": "failure", "why": str(exc)[-2000:]})
                    break
                done.append(cell)
                if cell["outcome"] != "in-process":
                    break
            else:
                result, _ = chain.finish()
                code = result["scheduler"][0]
        finally:
            chain.stop_everything()
        steps = [
            json.loads(line)
            for f in chain.out.glob("ids-*.jsonl")
            for line in f.read_text().splitlines()
            if '"ids"' in line
        ]
        if keep is not None:  # every process's output: the workers' hold their ranks' lines
            for name, lines in list(chain.job.lines.items()):  # each line with its time
                stamped = zip(chain.job.times[name], lines, strict=False)
                text = "".join(f"{t:.3f} {line}" for t, line in stamped)
                (Path(tmp) / f"{name}.log").write_text(text)
    faults = []
    for cell in done:
        hit = cell.get("hit")
        again = None
        if hit is not None and cell["outcome"] != "failure":
            later = [s["t"] for s in steps if s["round"] >= cell["round"] and s["t"] > hit["at"]]
            again = (min(later) - hit["at"]) if later else None
        faults.append(
            {
                "phase": cell["phase"],
                "how": cell["how"],
                "outcome": cell["outcome"],
                "train_again_s": again,
                "kept": "kept" in cell and cell["kept"] == cell["others"],
                **({"cut_worker": cell["cut_worker"]} if "cut_worker" in cell else {}),
                **({"why": cell["why"]} if "why" in cell else {}),
            }
        )
    return {"seed": seed, "exit": code, "job_s": time.time() - started, "faults": faults}


def phase_summary(jobs: list[dict]) -> dict:
    """Per "kind phase" (and per kind, and "all"): outcomes and p50/p95 seconds."""
    groups: dict[str, list[dict]] = {}
    for j in jobs:
        for f in j["faults"]:
            for key in (f"{f['how']} {f['phase']}", f["how"], "all"):
                groups.setdefault(key, []).append(f)
    summary = {}
    for key, faults in groups.items():
        times = [f["train_again_s"] for f in faults if f["train_again_s"] is not None]
        summary[key] = {
            "n": len(faults),
            **{k: sum(f["outcome"] == k for f in faults) for k in OUTCOMES},
            "p50": float(np.percentile(times, 50)) if times else None,
            "p95": float(np.percentile(times, 95)) if times else None,
        }
    return summary


def phases_main(args, lab: Lab | None = None) -> None:
    load_start, ticks = os.getloadavg(), cpu_ticks()
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    jobs: list[dict] = []
    name = "chaos" + ("_cut" if lab is not None else "") + (f"_{args.phase}" if args.phase else "")
    for seed in seeds:  # the results are written after every seed: a stopped run keeps them
        jobs.append(phase_job(seed, args.cells, args.keep, args.phase, lab))
        j = jobs[-1]
        said = ", ".join(
            f"{f['how']}@{f['phase']}: {f['outcome']}"
            + ("" if f["train_again_s"] is None else f" {f['train_again_s']:.1f} s")
            for f in j["faults"]
        )
        print(f"seed {seed}: exit {j['exit']}, {j['job_s']:.0f} s; {said}", flush=True)
        out = write_phase_results(jobs, load_start, ticks, name)
    print_phase_summary(phase_summary(jobs))
    print(f"wrote {out}")


def write_phase_results(jobs: list[dict], load_start, ticks, name: str) -> Path:
    load = {
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
        "steal": steal_share(ticks, cpu_ticks()),
    }
    return write_results(
        name,
        {
            "what": "per fault aimed at a phase: how the job came through, and the seconds "
            "from the fault to the first step of its next world",
            "machine": f"{os.cpu_count()} cores, shared",
            "seeds": [j["seed"] for j in jobs],
            "stall_timeout_s": float(STALL_S_PHASES),
            **load,
            "summary": phase_summary(jobs),
            "jobs": jobs,
        },
    )


def print_phase_summary(summary: dict) -> None:
    print(
        f"\n{'kind phase':>20} {'n':>3} {'in-proc':>7} {'restart':>7} {'failed':>6} "
        f"{'p50 s':>6} {'p95 s':>6}"
    )
    for key in sorted(summary, key=lambda k: (k == "all", " " not in k, k)):
        s = summary[key]
        p50 = "-" if s["p50"] is None else f"{s['p50']:.1f}"
        p95 = "-" if s["p95"] is None else f"{s['p95']:.1f}"
        print(
            f"{key:>20} {s['n']:3d} {s['in-process']:7d} {s['restart']:7d} {s['failure']:6d} "
            f"{p50:>6} {p95:>6}"
        )


def _stop_like_ctrl_c(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    # SIGTERM ends the run as Ctrl-C does, through every cleanup (the job's
    # processes, the namespace hosts): by default it would leave both behind.
    signal.signal(signal.SIGTERM, _stop_like_ctrl_c)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--first-seed", type=int, default=100)
    p.add_argument("--cells", type=int, default=11, help="faults per seed (phase mode)")
    p.add_argument(
        "--phase",
        choices=[p for p in PHASES if p != "end"],
        help="aim every fault but the first at this phase (writes chaos_PHASE.json)",
    )
    p.add_argument("--port", type=int, default=29680)
    p.add_argument("--keep", type=Path, help="keep each job's logs in KEEP/seed-N (a new folder)")
    p.add_argument(
        "--cut",
        action="store_true",
        help="phase mode, every fault a cut link: each worker on a namespace host (root)",
    )
    p.add_argument(
        "--netns", action="store_true", help="one namespace host per worker; network cuts too"
    )
    args = p.parse_args()
    if args.cut:
        preflight(["gloo"])
        remove_stale_namespaces()
        with Lab(4) as lab:
            phases_main(args, lab)
        return
    if not args.netns:
        phases_main(args)
        return
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

"""Goodput under failures: an elastic job trained while a fault strikes every P seconds.

    python benchmarks/goodput.py [--minutes 10] [--baseline-minutes 5] [--periods 60 15]
        [--seed 1] [--step-sleep 0.2] [--stall 6] [--autotune off] [--no-replay] [--keep DIR]
        [--svg docs/goodput_bench.svg]
    python benchmarks/goodput.py --from bench_results/goodput.json   # the tables and SVG again

One job, run once without faults and then once per period P: the
scheduler/worker launch over Gloo with ``HVDKIT_ELASTIC=1`` (in-process
recovery), 4 workers, ``HVDKIT_MIN_WORKERS=2``, a stall timeout of
``--stall`` s (:data:`STALL_S` = 6 by default), tests/multiproc/ft_train.py ``--mode elastic
--mask-padding`` (a commit every 5 steps, 4 samples per rank and step, steps
paced to at least ``--step-sleep`` s: a step whose compute leaves the CPU free,
as on an accelerator; tf.data's autotuner off unless ``--autotune on``: its
epoch-end stops, docs/limits.md, are TensorFlow's), with as many epochs of
:data:`SAMPLES` samples as fill the longest window.

The benchmark drives the faults from outside, on the wall clock: from the
moment the four ranks train (``t0``), one fault at ``t0 + (k + 1/2) P`` for
every k whose time falls in the window (``--minutes``), the kinds by turns
(:data:`KINDS`): a SIGKILL of a rank's process; a frozen rank (SIGSTOP; its
worker finds it at the stall timeout and kills it, else the benchmark does,
by its pid); a lost worker (a SIGKILL of the worker process that holds the
rank; the rank dies with it). The target is drawn with the seed among the
rank processes training at that moment, found as children of the processes
the benchmark started. A killed or frozen rank's worker starts the program
again; for a lost worker the benchmark starts a new one once the scheduler
says so, so the job grows back to 4. At the window's end the pacing stops
and the job trains its remaining epochs unpaced.

Measured per run, inside the window: committed samples per second (samples
of steps that live on in the final weights: steps rolled back by a recovery
are not counted, their re-training is), goodput (that rate / the fault-free
run's), the lost work (samples trained, then rolled back), and per fault the
times from the scheduler's lines and the ranks' step records:

* detection: fault -> the scheduler's "go on in-process" (a frozen rank: the
  stall timeout);
* regroup: that line -> the first step of the smaller world (new Gloo world,
  rollback broadcast, first step traced again);
* recovery = detection + regroup: fault -> first step of the next world;
* newcomer: its start (the decision for a rank its worker starts again; the
  benchmark's start of a new worker) -> the scheduler's "joins" (TensorFlow's
  start, ``hvdkit.init``), and the join pause: the survivors' last step ->
  the first step of the world of 4.

The whole job's checks, as tests/test_phases_mp.py makes them: exit 0, every
sample of every epoch committed exactly once (exact index sets), and final
weights equal, bit for bit, to a fault-free replay of its worlds (one launched
job per world, about 10 s each here: two per fault). Prints the tables
(markdown, as docs/performance.md shows them), writes
``bench_results/goodput.json`` (after each run) and the SVG (the committed
samples per second in 10-s bins; goodput beside TorchFT's published figures).
Wall-clock times on a shared machine with the load average and steal share;
never a pass/fail gate on a time; the exit status is 1 when a check failed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import re
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
from _common import REPO, steal_share, write_results
from goodput_records import (
    STALL_S,
    TORCHFT,
    WORKERS,
    committed_rate,
    fault_costs,
    fault_schedule,
    goodput,
    in_world_pauses,
    loss_split,
    markdown_tables,
    percentiles,
    pick_target,
    run_name,
    step_records,
    step_time,
    timeline,
    world_sizes,
)

SAMPLES = 960  # per epoch: 60 steps on 4 ranks of 4 samples, 80 on 3
BATCH, EVERY = 4, 5  # ft_train's defaults (and the replay's): commit every 5 steps
LOST = re.compile(r"rank \d+ lost its worker \(pid \d+ on \S+ ([\d.]+)\)")
RESTART = re.compile(r"scheduler: restart \d+/")


# ---------------------------------------------------------------- the job
def _harness():
    """The suite's job and checks (imported when a job runs: ``--from`` needs none of it)."""
    sys.path.insert(0, str(REPO / "tests"))
    import test_elastic_mp
    import test_phases_mp

    return test_elastic_mp, test_phases_mp


class Run:
    """One launched job and the faults fired at it on the wall clock."""

    def __init__(
        self,
        root: Path,
        epochs: int,
        step_sleep: float,
        stall_s: float = STALL_S,
        autotune: bool = False,
        env: dict[str, str] | None = None,
    ):
        self.stall_s = stall_s
        elastic, _ = _harness()
        self.root = root
        self.pace = root / "pace"
        root.mkdir(parents=True)
        self.pace.touch()
        self.job, self.out = elastic.start_job(
            root / "job",
            "--mask-padding",
            *([] if autotune else ["--no-autotune"]),
            "--step-sleep",
            str(step_sleep),
            "--sleep-while",
            str(self.pace),
            workers=WORKERS,
            samples=SAMPLES,
            epochs=epochs,
            HVDKIT_ELASTIC="1",
            HVDKIT_MAX_RESTARTS="1000",  # a worker whose program died starts it again
            HVDKIT_STALL_TIMEOUT=f"{stall_s:g}",
            **(env or {}),
        )
        self.workers_sh = elastic.WORKERS_SH
        self.new_workers: list[float] = []  # when each replacement worker was started
        self.frozen: dict[int, float] = {}  # pid -> when it was stopped
        self.ended_frozen: list[dict] = []
        self._stop = threading.Event()

    def sched_lines(self) -> list[tuple[float, str]]:
        with self.job._new_line:
            return list(zip(self.job.times["scheduler"], self.job.lines["scheduler"], strict=False))

    def ranks(self) -> dict[int, int]:
        """The job's rank processes training now (their record file open): pid -> worker pid.

        Only descendants of the processes this benchmark started are looked at.
        """
        found = {}
        for name, proc in list(self.job.procs.items()):
            if name == "scheduler":
                continue
            with contextlib.suppress(psutil.Error):
                kids = psutil.Process(proc.pid).children(recursive=True)
                for kid in kids:
                    with contextlib.suppress(psutil.Error):
                        if not any(a.endswith("ft_train.py") for a in kid.cmdline()):
                            continue
                        if kid.status() in (psutil.STATUS_STOPPED, psutil.STATUS_ZOMBIE):
                            continue
                        files = [Path(f.path) for f in kid.open_files()]
                        if any(f.parent == self.out and f.name.startswith("ids-") for f in files):
                            found[kid.pid] = kid.ppid()
        return found

    def wait_whole(self, limit_s: float = 900.0) -> float:
        """Until the 4 ranks have each trained a step; that moment (``t0``)."""
        deadline = time.monotonic() + limit_s
        while True:
            files = list(self.out.glob("ids-*.jsonl"))
            stepped = [f for f in files if '"ids"' in f.read_text()]
            if len(stepped) >= WORKERS:
                return time.time()
            if self.job.procs["scheduler"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the job never trained on 4:\n{self.job._everyone()}")
            time.sleep(0.2)

    def replace_lost_workers(self) -> None:
        """One new worker per worker the scheduler counts lost (as benchmarks/chaos.py)."""
        seen = 0
        while not self._stop.is_set() and self.job.procs["scheduler"].poll() is None:
            lost = [ln for _, ln in self.sched_lines() if LOST.search(ln)]
            for _ in lost[seen:]:
                self.job.start(
                    f"new{len(self.new_workers)}", [self.workers_sh, "1", *self.job.train]
                )
                self.new_workers.append(time.time())
                seen += 1
            self.end_frozen()
            time.sleep(0.2)

    def end_frozen(self) -> None:
        """A frozen rank its worker did not end within 3 stall timeouts + 10 s: end it (pid)."""
        for pid, t in list(self.frozen.items()):
            try:
                gone = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            except psutil.Error:
                gone = True
            if gone:
                self.ended_frozen.append({"pid": pid, "by": "the job"})
                del self.frozen[pid]
            elif time.time() - t > 3 * self.stall_s + 10:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                self.ended_frozen.append({"pid": pid, "by": "the benchmark"})
                del self.frozen[pid]

    def fire(self, fault: dict) -> dict:
        """Strike ``fault`` at a rank process training now; what was done and when."""
        ranks = self.ranks()
        if not ranks:
            return {**fault, "t": time.time(), "skipped": "no rank trained"}
        pid = pick_target(list(ranks), fault["pick"])
        worker = ranks[pid]
        t = time.time()
        if fault["kind"] == "kill":
            os.kill(pid, signal.SIGKILL)
        elif fault["kind"] == "stop":
            os.kill(pid, signal.SIGSTOP)
            self.frozen[pid] = t
        else:
            os.kill(worker, signal.SIGKILL)  # its rank dies with it
        return {**fault, "t": t, "pid": pid, "worker": worker}


def run_job(
    root: Path,
    period: float | None,
    seed: int,
    window_s: float,
    epochs: int,
    step_sleep: float,
    stall_s: float = STALL_S,
    autotune: bool = False,
    env: dict[str, str] | None = None,
) -> dict:
    """One job: its window of training under the faults of ``period`` (None: none).

    ``env``: more settings for the job's processes (``HVDKIT_PHASE_LOG``).
    """
    load_start, ticks = os.getloadavg(), _ticks()
    started = time.time()
    run = Run(root, epochs, step_sleep, stall_s, autotune, env)
    fired: list[dict] = []
    keeper = threading.Thread(target=run.replace_lost_workers, daemon=True)
    try:
        t0 = run.wait_whole()
        keeper.start()
        plan = fault_schedule(seed, period, window_s) if period else []
        for fault in plan:
            time.sleep(max(0.0, t0 + fault["at"] - time.time()))
            fired.append(run.fire(fault))
            print(f"  {fault['kind']:>6} at {fired[-1]['t'] - t0:6.1f} s", flush=True)
        time.sleep(max(0.0, t0 + window_s - time.time()))
        run.pace.unlink()  # the window is over: the rest trains unpaced
        result = run.job.finish()
    finally:
        run._stop.set()
        _end_everything(run)
    ticks_end = _ticks()
    lines = run.sched_lines()
    rank_lines = []
    with run.job._new_line:
        for name in run.job.procs:
            stamped = list(zip(run.job.times[name], run.job.lines[name], strict=False))
            (root / f"{name}.log").write_text("".join(f"{t:.3f} {ln}" for t, ln in stamped))
            if name != "scheduler":
                rank_lines += stamped
    files = {
        f.name: [json.loads(x) for x in f.read_text().splitlines()]
        for f in sorted(run.out.glob("ids-a*-r*.jsonl"))
    }
    return {
        "period_s": period,
        "seed": seed,
        "t0": t0,
        "stall_s": stall_s,
        "started": started,
        "job_s": time.time() - started,
        "exit": result["scheduler"][0],
        "restarts": sum(bool(RESTART.search(ln)) for _, ln in lines),
        "fired": fired,
        "new_worker_starts": run.new_workers,
        "frozen_ended": run.ended_frozen,
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
        "steal": steal_share(ticks, ticks_end),
        "_files": files,
        "_lines": lines,
        "_rank_lines": sorted(rank_lines),
        "_out": run.out,
        "_report": "\n".join(f"--- {n} ({c})\n{o[-3000:]}" for n, (c, o) in result.items()),
    }


def _ticks():
    from hvdkit.launch.transport import cpu_ticks

    return cpu_ticks()


def _end_everything(run: Run) -> None:
    """Every process this run started and its children (each by pid), if any is left."""
    for proc in run.job.procs.values():
        with contextlib.suppress(psutil.Error):
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(True)]
            for p in tree:
                with contextlib.suppress(psutil.Error):
                    p.kill()


def check_job(job: dict, root: Path, epochs: int, replay: bool) -> dict:
    """The suite's checks of the job: exit 0, each sample once per epoch, a replay's weights."""
    elastic, phases = _harness()
    checks: dict = {"exit_0": job["exit"] == 0}
    ids = elastic.trained_ids(job["_out"])
    checks["every_epoch"] = sorted(ids) == list(range(epochs))
    checks["each_sample_once"] = all(
        counts == collections.Counter(range(SAMPLES)) for counts in ids.values()
    )
    mine = collections.Counter()
    for s in step_records(job["_files"]):  # this file's rule, the same as trained_ids'
        if s["kept"]:
            mine.update(s["ids"])
    checks["same_count_as_trained_ids"] = mine == sum(ids.values(), collections.Counter())
    if replay and checks["exit_0"]:
        started = time.time()
        sched = "".join(ln for _, ln in job["_lines"])
        schedule = phases.replay_schedule(sched, WORKERS)
        finals = elastic.replay_worlds(root / "replay", schedule, SAMPLES, epochs)
        job_w, ref_w = elastic.final_weights(job["_out"]), elastic.final_weights(finals[-1])
        checks["replay_worlds"] = len(schedule)
        checks["weights_equal_replay"] = bool(
            job_w and ref_w and all(np.array_equal(w, ref_w[0]) for w in job_w + ref_w[1:])
        )
        checks["replay_s"] = time.time() - started
    checks["passed"] = all(v for k, v in checks.items() if k not in ("replay_worlds", "replay_s"))
    return checks


# ---------------------------------------------------------------- output
def summarize(
    job: dict,
    base_rate: float | None,
    window_s: float,
    base_step_s: float | None = None,
    base_clean_rate: float | None = None,
) -> dict:
    """One run's figures; ``base_*``: the fault-free run's rate, step and rate without its
    pauses inside a world (None: this is the fault-free run)."""
    steps = step_records(job["_files"])
    window = committed_rate(steps, job["t0"], job["t0"] + window_s)
    rate = base_rate or window["committed_per_s"]
    faults = [{**f, "new_worker_t": None} for f in job["fired"] if "skipped" not in f]
    # a lost worker's replacement: the benchmark's n-th new worker serves the n-th lost worker
    for f, t in zip(
        [f for f in faults if f["kind"] == "worker"], job["new_worker_starts"], strict=False
    ):
        f["new_worker_t"] = t
    for f in faults:
        if f["new_worker_t"] is None:
            del f["new_worker_t"]
    costs = fault_costs(faults, steps, job["_lines"], rate, rank_lines=job["_rank_lines"])
    run = {k: v for k, v in job.items() if not k.startswith("_")}
    run.update(window=window, faults=costs, goodput=goodput(window["committed_per_s"], rate))
    run["per_kind"] = percentiles(costs)
    run["timeline_10s"] = timeline(steps, job["t0"], window_s)
    t1 = job["t0"] + window_s
    run["step_s"] = step_time(steps, world_sizes(job["_lines"]), job["t0"], t1)
    # the fault-free run's share of its window spent in pauses inside its world
    clean_rate_share = base_rate / base_clean_rate if base_rate and base_clean_rate else 1.0
    n_pauses, paused = in_world_pauses(steps, job["t0"], t1)
    run["in_world_pauses"] = {"n": n_pauses, "s": paused}
    # the committed rate with those pauses left out, and against the fault-free run's so
    run["rate_without_pauses"] = window["committed_samples"] / (window_s - paused)
    clean = base_clean_rate or run["rate_without_pauses"]
    run["goodput_without_pauses"] = goodput(run["rate_without_pauses"], clean)
    # the same, with the fault-free rate scaled to this run's steady pace: a cross-check
    # against a machine whose speed drifted between the runs (others' work beside them)
    run["goodput_at_own_pace"] = (
        run["goodput"] * run["step_s"] / base_step_s if base_step_s and run["step_s"] else None
    )
    share = (1 - clean_rate_share) if base_clean_rate else 0.0
    run["loss"] = loss_split(
        window, costs, steps, job["_lines"], job["t0"], rate, WORKERS, base_step_s, share,
        stall_s=job["stall_s"],
    )  # fmt: skip
    return run


def svg(runs: list[dict], path: Path, stall_s: float = STALL_S) -> None:
    """Committed samples per second in 10-s bins over each run's window, with its goodput;
    beside it, goodput per period against TorchFT's published figures."""
    from _svg import Series, document, legend, line_chart

    colors = ["#333333", "#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    bins = max(len(r["timeline_10s"]) for r in runs)
    series = [
        Series(
            f"{run_name(r['period_s'])} ({r['window']['window_s']:.0f} s): "
            f"{100 * r['goodput']:.1f} %",
            color,
            [*r["timeline_10s"], *[None] * (bins - len(r["timeline_10s"]))],
        )
        for r, color in zip(runs, colors, strict=False)
    ]
    top = 20 * math.ceil(max(v for r in runs for v in r["timeline_10s"]) * 1.1 / 20)
    parts = line_chart(
        0,
        0,
        560,
        300,
        title="Committed samples per second, 10-s bins",
        x_labels=[f"{10 * b} s" if b % 6 == 0 else "" for b in range(bins)],
        y_label="samples/s",
        series=series,
        log_y=False,
        y_range=(0, top),
    )
    faulty = sorted((r for r in runs if r["period_s"] is not None), key=lambda r: -r["period_s"])
    if faulty:
        ours = Series("hvdkit, measured", "#1f77b4", [100 * r["goodput"] for r in faulty])
        theirs = [TORCHFT.get(r["period_s"]) for r in faulty]
        clean = [100 * r["goodput_without_pauses"] for r in faulty]
        versus = [
            ours,
            Series("hvdkit, pauses in a world left out", "#17becf", clean),
            Series("TorchFT, published", "#ff7f0e", theirs, dash=True),
        ]
        parts += line_chart(
            570,
            0,
            250,
            300,
            title="Goodput, %",
            x_labels=[f"1 per {r['period_s']:g} s" for r in faulty],
            y_label="% of the fault-free rate",
            series=versus,
            log_y=False,
            y_range=(0, 100),
        )
        parts += legend(600, 320, versus, 1, 220)
    parts += legend(70, 320, series, 1, 300)
    note = (
        f"{WORKERS} workers on {os.cpu_count()} cores, Gloo, in-process recovery, "
        f"stall timeout {stall_s:g} s: benchmarks/goodput.py"
    )
    path.write_text(document(830, 350 + 16 * len(series), parts, footnote=note))


def _stop_like_ctrl_c(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    # SIGTERM ends the run as Ctrl-C does, through the cleanup of the job's processes
    signal.signal(signal.SIGTERM, _stop_like_ctrl_c)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0, help="window of each run with faults")
    p.add_argument(
        "--baseline-minutes", type=float, default=5.0, help="window of the fault-free run"
    )
    p.add_argument("--periods", type=float, nargs="+", default=[60.0, 15.0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.2)
    p.add_argument(
        "--stall", type=float, default=STALL_S, help="the stall timeout, s (default %(default)s)"
    )
    p.add_argument(
        "--autotune",
        choices=["on", "off"],
        default="off",
        help="tf.data's autotuner in the job's pipeline (default off: its epoch-end stops "
        "are TensorFlow's, docs/limits.md)",
    )
    p.add_argument("--no-replay", action="store_true", help="skip the fault-free replay check")
    p.add_argument("--keep", type=Path, help="run the jobs in KEEP (a new folder) and keep them")
    p.add_argument("--svg", type=Path, default=REPO / "docs" / "goodput_bench.svg")
    p.add_argument("--name", default="goodput", help="bench_results/NAME.json")
    p.add_argument(
        "--from", dest="source", type=Path, help="print the tables and draw the SVG of a JSON"
    )
    args = p.parse_args()
    if args.source is not None:
        recorded = json.loads(args.source.read_text())
        runs = recorded["runs"]
        print(markdown_tables(runs))
        svg(runs, args.svg, recorded.get("stall_timeout_s", STALL_S))
        print(f"wrote {args.svg}")
        return
    window = 60 * args.minutes
    steps_per_epoch = SAMPLES // (WORKERS * BATCH)
    # enough epochs that paced steps outlast the longest window
    epochs = math.ceil(
        60 * max(args.minutes, args.baseline_minutes) / args.step_sleep / steps_per_epoch
    )
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=False)
    plan = [(None, 60 * args.baseline_minutes), *((float(p), window) for p in args.periods)]
    runs = []
    with contextlib.ExitStack() as stack:
        top = args.keep or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="hvdkit-goodput-"))
        )
        base_rate = base_step = base_clean = None
        for i, (period, win) in enumerate(plan):
            name = "no faults" if period is None else f"1 fault per {period:g} s"
            print(f"run {i + 1}: {name}, window {win:.0f} s, {epochs} epochs", flush=True)
            job = run_job(
                top / f"run{i + 1}",
                period,
                args.seed,
                win,
                epochs,
                args.step_sleep,
                args.stall,
                args.autotune == "on",
            )
            job["checks"] = check_job(job, top / f"run{i + 1}", epochs, not args.no_replay)
            run = summarize(job, base_rate, win, base_step, base_clean)
            run["order"], run["checks"] = i + 1, job["checks"]
            if base_rate is None:
                base_rate, base_step = run["window"]["committed_per_s"], run["step_s"]
                base_clean = run["rate_without_pauses"]
            runs.append(run)
            print(
                f"  exit {job['exit']}, {run['window']['committed_per_s']:.1f} samples/s, "
                f"goodput {100 * run['goodput']:.1f} %, checks {job['checks']}",
                flush=True,
            )
            if not job["checks"]["passed"]:
                print(job["_report"][-6000:], flush=True)
            out = write_results(
                args.name,
                {
                    "what": "committed samples per second under a fault every P seconds / "
                    "without faults, and each fault's costs (seconds)",
                    "machine": f"{os.cpu_count()} cores, shared",
                    "workers": WORKERS,
                    "stall_timeout_s": args.stall,
                    "tf_data_autotune": args.autotune,
                    "step_sleep_s": args.step_sleep,
                    "commit_every_steps": EVERY,
                    "samples_per_epoch": SAMPLES,
                    "epochs": epochs,
                    "seed": args.seed,
                    "order": [r["period_s"] for r in runs],
                    "torchft_published_percent": TORCHFT,
                    "runs": runs,
                },
            )
        print("\n" + markdown_tables(runs))
        svg(runs, args.svg, args.stall)
    print(f"wrote {out} and {args.svg}")
    if not all(r["checks"]["passed"] for r in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()

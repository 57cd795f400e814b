"""benchmarks/goodput.py's arithmetic: the fault schedule, and what the ranks' step
records and the scheduler's lines say about each run and each fault; the tables.

No processes and no clock here (tests/unit/test_goodput_bench.py checks it with a
small fixture). A step record is a line of tests/multiproc/ft_train.py's
``ids-a<A>-r<R>.jsonl``: ``{"epoch", "step", "ids", "round", "t"}``; a "line" is a
``(time, text)`` pair of the scheduler's (or a rank's) output.
"""

from __future__ import annotations

import math
import re

import numpy as np

KINDS = ("kill", "stop", "worker")
# 6 s: above Horovod's Gloo timeout in elastic jobs (5 s; tests/test_phases_mp.py says
# why a lower one fails) and 24 paced steps, so a loaded machine's slow step is not
# taken for a freeze; each freeze costs all of it, so no higher.
STALL_S = 6
WORKERS = 4
DECIDED = re.compile(r"go on in-process as round (\d+)")
RESUMED = re.compile(r"round (\d+): (\d+) ranks train again from step (\d+)")
MOVED = re.compile(
    r"\(round (\d+)\) after .*?; (?:rolled back to|went on from) step \d+; "
    r"([\d.]+) s to rejoin, ([\d.]+) s to roll back"
)
TORCHFT = {60: 81.2, 15: 13.4}  # published: 300 GPUs in 30 replica groups


def fault_schedule(seed: int, period: float, window_s: float) -> list[dict]:
    """The faults of one run: when (seconds after ``t0``), which kind, and a draw.

    One fault per period, in the middle of each: at ``(k + 1/2) * period``
    for every k with that time inside the window; the kinds by turns
    (:data:`KINDS`); ``pick`` in [0, 1) chooses the target among the rank
    processes training then (:func:`pick_target`).

    Example:
        >>> [(f["at"], f["kind"]) for f in fault_schedule(1, 60, 150)]
        [(30.0, 'kill'), (90.0, 'stop')]
    """
    rng = np.random.default_rng(seed)
    count = int(window_s // period)
    return [
        {"at": (k + 0.5) * period, "kind": KINDS[k % len(KINDS)], "pick": float(rng.random())}
        for k in range(count)
    ]


def pick_target(pids: list[int], pick: float) -> int:
    """The process ``pick`` (in [0, 1)) draws among ``pids``, taken in pid order."""
    ordered = sorted(pids)
    return ordered[min(len(ordered) - 1, int(pick * len(ordered)))]


def rounds_began(files: dict[str, list[dict]]) -> dict[int, int]:
    """Round -> the step it began training at, from the ranks' record files.

    ``files``: a file's name (``ids-a<A>-r<R>.jsonl``) -> its records. A
    process's first line says where its round began; a recovery's mark says it
    for the round the process went on in (the rule of tests/test_elastic_mp.py
    ``trained_ids``).
    """
    began: dict[int, int] = {}
    for name, rows in sorted(files.items()):
        if not rows:  # killed before its first line: trained nothing
            continue
        began.setdefault(int(name.split("-")[1][1:]), rows[0]["resumed_from"])
        for rec in rows:
            if "recovered_from" in rec:
                began[rec["round"]] = rec["recovered_from"]
    return began


def step_records(files: dict[str, list[dict]]) -> list[dict]:
    """Every training step of every rank, each with ``kept`` (it lives on in the weights)
    and ``undone_by`` (the round whose rollback undid it), sorted by time.

    A step trained in round r is kept unless a later round began at an
    earlier step; the first such round undid it.
    """
    began = rounds_began(files)
    rounds = sorted(began)
    out = []
    for rows in files.values():
        for rec in rows[1:]:
            if "ids" not in rec:
                continue
            later = [r for r in rounds if r > rec["round"]]
            undone = next((r for r in later if rec["step"] > began[r]), None)
            # kept: not after the step the next round began at (as trained_ids counts)
            kept = not later or rec["step"] <= began[later[0]]
            out.append({**rec, "n": len(rec["ids"]), "kept": kept, "undone_by": undone})
    return sorted(out, key=lambda r: r["t"])


def committed_rate(steps: list[dict], t0: float, t1: float) -> dict:
    """Committed and rolled-back samples of the steps trained in [t0, t1), and the rate."""
    inside = [s for s in steps if t0 <= s["t"] < t1]
    committed = sum(s["n"] for s in inside if s["kept"])
    return {
        "window_s": t1 - t0,
        "committed_samples": committed,
        "trained_samples": sum(s["n"] for s in inside),
        "rolled_back_samples": sum(s["n"] for s in inside if not s["kept"]),
        "committed_per_s": committed / (t1 - t0),
    }


def timeline(steps: list[dict], t0: float, window_s: float, bin_s: float = 10.0) -> list[float]:
    """Committed samples per second in each whole ``bin_s`` of the window from ``t0``."""
    bins = [0.0] * int(window_s // bin_s)
    for s in steps:
        b = math.floor((s["t"] - t0) / bin_s)
        if s["kept"] and 0 <= b < len(bins):
            bins[b] += s["n"] / bin_s
    return bins


def step_time(
    steps: list[dict], sizes: dict[int, int], t0: float, t1: float, workers: int = WORKERS
) -> float | None:
    """The median seconds between consecutive steps of a whole world (``workers`` ranks)
    inside [t0, t1): the machine's pace in that run, pauses left out."""
    done: dict[tuple[int, int], float] = {}  # (round, step) -> when its last rank recorded it
    for s in steps:
        if sizes.get(s["round"]) == workers and t0 <= s["t"] < t1:
            key = (s["round"], s["step"])
            done[key] = max(done.get(key, s["t"]), s["t"])
    gaps = [t - done[(r, n - 1)] for (r, n), t in done.items() if (r, n - 1) in done]
    return float(np.median(gaps)) if gaps else None


def in_world_pauses(
    steps: list[dict], t0: float, t1: float, min_gap_s: float = 1.0
) -> tuple[int, float]:
    """Gaps over ``min_gap_s`` between consecutive steps of one world in [t0, t1):
    how many and their seconds. A regroup's pause falls between two worlds and is not
    counted; what is counted stops a world that had no fault (seen as some epochs end,
    with or without faults)."""
    done: dict[tuple[int, int], float] = {}
    for s in steps:
        if t0 <= s["t"] < t1:
            key = (s["round"], s["step"])
            done[key] = max(done.get(key, s["t"]), s["t"])
    gaps = [t - done[(r, n - 1)] for (r, n), t in done.items() if (r, n - 1) in done]
    long = [g for g in gaps if g > min_gap_s]
    return len(long), float(sum(long))


def goodput(rate: float, fault_free_rate: float) -> float:
    """Committed samples per second under faults / without: a share (1.0 = no loss)."""
    return rate / fault_free_rate


def rank_moves(rank_lines: list[tuple[float, str]]) -> dict[int, dict]:
    """Round -> the slowest rank's rejoin and roll-back seconds, as the ranks' lines say
    them (``... (round 3) after ...; rolled back to step 40; 1.24 s to rejoin, 0.05 s to
    roll back``), and ``said_t``: when the last of them said it."""
    moves: dict[int, dict] = {}
    for t, line in rank_lines:
        m = MOVED.search(line)
        if m is None:
            continue
        mv = moves.setdefault(int(m.group(1)), {"rejoin_s": 0.0, "rollback_s": 0.0, "said_t": t})
        mv["rejoin_s"] = max(mv["rejoin_s"], float(m.group(2)))
        mv["rollback_s"] = max(mv["rollback_s"], float(m.group(3)))
        mv["said_t"] = max(mv["said_t"], t)
    return moves


def world_sizes(lines: list[tuple[float, str]], workers: int = WORKERS) -> dict[int, int]:
    """Round -> its ranks, from the scheduler's lines (round 0: ``workers``)."""
    sizes = {0: workers}
    for _, line in lines:
        m = RESUMED.search(line)
        if m:
            sizes[int(m.group(1))] = int(m.group(2))
    return sizes


def _first_step(steps: list[dict], rnd: int, after: float) -> float | None:
    times = [s["t"] for s in steps if s["round"] >= rnd and s["t"] > after]
    return min(times) if times else None


def fault_costs(
    faults: list[dict],
    steps: list[dict],
    lines: list[tuple[float, str]],
    base_rate: float,
    workers: int = WORKERS,
    rank_lines: list[tuple[float, str]] = (),
) -> list[dict]:
    """Each fired fault with its measured parts (seconds; a part not seen is left out).

    ``faults``: ``{"t", "kind", ...}`` as fired (a lost worker's with
    ``new_worker_t``, when its replacement was started); ``steps``:
    :func:`step_records`; ``lines``, ``rank_lines``: the scheduler's and the
    ranks' lines with their times; ``base_rate``: the fault-free committed
    samples per second, which turns lost samples into seconds; ``workers``: the
    whole world's size. Each scheduler decision is given to the first fault
    before it that has none yet: at a short period a fault may strike while the
    last one's world forms, and the events keep their order.

    The parts: ``detection_s`` (fault -> the scheduler's decision), ``regroup_s``
    (-> the first step of the smaller world; of it, as the ranks say,
    ``rejoin_s`` and ``rollback_s``, then ``first_step_s`` from their line to
    that step), ``recovery_s`` (the two), ``lost_work_s`` (samples trained
    before the fault and rolled back, at the fault-free rate); then the
    newcomer: ``newcomer_s`` (its start -> the first step of the whole world:
    its TensorFlow start, ``hvdkit.init``, the survivors' next commit boundary,
    the new world, the state sent), of which ``join_pause_s`` (the survivors'
    last step -> that step) stops the survivors, with ``join_rejoin_s`` and
    ``join_rollback_s`` the ranks' own figures; ``whole_again_s``: fault ->
    the whole world's first step.
    """
    decided = [(t, int(m.group(1))) for t, ln in lines for m in [DECIDED.search(ln)] if m]
    sizes = world_sizes(lines, workers)
    grown = [
        (t, int(m.group(1)))
        for t, ln in lines
        for m in [RESUMED.search(ln)]
        if m and int(m.group(2)) == workers
    ]
    moves = rank_moves(list(rank_lines))
    used: set[float] = set()
    out = []
    for f in sorted(faults, key=lambda f: f["t"]):
        cost = {**f}
        out.append(cost)
        dec = next(((t, r) for t, r in decided if t > f["t"] and t not in used), None)
        if dec is None:
            continue
        used.add(dec[0])
        t_dec, rnd = dec
        undone = [s for s in steps if s["undone_by"] == rnd]
        before = sum(s["n"] for s in undone if s["t"] <= f["t"])
        cost.update(
            round=rnd,
            ranks=sizes.get(rnd),
            detection_s=t_dec - f["t"],
            lost_samples=sum(s["n"] for s in undone),
            lost_before_fault_samples=before,
            lost_work_s=before / base_rate,
        )
        back = _first_step(steps, rnd, t_dec)
        if back is not None:
            cost.update(regroup_s=back - t_dec, recovery_s=back - f["t"])
            if rnd in moves:
                mv = moves[rnd]
                cost.update(rejoin_s=mv["rejoin_s"], rollback_s=mv["rollback_s"])
                cost["first_step_s"] = back - mv["said_t"]
        whole = next(((t, r) for t, r in grown if t > t_dec and r > rnd), None)
        t_whole = None if whole is None else _first_step(steps, whole[1], whole[0])
        if t_whole is None:
            continue
        last = [s["t"] for s in steps if s["t"] < t_whole]
        start = f.get("new_worker_t", t_dec)  # a lost worker's replacement, else the return
        cost.update(newcomer_s=t_whole - start, whole_again_s=t_whole - f["t"])
        if last:
            cost["join_pause_s"] = t_whole - max(last)
        if whole[1] in moves:
            mv = moves[whole[1]]
            cost.update(join_rejoin_s=mv["rejoin_s"], join_rollback_s=mv["rollback_s"])
    return out


PARTS = (
    "detection_s",
    "regroup_s",
    "rejoin_s",
    "rollback_s",
    "first_step_s",
    "recovery_s",
    "lost_work_s",
    "newcomer_s",
    "join_pause_s",
    "join_rejoin_s",
    "join_rollback_s",
    "whole_again_s",
)


def percentiles(costs: list[dict]) -> dict:
    """Per kind (and ``all``): the count and p50/p95 of each part of :data:`PARTS`."""
    table = {}
    for kind in (*KINDS, "all"):
        mine = [c for c in costs if kind in (c["kind"], "all")]
        row: dict = {"n": len(mine)}
        for part in PARTS:
            vals = [c[part] for c in mine if c.get(part) is not None]
            row[part] = (
                {"p50": float(np.percentile(vals, 50)), "p95": float(np.percentile(vals, 95))}
                if vals
                else None
            )
        table[kind] = row
    return table


def loss_split(
    window: dict,
    costs: list[dict],
    steps: list[dict],
    lines: list[tuple[float, str]],
    t0: float,
    base_rate: float,
    workers: int = WORKERS,
    base_step_s: float | None = None,
    base_pause_share: float = 0.0,
    stall_s: float = STALL_S,
) -> dict:
    """The run's lost training time (seconds of fault-free training), by cause.

    ``lost_s`` = window - committed samples / fault-free rate. Of it: the
    faults' recoveries (fault -> first step of the next world; of them the stall
    timeouts of the frozen ranks), their lost work (samples trained before the
    fault and rolled back, at the fault-free rate), the joins' pauses, the
    training on fewer ranks (each smaller world's span of steps times its
    missing share of ranks), the machine's pace against the fault-free run's
    (:func:`step_time` here and ``base_step_s`` there: negative when this run's
    steps were the quicker), the pauses inside a world against the fault-free
    run's share of them (``base_pause_share``, :func:`in_world_pauses`); the rest
    is other slower steps (a newcomer's TensorFlow start takes CPU from the
    ranks). At short periods faults overlap, and a second may be counted twice.
    """
    t1 = t0 + window["window_s"]
    inside = [c for c in costs if c["t"] < t1]
    lost_s = window["window_s"] - window["committed_samples"] / base_rate
    parts = {
        "recovery_s": sum(c.get("recovery_s") or 0.0 for c in inside),
        "stall_timeout_s": float(stall_s * sum(c["kind"] == "stop" for c in inside)),
        "lost_work_s": sum(c.get("lost_work_s") or 0.0 for c in inside),
        "join_pause_s": sum(c.get("join_pause_s") or 0.0 for c in inside),
    }
    fewer = 0.0
    for rnd, size in world_sizes(lines, workers).items():
        times = [s["t"] for s in steps if s["round"] == rnd and t0 <= s["t"] < t1]
        if size < workers and times:
            fewer += (max(times) - min(times)) * (1 - size / workers)
    parts["fewer_ranks_s"] = fewer
    step = step_time(steps, world_sizes(lines, workers), t0, t1, workers)
    pace = (
        0.0
        if base_step_s is None or step is None
        else window["window_s"] * (1 - base_step_s / step)
    )
    parts["pace_s"] = pace
    pauses = in_world_pauses(steps, t0, t1)[1] - base_pause_share * window["window_s"]
    parts["in_world_pauses_s"] = pauses
    paused = sum(parts[k] for k in ("recovery_s", "lost_work_s", "join_pause_s"))
    return {"lost_s": lost_s, **parts, "slower_steps_s": lost_s - paused - fewer - pace - pauses}


# ---------------------------------------------------------------- the tables
def _fmt(v, unit: str = "", digits: int = 1) -> str:
    return "–" if v is None else f"{v:.{digits}f}{unit}"


def run_name(period: float | None) -> str:
    """ "no faults", or "1 fault per P s"."""
    return "no faults" if period is None else f"1 fault per {period:g} s"


def _p(row: dict | None) -> str:
    return "–" if row is None else f"{row['p50']:.1f} / {row['p95']:.1f}"


KIND_NAMES = {"kill": "SIGKILL", "stop": "frozen", "worker": "lost worker", "all": "all"}
COST_COLUMNS = (
    ("detection", "detection_s"),
    ("rejoin", "rejoin_s"),
    ("roll back", "rollback_s"),
    ("first step", "first_step_s"),
    ("recovery", "recovery_s"),
    ("lost work", "lost_work_s"),
    ("newcomer: start to 4 ranks training", "newcomer_s"),
    ("join pause", "join_pause_s"),
    ("fault to 4 ranks again", "whole_again_s"),
)
SPLIT_COLUMNS = (
    ("recoveries", "recovery_s"),
    ("of them stall timeouts", "stall_timeout_s"),
    ("lost work", "lost_work_s"),
    ("join pauses", "join_pause_s"),
    ("fewer ranks", "fewer_ranks_s"),
    ("pace against the fault-free run", "pace_s"),
    ("pauses inside a world, against the fault-free run's", "in_world_pauses_s"),
    ("other slower steps", "slower_steps_s"),
)


def markdown_tables(runs: list[dict]) -> str:
    """The three tables of docs/performance.md ("Goodput under failures") from the runs."""
    out = [
        "| run (order) | window, s | faults: SIGKILL / frozen / lost worker | committed "
        "samples/s | goodput | goodput, pauses inside a world left out | TorchFT (published) "
        "| rolled back, "
        "samples | recovery p50 / p95, s | step of 4 ranks, s | pauses over 1 s inside a world "
        "| whole-job restarts | load avg | steal |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        kinds = " / ".join(str(sum(f["kind"] == k for f in r["faults"])) for k in KINDS)
        torchft = TORCHFT.get(r["period_s"])
        steal = "–" if r["steal"] is None else f"{100 * r['steal']:.1f} %"
        clean = r["goodput_without_pauses"]
        gaps = r.get("in_world_pauses") or {"n": 0, "s": 0.0}
        pauses = f"{gaps['n']}: {gaps['s']:.1f} s"
        out.append(
            f"| {run_name(r['period_s'])} ({r['order']}) | {r['window']['window_s']:.0f} | "
            f"{kinds} | "
            f"{r['window']['committed_per_s']:.1f} | {100 * r['goodput']:.1f} % | "
            f"{_fmt(100 * clean, ' %')} | "
            f"{'' if torchft is None else f'{torchft} %'} | "
            f"{r['window']['rolled_back_samples']} | {_p(r['per_kind']['all']['recovery_s'])} | "
            f"{_fmt(r['step_s'], digits=3)} | {pauses} | {r['restarts']} | "
            f"{r['load_avg_start'][0]:.1f}–{r['load_avg_end'][0]:.1f} | {steal} |"
        )
    head = " | ".join(name for name, _ in COST_COLUMNS)
    out += ["", f"| run | fault | n | {head} |", "|---" * (3 + len(COST_COLUMNS)) + "|"]
    for r in runs:
        for kind in (*KINDS, "all") if r["period_s"] is not None else ():
            row = r["per_kind"][kind]
            cells = " | ".join(_p(row[key]) for _, key in COST_COLUMNS)
            out.append(f"| {r['period_s']:g} s | {KIND_NAMES[kind]} | {row['n']} | {cells} |")
    head = " | ".join(name for name, _ in SPLIT_COLUMNS)
    out += ["", f"| run | lost | {head} |", "|---" * (2 + len(SPLIT_COLUMNS)) + "|"]
    for r in runs:
        if r["period_s"] is None:
            continue
        window, loss = r["window"]["window_s"], r["loss"]
        cells = " | ".join(
            f"{loss[key]:.0f} s ({100 * loss[key] / window:.1f} %)" for _, key in SPLIT_COLUMNS
        )
        out.append(
            f"| {r['period_s']:g} s | {loss['lost_s']:.0f} s ({100 * loss['lost_s'] / window:.1f}"
            f" %) | {cells} |"
        )
    return "\n".join(out)

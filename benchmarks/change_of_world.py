"""Where an elastic job's change of world goes: every rank's phases, logged and split.

    python benchmarks/change_of_world.py [--minutes 4] [--period 20] [--seed 1] [--stall 6]
    python benchmarks/change_of_world.py --from bench_results/change_of_world.json

The goodput benchmark's job (:mod:`goodput`: 4 workers of the scheduler/worker
launch over Gloo, in-process recovery, steps paced to 0.2 s, a commit every 5
steps, a fault every ``--period`` s by turns, each lost rank started again so
that the job grows back to 4) with ``HVDKIT_PHASE_LOG`` set: every process
adds a line as it enters a phase (:mod:`hvdkit._phases`). Each world after the
first is a *loss* (the survivors of a lost rank, no newcomer) or a *join* (a
newcomer restores in it), and its time from the survivors leaving the old
world to the new world's first step splits into (the last rank to get there
each time, so the world's own pace):

* meeting: leaving -> every rank starts Horovod (the ready/go meeting);
* Horovod's start: -> the survivors' roll back begins (Gloo's rendezvous and
  connections: ``hvd.init``);
* the state: -> the roll back's broadcast is done (at a join it waits for the
  newcomer to reach its ``restore()``);
* first step: -> the first step of the world ends (``fit`` starts again, Keras
  traces the train function again, one step is trained).

A join's pause also holds the survivors' last step before leaving (from it
to the leave: the agreed step's commit). Also printed: a steady step of 4
ranks (the median time between two steps of one rank in a world). The
record is ``bench_results/NAME.json``; ``--from`` prints its table again.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import write_results

SEGMENTS = ("meeting", "horovod_start", "state", "first_step")
HEADS = {
    "meeting": "leaving → every rank met",
    "horovod_start": "Horovod's start",
    "state": "the state's broadcast",
    "first_step": "first step: fit, the trace, one step",
    "total": "leaving → first step",
    "last_step_to_leave": "last step → leaving",
}


def read_log(path: Path) -> list[dict]:
    """The phase log's lines (whole ones: a line cut by a killed process is skipped)."""
    lines = []
    for text in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            lines.append(json.loads(text))
    return sorted(lines, key=lambda e: e["t"])


def changes(events: list[dict]) -> list[dict]:
    """Each world after the first that trained: its kind and its segments, in seconds.

    A world's ranks are the processes that started Horovod in its round
    (``init``); its newcomers those that ``restore`` in it, its survivors
    the others, which roll back. A world whose survivors did not all reach
    its first step (a peer lost meanwhile) is left out.
    """
    by_round: dict[int, dict[str, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    before: dict[int, list[dict]] = defaultdict(list)  # pid -> its events, in order
    for e in events:
        before[e["pid"]].append(e)
        if e["phase"] in ("init", "rollback", "reshard", "restore", "first_step", "meet"):
            by_round[e["round"]][e["phase"]].setdefault(e["pid"], e["t"])
    out = []
    for round_, at in sorted(by_round.items()):
        ranks = set(at["init"])
        newcomers = ranks & set(at["restore"])
        survivors = ranks - newcomers
        if round_ == 0 or not survivors:
            continue
        if any(p not in at[k] for p in survivors for k in ("rollback", "reshard")):
            continue
        if any(p not in at["first_step"] for p in ranks):
            continue
        left = {}
        last_step = {}
        for pid in survivors:
            mine = [e for e in before[pid] if e["t"] < at["init"][pid]]
            leaves = [e["t"] for e in mine if e["phase"] == "leave"]
            steps = [e["t"] for e in mine if e["phase"] in ("step", "first_step")]
            if not leaves:
                break
            left[pid] = leaves[-1]
            last_step[pid] = steps[-1] if steps else None
        else:
            leave_t = max(left.values())
            marks = {
                "meeting": max(at["init"][p] for p in ranks),
                "horovod_start": max(at["rollback"][p] for p in survivors),
                "state": max(at["reshard"][p] for p in survivors),
                "first_step": max(at["first_step"][p] for p in ranks),
            }
            seg, prev = {}, leave_t
            for name in SEGMENTS:
                seg[name] = max(0.0, marks[name] - prev)
                prev = max(prev, marks[name])
            seg["total"] = marks["first_step"] - leave_t
            kind = "join" if newcomers else "loss"
            if kind == "join" and all(t is not None for t in last_step.values()):
                seg["last_step_to_leave"] = leave_t - max(last_step.values())
            out.append({"round": round_, "kind": kind, "ranks": len(ranks), "at": leave_t, **seg})
    return out


def steady_step_s(events: list[dict], t0: float, t1: float, size: int = 4) -> float | None:
    """The median time between two steps of one rank in a world of ``size`` ranks.

    Only steps between ``t0`` and ``t1`` (the paced window; the job trains its
    remaining epochs unpaced after it).
    """
    gaps, last = [], {}
    for e in events:
        if not t0 <= e["t"] <= t1 or e["phase"] != "step" or e["size"] != size:
            continue
        key = (e["pid"], e["round"])
        if key in last:
            gaps.append(e["t"] - last[key])
        last[key] = e["t"]
    return statistics.median(gaps) if gaps else None


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


def summary(found: list[dict]) -> dict:
    """Per kind: n and p50/p95 of each segment, the total and (joins) the last step's."""
    out = {}
    for kind in ("loss", "join"):
        rows = [c for c in found if c["kind"] == kind]
        if not rows:
            continue
        out[kind] = {"n": len(rows)}
        for name in (*SEGMENTS, "total", "last_step_to_leave"):
            values = [c[name] for c in rows if name in c]
            if values:
                out[kind][name] = {"p50": _p(values, 0.5), "p95": _p(values, 0.95)}
    return out


def markdown_table(summ: dict, step_s: float | None) -> str:
    """The table docs/performance.md prints: per kind, p50 / p95 seconds."""
    names = (*SEGMENTS, "total", "last_step_to_leave")
    head = "| change of world | n | " + " | ".join(HEADS[n] for n in names) + " | a step |"
    rows = [head, "|" + "---|" * (len(names) + 3)]
    for kind, s in summ.items():
        cells = [f"{s[n]['p50']:.2f} / {s[n]['p95']:.2f}" if n in s else "–" for n in names]
        step = f"{step_s:.2f}" if step_s is not None else "–"
        rows.append(f"| {kind} | {s['n']} | " + " | ".join(cells) + f" | {step} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=4.0)
    p.add_argument("--period", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--stall", type=float, default=6.0)
    p.add_argument("--keep", type=Path)
    p.add_argument("--name", default="change_of_world")
    p.add_argument("--from", dest="from_", type=Path, help="print a recorded run's table")
    args = p.parse_args()
    if args.from_ is not None:
        rec = json.loads(args.from_.read_text())
        print(markdown_table(rec["summary"], rec["step_s"]))
        return
    import goodput
    from goodput_records import WORKERS

    window = 60 * args.minutes
    step_sleep = 0.2  # goodput.py's default
    epochs = math.ceil(window / step_sleep / (goodput.SAMPLES // (WORKERS * goodput.BATCH)))
    with contextlib.ExitStack() as stack:
        top = args.keep or Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="hvdkit-change-of-world-"))
        )
        log = top / "phases.jsonl"
        job = goodput.run_job(
            top / "run",
            args.period,
            args.seed,
            window,
            epochs,
            step_sleep,
            args.stall,
            env={"HVDKIT_PHASE_LOG": str(log)},
        )
        checks = goodput.check_job(job, top / "run", epochs, False)
        events = read_log(log)
    found = [c for c in changes(events) if c["at"] <= job["t0"] + window]
    summ, step = summary(found), steady_step_s(events, job["t0"], job["t0"] + window)
    out = write_results(
        args.name,
        {
            "what": "an elastic job's changes of world split by phase (seconds; the last "
            "rank to reach each phase)",
            "period_s": args.period,
            "window_s": window,
            "stall_timeout_s": args.stall,
            "exit": job["exit"],
            "checks": checks,
            "changes": found,
            "summary": summ,
            "step_s": step,
        },
    )
    print(markdown_table(summ, step))
    print(f"wrote {out}")
    if not checks["passed"]:
        sys.exit(1)


if __name__ == "__main__":
    main()

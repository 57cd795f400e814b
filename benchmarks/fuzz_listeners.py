"""A longer fuzz run of every listener's parser (issue 20); the suite runs 150 cases each.

    python benchmarks/fuzz_listeners.py                 # 2,000 cases per listener
    python benchmarks/fuzz_listeners.py --cases 20000   # longer

For each listener of a job (the scheduler's registration line, a worker's
signed messages, the guarded rendezvous HTTP server, a heartbeat receiver)
hypothesis draws ``--cases`` hostile inputs (``tests/listener_targets.py``:
random bytes, JSON of every shape, ``[[[`` nesting to 3000 deep, non-UTF-8,
lines to 300 KB, over-long integers, mutated genuine messages) and feeds them
to the running listener. Reported per listener: cases, the outcomes, uncaught
exceptions (must be 0), log lines too long or with a traceback (must be 0),
whether a genuine client is still served, the state the listener keeps
(bounded), and the Python heap traced over the run: its peak (hypothesis's
own bookkeeping included), and what hvdkit's code held after all cases
minus after half of them (a leak grows with the cases; bounded state does
not; log records kept by the run are not hvdkit's). Prints a table and writes
``bench_results/fuzz_listeners.json``; exits 1 if a listener failed.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO)]

from _common import write_results  # noqa: E402
from listener_targets import TARGETS, run_cases, watching  # noqa: E402


def _held_by_hvdkit() -> int:
    """Bytes now allocated by hvdkit's own code (the listeners' state), per tracemalloc."""
    snapshot = tracemalloc.take_snapshot()
    mine = snapshot.filter_traces([tracemalloc.Filter(True, str(REPO / "hvdkit" / "*"))])
    return sum(stat.size for stat in mine.statistics("filename"))


def fuzz(target_cls, cases: int) -> dict:
    target = target_cls()
    heap = {}

    def after_each(done):
        if done in (cases // 2, cases):  # after the first half, and at the end
            heap.setdefault(done, _held_by_hvdkit())

    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with watching() as watch:
            outcomes = collections.Counter(run_cases(target, cases, after_each))
            answers = target.answers()
            state = target.state()
    finally:
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        target.close()
    half, end = heap.get(cases // 2), heap.get(cases)
    growth = None if half is None or end is None else round((end - half) / 1e3, 1)
    return {
        "listener": target.name,
        "cases": sum(outcomes.values()),
        "seconds": round(seconds, 1),
        "uncaught exceptions": watch.uncaught,
        "bad log lines": watch.bad_lines(),
        "log lines": watch.count,
        "still answers": answers,
        "state": state,
        "heap peak MB": round(peak / 1e6, 1),
        "hvdkit heap growth, 2nd half, KB": growth,
        "outcomes": dict(outcomes.most_common(12)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=2000, help="per listener (default 2000)")
    args = parser.parse_args()
    if args.cases < 2:
        parser.error(f"--cases {args.cases}: give at least 2")
    rows = [fuzz(t, args.cases) for t in TARGETS]
    print(
        f"{'listener':<20} {'cases':>6} {'s':>6} {'uncaught':>8} {'bad lines':>9} "
        f"{'answers':>7} {'heap MB':>7} {'hvdkit +KB':>10}  state"
    )
    failed = False
    for r in rows:
        bad = r["uncaught exceptions"] or r["bad log lines"] or not r["still answers"]
        failed = failed or bool(bad)
        print(
            f"{r['listener']:<20} {r['cases']:>6} {r['seconds']:>6} "
            f"{len(r['uncaught exceptions']):>8} {len(r['bad log lines']):>9} "
            f"{'yes' if r['still answers'] else 'NO':>7} {r['heap peak MB']:>7} "
            f"{r['hvdkit heap growth, 2nd half, KB']!s:>10}  {r['state']}"
        )
    out = write_results("fuzz_listeners", {"cases per listener": args.cases, "listeners": rows})
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

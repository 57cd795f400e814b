"""benchmarks/goodput.py's pure parts (benchmarks/goodput_records.py): the fault schedule
by seed, and the arithmetic of committed samples, lost work and each fault's times from a
small record fixture.

The fixture: 2 ranks train steps 1-7 in round 0 (one sample id per rank and step,
one step a second, a commit at step 5); rank 1 is killed at t = 7.5; the scheduler
says "go on in-process as round 1" at 8.0; rank 0 rolls back to step 5 and trains
steps 6-8 alone in round 1 (t = 10-12); the killed rank's program, started again,
registers at 13.0 (round 2), and both train step 9 at t = 15. The ranks' own lines
say how long each regroup's rejoin and roll back took.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import goodput_records as gp


def step(epoch: int, s: int, rank: int, rnd: int, t: float) -> dict:
    return {"epoch": epoch, "step": s, "ids": [10 * s + rank], "round": rnd, "t": t}


FILES = {
    "ids-a0-r0.jsonl": [
        {"resumed_from": 0, "size": 2},
        *(step(0, s, 0, 0, float(s)) for s in range(1, 8)),
        {"recovered_from": 5, "size": 1, "rank": 0, "round": 1},
        *(step(0, s, 0, 1, float(s + 4)) for s in range(6, 9)),
        step(0, 9, 0, 2, 15.0),
    ],
    "ids-a0-r1.jsonl": [
        {"resumed_from": 0, "size": 2},
        *(step(0, s, 1, 0, float(s)) for s in range(1, 8)),
    ],
    "ids-a2-r1.jsonl": [{"resumed_from": 8, "size": 2}, step(0, 9, 1, 2, 15.0)],
}
RANK_LINES = [
    (
        9.9,
        "[rank 0] hvdkit: rank 0 of 2 is rank 0 of 1 (round 1) after UnknownError: ...; "
        "rolled back to step 5; 1.20 s to rejoin, 0.30 s to roll back\n",
    ),
    (
        14.6,
        "[rank 0] hvdkit: rank 0 of 1 is rank 0 of 2 (round 2) after a newcomer; "
        "went on from step 8; 0.50 s to rejoin, 0.20 s to roll back\n",
    ),
]
LINES = [
    (8.0, "scheduler: rank 1 died; 1 of 2 workers go on in-process as round 1 (lost: w1)\n"),
    (10.0, "scheduler: round 1: 1 ranks train again from step 5\n"),
    (13.0, "scheduler: w1 joins: 2 of 2 workers as round 2 (1 go on in-process; ...)\n"),
    (14.5, "scheduler: round 2: 2 ranks train again from step 8\n"),
]


def test_the_schedule_is_one_fault_in_the_middle_of_each_period_the_kinds_by_turns():
    plan = gp.fault_schedule(7, 15, 600)
    assert [f["at"] for f in plan] == [7.5 + 15 * k for k in range(40)]
    assert [f["kind"] for f in plan[:4]] == ["kill", "stop", "worker", "kill"]
    assert [f["kind"] for f in plan].count("stop") == 13
    picks = [f["pick"] for f in plan]
    assert picks == [f["pick"] for f in gp.fault_schedule(7, 15, 600)]
    assert picks == list(np.random.default_rng(7).random(40))
    assert picks != [f["pick"] for f in gp.fault_schedule(8, 15, 600)]
    assert [f["at"] for f in gp.fault_schedule(7, 60, 600)] == [30.0 + 60 * k for k in range(10)]
    assert gp.fault_schedule(7, 60, 59) == []


def test_the_target_is_drawn_among_the_pids_in_order():
    pids = [40, 10, 30, 20]
    assert [gp.pick_target(pids, x) for x in (0.0, 0.24, 0.25, 0.5, 0.99)] == [10, 10, 20, 30, 40]


def test_steps_are_kept_unless_a_later_round_began_before_them():
    assert gp.rounds_began(FILES) == {0: 0, 1: 5, 2: 8}
    steps = gp.step_records(FILES)
    assert len(steps) == 7 + 7 + 3 + 2
    undone = sorted((s["step"], s["ids"][0]) for s in steps if not s["kept"])
    assert undone == [(6, 60), (6, 61), (7, 70), (7, 71)]
    assert {s["undone_by"] for s in steps if not s["kept"]} == {1}
    assert sorted(i for s in steps if s["kept"] for i in s["ids"]) == sorted(
        [*(10 * s + r for s in range(1, 6) for r in (0, 1)), 60, 70, 80, 90, 91]
    )


def test_committed_rate_and_goodput():
    steps = gp.step_records(FILES)
    w = gp.committed_rate(steps, 0.0, 16.0)
    assert w == {
        "window_s": 16.0,
        "committed_samples": 15,
        "trained_samples": 19,
        "rolled_back_samples": 4,
        "committed_per_s": 15 / 16,
    }
    # a window [2, 8): steps 2-7 of both ranks, of which steps 6 and 7 were rolled back
    assert gp.committed_rate(steps, 2.0, 8.0)["committed_samples"] == 8
    assert gp.goodput(15 / 16, 2.0) == pytest.approx(15 / 32)
    # per 4-s bin from t = 0: steps 1-3 (6 samples), 4-5 (4: 6 and 7 were rolled back),
    # 6-7 again at 10-11 (2), step 8 at 12 and step 9 of both ranks at 15 (3); the part-bin
    # [16, 18) is left out
    assert gp.timeline(steps, 0.0, 18.0, 4.0) == [1.5, 1.0, 0.5, 0.75]


def test_each_fault_gets_its_detection_regroup_lost_work_and_join():
    steps = gp.step_records(FILES)
    (cost,) = gp.fault_costs(
        [{"t": 7.5, "kind": "kill"}], steps, LINES, 2.0, workers=2, rank_lines=RANK_LINES
    )
    assert cost == pytest.approx(
        {
            "t": 7.5,
            "kind": "kill",
            "round": 1,
            "ranks": 1,
            "detection_s": 0.5,
            "regroup_s": 2.0,  # 8.0 -> the first step of round 1 at 10.0
            "rejoin_s": 1.2,  # as the rank said it
            "rollback_s": 0.3,
            "first_step_s": 0.1,  # its line at 9.9 -> the step at 10.0
            "recovery_s": 2.5,
            "lost_samples": 4,
            "lost_before_fault_samples": 4,
            "lost_work_s": 2.0,  # 4 samples at 2 per second
            "newcomer_s": 7.0,  # started again at the decision (8.0); both train at 15.0
            "join_pause_s": 3.0,  # the survivor's last step at 12.0 -> 15.0
            "join_rejoin_s": 0.5,
            "join_rollback_s": 0.2,
            "whole_again_s": 7.5,
        }
    )
    # a lost worker's newcomer starts when the benchmark starts it
    (lost,) = gp.fault_costs(
        [{"t": 7.5, "kind": "worker", "new_worker_t": 9.0}], steps, LINES, 2.0, workers=2
    )
    assert lost["newcomer_s"] == 6.0 and "rejoin_s" not in lost  # (no rank lines given)
    # a second fault before any new decision is given none
    both = gp.fault_costs(
        [{"t": 7.5, "kind": "kill"}, {"t": 7.8, "kind": "stop"}], steps, LINES, 2.0, workers=2
    )
    assert both[0]["round"] == 1 and set(both[1]) == {"t", "kind"}


def test_the_percentiles_and_the_split_of_the_lost_time():
    steps = gp.step_records(FILES)
    costs = gp.fault_costs([{"t": 7.5, "kind": "kill"}], steps, LINES, 2.0, workers=2)
    table = gp.percentiles(costs)
    assert table["kill"]["n"] == table["all"]["n"] == 1 and table["stop"]["n"] == 0
    assert table["kill"]["recovery_s"] == {"p50": 2.5, "p95": 2.5}
    assert table["stop"]["recovery_s"] is None
    assert gp.world_sizes(LINES, 2) == {0: 2, 1: 1, 2: 2}
    window = gp.committed_rate(steps, 0.0, 16.0)
    split = gp.loss_split(window, costs, steps, LINES, 0.0, 2.0, workers=2)
    # 16 s of window, 15 samples committed at 2 per second: 8.5 s of training lost; round 1
    # trained from 10.0 to 12.0 on 1 rank of 2: 1.0 s of it
    assert split == {
        "lost_s": 8.5,
        "recovery_s": 2.5,
        "stall_timeout_s": 0.0,
        "lost_work_s": 2.0,
        "join_pause_s": 3.0,
        "fewer_ranks_s": 1.0,
        "pace_s": 0.0,
        "in_world_pauses_s": 0.0,
        "slower_steps_s": 0.0,
    }
    # gaps inside a world: none of 1.5 s; of 0.5 s, the 6 of round 0 and the 2 of round 1
    assert gp.in_world_pauses(steps, 0.0, 16.0, 1.5) == (0, 0.0)
    assert gp.in_world_pauses(steps, 0.0, 16.0, 0.5) == (8, 8.0)
    # the machine's pace: a step a second in the whole worlds (round 2 has one step only)
    assert gp.step_time(steps, gp.world_sizes(LINES, 2), 0.0, 16.0, workers=2) == 1.0
    # against a fault-free run whose steps took 0.8 s, 16 * (1 - 0.8) s of the loss is pace
    paced = gp.loss_split(window, costs, steps, LINES, 0.0, 2.0, workers=2, base_step_s=0.8)
    assert paced["pace_s"] == pytest.approx(3.2)
    assert paced["slower_steps_s"] == pytest.approx(-3.2)
    # a fault-free run that spent a tenth of its window in pauses inside its world: this
    # one, with none over 1 s, gained 1.6 s of its 16 by that
    paused = gp.loss_split(window, costs, steps, LINES, 0.0, 2.0, 2, None, 0.1)
    assert paused["in_world_pauses_s"] == pytest.approx(-1.6)
    assert paused["slower_steps_s"] == pytest.approx(1.6)
    # a frozen rank's share is the run's stall timeout (--stall), once per freeze in the window
    frozen = [{**costs[0], "kind": "stop"}, {**costs[0], "kind": "stop", "t": 99.0}]
    for stall in (6.0, 3.0):
        split = gp.loss_split(window, frozen, steps, LINES, 0.0, 2.0, workers=2, stall_s=stall)
        assert split["stall_timeout_s"] == stall  # the one at t = 99 is after the window


ROOT = Path(__file__).resolve().parents[2]
PERFORMANCE = ROOT / "docs/performance.md"
RECORDS = ROOT / "benchmarks/records"
RUN = RECORDS / "goodput_deferred_join_2026-11-29.json"  # the full run the docs print
EAGER = RECORDS / "goodput_2026-11-29.json"  # the one before: a newcomer started in init()
POLLED = RECORDS / "goodput_polled_2026-11-29.json"  # the one before the workers' waits woke


def test_performance_md_prints_the_recorded_goodput_run():
    """docs/performance.md's goodput tables are markdown_tables of the recorded run, and
    its prose quotes the goodput of that run and of the run before, as recorded."""
    import json

    page = PERFORMANCE.read_text()
    runs = json.loads(RUN.read_text())["runs"]
    assert [r["period_s"] for r in runs] == [None, 60.0, 15.0]
    assert all(r["checks"]["passed"] for r in runs)
    for block in gp.markdown_tables(runs).split("\n\n"):
        assert block.strip() in page, block[:200]
    text = " ".join(page.split())

    def pct(run):
        return [f"{100 * r['goodput']:.1f} %" for r in json.loads(run.read_text())["runs"][1:]]

    now, eager, polled = pct(RUN), pct(EAGER), pct(POLLED)
    assert f"**{now[0]}** at one fault a minute" in text
    assert f"**{now[1]}** at one every 15 s" in text
    assert f"(before: {eager[0]} and {eager[1]} with the newcomer's Horovod start" in text
    assert f"and {polled[0]} and {polled[1]} with workers that looked" in text
    assert json.loads(RUN.read_text())["tf_data_autotune"] == "off"
    # the freezes' stall timeouts added back: what the faults found at once leave
    found_at_once = [
        r["goodput"] + r["loss"]["stall_timeout_s"] / r["window"]["window_s"] for r in runs[1:]
    ]
    stalls = [r["loss"]["stall_timeout_s"] / r["window"]["window_s"] for r in runs[1:]]
    assert (
        f"are {100 * stalls[0]:.1f} and {100 * stalls[1]:.1f} points; with them added back" in text
    )
    assert (
        f"the goodput is **{100 * found_at_once[0]:.1f} %** and **{100 * found_at_once[1]:.1f} %**"
        in text
    )
    assert found_at_once[0] >= 0.95 and found_at_once[1] >= 0.80  # the targets, for those
    # the lost work per fault, on average, against half the commit interval
    faults = [len(r["faults"]) for r in runs[1:]]
    lost = [r["loss"]["lost_work_s"] / n for r, n in zip(runs[1:], faults, strict=True)]
    assert faults == [10, 40]
    assert f"averaged {lost[0]:.2f} and {lost[1]:.2f} s" in text
    assert f"({lost[0]:.2f} s on average at one fault a minute, {lost[1]:.2f} s at one" in text


def test_performance_md_quotes_the_run_with_a_3_s_stall_timeout():
    """The stall timeout's trade, measured: the --stall 3 run against the 6-s run."""
    import json

    text = " ".join(PERFORMANCE.read_text().split())
    three = json.loads((RECORDS / "goodput_stall3_2026-11-29.json").read_text())
    six = json.loads(EAGER.read_text())  # the run with 6 s under the same conditions
    assert (three["stall_timeout_s"], six["stall_timeout_s"]) == (3.0, 6)
    base, faults = three["runs"]
    assert base["checks"]["passed"] and faults["checks"]["passed"]
    assert base["checks"]["replay_worlds"] == 1  # no rank counted stalled without faults
    detected = [r["runs"][1]["per_kind"]["stop"]["detection_s"]["p50"] for r in (three, six)]
    assert f"a freeze found in {detected[0]:.1f} s (p50; {detected[1]:.1f} s with 6 s)" in text
    share = faults["loss"]["stall_timeout_s"] / faults["window"]["window_s"]
    assert f"the timeouts {100 * share:.1f} % of the window" in text
    clean = [r["runs"][1]["goodput_without_pauses"] for r in (three, six)]
    assert f"left out {100 * clean[0]:.1f} % ({100 * clean[1]:.1f} % with 6 s;" in text
    paused = [r["in_world_pauses"]["s"] for r in (base, faults)]
    assert f"goodput column, {100 * faults['goodput']:.1f} %, does not compare" in text
    assert f"took {paused[0]:.1f} s of its fault-free run's 300 s and {paused[1]:.1f} s" in text

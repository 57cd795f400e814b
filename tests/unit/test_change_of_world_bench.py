"""benchmarks/change_of_world.py's split of a change of world, on a hand-made phase log
(the lines hvdkit/_phases.py adds with HVDKIT_PHASE_LOG), and the log itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import change_of_world as cw  # noqa: E402


def ev(t, pid, phase, rnd, size=None):
    return {"t": t, "pid": pid, "phase": phase, "rank": None, "size": size, "round": rnd}


LOG = [
    # round 0: ranks 1, 2, 3
    *[ev(0.0, p, "init", 0, 3) for p in (1, 2, 3)],
    *[ev(9.8, p, "step", 0, 3) for p in (1, 2)],
    # a loss: 3 dies; 1 and 2 leave, meet and start in round 1
    ev(10.0, 1, "leave", 0, 3),
    ev(10.1, 2, "leave", 0, 3),
    ev(10.1, 1, "meet", 1, 2),
    ev(10.15, 2, "meet", 1, 2),
    ev(10.2, 1, "init", 1, 2),
    ev(10.25, 2, "init", 1, 2),
    ev(10.4, 1, "rollback", 1, 2),
    ev(10.45, 2, "rollback", 1, 2),
    ev(10.7, 1, "reshard", 1, 2),
    ev(10.6, 2, "reshard", 1, 2),
    ev(11.2, 1, "first_step", 1, 2),
    ev(11.25, 2, "first_step", 1, 2),
    # a join: newcomer 4 in round 2
    ev(19.9, 4, "meet", 2, 3),
    ev(20.0, 1, "step", 1, 2),
    ev(20.02, 2, "step", 1, 2),
    ev(20.1, 1, "leave", 1, 2),
    ev(20.12, 2, "leave", 1, 2),
    *[ev(20.13, p, "meet", 2, 3) for p in (1, 2)],
    ev(20.3, 1, "init", 2, 3),
    ev(20.31, 2, "init", 2, 3),
    ev(20.3, 4, "init", 2, 3),
    ev(20.55, 4, "restore", 2, 3),
    ev(20.6, 1, "rollback", 2, 3),
    ev(20.58, 2, "rollback", 2, 3),
    ev(20.8, 1, "reshard", 2, 3),
    ev(20.85, 2, "reshard", 2, 3),
    ev(21.5, 1, "first_step", 2, 3),
    ev(21.52, 2, "first_step", 2, 3),
    ev(21.5, 4, "first_step", 2, 3),
    # round 3 never trains: 2 is lost before its first step
    *[ev(30.0, p, "leave", 2, 3) for p in (1, 2, 4)],
    *[ev(30.2, p, "init", 3, 3) for p in (1, 2, 4)],
    *[ev(30.4, p, "rollback", 3, 3) for p in (1, 2, 4)],
    *[ev(30.6, p, "reshard", 3, 3) for p in (1, 2, 4)],
    ev(31.0, 1, "first_step", 3, 3),
]


def test_a_loss_and_a_join_split_at_the_last_rank_to_reach_each_phase():
    found = cw.changes(sorted(LOG, key=lambda e: e["t"]))
    assert [(c["round"], c["kind"], c["ranks"]) for c in found] == [(1, "loss", 2), (2, "join", 3)]
    loss, join = found
    expected_loss = {"meeting": 0.15, "horovod_start": 0.2, "state": 0.25, "first_step": 0.55}
    expected_join = {"meeting": 0.19, "horovod_start": 0.29, "state": 0.25, "first_step": 0.67}
    for got, want, total in ((loss, expected_loss, 1.15), (join, expected_join, 1.40)):
        assert {k: round(got[k], 6) for k in want} == pytest.approx(want)
        assert got["total"] == pytest.approx(total)
        assert sum(got[k] for k in cw.SEGMENTS) == pytest.approx(got["total"])
    assert "last_step_to_leave" not in loss
    assert join["last_step_to_leave"] == pytest.approx(0.10)


def test_the_summary_and_the_table():
    summ = cw.summary(cw.changes(sorted(LOG, key=lambda e: e["t"])))
    assert summ["loss"]["n"] == summ["join"]["n"] == 1
    assert summ["join"]["state"] == {"p50": pytest.approx(0.25), "p95": pytest.approx(0.25)}
    table = cw.markdown_table(summ, 0.24).splitlines()
    cells = "0.15 / 0.15 | 0.20 / 0.20 | 0.25 / 0.25 | 0.55 / 0.55 | 1.15 / 1.15 | –"
    assert table[2] == f"| loss | 1 | {cells} | 0.24 |"
    assert table[3].startswith("| join | 1 | 0.19 / 0.19 | 0.29 / 0.29 |")


def test_the_steady_step_is_the_median_gap_of_one_rank_in_the_window():
    steps = [ev(t, 7, "step", 5, 4) for t in (1.0, 1.22, 1.45, 1.67, 9.0)]
    steps += [ev(1.1, 8, "step", 5, 3), ev(1.3, 8, "step", 5, 3)]  # another size
    assert cw.steady_step_s(steps, 0.0, 2.0) == pytest.approx(0.22)
    assert cw.steady_step_s(steps, 5.0, 6.0) is None


def test_read_log_skips_a_line_cut_by_a_killed_process(tmp_path):
    path = tmp_path / "phases.jsonl"
    path.write_text(json.dumps(ev(2.0, 1, "init", 0)) + "\n" + '{"t": 1.0, "pi' + "\n")
    assert cw.read_log(path) == [ev(2.0, 1, "init", 0)]


def test_every_process_adds_its_phases_to_the_log(tmp_path):
    """hvdkit._phases with HVDKIT_PHASE_LOG: a line per phase entered, the first step
    of a round named so; no trap folder needed."""
    log = tmp_path / "phases.jsonl"
    code = (
        "from hvdkit import _phases\n"
        "assert _phases.ACTIVE\n"
        "for phase in ('init', 'step', 'step', 'save'):\n"
        "    _phases.enter(phase)\n"
    )
    env = {"HVDKIT_PHASE_LOG": str(log), "HVDKIT_RESTART_COUNT": "3", "HOROVOD_RANK": "1"}
    env |= {"HOROVOD_SIZE": "2", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=ROOT)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [(x["phase"], x["rank"], x["size"], x["round"]) for x in lines] == [
        ("init", 1, 2, 3),
        ("first_step", 1, 2, 3),
        ("step", 1, 2, 3),
        ("save", 1, 2, 3),
    ]
    assert len({x["pid"] for x in lines}) == 1


def test_performance_md_prints_the_recorded_split_and_quotes_it():
    records = ROOT / "benchmarks/records"
    now = json.loads((records / "change_of_world_2026-11-29.json").read_text())
    before = json.loads((records / "change_of_world_per_variable_2026-11-29.json").read_text())
    assert now["checks"]["passed"] and before["checks"]["passed"]
    assert now["summary"]["loss"]["n"] >= 10 and now["summary"]["join"]["n"] >= 10
    page = (ROOT / "docs/performance.md").read_text()
    assert cw.markdown_table(now["summary"], now["step_s"]) in page
    text = " ".join(page.split())
    s, b, step = now["summary"], before["summary"], now["step_s"]

    def p50(summ, kind, name):
        return f"{summ[kind][name]['p50']:.2f}"

    assert f"ready and go ({p50(s, 'loss', 'meeting')}–{p50(s, 'join', 'meeting')} s;" in text
    assert (
        f"takes {p50(s, 'loss', 'horovod_start')} s with 3 ranks and "
        f"{p50(s, 'join', 'horovod_start')} s with 4" in text
    )
    assert f"takes {p50(s, 'loss', 'state')} s at a loss and {p50(s, 'join', 'state')} s" in text
    assert f"it took {p50(b, 'loss', 'state')} and {p50(b, 'join', 'state')} s" in text
    trace = [s[k]["first_step"]["p50"] - step for k in ("loss", "join")]
    assert f"one step ({step:.2f} s) and {trace[0]:.2f} s (a loss) to {trace[1]:.2f} s" in text
    assert f"({p50(s, 'join', 'last_step_to_leave')} s from it to the leave)" in text


def test_a_phase_log_that_cannot_be_written_is_said_once_and_training_goes_on(
    tmp_path, monkeypatch, capsys
):
    from hvdkit import _phases

    monkeypatch.setattr(_phases, "_log", str(tmp_path / "no-such-folder" / "phases.jsonl"))
    monkeypatch.setattr(_phases, "_folder", None)
    _phases.enter("init", 0, 2)
    _phases.enter("save", 0, 2)
    err = capsys.readouterr().err
    assert err.count("HVDKIT_PHASE_LOG=") == 1 and "cannot be written" in err
    assert _phases._log is None

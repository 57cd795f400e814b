"""benchmarks/scale_model.py: the model's arithmetic on a small fixture of the three
records it reads, and docs/performance.md's model and control plane tables as printed
from the recorded runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import control_plane  # noqa: E402
import scale_model as sm  # noqa: E402

PERFORMANCE = ROOT / "docs/performance.md"


def fault(kind: str, recovery: float, join: float, lost: float, newcomer: float) -> dict:
    return {
        "kind": kind,
        "recovery_s": recovery,
        "join_pause_s": join,
        "lost_work_s": lost,
        "newcomer_s": newcomer,
    }


@pytest.fixture
def records(tmp_path):
    """Two goodput runs (kills, lost workers and a freeze whose numbers must not count),
    a control plane run at 16/64/256/1,000 and rendezvous runs (1,000 ranks three times)."""
    runs = [
        {"period_s": None, "faults": []},
        {"period_s": 60.0, "faults": [fault("kill", 1.0, 2.0, 0.4, 5.0),
                                      fault("stop", 9.0, 9.0, 9.0, 9.0),
                                      fault("worker", 0.8, 1.6, 0.6, 4.0)]},
        {"period_s": 15.0, "faults": [fault("kill", 1.2, 2.2, 0.5, 6.0),
                                      fault("stop", 9.0, 9.0, 9.0, 9.0)]},
    ]  # fmt: skip
    goodput = tmp_path / "goodput.json"
    goodput.write_text(json.dumps({"runs": runs}))
    control = tmp_path / "control.json"
    go = {16: 0.1, 64: 0.3, 256: 0.5, 1000: 2.0}
    control.write_text(json.dumps({"rows": [{"n": n, "go_s": s} for n, s in go.items()]}))
    after = [{"n": 3, "world_s": 0.05}, {"n": 64, "world_s": 0.45}, {"n": 300, "world_s": 2.0}]
    rendezvous = tmp_path / "rendezvous.json"
    rendezvous.write_text(json.dumps({"runs": [
        {"label": "before", "rows": [{"n": 64, "world_s": 99.0}]},
        {"label": "after", "rows": [*after, {"n": 1000, "world_s": 7.0}]},
        {"label": "after", "rows": [{"n": 1000, "world_s": 9.0}]},
        {"label": "after", "rows": [{"n": 1000, "world_s": 8.0}]},
        {"label": "what-if-no-delete", "rows": [{"n": 1000, "world_s": 1.0}]},
    ]}))  # fmt: skip
    return goodput, control, rendezvous


def test_the_inputs_are_the_p50_of_the_faults_found_at_once(records):
    m = sm.Model.from_records(*records)
    # kills and lost workers of both runs: recovery 1.0, 0.8, 1.2 -> 1.0; the freezes left out
    assert (m.r, m.j, m.w, m.t) == (1.0, 2.0, 0.5, 5.0)
    assert m.control == {16: 0.1, 64: 0.3, 256: 0.5, 1000: 2.0}
    # the "after" runs only; 1,000 ranks as the median of its three runs
    assert m.rendezvous == {3: 0.05, 64: 0.45, 300: 2.0, 1000: 8.0}


def test_a_failure_costs_two_changes_of_world_the_lost_work_and_a_share_of_the_newcomers_start(
    records,
):
    m = sm.Model.from_records(*records)
    # at 4 ranks: C(4) is C(16), G(4) is G(3): nothing added
    assert m.per_failure(4) == pytest.approx(0.5 + 1.0 + 2.0 + (5.0 - 1.0 - 2.0) / 4)
    # at 64: C adds 0.3 - 0.1, G adds 0.45 - 0.05, to each of the two changes of world
    assert m.per_failure(64) == pytest.approx(0.5 + 1.6 + 2.6 + 2.0 / 64)
    assert m.goodput(64, 1 / 60) == pytest.approx(1 - (4.7 + 2.0 / 64) / 60)
    # at 300, C on the line from 256 to 1,000: 0.5 + 44/744 * 1.5
    c300 = 0.5 + 44 / 744 * 1.5
    assert m.c(300) == pytest.approx(c300)
    assert m.per_failure(300) == pytest.approx(0.5 + 2 * (c300 - 0.1 + 2.0 - 0.05) + 3.0 + 2 / 300)
    # as fast as at 4: only the share of the newcomer's start changes with N
    assert m.per_failure(1000, as_at_4=True) == pytest.approx(3.5 + 2.0 / 1000)
    # more lost per failure than the period: nothing committed, never negative
    assert m.per_failure(1000) > 15 and m.goodput(1000, 1 / 15) == 0.0


def test_performance_md_prints_the_model_of_the_recorded_runs():
    page = PERFORMANCE.read_text()
    m = sm.Model.from_records()
    assert sm.markdown_table(m) in page
    text = " ".join(page.split())
    for name, value in (("w", m.w), ("r", m.r), ("j", m.j), ("t", m.t)):
        assert f"{name} = {value:.2f} s" in text, name
    assert (
        f"At 4 ranks the model gives {sm._pct(m.goodput(4, 1 / 60))} and "
        f"{sm._pct(m.goodput(4, 1 / 15))} for failures found at once" in text
    )
    assert f"minute ({sm._pct(m.goodput(300, 1 / 60))}) is above TorchFT's 81.2 %" in text
    assert f"every 15 s ({sm._pct(m.goodput(300, 1 / 15))}) above its 13.4 %" in text


def test_performance_md_prints_the_recorded_control_plane_run():
    rows = json.loads(sm.CONTROL_PLANE.read_text())["rows"]
    assert [r["n"] for r in rows] == [16, 64, 256, 1000]
    assert all(r["worker_errors"] == [] for r in rows)
    assert control_plane.markdown_table(rows) in PERFORMANCE.read_text()

"""benchmarks/epoch_end.py's pure parts (the autotuner's period ends, a variant's summary)
and docs/limits.md's paragraph on fit's late return, quoted from the recorded runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import epoch_end  # noqa: E402

RECORDS = ROOT / "benchmarks/records"
LIMITS = ROOT / "docs/limits.md"


@pytest.mark.parametrize(
    ("age_s", "end_ms"),
    [(0.005, 10), (0.01, 10), (0.011, 30), (3.0, 5110), (5.1, 5110), (12.2, 20470)],
)
def test_the_autotuner_periods_end_at_10_ms_times_2_to_the_k_minus_1(age_s, end_ms):
    # 10, 20, 40, ... ms periods, one after the other: they end at 10, 30, 70, ..., 5110, ...
    assert epoch_end.period_end_ms(age_s) == end_ms


def test_a_variants_summary_counts_the_returns_that_waited():
    epochs = [
        {"epoch": 0, "wait_s": 0.001, "age_s": 3.07},
        {"epoch": 1, "wait_s": 2.03, "age_s": 5.106},
        {"epoch": 2, "wait_s": 0.002, "age_s": 3.08},
        {"epoch": 3, "wait_s": 0.6, "age_s": 2.547},
    ]
    s = epoch_end.summarize(epochs)
    assert (s["epochs"], s["waits"], s["wait_s"]) == (4, 2, [0.6, 2.03])
    assert s["median_return_s"] == pytest.approx((0.002 + 0.6) / 2)
    # 5.106 s is 4 ms before the period end at 5110 ms; 2.547 s is 3 ms before 2550 ms
    assert s["off_period_end_ms"] == [-4, -3]


def test_limits_md_quotes_the_recorded_runs():
    run = json.loads((RECORDS / "epoch_end_2026-11-29.json").read_text())
    on, off = run["summary"]["on"], run["summary"]["off"]
    assert run["args"]["batches"] * run["args"]["step_sleep"] == pytest.approx(3.0)
    assert on["waits"] > 0 and off["waits"] == 0  # the finding itself
    assert all(abs(ms) <= 10 for ms in on["off_period_end_ms"])  # at a period's end
    text = " ".join(LIMITS.read_text().split())
    waits = f"{min(on['wait_s']):.2f}–{max(on['wait_s']):.2f} s"
    assert f"{on['waits']} of {on['epochs']} three-second epochs returned {waits} late" in text
    assert f"none of {off['epochs']} with" in text
    twelve = json.loads((RECORDS / "epoch_end_12s_2026-11-29.json").read_text())
    on12, off12 = twelve["summary"]["on"], twelve["summary"]["off"]
    assert twelve["args"]["batches"] * twelve["args"]["step_sleep"] == pytest.approx(12.0)
    assert off12["waits"] == 0 and all(abs(ms) <= 10 for ms in on12["off_period_end_ms"])
    waits = f"{min(on12['wait_s']):.2f}–{max(on12['wait_s']):.2f} s"
    assert f"{on12['waits']} of {on12['epochs']} twelve-second epochs {waits} late" in text
    # the iterator's age at each late return: the period end the paragraph names
    for record, said in ((run, "each as its iterator turned {} s old"), (twelve, "late (at {} s)")):
        late = [e for e in record["runs"]["on"] if e["wait_s"] > epoch_end.WAIT_S]
        ends = {epoch_end.period_end_ms(e["age_s"] - 0.05) for e in late}
        assert len(ends) == 1 and said.format(f"{ends.pop() / 1000:.2f}") in text, ends

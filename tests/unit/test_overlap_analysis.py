"""benchmarks/overlap.py's analysis of a run, on rounds computed by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import overlap

ROUND = {  # seconds per step; backward = 0.6 - 0.2 = 0.4, hideable = min(0.3, 0.4) = 0.3
    "forward": 0.2,
    "compute": 0.6,
    "allreduce": 0.3,
    "raw_horovod": 0.7,
    "tape_default": 0.69,
    "fit_default": 0.72,
}
FIT_CONTROLS = {"fit_compute": 0.65, "fit_raw_horovod": 0.75}


def test_fit_rows_are_set_against_fit_compute_and_raw_horovod_in_fit():
    got = overlap.summarise({"rounds": [{**ROUND, **FIT_CONTROLS}]})
    assert got["hidden"]["tape_default"] == pytest.approx((0.6 + 0.3 - 0.69) / 0.3)
    assert got["hidden"]["fit_default"] == pytest.approx((0.65 + 0.3 - 0.72) / 0.3)
    assert got["over_raw"]["tape_default"] == pytest.approx(0.7 / 0.69)
    assert got["over_raw"]["fit_default"] == pytest.approx(0.75 / 0.72)
    assert got["over_raw_tape"]["fit_default"] == pytest.approx(0.7 / 0.72)
    assert got["over_raw"]["fit_raw_horovod"] == pytest.approx(1.0)
    assert "fit_compute" not in got["hidden"]  # a control, not a variant
    assert got["backward_s"] == pytest.approx(0.4)


def test_runs_without_the_fit_controls_use_the_tape_ones():
    got = overlap.summarise({"rounds": [ROUND]})
    assert got["hidden"]["fit_default"] == pytest.approx((0.6 + 0.3 - 0.72) / 0.3)
    assert got["over_raw"]["fit_default"] == pytest.approx(0.7 / 0.72)


def test_each_round_is_set_against_its_own_references_then_the_median():
    slow = {k: 2 * v for k, v in {**ROUND, **FIT_CONTROLS}.items()}  # a round twice as slow
    fast = {**ROUND, **FIT_CONTROLS, "fit_default": 0.70}
    got = overlap.summarise({"rounds": [{**ROUND, **FIT_CONTROLS}, slow, fast]})
    # the slow round's ratio is the same as the first's; the median is that ratio
    assert got["over_raw"]["fit_default"] == pytest.approx(0.75 / 0.72)
    assert got["median_s"]["fit_default"] == pytest.approx(0.72)


def test_a_round_without_anything_to_hide_is_refused():
    with pytest.raises(ValueError, match="allreduce=0"):
        overlap.hidden_fraction(0.6, 0.0, 0.4, 0.6)

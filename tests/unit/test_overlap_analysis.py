"""benchmarks/overlap.py's analysis of a run, on rounds computed by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import overlap
from _common import steal_share

from hvdkit.launch.transport import cpu_ticks

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


def test_a_job_on_a_stolen_or_noisy_machine_is_not_a_measurement():
    quiet = overlap.summarise({"rounds": [{**ROUND, "raw_horovod_b": 0.7 / 1.03}]})
    assert overlap.doubts(quiet, 0.01) == []
    assert overlap.doubts(quiet, None) == []  # steal unknown: no reason by itself
    assert overlap.doubts(quiet, 0.05) == []  # the limit itself passes
    assert overlap.doubts(quiet, 0.06) == ["the host took 6 % of the time (steal)"]
    noisy = overlap.summarise({"rounds": [{**ROUND, "raw_horovod_b": 0.7 / 1.14}]})
    assert noisy["over_raw"]["raw_horovod_b"] == pytest.approx(1.14)
    assert overlap.doubts(noisy, 0.0) == ["raw Horovod and its control 1.14x apart"]
    slow_raw = overlap.summarise({"rounds": [{**ROUND, "raw_horovod_b": 0.7 / 0.86}]})
    assert overlap.doubts(slow_raw, 0.3) == [
        "the host took 30 % of the time (steal)",
        "raw Horovod and its control 0.86x apart",
    ]
    # runs before the control existed are judged by steal alone
    assert overlap.doubts(overlap.summarise({"rounds": [ROUND]}), 0.0) == []


def test_steal_share_is_the_steal_ticks_over_all_ticks_between_two_readings():
    # user nice system idle iowait irq softirq steal: 100 ticks pass, 15 of them stolen
    assert steal_share([10, 0, 5, 80, 0, 0, 0, 5], [20, 0, 10, 150, 0, 0, 0, 20]) == 0.15
    assert steal_share([5] * 8, [5] * 8) is None  # no time passed
    assert steal_share(None, [1] * 8) is None
    assert steal_share([1] * 7, [2] * 7) is None  # a kernel without the steal column
    ticks = cpu_ticks()  # this Linux machine has /proc/stat
    assert ticks is not None and len(ticks) == 8 and all(t >= 0 for t in ticks)


def test_the_bound_leaves_the_first_layers_wire_time_exposed():
    # 2 ranks send 2 * 1/2 = all 12.5 MB of the bucket: 0.1 s at 1 Gbit/s; (0.3 - 0.1) / 0.3
    assert overlap.last_bucket_bound(0.3, 0.4, 12_500_000, 2, 1.0) == pytest.approx(0.2 / 0.3)
    # 4 ranks send 2 * 3/4 of it: 0.15 s; the backward pass (0.25 s) bounds what is hideable
    assert overlap.last_bucket_bound(0.3, 0.25, 12_500_000, 4, 1.0) == pytest.approx(0.15 / 0.25)
    assert overlap.last_bucket_bound(0.3, 0.1, 1_000, 2, 10.0) == 1.0  # at most 1
    with pytest.raises(ValueError, match="ranks=1"):
        overlap.last_bucket_bound(0.3, 0.4, 1_000, 1, 1.0)

"""The ring-allreduce model of benchmarks/multihost.py, on cases computed by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import multihost as mh


def test_ring_allreduce_time_by_hand():
    # 100 MB on 8 hosts at 1.25e9 B/s (10 Gbit/s), alpha 0.1 ms:
    # 2*7/8 * 1e8/1.25e9 = 0.14 s of bandwidth, 2*7 * 1e-4 = 0.0014 s of latency
    assert mh.ring_allreduce_seconds(100e6, 8, 1.25e9, 1e-4) == pytest.approx(0.1414, rel=1e-12)
    # 2 hosts: S/B + 2 alpha = 4e6/1e9 + 2*0.5e-3
    assert mh.ring_allreduce_seconds(4e6, 2, 1e9, 0.5e-3) == pytest.approx(0.005, rel=1e-12)
    # 128 hosts, latency only: 2*127 * 1e-3
    assert mh.ring_allreduce_seconds(0, 128, 1e9, 1e-3) == pytest.approx(0.254, rel=1e-12)
    assert mh.ring_allreduce_seconds(100e6, 1, 1e9, 1e-3) == 0.0


def test_step_adds_the_per_call_cost_and_one_negotiation_ring():
    # 0.002 + 0.1414 + 2*7*1e-4
    got = mh.step_allreduce_seconds(100e6, 8, 1.25e9, 1e-4, per_call=0.002)
    assert got == pytest.approx(0.1448, rel=1e-12)
    assert mh.step_allreduce_seconds(100e6, 1, 1.25e9, 1e-4, per_call=0.002) == 0.0


def test_scaling_efficiency_with_and_without_overlap():
    assert mh.scaling_efficiency(0.25, 0.1414) == pytest.approx(0.25 / 0.3914, rel=1e-12)
    # all of it hidden behind a backward pass of 2/3 * 0.25 s
    assert mh.scaling_efficiency(0.25, 0.1414, overlap_s=0.25 * 2 / 3) == 1.0
    assert mh.scaling_efficiency(0.25, 0.1414, overlap_s=0.1) == pytest.approx(
        0.25 / 0.2914, rel=1e-12
    )


def test_fit_recovers_bandwidth_and_per_call_cost():
    # 2 hosts, B = 1e8 B/s, c = 3 ms, alpha = 0.1 ms: T = c + S/B + 2*2*alpha
    sizes = [1e6, 4e6, 16e6]
    times = [0.003 + s / 1e8 + 4 * 1e-4 for s in sizes]
    fit = mh.fit_alpha_beta(sizes, times, 2, 1e-4)
    assert fit["bandwidth"] == pytest.approx(1e8, rel=1e-9)
    assert fit["per_call"] == pytest.approx(0.003, rel=1e-9)
    # 4 hosts: the slope is 2*3/4 / B, the intercept c + 2*2*3*alpha
    times4 = [0.003 + 1.5 * s / 1e8 + 12 * 1e-4 for s in sizes]
    fit4 = mh.fit_alpha_beta(sizes, times4, 4, 1e-4)
    assert fit4["bandwidth"] == pytest.approx(1e8, rel=1e-9)
    assert fit4["per_call"] == pytest.approx(0.003, rel=1e-9)


def test_largest_power_of_two_host_count_at_90_percent():
    # latency only: T = 2 * 2(n-1) * 1 ms = 4 ms * (n-1); >= 90 % of a 1 s step
    # while T <= 1/9 s, i.e. n <= 28: 16 hosts (0.943), not 32 (0.889)
    assert mh.hosts_at_efficiency(0.9, 1.0, 0.0, 1e9, 1e-3, 0.0) == 16
    # a constant 50 ms per step never drops below 0.952: the search stops at its limit
    assert mh.hosts_at_efficiency(0.9, 1.0, 0.0, 1e9, 0.0, 0.05, limit=64) == 64


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="bandwidth=0"):
        mh.ring_allreduce_seconds(1e6, 4, 0, 1e-4)
    with pytest.raises(ValueError, match="distinct x"):
        mh.fit_line([1.0, 1.0], [2.0, 3.0])
    with pytest.raises(ValueError, match="slope"):
        mh.fit_alpha_beta([1e6, 2e6], [0.01, 0.005], 2, 0.0)


def _run(transport, link, scale, hosts=2):
    """A run of the benchmark's JSON whose times are ``scale`` x (1 ms per MB + 2 ms)."""
    seconds = {
        c: {s: scale * (1e-3 * mb + 2e-3) for s, mb in (("1M", 1), ("4M", 4))}
        for c in mh.COMPRESSIONS
    }
    run = {"hosts": hosts, "link": link, "probe": {"rtt_s": 40e-6}, "seconds": seconds}
    if transport is not None:
        run["transport"] = transport
    return run


def test_mpi_over_gloo_pairs_runs_by_hosts_and_link():
    runs = [_run("gloo", "veth", 1.0), _run("mpi", "veth", 0.5), _run("gloo", "1gbit", 1.0)]
    got = mh.mpi_over_gloo(runs, ["1M", "4M"])
    assert got == {
        "2/veth/none": {"1M": pytest.approx(0.5), "4M": pytest.approx(0.5)},
        "2/veth/fp16": {"1M": pytest.approx(0.5), "4M": pytest.approx(0.5)},
    }  # 1gbit has no MPI run: no ratio


def test_runs_without_a_transport_are_gloo_and_mpi_stays_out_of_the_gloo_fits():
    assert mh.transport_of(_run(None, "veth", 1.0)) == "gloo"
    sizes = ["1M", "4M"]
    gloo_only = mh.analyse([_run(None, "10gbit", 1.0)], sizes)
    both = mh.analyse([_run(None, "10gbit", 1.0), _run("mpi", "10gbit", 0.25)], sizes)
    assert both["fits"] == gloo_only["fits"]
    assert both["predictions"] == gloo_only["predictions"]
    assert gloo_only["mpi_fits"] == {} and gloo_only["mpi_predictions"] == []
    # MPI's own fit: 4x Gloo's bandwidth for a quarter of the time
    assert both["mpi_fits"]["2/10gbit/none"]["bandwidth"] == pytest.approx(
        4 * both["fits"]["2/10gbit/none"]["bandwidth"]
    )
    assert {r["link"] for r in both["mpi_predictions"]} == {"10gbit"}


def test_svg_text_is_escaped(tmp_path):
    import xml.etree.ElementTree as ET

    runs = [_run("gloo", "veth", 1.0), _run("mpi", "veth", 0.5)]
    analysis = mh.analyse(runs, ["1M", "4M"])
    path = tmp_path / "x.svg"
    mh.svg_plot(runs, ["1M", "4M"], analysis, path)
    root = ET.parse(path).getroot()  # a '<' left unescaped would not parse
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "< 1: MPI faster" in texts
    assert root.get("width") == "1320"  # the third panel is drawn

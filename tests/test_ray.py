"""hvdkit.ray.run on a real two-node Ray cluster (tests/ray_cluster.py).

One driver script (tests/multiproc/ray_driver.py) runs every case on the
head node; the test kills every process of node n2 (a lost node) when the
second training run holds at its checkpoint, and each test below asserts
one fact of what the driver saw.
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
import ray_cluster
from cluster_results import assert_frozen_rank_resumed, error, value

from hvdkit import config

from conftest import MULTIPROC

pytestmark = pytest.mark.skipif(
    ray_cluster.missing() is not None,
    reason=f"NOT TESTED: hvdkit.ray on a Ray cluster: {ray_cluster.missing()}",
)
DRIVER_TIMEOUT_S = 900
STALL_S = 8  # the driver's stall timeout: a frozen rank ends its attempt after it


@pytest.fixture(scope="module")
def seen():
    with ray_cluster.RayCluster() as cluster:
        result = cluster.hosts.root / "result.json"
        driver = cluster.driver(
            [str(MULTIPROC / "ray_driver.py"), str(cluster.shared), str(result)],
            "driver.log",
            {config.STALL_TIMEOUT: str(STALL_S)},
        )
        holding = cluster.shared / "killed" / "holding"
        frozen = cluster.shared / "frozen" / "holding"
        lost_at = stopped = None
        deadline = time.monotonic() + DRIVER_TIMEOUT_S
        try:
            while driver.poll() is None and time.monotonic() < deadline:
                if holding.exists() and lost_at is None:
                    cluster.hosts.kill_host("n2")
                    lost_at = time.monotonic()
                if frozen.exists() and stopped is None:
                    stopped = int(frozen.read_text().split()[1])
                    os.kill(stopped, signal.SIGSTOP)  # its actor: killed by the driver
                time.sleep(0.2)
        finally:
            if driver.poll() is None:
                driver.kill()
            driver.wait()
        got = json.loads(result.read_text()) if result.exists() else {}
        yield dict(
            got=got,
            lost=lost_at is not None,
            frozen=stopped,
            output=cluster.hosts.log("driver.log"),
            code=driver.returncode,
        )


def test_driver_ran_every_case_and_exited_0(seen):
    assert seen["code"] == 0, seen["output"][-4000:]
    assert list(seen["got"]) == [
        "whole_batch_2",
        "whole_batch_1",
        "uninterrupted",
        "killed",
        "frozen",
        "executor",
        "too_many",
        "bad_cpus",
        "unpicklable",
        "fn_raises",
        "unshipped_module",
    ]


def test_two_ranks_equal_one_process_on_the_whole_batch(seen):
    two, one = value(seen, "whole_batch_2"), value(seen, "whole_batch_1")
    assert len(two) == 2 and len(one) == 1
    for a, b in zip(two[0], two[1], strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    for a, b in zip(two[0], one[0], strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)


def test_two_ranks_spread_over_two_nodes_reach_the_demo_accuracy(seen):
    ranks = value(seen, "uninterrupted")
    assert [r["rank"] for r in ranks] == [0, 1] and {r["size"] for r in ranks} == {2}
    assert sorted(r["host"] for r in ranks) == ["n1", "n2"]
    assert [(r["local_rank"], r["local_size"]) for r in ranks] == [(0, 1), (0, 1)]
    assert ranks[0]["accuracy"] >= 0.95, ranks


def test_a_lost_node_ends_with_the_uninterrupted_weights_on_the_survivor(seen):
    assert seen["lost"], (
        "node n2 was never killed (no 'holding' marker: no rank of the first attempt ran on n2?)"
    )
    plain, resumed = value(seen, "uninterrupted"), value(seen, "killed")
    assert resumed[0]["resumed_from"] >= 5, resumed
    assert [r["host"] for r in resumed] == ["n1", "n1"]  # both on the node left
    assert [(r["local_rank"], r["local_size"]) for r in resumed] == [(0, 2), (1, 2)]
    assert [r["step"] for r in resumed] == [r["step"] for r in plain]
    assert {r["fingerprint"] for r in resumed} == {plain[0]["fingerprint"]}
    assert "hvdkit.ray: attempt 1 lost a rank (rank " in seen["output"]


def test_a_frozen_rank_ends_its_attempt_at_the_stall_timeout_and_the_job_resumes(seen):
    assert_frozen_rank_resumed(seen, STALL_S)
    assert seen["output"].count("hvdkit.ray: attempt 1 lost a rank") == 2  # killed, frozen


def test_ray_executor_keeps_its_world_across_runs(seen):
    assert value(seen, "executor") == [[2, 2], [0, 10]]


def test_more_workers_than_cpus_fails_within_seconds_naming_them(seen):
    entry = error(seen, "too_many")
    assert entry["type"] == "ConfigurationError"
    assert "needs 4 CPUs" in entry["error"] and "num_workers=4" in entry["error"]
    assert entry["seconds"] < 30  # a pending actor would otherwise wait for ever


def test_bad_argument_names_the_value(seen):
    entry = error(seen, "bad_cpus")
    assert entry["type"] == "ConfigurationError" and "cpus_per_worker=0" in entry["error"]


def test_unpicklable_fn_is_refused_naming_it_and_the_object(seen):
    entry = error(seen, "unpicklable")
    assert entry["type"] == "ConfigurationError", entry
    assert "hvdkit.ray cannot send <lambda>" in entry["error"] and "lock" in entry["error"]
    assert "inside fn" in entry["error"]


def test_the_functions_own_error_comes_back_and_is_not_retried(seen):
    entry = error(seen, "fn_raises")
    assert entry["type"] == "LaunchError"
    assert "ValueError: the function's own error, 42" in entry["error"]


def test_a_fn_from_a_module_the_workers_lack_names_it_and_the_fix_without_retrying(seen):
    entry = error(seen, "unshipped_module")
    assert entry["type"] == "LaunchError", entry
    assert "No module named 'user_mod_unshipped'" in entry["error"]
    assert "py_modules" in entry["error"] and "register_pickle_by_value" in entry["error"]

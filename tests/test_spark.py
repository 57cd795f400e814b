"""hvdkit.spark.run on a real two-node Spark standalone cluster (tests/spark_cluster.py).

One driver script (tests/multiproc/spark_driver.py), submitted with
spark-submit as a user would, runs every case in one Spark application; the
test kills the executor of node n2 when the second training run holds at its
checkpoint, and each test below asserts one fact of what the driver saw.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import numpy as np
import pytest
import spark_cluster
from cluster_results import assert_frozen_rank_resumed, error, value

from hvdkit import config

from conftest import MULTIPROC

pytestmark = pytest.mark.skipif(
    spark_cluster.missing() is not None,
    reason=f"NOT TESTED: hvdkit.spark on a Spark cluster: {spark_cluster.missing()}",
)
DRIVER_TIMEOUT_S = 900
STALL_S = 8  # the driver's stall timeout: a frozen rank ends its stage after it


@pytest.fixture(scope="module")
def seen():
    with spark_cluster.SparkCluster() as cluster:
        result = cluster.hosts.root / "result.json"
        log = open(cluster.hosts.root / "driver.log", "wb")
        driver = cluster.submit(
            str(MULTIPROC / "spark_driver.py"),
            [str(cluster.shared), str(result)],
            log,
            {config.STALL_TIMEOUT: str(STALL_S)},
        )
        holding = cluster.shared / "killed" / "holding"
        frozen = cluster.shared / "frozen" / "holding"
        killed: list[int] = []
        stopped = None
        deadline = time.monotonic() + DRIVER_TIMEOUT_S
        try:
            while driver.poll() is None and time.monotonic() < deadline:
                if holding.exists() and not killed:
                    killed = cluster.kill_executor("n2")
                if frozen.exists() and stopped is None:
                    stopped = int(frozen.read_text().split()[1])
                    os.kill(stopped, signal.SIGSTOP)  # the rank's process; its task ends it
                time.sleep(0.2)
        finally:
            if driver.poll() is None:
                driver.kill()
            driver.wait()
            log.close()
        output = (cluster.hosts.root / "driver.log").read_text(errors="replace")
        got = json.loads(result.read_text()) if result.exists() else {}
        yield dict(
            got=got,
            killed=killed,
            frozen=stopped,
            output=output,
            code=driver.returncode,
            report=cluster.report(),
        )


def test_driver_ran_every_case_and_exited_0(seen):
    assert seen["code"] == 0, seen["output"][-4000:]
    assert list(seen["got"]) == [
        "whole_batch_2",
        "whole_batch_1",
        "uninterrupted",
        "killed",
        "frozen",
        "default_num_proc",
        "dataframe",
        "too_many",
        "unpicklable",
        "fn_raises",
        "inside_task",
        "bad_num_proc",
        "unshipped_module",
    ]


def test_run_right_after_the_session_waits_for_the_executors_and_equals_one_process(seen):
    two = value(seen, "whole_batch_2")
    one = value(seen, "whole_batch_1")
    assert len(two) == 2 and len(one) == 1
    for a, b in zip(two[0], two[1], strict=True):  # both ranks end equal
        np.testing.assert_array_equal(np.array(a), np.array(b))
    for a, b in zip(two[0], one[0], strict=True):  # 2 ranks = 1 process on the whole batch
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)


def test_two_ranks_on_two_nodes_reach_the_demo_accuracy(seen):
    ranks = value(seen, "uninterrupted")
    assert [r["rank"] for r in ranks] == [0, 1]
    assert {r["size"] for r in ranks} == {2}
    assert sorted(r["host"] for r in ranks) == ["n1", "n2"]
    assert [(r["local_rank"], r["local_size"]) for r in ranks] == [(0, 1), (0, 1)]
    assert ranks[0]["accuracy"] >= 0.95, ranks
    assert ranks[0]["fingerprint"] == ranks[1]["fingerprint"]


def test_a_killed_executor_ends_with_the_uninterrupted_weights(seen):
    assert seen["killed"], (
        "the executor of n2 was never killed "
        "(no 'holding' marker: no rank of the first attempt ran on n2?)"
    )
    plain = value(seen, "uninterrupted")
    resumed = value(seen, "killed")
    assert resumed[0]["resumed_from"] >= 5, resumed  # a second attempt, from a checkpoint
    assert [r["step"] for r in resumed] == [r["step"] for r in plain]
    assert {r["fingerprint"] for r in resumed} == {plain[0]["fingerprint"]}
    # the retry's line names the lost rank and why: its executor, or (if its peer's task
    # failed first) the peer's lost collective (tests/unit/test_cluster_errors.py)
    said = r"hvdkit.spark: attempt 1 lost a rank \(rank [01](: ExecutorLostFailure| lost a peer)"
    assert re.search(said, seen["output"]), seen["output"][-3000:]
    # the retry waited for the replacement executor (tests/unit/test_spark_retry.py)
    assert "running the stage again once 2 task slots are back" in seen["output"]


def test_a_frozen_rank_ends_its_stage_at_the_stall_timeout_and_the_job_resumes(seen):
    assert_frozen_rank_resumed(seen, STALL_S)


def test_num_proc_defaults_to_the_clusters_parallelism(seen):
    assert value(seen, "default_num_proc") == [7, 7]  # two workers of one core


def test_each_rank_reads_its_own_files_of_a_dataframe(seen):
    (files0, ids0), (files1, ids1) = value(seen, "dataframe")
    assert files0 == files1 == 4
    assert len(ids0) + len(ids1) == 40 and sorted(ids0 + ids1) == list(range(40))


def test_num_proc_above_the_slots_names_them_within_seconds(seen):
    entry = error(seen, "too_many")
    assert entry["type"] == "ConfigurationError"
    assert "needs 3 task slots" in entry["error"] and "the cluster has 2" in entry["error"]
    assert "num_proc <= 2" in entry["error"]
    assert entry["seconds"] < 60  # Spark's own barrier check retries for minutes


def test_unpicklable_fn_is_refused_before_anything_starts(seen):
    entry = error(seen, "unpicklable")
    assert entry["type"] == "ConfigurationError"
    assert "cannot send" in entry["error"] and "lock" in entry["error"]


def test_the_functions_own_error_comes_back_with_its_traceback_and_no_retry(seen):
    entry = error(seen, "fn_raises")
    assert entry["type"] == "LaunchError"
    assert "fn raised on rank" in entry["error"]
    assert "ValueError: the function's own error, 42" in entry["error"]
    # the killed and the frozen runs retried once each; the function's own error was not
    assert seen["output"].count("lost a rank") == 2, seen["output"][-3000:]


def test_run_inside_a_task_is_refused(seen):
    entry = error(seen, "inside_task")
    assert "inside a Spark task" in entry["error"]


def test_bad_num_proc_names_the_value(seen):
    entry = error(seen, "bad_num_proc")
    assert entry["type"] == "ConfigurationError"
    assert "num_proc=0" in entry["error"]


def test_a_fn_from_a_module_the_workers_lack_names_it_and_the_fix_without_retrying(seen):
    entry = error(seen, "unshipped_module")
    assert entry["type"] == "LaunchError", entry
    assert "No module named 'user_mod_unshipped'" in entry["error"]
    assert "--py-files" in entry["error"] and "register_pickle_by_value" in entry["error"]

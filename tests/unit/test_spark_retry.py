"""hvdkit.spark.run's wait for task slots, first attempt and retry, on a scripted clock.

The cluster is a fake SparkContext whose task slots follow a script of
(from second, slots); the waits' clock and sleep are the script's, so a wait of
minutes takes no wall-clock time and a loaded machine cannot change the outcome.
The real cluster runs in tests/test_spark.py.
"""

from __future__ import annotations

import pytest

from hvdkit.clusters import spark as hspark
from hvdkit.errors import ConfigurationError, LaunchError


class FakeCluster:
    """A SparkContext-like object whose task slots change at scripted seconds."""

    def __init__(self, *script: tuple[float, int]):
        self.now = 0.0
        self.script = list(script)
        self.conf = {"spark.task.cpus": "1", "spark.driver.host": "127.0.0.1"}

    def slots(self) -> int:
        return [count for since, count in self.script if since <= self.now][-1]

    def change(self, after_s: float, count: int) -> None:
        """From ``after_s`` seconds after now on, the cluster has ``count`` slots."""
        # a stable sort: of two changes at one second, the later one holds
        self.script = sorted([*self.script, (self.now + after_s, count)], key=lambda e: e[0])

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def getConf(self):  # pyspark's name
        return self.conf


@pytest.fixture
def cluster(monkeypatch):
    sc = FakeCluster((0.0, 2))
    monkeypatch.setattr(hspark, "_monotonic", lambda: sc.now)
    monkeypatch.setattr(hspark, "_sleep", sc.sleep)
    monkeypatch.setattr(hspark, "task_slots", lambda ctx: ctx.slots())
    return sc


LOST_FOR_S = 3 * hspark.SLOTS_SETTLED_S  # the replacement registers well after the settle time


@pytest.mark.parametrize("left", [1, 0])  # one of two executors lost, or both
def test_a_retry_waits_past_the_settle_time_for_the_lost_executors_slots(cluster, left):
    cluster.change(0.0, left)
    cluster.change(LOST_FOR_S, 2)
    assert hspark._wait_for_slots(cluster, 2, timeout_s=600.0, retry=True) == 2
    assert cluster.now == LOST_FOR_S  # it looked until the slots came back, not longer


def test_a_first_attempt_with_the_same_slots_refuses_once_they_settle(cluster):
    cluster.change(0.0, 1)
    cluster.change(LOST_FOR_S, 2)
    with pytest.raises(ConfigurationError) as err:
        hspark._wait_for_slots(cluster, 2, timeout_s=600.0)
    assert cluster.now == hspark.SLOTS_SETTLED_S == 10.0
    text = str(err.value)
    assert "needs 2 task slots" in text and "the cluster has 1" in text
    assert "unchanged for 10 s" in text and "num_proc <= 1" in text


def test_a_retrys_slots_that_never_come_back_fail_at_start_timeout_naming_it(cluster):
    cluster.change(0.0, 1)
    with pytest.raises(LaunchError) as err:
        hspark._wait_for_slots(cluster, 2, timeout_s=45.0, retry=True)
    assert cluster.now == 45.0
    text = str(err.value)
    assert "needs 2 task slots again" in text and "the cluster has 1" in text
    assert "start_timeout=45 s" in text and "raise start_timeout" in text
    assert "not relaunched" in text


def test_run_retries_after_a_lost_executor_once_its_replacement_registers(
    cluster, monkeypatch, capsys
):
    """The CI failure: the replacement executor registered after the settle time."""
    pytest.importorskip("pyspark")  # run pickles fn with pyspark's cloudpickle
    monkeypatch.setattr(hspark, "_spark_context", lambda: cluster)
    started: list[float] = []

    def one_stage(sc, spec, num_proc, relay):
        started.append(sc.now)
        if len(started) == 1:  # an executor dies; Spark's master starts a new one, slowly
            sc.change(0.0, 1)
            sc.change(LOST_FOR_S, 2)
            raise hspark._StageLost("ExecutorLostFailure (executor 1 exited)")
        return list(range(num_proc))

    monkeypatch.setattr(hspark, "_one_stage", one_stage)
    assert hspark.run(print, num_proc=2, start_timeout=600) == [0, 1]
    assert started == [0.0, LOST_FOR_S]
    err = capsys.readouterr().err
    assert "attempt 1 lost a rank (ExecutorLostFailure (executor 1 exited))" in err
    assert "once 2 task slots are back, within 600 s (3 more attempts allowed)" in err

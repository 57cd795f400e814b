"""hvdkit.clusters' pure parts, in one process: the world's places, the checks, the waits.

The engines themselves run in tests/test_spark.py and tests/test_ray.py on real clusters.
"""

from __future__ import annotations

import pytest

from hvdkit.clusters import _call, _world
from hvdkit.clusters import ray as hray
from hvdkit.clusters import spark as hspark
from hvdkit.errors import CollectiveError, CollectiveMismatchError, ConfigurationError


@pytest.mark.parametrize(
    "hosts, expected",
    [
        (["a"], [(0, 0, 1, 0, 1)]),
        (["a", "b"], [(0, 0, 1, 0, 2), (1, 0, 1, 1, 2)]),
        (["a", "a", "b"], [(0, 0, 2, 0, 2), (1, 1, 2, 0, 1), (2, 0, 1, 1, 2)]),
        # ranks of a host need not be consecutive (Spark's partitions, Ray's bundles)
        (
            ["a", "b", "a", "b"],
            [(0, 0, 2, 0, 2), (1, 0, 2, 1, 2), (2, 1, 2, 0, 2), (3, 1, 2, 1, 2)],
        ),
    ],
)
def test_places_number_ranks_per_host_and_across_hosts(hosts, expected):
    got = [
        (p.rank, p.local_rank, p.local_size, p.cross_rank, p.cross_size)
        for p in _world.places(hosts)
    ]
    assert got == expected
    assert {p.size for p in _world.places(hosts)} == {len(hosts)}
    # every (cross_rank, local_rank) pair is a distinct rank: Horovod's communicators
    pairs = {(p.cross_rank, p.local_rank) for p in _world.places(hosts)}
    assert len(pairs) == len(hosts)


def test_a_loopback_host_among_several_machines_is_refused_naming_it():
    with pytest.raises(ConfigurationError, match=r"'localhost' \(127.0.0.1\), a loopback.*FIX"):
        _world.check_reachable(["10.0.0.2", "localhost"], ["10.0.0.2", "127.0.0.1"], "FIX")
    _world.check_reachable(["localhost", "localhost"], ["127.0.0.1", "127.0.0.1"], "FIX")  # one
    _world.check_reachable(["a", "b"], ["10.0.0.2", "10.0.0.3"], "FIX")


def test_an_unreachable_rendezvous_is_an_error_naming_it_not_a_hang(monkeypatch):
    monkeypatch.setattr(_world, "POLL_S", 0.0)
    with pytest.raises(ConfigurationError, match=r"127.0.0.1:1 did not answer within 0 s.*HOW"):
        _world.local_address_towards("127.0.0.1", 1, 0.0, "HOW")


def test_errors_are_sorted_into_lost_peer_and_the_functions_own():
    assert _call.kind_of(CollectiveError("a peer was lost")) == _call.LOST_PEER
    assert _call.kind_of(CollectiveMismatchError("shapes differ")) == _call.FN_ERROR
    assert _call.kind_of(ValueError("boom")) == _call.FN_ERROR
    assert _call.kind_of(RuntimeError("Horovod has been shut down")) == _call.LOST_PEER


def test_a_lost_peer_is_named_by_what_was_raised_not_the_last_line():
    trace = (
        'Traceback (most recent call last):\n  File "x.py", line 1, in f\n'
        "hvdkit.errors.CollectiveError: a peer was lost: connection closed\n"
        "\t [[{{node hvdkit.gradients.one_step_on_data.0.0}}]] [Op:__inference_step]\n"
    )
    assert (
        _call.summary(trace) == "hvdkit.errors.CollectiveError: a peer was lost: connection closed"
    )
    assert _call.summary("ValueError: boom") == "ValueError: boom"


class FakeContext:
    """A SparkContext whose task slots follow a script, one value per look."""

    def __init__(self, slots):
        self.looks = list(slots)

    def getConf(self):
        return {"spark.task.cpus": "1"}


@pytest.fixture
def fake_slots(monkeypatch):
    monkeypatch.setattr(hspark, "SLOT_POLL_S", 0.0)
    monkeypatch.setattr(
        hspark, "task_slots", lambda sc: sc.looks.pop(0) if len(sc.looks) > 1 else sc.looks[0]
    )


def test_run_waits_while_executors_register(fake_slots):
    sc = FakeContext([0, 0, 1, 1, 2])
    assert hspark._wait_for_slots(sc, 2, timeout_s=60) == 2
    assert sc.looks == [2]  # it looked until the second slot came


def test_num_proc_above_settled_slots_fails_naming_them(fake_slots, monkeypatch):
    monkeypatch.setattr(hspark, "SLOTS_SETTLED_S", 0.0)
    with pytest.raises(ConfigurationError) as err:
        hspark._wait_for_slots(FakeContext([1]), 3, timeout_s=60)
    text = str(err.value)
    assert "num_proc=3" in text and "the cluster has 1" in text and "num_proc <= 1" in text


def test_no_executor_within_start_timeout_fails(fake_slots):
    with pytest.raises(ConfigurationError, match=r"the cluster has 0.*after 0 s \(start_timeout\)"):
        hspark._wait_for_slots(FakeContext([0]), 1, timeout_s=0.0)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "2"])
def test_spark_counts_are_checked(bad):
    with pytest.raises(ConfigurationError, match=f"num_proc={bad!r}"):
        hspark._check_count("num_proc", bad, minimum=1, allow_none=True)


@pytest.mark.parametrize("bad", [0, -5, float("nan"), True])
def test_start_timeout_is_checked(bad):
    with pytest.raises(ConfigurationError, match="start_timeout"):
        hspark._start_timeout(bad)


def test_start_timeout_defaults_to_horovods_variable_then_600(monkeypatch):
    monkeypatch.delenv("HOROVOD_SPARK_START_TIMEOUT", raising=False)
    assert hspark._start_timeout(None) == 600.0
    monkeypatch.setenv("HOROVOD_SPARK_START_TIMEOUT", "42")
    assert hspark._start_timeout(None) == 42.0


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(num_workers=0), "num_workers=0"),
        (dict(num_workers=2, cpus_per_worker=0), "cpus_per_worker=0"),
        (dict(num_workers=2, gpus_per_worker=-1), "gpus_per_worker=-1"),
        (dict(num_workers=2, placement_strategy="RANDOM"), "placement_strategy='RANDOM'"),
        (dict(num_workers=2, start_timeout=0), "start_timeout=0"),
    ],
)
def test_ray_arguments_are_checked_before_any_actor_starts(kwargs, named):
    with pytest.raises(ConfigurationError, match=named.replace("(", r"\(")):
        hray.RayExecutor(**kwargs)


def test_ray_executor_takes_horovods_arguments_in_horovods_order():
    import inspect

    # horovod.ray.RayExecutor.__init__ of Horovod 0.28.1, in order
    horovods = ["settings", "num_workers", "num_hosts", "num_workers_per_host", "cpus_per_worker"]
    horovods += ["use_gpu", "gpus_per_worker", "use_current_placement_group"]
    assert list(inspect.signature(hray.RayExecutor).parameters)[:8] == horovods


def test_ray_executor_num_hosts_places_whole_hosts():
    ex = hray.RayExecutor(None, num_hosts=2, num_workers_per_host=3)
    assert (ex.num_workers, ex.per_bundle, ex.strategy) == (6, 3, "STRICT_SPREAD")
    assert (hray.RayExecutor(num_workers=4).strategy, hray.RayExecutor().num_workers) == (
        "SPREAD",
        1,
    )
    with pytest.raises(ConfigurationError, match=r"num_workers=2, num_hosts=2\): give one"):
        hray.RayExecutor(num_workers=2, num_hosts=2)
    with pytest.raises(ConfigurationError, match="num_workers_per_host=0"):
        hray.RayExecutor(num_hosts=2, num_workers_per_host=0)


def test_ray_executor_inside_another_placement_group_is_refused(monkeypatch):
    import types

    fake = types.SimpleNamespace(
        cluster_resources=lambda: {"CPU": 8.0},
        util=types.SimpleNamespace(get_current_placement_group=lambda: object()),
    )
    monkeypatch.setattr(hray, "_ray", lambda: fake)
    with pytest.raises(hray.NotSupportedError, match="use_current_placement_group=False"):
        hray.RayExecutor(num_workers=2).start()

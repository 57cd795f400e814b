"""hvdkit.ray.run's restarts and RayExecutor.start's clean-up, on a scripted Ray.

A rank can be lost while the ranks meet (a node dies between the placement
and the rendezvous), not only while ``fn`` runs: ``run`` must start again
then too, and a ``start`` that fails must leave no actor or placement group
behind. The real cluster runs in tests/test_ray.py.
"""

from __future__ import annotations

import types

import pytest

from hvdkit.clusters import ray as hray
from hvdkit.errors import LaunchError


@pytest.fixture
def scripted(monkeypatch):
    """RayExecutor's start/run/shutdown replaced by a script; the calls in order."""
    calls: list[str] = []
    starts = {"lost": 0}

    def start(self):
        calls.append("start")
        if starts["lost"]:
            starts["lost"] -= 1
            raise hray._RankLost("while starting: ActorDiedError")

    def run(self, fn, args=(), kwargs=None):
        calls.append("run")
        return [fn(*args), fn(*args)]

    monkeypatch.setattr(hray.RayExecutor, "start", start)
    monkeypatch.setattr(hray.RayExecutor, "run", run)
    monkeypatch.setattr(hray.RayExecutor, "shutdown", lambda self: calls.append("shutdown"))
    return calls, starts


def test_a_rank_lost_while_the_ranks_meet_starts_them_again(scripted):
    calls, starts = scripted
    starts["lost"] = 1
    assert hray.run(lambda x: x * 2, args=(21,), num_workers=2, verbose=0) == [42, 42]
    assert calls == ["start", "shutdown", "start", "run", "shutdown"]


def test_every_start_losing_a_rank_ends_in_launch_error_after_max_restarts(scripted):
    calls, starts = scripted
    starts["lost"] = 5
    with pytest.raises(LaunchError, match=r"lost a rank 2 times; the last time: while starting"):
        hray.run(lambda: 0, num_workers=2, max_restarts=1, verbose=0)
    assert calls == ["start", "shutdown", "start", "shutdown"]


class _RayError(Exception):
    pass


class _Ref:
    def __init__(self, ok: bool):
        self.ok = ok


class _Actor:
    """A Rank actor whose node is gone: every call's result raises."""

    def __getattr__(self, name):
        return types.SimpleNamespace(remote=lambda *a, **k: _Ref(False))


def _fake_ray(killed: list):
    def get(refs, timeout=None):
        if isinstance(refs, _Ref) and refs.ok:  # the placement group is ready
            return True
        raise exceptions.ActorDiedError("the actor's node died")

    exceptions = types.SimpleNamespace(
        RayError=_RayError,
        GetTimeoutError=type("GetTimeoutError", (_RayError,), {}),
        RayTaskError=type("RayTaskError", (_RayError,), {}),
        ActorDiedError=type("ActorDiedError", (_RayError,), {}),
    )
    actor_cls = types.SimpleNamespace(
        options=lambda **_: types.SimpleNamespace(remote=lambda: _Actor())
    )
    return types.SimpleNamespace(
        exceptions=exceptions,
        get=get,
        remote=lambda cls: actor_cls,
        kill=lambda actor, no_restart: killed.append(actor),
        cluster_resources=lambda: {"CPU": 3.0},
        available_resources=lambda: {"CPU": 3.0},
        util=types.SimpleNamespace(get_current_placement_group=lambda: None),
    )


def test_a_start_that_loses_an_actor_raises_launch_error_and_leaves_nothing(monkeypatch):
    pytest.importorskip("ray")
    import importlib

    ray_pg = importlib.import_module("ray.util.placement_group")  # the module, not its function

    killed: list = []
    removed: list = []
    group = types.SimpleNamespace(ready=lambda: _Ref(True))
    monkeypatch.setattr(hray, "_ray", lambda: _fake_ray(killed))
    monkeypatch.setattr(ray_pg, "placement_group", lambda bundles, strategy: group)
    monkeypatch.setattr(hray, "_remove_and_wait", lambda ray, pg, free: removed.append(pg))
    executor = hray.RayExecutor(num_workers=2)
    with pytest.raises(LaunchError, match="while starting: ActorDiedError"):
        executor.start()
    assert len(killed) == 2 and removed == [group]  # both actors stopped, the group freed
    assert executor._actors == [] and executor._pg is None

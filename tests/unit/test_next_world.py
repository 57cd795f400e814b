"""The one "on a lost peer, join the next world and try again" loop (hvdkit/fault/_next_world.py),
in one process: the rejoin is a stand-in that counts rounds, the runtime is size 1.

Its three users under the real launcher: Checkpointer.restore (tests/test_elastic_faults_mp.py,
tests/test_phases_mp.py), elastic.run's recovery and roll back (tests/test_elastic_mp.py,
tests/test_elastic_faults_mp.py) and Horovod's state classes (tests/test_elastic_horovod_api_mp.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hvdkit import config, runtime
from hvdkit.data import ShardSampler
from hvdkit.fault import _next_world
from hvdkit.fault._next_world import LostPeerWatch, retry
from hvdkit.fault.preemption import Regroup

LOST = "Horovod has been shut down"  # what a collective says once a peer was lost


@pytest.fixture
def world(local_runtime, monkeypatch, tmp_path):
    """An elastic job's rank in round 2; ``events`` records rejoins (with the watch's state)."""
    monkeypatch.setenv(config.ELASTIC_DIR, str(tmp_path))
    monkeypatch.setenv(config.RESTART_COUNT, "2")
    monkeypatch.setattr(LostPeerWatch, "ended", 4)  # the watch ended 4 connections
    monkeypatch.setattr(LostPeerWatch, "_recovering", False)
    events = []

    def rejoin():
        round_ = config.restart_count() + 1
        monkeypatch.setenv(config.RESTART_COUNT, str(round_))
        events.append(("rejoin", round_, LostPeerWatch._recovering))
        return round_

    monkeypatch.setattr(runtime, "rejoin", rejoin)
    return events


def test_a_lost_peer_is_said_left_joined_resharded_and_tried_again(world, capsys):
    with pytest.warns(UserWarning, match="differ from this job"):  # the old world's shards
        sampler = ShardSampler(12, 2, 0)
    sampler.advance(3)  # the job read list positions 0..5
    seen, left = [], []

    def attempt(move):
        seen.append(None if move is None else (move.number, move.round, move.old_size))
        if len(seen) < 3:
            raise RuntimeError(f"broadcast failed: {LOST}")
        return "done"

    result = retry(attempt, where="the restore", sampler=sampler, leave=left.append)
    assert result == "done"
    assert seen == [None, (1, 3, 1), (2, 4, 1)]
    assert world == [("rejoin", 3, True), ("rejoin", 4, True)]  # the watch stood aside
    assert [type(e).__name__ for e in left] == ["RuntimeError", "RuntimeError"]
    # size 1 now: one shard, the rest of the epoch from the job's cursor
    assert (sampler.num_shards, sampler.shard_id, sampler.start, sampler.position) == (1, 0, 6, 0)
    said = capsys.readouterr().err.splitlines()
    assert said == 2 * [
        "hvdkit: rank 0 of 1: a peer was lost during the restore (RuntimeError); "
        "it meets the next world"
    ]
    assert LostPeerWatch.ended is None  # a new world: the watch may end it again


def test_anything_else_is_raised_without_a_move(world):
    def attempt(move):
        raise ValueError("shapes differ")

    with pytest.raises(ValueError, match="shapes differ"):
        retry(attempt, where="the restore")
    assert world == []


def test_outside_an_elastic_job_a_lost_peer_is_raised(world, monkeypatch):
    monkeypatch.delenv(config.ELASTIC_DIR)

    def attempt(move):
        raise RuntimeError(LOST)

    with pytest.raises(RuntimeError, match=LOST):
        retry(attempt, where="the restore")
    assert world == []


def test_a_regroup_moves_quietly_only_where_asked(world, capsys):
    def attempt(move):
        if move is None:
            raise Regroup(7)
        return move

    with pytest.raises(Regroup):
        retry(attempt, where="the roll back")
    assert world == []
    move = retry(attempt, where="the roll back", regroup=True)
    assert (move.number, move.round, move.ended, move.why()) == (
        1,
        3,
        4,
        "a worker joined (the scheduler's word: a rank was lost; ended 4 connections)",
    )
    assert "a peer was lost" not in capsys.readouterr().err
    move.report("went on from step 7")
    assert capsys.readouterr().err == (
        "hvdkit: rank 0 of 1 is rank 0 of 1 (round 3) after a worker joined (the scheduler's "
        "word: a rank was lost; ended 4 connections); went on from step 7\n"
    )


def test_the_place_named_is_read_when_the_peer_is_lost(world, capsys):
    tries = []

    def attempt(move):
        tries.append(move)
        if len(tries) == 1:
            raise RuntimeError(LOST)

    retry(attempt, where=lambda: f"round {config.restart_count()}'s roll back")
    assert "a peer was lost during round 2's roll back (RuntimeError)" in capsys.readouterr().err
    assert _next_world.lost_peer(RuntimeError(LOST))


def test_one_loop_joins_the_next_world_and_one_place_reshards():
    """Issue 49 found three such loops (Checkpointer.restore, elastic's roll back and its
    loop for Horovod's states), the lost-peer line written twice, and "take the new world's
    shards" twice: each is now called in hvdkit/fault/_next_world.py alone."""
    package = Path(_next_world.__file__).resolve().parents[1]
    calls = {"rejoin": set(), "reshard": set(), "_say_lost": set()}
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", None))
                if name in calls:
                    calls[name].add(str(path.relative_to(package)))
    assert calls == {k: {"fault/_next_world.py"} for k in calls}, calls


def test_outside_an_elastic_job_a_sampler_sharded_unlike_the_world_is_left_as_built(
    local_runtime, monkeypatch
):
    """restore() goes through retry(): a sampler built with its own shards keeps them."""
    monkeypatch.delenv(config.ELASTIC_DIR, raising=False)
    with pytest.warns(UserWarning, match="differ from this job's size 1"):
        sampler = ShardSampler(12, 3, 2)  # a job of size 1 reading shard 2 of 3 on purpose
    assert retry(lambda move: move, sampler=sampler) is None
    assert (sampler.num_shards, sampler.shard_id) == (3, 2)

"""A newcomer to a running elastic job starts Horovod at its first collective, not in init()
(hvdkit/runtime.py: _DeferredStart, start_deferred).

The survivors leave their world when the newcomer says ready; said at init(), they waited
in the new world's first collective for everything the newcomer's script does before its
restore(). The multi-process side: tests/test_elastic_mp.py and tests/test_phases_mp.py
(newcomers join running jobs), benchmarks/goodput.py (the join pause).
"""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest

from hvdkit import config, runtime
from hvdkit import process_sets as _sets
from hvdkit._comm import meeting as _meeting
from hvdkit._comm import progress as _progress
from hvdkit.backends.local import LocalBackend
from hvdkit.data import ShardSampler
from hvdkit.errors import CollectiveError
from hvdkit.fault._next_world import retry

PLACE = {
    "HOROVOD_RANK": "3",
    "HOROVOD_SIZE": "4",
    "HOROVOD_LOCAL_RANK": "1",
    "HOROVOD_LOCAL_SIZE": "2",
    "HOROVOD_CROSS_RANK": "1",
    "HOROVOD_CROSS_SIZE": "2",
}


class EnvBackend(LocalBackend):
    """A backend whose place is Horovod's settings in the environment, as Horovod's is."""

    name = "horovod"

    def rank(self) -> int:
        return int(config.get("HOROVOD_RANK"))

    def size(self) -> int:
        return int(config.get("HOROVOD_SIZE"))


@pytest.fixture
def newcomer(monkeypatch, tmp_path):
    """A rank its worker started to join round 2 of a running elastic job; its starts."""
    monkeypatch.setenv(config.ELASTIC_DIR, str(tmp_path))
    monkeypatch.setenv(config.ELASTIC_JOIN, "1")
    monkeypatch.setenv(config.RESTART_COUNT, "2")
    monkeypatch.setenv(config.SCHED_TIMEOUT, "30")
    monkeypatch.setenv(config.GC_FREEZE, "0")
    for key, value in PLACE.items():
        monkeypatch.setenv(key, value)
    starts = []

    def create(name, sets, dynamic):
        starts.append((config.restart_count(), config.get("HOROVOD_RANK")))
        return EnvBackend(sets, dynamic)

    monkeypatch.setattr(runtime, "create", create)
    yield str(tmp_path), starts
    runtime.shutdown()


def go(folder: str, round_: int) -> None:
    _meeting.write(folder, _meeting.GO, str(round_))


def go_once_ready(folder: str, round_: int) -> threading.Thread:
    """The worker's go for ``round_`` once the rank said ready for it (as the scheduler's)."""

    def wait():
        while _meeting.read_round(folder, _meeting.READY) != round_:
            time.sleep(0.01)
        go(folder, round_)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread


def offer(folder: str, round_: int, rank: int, size: int) -> None:
    """The worker's word: round ``round_``, this process as ``rank`` of ``size``."""
    env = {"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(size)}
    _meeting.write(folder, _meeting.ASSIGN, json.dumps({"round": round_, "env": env}))


def test_init_neither_says_ready_nor_starts_and_answers_from_the_assignment(newcomer):
    folder, starts = newcomer
    runtime.init("horovod", intra_op_threads=0, pin_gpu=False)
    assert starts == []
    assert _meeting.read_round(folder, _meeting.READY) is None
    assert runtime.is_initialized()
    place = [runtime.rank(), runtime.size(), runtime.local_rank(), runtime.local_size()]
    assert place + [runtime.cross_rank(), runtime.cross_size()] == [3, 4, 1, 2, 1, 2]
    assert runtime.job_rank_size("shard_id", "pass it") == (3, 4)


def test_the_first_collective_says_ready_meets_and_starts_once(newcomer):
    folder, starts = newcomer
    runtime.init("horovod", intra_op_threads=0, pin_gpu=False)
    go(folder, 2)
    assert runtime.backend().rank() == 3  # a collective's way to the backend
    assert starts == [(2, "3")]
    assert _meeting.read_round(folder, _meeting.READY) == 2
    assert config.get(config.ELASTIC_JOIN) is None  # joined: a later init() meets no more
    assert runtime.start_deferred() is False
    assert starts == [(2, "3")]


def test_a_process_sets_first_use_starts_it(newcomer):
    folder, starts = newcomer
    runtime.init("horovod", intra_op_threads=0, pin_gpu=False)
    go(folder, 2)
    assert _sets.global_process_set.rank() == 3
    assert starts == [(2, "3")]


def test_a_later_round_handed_over_meanwhile_renumbers_the_rank_and_reshards(
    newcomer, monkeypatch, caplog
):
    """A survivor was lost while the newcomer built its model: the scheduler gave round 3,
    where it is rank 1 of 3; retry() (restore's loop) starts it there and re-shards."""
    folder, starts = newcomer
    ranks = []
    monkeypatch.setattr(_progress, "rank_changed", ranks.append)
    runtime.init("horovod", intra_op_threads=0, pin_gpu=False)
    sampler = ShardSampler(12, 4, 3)  # as built from rank() and size() before the start
    offer(folder, 3, rank=1, size=3)
    worker = go_once_ready(folder, 3)
    with caplog.at_level(logging.WARNING, logger="hvdkit"):
        seen = retry(lambda move: (move, runtime.rank(), runtime.size()), sampler=sampler)
    worker.join()
    assert seen == (None, 1, 3)
    assert starts == [(3, "1")]
    assert (sampler.num_shards, sampler.shard_id) == (3, 1)
    assert ranks == [1]  # the heartbeats speak for rank 1 now
    assert "as rank 1 of 3, not rank 3 of 4" in caplog.text


def test_a_sampler_reshards_though_another_call_started_horovod_first(newcomer):
    """A probe or a collective before restore() started it in a later round: retry() still
    gives the sampler this world's shards."""
    folder, starts = newcomer
    runtime.init("horovod", intra_op_threads=0, pin_gpu=False)
    sampler = ShardSampler(12, 4, 3)
    offer(folder, 3, rank=0, size=3)
    worker = go_once_ready(folder, 3)
    runtime.backend()
    worker.join()
    assert retry(lambda move: runtime.rank(), sampler=sampler) == 0
    assert (sampler.num_shards, sampler.shard_id) == (3, 0)


def test_a_start_where_init_said_warns_nothing(newcomer, caplog):
    folder, starts = newcomer
    runtime.init("horovod", intra_op_threads=0, pin_gpu=False)
    go(folder, 2)
    with caplog.at_level(logging.WARNING, logger="hvdkit"):
        runtime.backend()
    assert starts == [(2, "3")] and "stale" not in caplog.text


def test_a_start_that_fails_for_a_lost_peer_starts_in_the_next_world(newcomer, monkeypatch):
    folder, starts = newcomer
    monkeypatch.setattr(_meeting, "_after_failed_start_s", lambda: 5.0)
    runtime.init("horovod", intra_op_threads=0, pin_gpu=False)
    go(folder, 2)

    def create(name, sets, dynamic):
        starts.append((config.restart_count(), config.get("HOROVOD_RANK")))
        if len(starts) == 1:  # a peer dies as the ranks connect; the worker gives round 3
            offer(folder, 3, rank=2, size=3)
            go_once_ready(folder, 3)
            raise CollectiveError("Horovod could not start")
        return EnvBackend(sets, dynamic)

    monkeypatch.setattr(runtime, "create", create)
    assert runtime.start_deferred() is True
    assert starts == [(2, "3"), (3, "2")]
    assert (runtime.rank(), runtime.size()) == (2, 3)


def test_with_process_sets_the_newcomer_starts_in_init(newcomer):
    folder, starts = newcomer
    go(folder, 2)
    runtime.init("horovod", intra_op_threads=0, pin_gpu=False, process_sets="dynamic")
    assert starts == [(2, "3")]
    assert _meeting.read_round(folder, _meeting.READY) == 2


def test_a_survivor_or_a_first_start_is_not_put_off(newcomer, monkeypatch):
    folder, starts = newcomer
    monkeypatch.delenv(config.ELASTIC_JOIN)
    runtime.init("horovod", intra_op_threads=0, pin_gpu=False)
    assert starts == [(2, "3")]
    assert _meeting.read_round(folder, _meeting.READY) is None  # no meeting at a first start


def test_shutdown_before_the_start_starts_nothing(newcomer):
    folder, starts = newcomer
    runtime.init("horovod", intra_op_threads=0, pin_gpu=False)
    runtime.shutdown()
    assert not runtime.is_initialized()
    assert runtime.start_deferred() is False
    assert starts == []
    assert _meeting.read_round(folder, _meeting.READY) is None

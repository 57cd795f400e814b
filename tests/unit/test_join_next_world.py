"""A rank whose Horovod start failed for a lost peer meets the next world and starts there
(hvdkit/_comm/meeting.py: join_next_world, peer_lost).

The multi-process side: tests/test_phases_mp.py (a survivor killed as Horovod starts, or
before the rollback broadcast, in a world a newcomer joins) and tests/test_elastic_faults_mp.py.
"""

from __future__ import annotations

import json

import pytest

from hvdkit import config, runtime
from hvdkit._comm import meeting as _meeting
from hvdkit.errors import CollectiveError, LaunchError


@pytest.fixture
def folder(monkeypatch, tmp_path):
    """This rank's elastic folder; its start failed in round 2."""
    monkeypatch.setenv(config.ELASTIC_DIR, str(tmp_path))
    monkeypatch.setenv(config.RESTART_COUNT, "2")
    monkeypatch.setenv(config.SCHED_TIMEOUT, "30")
    monkeypatch.setattr(_meeting, "_after_failed_start_s", lambda: 0.3)
    # the worker's word writes this process's rank into os.environ (meeting.take)
    monkeypatch.setenv("HOROVOD_RANK", "2")
    return str(tmp_path)


def offer(folder: str, round_: int, rank: int) -> None:
    """The worker's word: round ``round_``, this process as ``rank``, and everyone ready."""
    body = {"round": round_, "env": {"HOROVOD_RANK": str(rank)}, "lost": True}
    _meeting.write(folder, _meeting.ASSIGN, json.dumps(body))
    _meeting.write(folder, _meeting.GO, str(round_))


def test_a_failed_start_starts_again_in_each_next_world_until_one_starts(folder):
    offer(folder, 3, rank=1)
    starts = []

    def start():
        starts.append((config.restart_count(), config.get("HOROVOD_RANK")))
        if len(starts) == 1:  # round 3 loses a peer too; the worker gives round 4
            offer(folder, 4, rank=0)
            raise CollectiveError("Horovod could not start")

    round_ = _meeting.join_next_world(start, failed=CollectiveError("Horovod could not start"))
    assert (round_, starts) == (4, [(3, "1"), (4, "0")])
    assert _meeting.read_round(folder, _meeting.READY) == 4


def test_no_next_world_after_a_failed_start_ends_the_rank_naming_gloos_timeout(folder):
    with pytest.raises(LaunchError, match=config.GLOO_TIMEOUT) as info:
        _meeting.join_next_world(lambda: None, failed=CollectiveError("Horovod could not start"))
    assert "round 2" in str(info.value)


@pytest.mark.parametrize("failures", [1, 2])
def test_an_elastic_jobs_first_start_that_fails_meets_the_next_world(folder, monkeypatch, failures):
    """Round 0 (no newcomer: the job's first start) loses a peer as Horovod starts: the
    rank waits for round 1 in its process; if that start fails too, for round 2."""
    monkeypatch.setenv(config.RESTART_COUNT, "0")
    real, rounds = runtime.create, []

    def create(name, sets, dynamic):
        rounds.append(config.restart_count())
        if len(rounds) <= failures:
            offer(folder, len(rounds), rank=0)  # the scheduler's next world
            raise CollectiveError("Horovod could not start")
        return real(name, sets, dynamic)

    joins = []

    def join_next_world(start, failed=None):
        joins.append(failed)
        return real_join(start, failed=failed)

    real_join = _meeting.join_next_world
    monkeypatch.setattr(runtime, "create", create)
    monkeypatch.setattr(_meeting, "join_next_world", join_next_world)
    runtime.init("local")
    try:
        assert rounds == list(range(failures + 1))
        assert len(joins) == 1  # a second failure is the first meeting's to handle: no nesting
        assert runtime.is_initialized() and not runtime._rejoining
    finally:
        runtime.shutdown()


def test_a_failed_start_outside_an_elastic_job_raises(monkeypatch):
    monkeypatch.delenv(config.ELASTIC_DIR, raising=False)

    def create(name, sets, dynamic):
        raise CollectiveError("Horovod could not start")

    monkeypatch.setattr(runtime, "create", create)
    with pytest.raises(CollectiveError, match="could not start"):
        runtime.init("local")
    assert not runtime.is_initialized()


@pytest.mark.parametrize(
    ("text", "lost"),
    [
        ("Horovod has been shut down", True),
        ("Read error [127.0.0.1]:3: Connection reset (gloo/transport/tcp/pair.cc:598)", True),
        ("broadcast of tensor 'x' failed: shapes differ", False),
    ],
)
def test_peer_lost_reads_the_cause_chain(text, lost):
    try:
        try:
            raise RuntimeError(text)
        except RuntimeError as inner:
            raise CollectiveError("broadcast failed") from inner
    except CollectiveError as exc:
        assert _meeting.peer_lost(exc) is lost


@pytest.mark.parametrize(
    "given, launcher, advised",
    [
        (None, {}, False),
        (("0", "2"), {"HOROVOD_CONTROLLER": "gloo"}, True),  # plain horovodrun --gloo
        (("0", "2"), {"HOROVOD_CONTROLLER": "gloo", "HVDKIT_MONITOR_ADDR": "x"}, False),
        (("0", "2"), {"HOROVOD_CONTROLLER": "mpi"}, False),
    ],
)
def test_a_failed_horovod_start_says_which_rank_this_process_was_given(
    monkeypatch, given, launcher, advised
):
    """Under plain horovodrun --gloo a HOROVOD_RANK left in the launching shell gives every
    rank the same rank: the failed start's message shows the rank, so two equal ones show
    it, and says why; under hvdkit's launchers (which set each rank's own) the rank only."""
    from hvdkit.backends import horovod as backend

    class FailingHorovod:
        shut_down = 0

        def init(self, process_sets=None):
            raise ValueError(f"{backend._INIT_FAILED}: rank 1 did not come to the rendezvous")

        def shutdown(self):
            self.shut_down += 1

    fake = FailingHorovod()
    monkeypatch.setattr(backend, "hvd", fake)
    for name in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_CONTROLLER", "HVDKIT_MONITOR_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS", raising=False)
    if given:
        monkeypatch.setenv("HOROVOD_RANK", given[0])
        monkeypatch.setenv("HOROVOD_SIZE", given[1])
    for name, value in launcher.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(CollectiveError, match="Horovod could not start") as info:
        backend._start(process_sets=None)
    said = str(info.value)
    assert fake.shut_down == 1
    assert ("This process was started as rank 0 of 2" in said) == bool(given), said
    assert ("set where horovodrun ran" in said) == advised, said
    assert said.endswith("In an elastic job the rank waits for the next world.")

"""hvdkit.Checkpointer on 2 ranks (Gloo and MPI): API checks, and crash-and-resume jobs.

The jobs run ``tests/multiproc/ft_train.py`` (the pattern users write): an
uninterrupted reference (under hvdkitrun, shared with other files), then the
same training under horovodrun killed at a chosen point and launched again.
The resumed job must end with the reference's weights (rtol 1e-6: the same
arithmetic, the same two-rank sums) and must have trained, per epoch, the
reference's multiset of sample ids, counted from what the training step
itself recorded. Steps that a crashed attempt ran after its last checkpoint
are rolled back by the resume, so they are not counted: the *effective*
history of attempt ``a`` ends at the step attempt ``a + 1`` resumed from.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from conftest import MULTIPROC, WorkerRun, launch, launcher_env, run_bounded, uninterrupted_fit

RUN = WorkerRun("checkpoint_worker.py", timeout=600)
CHECKS = [
    "fresh_restore_broadcasts_rank0_initial_weights",
    "restore_loads_on_rank0_and_broadcasts_everything",
    "every_seconds_decided_by_rank0_clock",
    "bad_input_raises_the_same_error_on_every_rank",
    "torn_checkpoint_skipped_and_previous_loaded",
    "manifest_lists_every_variable_once",
]


@pytest.mark.parametrize("check", CHECKS)
def test_checkpointer_on_two_ranks(check, transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_check(check)


def test_checkpointer_reports_exactly_these_checks(transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_reported_exactly(CHECKS)


# --------------------------------------------------------------------------- the jobs
SAMPLES, EPOCHS = 96, 3  # ft_train.py's defaults: 12 steps per epoch on 2 ranks, 36 in all
EVERY = 5  # ft_train.py's --every: a checkpoint every 5 steps
TIMEOUT = 400


class Job:
    """One ft_train.py output folder, launched once or several times."""

    def __init__(self, root: Path, name: str, transport: str):
        self.dir = root / name
        self.transport = transport

    def run(self, *args, np_: int = 2, attempt: int = 0) -> tuple[int, str]:
        argv = (f"--attempt={attempt}", *args)
        if np_ == 1:  # no launcher: hvdkit runs as a job of size 1
            self.out.mkdir(exist_ok=True)
            cmd = [sys.executable, str(MULTIPROC / "ft_train.py"), str(self.out), *argv]
            code, out, timed_out = run_bounded(cmd, TIMEOUT, env=launcher_env(), cwd=self.dir)
        else:
            res = launch("ft_train.py", self.dir, self.transport, np_, args=argv, timeout=TIMEOUT)
            code, out, timed_out = res.returncode, res.output, res.timed_out
        assert not timed_out, f"attempt {attempt} hung:\n{out[-3000:]}"
        return code, out

    @property
    def out(self) -> Path:
        return self.dir / f"out-{self.transport}"

    def result(self, attempt: int, rank: int = 0) -> dict:
        return json.loads((self.out / f"result-a{attempt}-r{rank}.json").read_text())

    def records(self, attempt: int) -> tuple[int, list[dict]]:
        """``(resumed_from, step records of every rank)`` of one attempt."""
        resumed, lines = None, []
        for path in sorted(self.out.glob(f"ids-a{attempt}-r*.jsonl")):
            rows = [json.loads(line) for line in path.read_text().splitlines() if line]
            resumed = rows[0]["resumed_from"]
            lines += rows[1:]
        assert resumed is not None, f"attempt {attempt} wrote no ids"
        return resumed, lines

    def effective_ids(self, attempts: int) -> dict[int, Counter]:
        """Per epoch, the ids of the steps whose effect survived into the final weights."""
        per_epoch: dict[int, Counter] = {}
        for a in range(attempts):
            limit = self.records(a + 1)[0] if a + 1 < attempts else float("inf")
            for row in self.records(a)[1]:
                if row["step"] <= limit:
                    per_epoch.setdefault(row["epoch"], Counter()).update(row["ids"])
        return per_epoch


class Scenarios:
    """Every job of one transport, run once and shared by the tests."""

    def __init__(self, transport: str, root: Path, tmp_path_factory):
        self.transport, self.root = transport, root
        self.tmp_path_factory = tmp_path_factory
        self._jobs: dict[str, Job] = {}

    def job(self, name: str, runs: list[dict]) -> Job:
        if name not in self._jobs:
            job = Job(self.root, name, self.transport)
            job.dir.mkdir()
            job.codes = []
            for attempt, run in enumerate(runs):
                code, out = job.run(*run["args"], np_=run.get("np", 2), attempt=attempt)
                job.codes.append(code)
                job.__dict__.setdefault("outputs", []).append(out)
            self._jobs[name] = job
        return self._jobs[name]


_SCENARIOS: dict[str, Scenarios] = {}


@pytest.fixture
def jobs(transport, tmp_path_factory) -> Scenarios:
    if transport not in _SCENARIOS:
        root = tmp_path_factory.mktemp(f"ft-{transport}")
        _SCENARIOS[transport] = Scenarios(transport, root, tmp_path_factory)
    return _SCENARIOS[transport]


def reference(jobs: Scenarios) -> Job:
    """The same training without faults: one run per test run, under hvdkitrun
    (conftest.uninterrupted_fit, shared with test_restart_mp and test_preemption_mp)."""
    shared = uninterrupted_fit(jobs.tmp_path_factory)  # first: it may fail
    job = Job(jobs.root, "reference", jobs.transport)
    if not job.out.exists():
        job.dir.mkdir(exist_ok=True)
        job.out.symlink_to(shared)
    return job


def assert_same_training(job: Job, ref: Job, attempts: int) -> None:
    got, want = job.result(attempts - 1), ref.result(0)
    other = job.result(attempts - 1, rank=1)
    assert got["final_step"] == want["final_step"] == EPOCHS * SAMPLES // 8
    np.testing.assert_array_equal(got["weights"], other["weights"])  # ranks agree exactly
    np.testing.assert_allclose(got["weights"], want["weights"], rtol=1e-6, atol=1e-7)
    ref_ids = ref.effective_ids(1)
    assert sorted(ref_ids) == list(range(EPOCHS))
    for epoch in range(EPOCHS):  # pad mode with 96 = 2 * 48: every sample once per epoch
        assert ref_ids[epoch] == Counter(range(SAMPLES))
    assert job.effective_ids(attempts) == ref_ids


def assert_crashed_then_resumed(
    job: Job, resumed_from: int, crash_step: int, every: int | None = None, overrun: int = 0
) -> None:
    """The kill came at ``crash_step``; the rerun resumed from the newest complete checkpoint.

    ``every``: when the killed process is rank 0, the writer, its background write of
    the newest checkpoint (``resumed_from``) may still have been running (a loaded
    machine): then the one ``every`` steps earlier is the newest complete one, and
    the rerun must resume from it. Which of the two is on disk decides.
    ``overrun``: how many steps after ``crash_step`` the killed attempt may have
    trained (a kill from the background writer comes while training goes on).
    """
    assert job.codes[0] != 0, "the first attempt was meant to be killed"
    assert job.codes[1:] == [0] * (len(job.codes) - 1), job.outputs[-1][-3000:]
    first_resumed, first_rows = job.records(0)
    assert first_resumed == 0
    # the killed attempt really ran past the checkpoint it is resumed from
    last = max(row["step"] for row in first_rows)
    assert crash_step <= last <= crash_step + overrun, (last, crash_step, overrun)
    allowed = [resumed_from] if every is None else [resumed_from, resumed_from - every]
    assert job.records(1)[0] in allowed, (job.records(1)[0], allowed)
    assert job.records(1)[0] == job.result(1)["resumed_from"]


def test_fit_killed_mid_epoch_resumes_exactly(jobs):
    ref = reference(jobs)
    job = jobs.job(
        "fit-crash",
        [{"args": ["--mode=fit", "--crash-at=17", "--crash-rank=1"]}, {"args": ["--mode=fit"]}],
    )
    assert_crashed_then_resumed(job, resumed_from=15, crash_step=17)
    assert_same_training(job, ref, attempts=2)


def test_crash_inside_a_checkpoint_write_resumes_from_the_previous_one(jobs):
    ref = reference(jobs)
    job = jobs.job(
        "save-crash",
        [{"args": ["--mode=fit", "--crash-in-save=10"]}, {"args": ["--mode=fit"]}],
    )
    # The write of step 10 runs in rank 0's background writer while training goes
    # on (seen in CI: step 11 recorded before the kill); the save of step 15 waits
    # for it, and the other rank is at most one step ahead: 10..16.
    assert_crashed_then_resumed(job, resumed_from=5, crash_step=10, overrun=EVERY + 1)
    warned = job.result(1)["warnings"]
    assert any("torn checkpoint" in w and ".tmp-ckpt-0000000010-" in w for w in warned), warned
    assert_same_training(job, ref, attempts=2)


def test_sink_train_killed_inside_a_sink_resumes_at_a_sink_boundary(jobs):
    ref = reference(jobs)
    args = ["--mode=sink", "--every=6", "--sink-size=3"]
    job = jobs.job("sink-crash", [{"args": [*args, "--crash-at=20"]}, {"args": args}])
    # sinks are steps 19-21; step 20 is inside one; the checkpoint of step 18 is the last
    assert_crashed_then_resumed(job, resumed_from=18, crash_step=20)
    assert_same_training(job, ref, attempts=2)


def test_custom_loop_killed_resumes_exactly(jobs):
    ref = reference(jobs)
    args = ["--mode=loop", "--every=5"]
    job = jobs.job("loop-crash", [{"args": [*args, "--crash-at=13"]}, {"args": args}])
    assert_crashed_then_resumed(job, resumed_from=10, crash_step=13)
    assert_same_training(job, ref, attempts=2)


def test_two_ranks_to_one_trains_every_remaining_sample_once(jobs):
    args = ["--mode=data_sink", "--every=6", "--sink-size=3"]
    job = jobs.job(
        "resize",
        [{"args": [*args, "--crash-at=20", "--crash-rank=0"]}, {"args": args, "np": 1}],
    )
    assert_crashed_then_resumed(job, resumed_from=18, crash_step=20, every=6)
    assert job.result(1)["size"] == 1
    # 12 steps on 2 ranks (8 samples each) are epoch 0; step 18 is half of epoch 1.
    # After resuming at step r, 1 rank trains the rest of epoch 1 and epoch 2, 4 a step.
    r = job.records(1)[0]
    left_of_epoch1 = SAMPLES - (r - 12) * 8
    assert job.result(1)["final_step"] == r + left_of_epoch1 // 4 + SAMPLES // 4
    ids = job.effective_ids(2)
    assert sorted(ids) == list(range(EPOCHS))
    for epoch in range(EPOCHS):
        assert ids[epoch] == Counter(range(SAMPLES)), epoch
    _, rows = job.records(1)
    resumed_epoch1 = Counter(i for row in rows if row["epoch"] == 1 for i in row["ids"])
    assert sum(resumed_epoch1.values()) == left_of_epoch1 and max(resumed_epoch1.values()) == 1

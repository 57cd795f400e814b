"""Horovod's elastic Keras API on hvdkit's elastic launch (Gloo): its example, import changed.

examples/horovod/keras_mnist_elastic.py (Horovod's
``tensorflow2_keras_mnist_elastic.py`` with the import changed: ``KerasState``,
the three state callbacks, a reset callback, ``@hvd.elastic.run``) runs on 3
workers (``HVDKIT_ELASTIC=1``, ``HVDKIT_MIN_WORKERS=2``). Rank 2 kills its
worker at optimizer step 12: the two others must go on in their own
processes as a world of 2 (restored to their last commit, reset callbacks
run, state synced). Held there until a new worker is ready to join, they
admit it at a commit (``HostsUpdatedInterrupt``), and the three finish the
job. The example's own calls decide what is trained; the test checks the
launch (exit codes, nobody restarted, the scheduler's and ranks' lines) and
the outcome (every rank's final weights and optimizer state equal, the
state's epoch at the end, the learning rate rescaled by the reset callback).

No wall-clock bound: the waits' deadlines only turn a hang into a failure.
"""

from __future__ import annotations

import json

import numpy as np
from test_elastic_mp import Job
from test_launch_mp import PY, SCHEDULER_SH, WORKERS_SH, free_port, sched_env

from conftest import MULTIPROC, launcher_env

RUN = str(MULTIPROC / "elastic_example_run.py")
EPOCHS, STEPS, CRASH = 3, 48, 12  # 16 steps an epoch on 3 ranks, 24 on 2


def test_horovods_elastic_keras_example_survives_a_lost_worker_and_takes_a_new_one(tmp_path):
    out, release = tmp_path / "out", tmp_path / "release"
    out.mkdir()
    env = {
        **launcher_env(),
        **sched_env(free_port(), worker_num=3, HVDKIT_MIN_WORKERS="2", HVDKIT_ELASTIC="1"),
    }
    job = Job(tmp_path, env)
    train = [PY, RUN, str(out), "--crash-at", str(CRASH), "--crash-rank", "2"]
    train += ["--hold-until", str(release), "--step-sleep", "0.3", "--"]
    train += ["--epochs", str(EPOCHS), "--steps", str(STEPS), "--outdir", str(out), "--seed", "1"]
    job.start("scheduler", [SCHEDULER_SH])
    for i in range(3):
        job.start(f"worker{i}", [WORKERS_SH, "1", *train])
    job.wait_for("scheduler", "go on in-process")
    job.start("newcomer", [WORKERS_SH, "1", *train])
    job.wait_for("newcomer", "is ready for round 2")
    survivors = [n for n in ("worker0", "worker1", "worker2") if _first_rank(job, n) != 2]
    for name in survivors:
        job.wait_for(name, "goes on in-process as rank")
        job.wait_for_count(name, "(round 2)", 1)
    release.touch()
    result = job.finish()
    report = "\n".join(f"--- {n} ({c})\n{o[-3000:]}" for n, (c, o) in result.items())

    # exit codes: the job, the survivors' and the newcomer's workers 0; the lost worker killed
    assert result["scheduler"][0] == 0, report
    lost = [n for n in ("worker0", "worker1", "worker2") if n not in survivors]
    assert len(lost) == 1 and result[lost[0]][0] != 0, report
    assert all(result[n][0] == 0 for n in [*survivors, "newcomer"]), report
    sched = result["scheduler"][1]
    assert "2 of 3 workers go on in-process as round 1" in sched, report
    assert " joins: 3 of 3 workers as round 2" in sched, report
    assert "round 1: 2 ranks train again from step" in sched, report
    assert "round 2: 3 ranks train again from step" in sched, report

    # training continued in the survivors' processes: each started as rank 0 or 1 of 3,
    # restored its commit in a world of 2, went on in a world of 3 and finished there
    starts = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("start-*")}
    results = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("result-*")}
    held = sorted(int(p.stem.split("-")[1]) for p in out.glob("held-*"))
    assert len(results) == 3 and (out / "crashed").exists(), (sorted(results), report)
    assert len(held) == 2 and set(held) < set(results), (held, sorted(results))
    assert sorted(starts[pid]["rank"] for pid in held) == [0, 1]
    assert all(starts[pid]["size"] == 3 for pid in results)
    assert {(results[pid]["rank"], results[pid]["size"]) for pid in held} == {(0, 3), (1, 3)}
    lines = [ln for _, (_, o) in result.items() for ln in o.splitlines() if "hvdkit: rank " in ln]
    shrunk = [ln for ln in lines if " of 3 is rank " in ln and " of 2 (round 1) " in ln]
    grown = [ln for ln in lines if " of 2 is rank " in ln and " of 3 (round 2) " in ln]
    assert len(shrunk) == 2 and all("; restored commit " in ln for ln in shrunk), lines
    assert len(grown) == 2, lines
    assert all("after a worker joined; goes on from commit" in ln for ln in grown), lines

    # every rank ends with the same weights and optimizer state, trained to the last epoch,
    # with the learning rate the reset callback set for 3 ranks
    finals = [results[pid] for pid in sorted(results)]
    weights = [np.asarray(r["weights"]) for r in finals]
    for w in weights[1:]:
        np.testing.assert_array_equal(w, weights[0])
    assert {(r["epoch"], r["batch"]) for r in finals} == {(EPOCHS, 0)}
    assert len({r["iterations"] for r in finals}) == 1
    assert {r["learning_rate"] for r in finals} == {np.float32(0.003).item()}
    assert sorted(p.name for p in out.glob("checkpoint-*.keras"))  # rank 0's ModelCheckpoint


def _first_rank(job: Job, name: str) -> int:
    """The rank a first worker's program started as (its first output line names it)."""
    for rank in range(3):
        if job.lines[name] and f"rank {rank} of 3 " in job.lines[name][0]:
            return rank
    raise AssertionError(f"{name} did not say which rank it started: {job.lines[name][:3]}")

"""In-process recovery (hvdkit.elastic) under the scheduler/worker launch, Gloo, 3 workers.

The job (tests/multiproc/ft_train.py ``--mode elastic``: ``model.fit`` inside
``@hvdkit.elastic.run`` with a Checkpointer saving every 5 steps) trains 3
epochs of 96 samples, 4 per rank and step. Rank 2 kills its worker inside
step 12. With ``HVDKIT_ELASTIC=1`` the two other ranks must go on in their
own processes (no restart), rolled back to step 10, as ranks of a world of 2;
the same fault in the same job without it is a whole-job restart on the two
workers left (``HVDKIT_MAX_RESTARTS=1``), from the step-10 checkpoint on disk.
Both must end with the same weights, bit for bit, and have trained every
sample of every epoch exactly once (the steps after the last save, redone,
counted once).

No test bounds wall-clock time: the subprocess timeouts only turn a hang into
a failure.
"""

from __future__ import annotations

import collections
import json
import re
import subprocess
from pathlib import Path

import numpy as np
from test_launch_mp import PY, SCHEDULER_SH, WORKERS_SH, free_port, sched_env

from conftest import MULTIPROC, launcher_env

FT_TRAIN = str(MULTIPROC / "ft_train.py")
HANG = 900  # seconds: only a hang gets near this
SAMPLES, EPOCHS, CRASH, EVERY = 96, 3, 12, 5
LAST_SAVE = CRASH // EVERY * EVERY  # 10: what both ways go back to


def run_job(root: Path, **settings: str) -> tuple[dict[str, tuple[int, str]], Path]:
    """Scheduler + 3 workers; returns ({name: (exit code, output)}, the job's output folder)."""
    out = root / "out"
    out.mkdir(parents=True)
    env = {
        **launcher_env(),
        **sched_env(
            free_port(),
            worker_num=3,
            HVDKIT_MIN_WORKERS="2",
            HVDKIT_CHECKPOINT_DIR=str(out / "ckpt"),
            **settings,
        ),
    }
    train = [PY, FT_TRAIN, str(out), "--mode", "elastic", "--epochs", str(EPOCHS)]
    train += ["--samples", str(SAMPLES), "--every", str(EVERY), "--crash-at", str(CRASH)]
    train += ["--crash-rank", "2", "--crash-how", "worker"]
    procs = {"scheduler": [SCHEDULER_SH]} | {
        f"worker{i}": [WORKERS_SH, "1", *train] for i in range(3)
    }
    started = {
        name: subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=root
        )
        for name, cmd in procs.items()
    }
    return {n: (p.wait(timeout=HANG), p.communicate()[0]) for n, p in started.items()}, out


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def trained_ids(out: Path) -> dict[int, collections.Counter]:
    """Per epoch, the ids kept: every step a process trained, except the steps after a
    rollback's step that were trained before it (redone after it)."""
    per_epoch: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    files = sorted(out.glob("ids-a*-r*.jsonl"))
    # Where each attempt's successor (a restart) or a recovery went back to.
    back_to = {}
    for f in files:
        attempt = int(f.name.split("-")[1][1:])
        first = records(f)[0]
        if attempt > 0:
            back_to[attempt - 1] = min(back_to.get(attempt - 1, 1 << 30), first["resumed_from"])
        for rec in records(f):
            if "recovered_from" in rec:
                back_to[attempt] = min(back_to.get(attempt, 1 << 30), rec["recovered_from"])
    for f in files:
        attempt = int(f.name.split("-")[1][1:])
        limit = back_to.get(attempt)
        recovered = False
        for rec in records(f)[1:]:
            if "recovered_from" in rec:
                recovered = True
                continue
            if recovered or limit is None or rec["step"] <= limit:
                per_epoch[rec["epoch"]].update(rec["ids"])
    return dict(per_epoch)


def final_weights(out: Path) -> list[np.ndarray]:
    return [np.asarray(json.loads(p.read_text())["weights"]) for p in sorted(out.glob("result-*"))]


def test_survivors_of_a_lost_worker_go_on_in_process_and_end_as_a_restart_would(tmp_path):
    elastic, e_out = run_job(tmp_path / "elastic", HVDKIT_ELASTIC="1")
    restart, r_out = run_job(
        tmp_path / "restart", HVDKIT_MAX_RESTARTS="1", HVDKIT_REPLACE_TIMEOUT="2"
    )
    report = "\n".join(f"--- {n} ({c})\n{o[-3000:]}" for n, (c, o) in elastic.items())

    # In-process: the job ends by itself, the two survivors' processes finished it.
    assert elastic["scheduler"][0] == 0, report
    codes = sorted(c for n, (c, _) in elastic.items() if n != "scheduler")
    assert codes[:2] == [0, 0] and codes[2] != 0, report  # the lost worker's script fails
    said = [ln for ln in elastic["scheduler"][1].splitlines() if "go on in-process" in ln]
    assert len(said) == 1 and "2 of 3 workers go on in-process as round 1" in said[0], report
    assert sorted(p.name for p in e_out.glob("result-*")) == [
        "result-a0-r0.json",
        "result-a0-r1.json",
    ]
    assert not list(e_out.glob("ids-a1-*"))  # no process was started again
    for rank in (0, 1):
        marks = [r for r in records(e_out / f"ids-a0-r{rank}.jsonl") if "recovered_from" in r]
        assert [(m["recovered_from"], m["size"]) for m in marks] == [(LAST_SAVE, 2)], marks
    recovered = [ln for _, (_, o) in elastic.items() for ln in o.splitlines() if "to rejoin" in ln]
    assert len(recovered) == 2, report
    assert all(re.search(rf"rolled back to step {LAST_SAVE}; ", ln) for ln in recovered), recovered

    # The restart does the same with new processes, from the checkpoint on disk.
    assert restart["scheduler"][0] == 0, restart["scheduler"][1][-3000:]
    assert sorted(p.name for p in r_out.glob("result-*")) == [
        "result-a1-r0.json",
        "result-a1-r1.json",
    ]
    assert records(r_out / "ids-a1-r0.jsonl")[0] == {"resumed_from": LAST_SAVE, "size": 2}

    # Both end alike, bit for bit, every sample of every epoch trained once.
    weights = final_weights(e_out) + final_weights(r_out)
    for w in weights[1:]:
        np.testing.assert_array_equal(w, weights[0])
    for out in (e_out, r_out):
        ids = trained_ids(out)
        assert sorted(ids) == list(range(EPOCHS))
        for epoch, counts in ids.items():
            assert counts == collections.Counter(range(SAMPLES)), (out.name, epoch, counts)

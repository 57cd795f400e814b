"""Automatic restart under the real launchers, 2 processes.

The job (tests/multiproc/restart_train.py) trains 2 epochs of 6 global steps
with a checkpoint every 2 steps and a global data cursor. A restarted job
must end as an uninterrupted one would: the same weights (bit-identical:
the arithmetic is deterministic) and every sample of every epoch trained
exactly once, ids recorded by the training step. No test bounds wall-clock
time: the subprocess timeouts only turn a hang into a failure.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from test_launch_mp import (  # noqa: F401  (two_hosts is a fixture)
    PY,
    SCHEDULER_SH,
    WORKERS_SH,
    free_port,
    sched_env,
    two_hosts,
)

from conftest import MULTIPROC, VENV_BIN, launcher_env, needs_netns, uninterrupted_fit

TRAIN = str(MULTIPROC / "restart_train.py")
HVDKITRUN = str(VENV_BIN / "hvdkitrun")
SAMPLES, EPOCHS = 48, 2
HANG = 900  # seconds: only a hang gets near this


def job_dirs(root: Path, name: str) -> tuple[Path, Path]:
    out, ckpt = root / name / "out", root / name / "ckpt"
    out.mkdir(parents=True)
    ckpt.mkdir()
    return out, ckpt


def hvdkitrun(root: Path, name: str, transport: str, *extra, restarts=None, env_extra=None):
    """hvdkitrun -np 2 [--max-restarts N] restart_train.py; returns (proc, outdir)."""
    out, ckpt = job_dirs(root, name)
    opts = [] if restarts is None else ["--max-restarts", str(restarts)]
    cmd = [HVDKITRUN, "-np", "2", f"--{transport}", *opts, "--checkpoint-dir", str(ckpt)]
    cmd += [PY, TRAIN, str(out), str(ckpt), *extra]
    env = {**launcher_env(), **(env_extra or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, timeout=HANG)
    proc.output = proc.stdout + proc.stderr
    return proc, out


_BASELINE: list[np.ndarray] = []


def baseline(tmp_path_factory) -> np.ndarray:
    """Final weights of the uninterrupted job, run once over Gloo: the reference of both
    transports (why that holds: conftest.uninterrupted_fit)."""
    if not _BASELINE:
        root = tmp_path_factory.mktemp("baseline")
        proc, out = hvdkitrun(root, "job", "gloo")
        assert proc.returncode == 0, proc.output[-3000:]
        assert_every_sample_once(out)
        _BASELINE.append(weights(out))
    return _BASELINE[0]


def weights(out: Path) -> np.ndarray:
    w0, w1 = (np.load(out / f"weights.rank{r}.npy") for r in (0, 1))
    np.testing.assert_array_equal(w0, w1, err_msg="the two ranks ended with different weights")
    return w0


def attempts(out: Path, rank: int) -> list[dict]:
    found = sorted(out.glob(f"attempt*.rank{rank}.json"), key=lambda p: int(p.name[7:-11]))
    return [json.loads(p.read_text()) for p in found]


def assert_every_sample_once(out: Path) -> None:
    """Per epoch, the ids the training step saw are each sample exactly once."""
    trained = json.loads((out / "trained.json").read_text())
    assert sorted(trained) == [str(e) for e in range(EPOCHS)], sorted(trained)
    for epoch, ids in trained.items():
        counts = collections.Counter(ids)
        repeated = sorted(i for i, c in counts.items() if c > 1)
        missing = sorted(set(range(SAMPLES)) - set(counts))
        assert not repeated and not missing, (epoch, repeated, missing)


def restart_lines(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if ": restart " in ln and " after " in ln]


# ------------------------------------------------------------------ hvdkitrun
@pytest.mark.parametrize("transport", ["gloo", "mpi"])
def test_a_kill_a_stall_and_an_early_exit_0_are_each_restarted_and_resumed_exactly(
    tmp_path, tmp_path_factory, transport
):
    # One job, three failures in a row (checkpoints every 2 global steps):
    #   attempt 0: rank 1 SIGKILLs itself before step 5   -> resume from step 4
    #   attempt 1: rank 1 SIGSTOPs itself before step 7   -> stalled, resume from 6
    #   attempt 2: rank 0 os._exit(0)s before step 9       -> no error, yet the job
    #              is not done: a failure, resume from 8
    faults = ["0:kill:1:5", "1:stop:1:7", "2:exit0:0:9"]
    proc, out = hvdkitrun(
        tmp_path,
        "faults",
        transport,
        *[arg for f in faults for arg in ("--fault", f)],
        restarts=3,
        env_extra={"HVDKIT_STALL_TIMEOUT": "10"},
    )
    assert proc.returncode == 0, proc.output[-4000:]
    lines = restart_lines(proc.stderr)
    assert len(lines) == 3, (lines, proc.stderr[-4000:])
    kill, stall, exit0 = lines
    assert kill.startswith("hvdkitrun: restart 1/3 after rank 1 "), kill
    assert kill.endswith("; resuming from checkpoint step 4."), kill
    assert stall.startswith("hvdkitrun: restart 2/3 after rank 1 stalled (no heartbeat for "), stall
    assert stall.endswith("; resuming from checkpoint step 6."), stall
    assert exit0.startswith("hvdkitrun: restart 3/3 after rank 0 "), exit0
    assert exit0.endswith("; resuming from checkpoint step 8."), exit0
    for rank in (0, 1):
        seen = [(a["attempt"], a["resumed_from"], a["size"]) for a in attempts(out, rank)]
        # HVDKIT_RESTART_COUNT 0..3, each resuming from the newest checkpoint
        assert seen == [(0, 0, 2), (1, 4, 2), (2, 6, 2), (3, 8, 2)], (rank, seen)
    stopped = attempts(out, 1)[1]["pid"]
    alive = psutil.pid_exists(stopped) and psutil.Process(stopped).status() != "zombie"
    assert not alive, "the SIGSTOPped rank was left behind"
    assert_every_sample_once(out)
    np.testing.assert_array_equal(weights(out), baseline(tmp_path_factory))


def test_a_spent_budget_ends_non_zero_listing_every_cause(tmp_path):
    proc, out = hvdkitrun(
        tmp_path, "spent", "gloo", "--fault", "0:kill:1:3", "--fault", "1:exit:0:5", restarts=1
    )
    assert proc.returncode != 0, proc.output[-4000:]
    lines = restart_lines(proc.stderr)
    assert len(lines) == 1 and "restart 1/1 after rank 1 " in lines[0], lines
    assert "resuming from checkpoint step 2." in lines[0]
    summary = [ln for ln in proc.stderr.splitlines() if "gave up after" in ln]
    assert len(summary) == 1, proc.stderr[-4000:]
    assert (
        "hvdkitrun: gave up after 2 failed attempts (1 restarts): attempt 1: rank 1 "
        in (summary[0])
    )
    # Rank 0 is blamed; how it ended is a race with horovodrun. Its own
    # "exit code 3" shows if it ended before horovodrun stopped the job;
    # "went away first" if horovodrun stopped rank 1 before reporting rank 0
    # (the race of test_max_restarts_0_fails_as_before); "143 (SIGTERM)" if
    # rank 1 failed in its collective first and horovodrun then terminated
    # rank 0 while sys.exit(3) was still shutting Horovod down.
    second = summary[0].split("; attempt 2: ", 1)[-1]
    endings = ("exit code 3", "went away first", "exit code 143 (SIGTERM)")
    assert second.startswith(tuple(f"rank 0 {e}" for e in endings)), summary[0]
    assert not (out / "trained.json").exists()


def test_max_restarts_0_fails_as_before(tmp_path):
    proc, out = hvdkitrun(tmp_path, "norestart", "gloo", "--fault", "0:exit:1:3", restarts=0)
    assert proc.returncode == 1, proc.output[-4000:]
    # rank 1 is blamed; its own "exit code 3" shows only if it ended before
    # horovodrun stopped it (rank 0 fails at once in its next collective), as
    # in test_a_spent_budget_ends_non_zero_listing_every_cause
    blamed = [ln for ln in proc.stderr.splitlines() if ln.startswith("hvdkitrun: rank 1 failed (")]
    assert len(blamed) == 1, proc.stderr[-4000:]
    endings = ("exit code 3", "went away first", "exit code 143 (SIGTERM)")
    assert blamed[0].startswith(tuple(f"hvdkitrun: rank 1 failed ({e}" for e in endings)), blamed
    assert not restart_lines(proc.output) and "gave up" not in proc.output
    assert [a["attempt"] for a in attempts(out, 1)] == [0]


# ------------------------------------------------------------------ scheduler/worker
def start(cmd, env_extra, cwd, netns=None):
    env = {**launcher_env(), **env_extra}
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd
    )


def wait_for(path: Path, procs, what: str) -> None:
    """Until ``path`` exists; fails at once if a process of the job ended first.

    The deadline only turns a hang into a failure (no speed is asserted)."""
    deadline = time.monotonic() + HANG
    while not path.exists():
        ended = [p.args for p in procs if p.poll() is not None]
        assert not ended, f"{what}: a process ended first: {ended}"
        assert time.monotonic() < deadline, f"{what}: {path} did not appear in {HANG} s"
        time.sleep(0.2)


def lose_rank_1_for_good(out: Path, procs) -> int:
    """Wait until rank 1 holds at step 5, then SIGKILL its worker (its program dies with it).

    Returns the pid of the worker script (run_workers.sh) that started that worker.
    """
    wait_for(out / "held", procs, "rank 1 did not reach step 5")
    program = attempts(out, 1)[0]["pid"]
    worker = psutil.Process(program).parent()
    script = worker.ppid()
    os.kill(worker.pid, signal.SIGKILL)
    return script


def scheduler_job(
    root,
    name,
    *,
    min_workers=None,
    replace=False,
    netns=(None, None, None),
    sched_host="127.0.0.1",
    port=None,
):
    """Scheduler + 2 workers; rank 1's worker is lost for good at step 5 of attempt 0.

    Returns ``{"scheduler"|"survivor"|"lost"|"replacement": (exit code, output)}``.
    """
    out, ckpt = job_dirs(root, name)
    extra = dict(
        HVDKIT_SCHED_HOST=sched_host, HVDKIT_MAX_RESTARTS=1, HVDKIT_CHECKPOINT_DIR=str(ckpt)
    )
    if min_workers is not None:
        extra.update(HVDKIT_MIN_WORKERS=min_workers, HVDKIT_REPLACE_TIMEOUT=2)
    env = sched_env(port or free_port(), **extra)
    train = [PY, TRAIN, str(out), str(ckpt), "--hold", "0:1:5"]
    sched = start([SCHEDULER_SH], env, root, netns[0])
    workers = [start([WORKERS_SH, "1", *train], env, root, ns) for ns in netns[1:]]
    lost_script = lose_rank_1_for_good(out, [sched, *workers])
    lost = next(w for w in workers if w.pid == lost_script)
    survivor = next(w for w in workers if w is not lost)
    procs = {"scheduler": sched, "survivor": survivor, "lost": lost}
    if replace:
        ns = netns[1 + workers.index(lost)]
        procs["replacement"] = start([WORKERS_SH, "1", *train], env, root, ns)
    results = {k: p.communicate(timeout=HANG)[0] for k, p in procs.items()}
    return {k: (p.returncode, results[k]) for k, p in procs.items()}, out


def test_scheduler_goes_on_with_min_workers_and_trains_the_rest_exactly_once(tmp_path):
    job, out = scheduler_job(tmp_path, "shrink", min_workers=1)
    assert job["scheduler"][0] == 0 and job["survivor"][0] == 0, job
    assert job["lost"][0] != 0
    sched = job["scheduler"][1]
    assert "round failed: rank 1 lost its worker" in sched, sched
    assert "scheduler: restart 1/1 after rank 1 lost its worker" in sched, sched
    assert "resuming from checkpoint step 4." in sched
    assert "continuing on 1 of 2 workers (HVDKIT_MIN_WORKERS=1)" in sched
    assert "all 1 ranks finished successfully" in sched
    runs = attempts(out, 0)
    assert [(a["attempt"], a["size"], a["resumed_from"]) for a in runs] == [(0, 2, 0), (1, 1, 4)]
    # the learning-rate hook saw the world size change
    assert runs[1]["old_size"] == 2 and runs[1]["lr"] == pytest.approx(runs[0]["lr"] / 2)
    assert_every_sample_once(out)


def test_scheduler_takes_a_replacement_worker(tmp_path, tmp_path_factory):
    job, out = scheduler_job(tmp_path, "replace", replace=True)
    codes = {k: c for k, (c, _) in job.items()}
    assert codes["scheduler"] == codes["survivor"] == codes["replacement"] == 0, job
    assert codes["lost"] != 0
    sched = job["scheduler"][1]
    assert "scheduler: restart 1/1 after rank 1 lost its worker" in sched, sched
    assert sched.count("assigned 2 ranks on 1 host(s); rendezvous on port") == 2, sched
    for rank in (0, 1):
        last = attempts(out, rank)[-1]
        assert (last["attempt"], last["resumed_from"], last["size"]) == (1, 4, 2)
    assert "rank 1 of 2 (local 1 of 2) on lo, restart 1" in job["replacement"][1]
    assert_every_sample_once(out)
    np.testing.assert_array_equal(weights(out), baseline(tmp_path_factory))


@needs_netns("a scheduler restart across two hosts (namespaces)")
def test_scheduler_restart_across_two_network_namespaces(tmp_path, two_hosts):  # noqa: F811
    a, b = two_hosts
    job, out = scheduler_job(
        tmp_path, "netns", min_workers=1, netns=(a, a, b), sched_host="10.213.7.1", port=29715
    )
    codes = {k: c for k, (c, _) in job.items()}
    assert codes["scheduler"] == codes["survivor"] == 0 and codes["lost"] != 0, job
    sched = job["scheduler"][1]
    assert "assigned 2 ranks on 2 host(s)" in sched, sched
    assert "continuing on 1 of 2 workers" in sched
    assert [a_["size"] for a_ in attempts(out, 0)] == [2, 1]
    assert_every_sample_once(out)


# ------------------------------------------------------------------ with hvdkit.Checkpointer
FT_TRAIN = MULTIPROC / "ft_train.py"


def ft_job(root: Path, name: str, transport: str, *extra, restarts=None):
    out = root / name
    out.mkdir()
    ckpt = out / "ckpt"
    opts = [] if restarts is None else ["--max-restarts", str(restarts)]
    cmd = [HVDKITRUN, "-np", "2", f"--{transport}", *opts, "--checkpoint-dir", str(ckpt)]
    cmd += [PY, str(FT_TRAIN), str(out), "--mode", "fit", "--ckpt", str(ckpt), *extra]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, env=launcher_env(), cwd=root, timeout=HANG
    )
    proc.output = proc.stdout + proc.stderr
    return proc, out


def ft_trained_ids(out: Path, last_attempt: int) -> dict[int, collections.Counter]:
    """Per epoch, the ids the training steps kept: each attempt's steps up to where the next
    attempt resumed (later ones were redone), and every step of the last attempt."""
    per_epoch: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for attempt in range(last_attempt + 1):
        nxt = out / f"ids-a{attempt + 1}-r0.jsonl"
        until = None
        if nxt.exists():
            until = json.loads(nxt.read_text().splitlines()[0])["resumed_from"]
        for rank in (0, 1):
            lines = (out / f"ids-a{attempt}-r{rank}.jsonl").read_text().splitlines()[1:]
            for line in map(json.loads, lines):
                if until is None or line["step"] <= until:
                    per_epoch[line["epoch"]].update(line["ids"])
    return dict(per_epoch)


@pytest.mark.parametrize("transport", ["gloo", "mpi"])
def test_checkpointer_job_killed_mid_epoch_equals_uninterrupted(
    tmp_path, tmp_path_factory, transport
):
    ref_out = uninterrupted_fit(tmp_path_factory)  # (shared with two other files)
    proc, out = ft_job(tmp_path, "killed", transport, "--crash-at", "17", restarts=2)
    assert proc.returncode == 0, proc.output[-4000:]
    lines = restart_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("hvdkitrun: restart 1/2 after rank 1 "), lines
    resumed = json.loads((out / "result-a1-r0.json").read_text())["resumed_from"]
    assert 0 < resumed < 17
    assert lines[0].endswith(f"; resuming from checkpoint step {resumed}."), (lines, resumed)
    for rank in (0, 1):
        want = json.loads((ref_out / f"result-a0-r{rank}.json").read_text())["weights"]
        got = json.loads((out / f"result-a1-r{rank}.json").read_text())["weights"]
        assert len(got) == len(want)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=0)
    assert ft_trained_ids(out, 1) == ft_trained_ids(ref_out, 0)

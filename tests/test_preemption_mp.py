"""Preemption under the real launchers, 2 processes: SIGTERM loses no step.

The job (tests/multiproc/ft_train.py, ``model.fit`` with ``hvdkit.Checkpointer``)
holds every rank inside step 8 until the test has sent ``SIGTERM`` (to
``hvdkitrun``, to one rank, to the scheduler or to a worker) and the launcher
said it passed the signal on; each later step sleeps 0.05 s, so the 28 steps
left take longer than the ranks' one-second decision cadence on any machine.
Then:

* every launcher exits 75 and says the step the ranks stopped after;
* the checkpoint holds exactly that step, and no rank trained past it;
* the same command run again resumes from that step and ends with the
  weights of an uninterrupted run (bit-identical), every sample of every
  epoch trained exactly once over the two runs.

No test bounds wall-clock time: the subprocess timeouts only turn a hang into
a failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from test_launch_mp import PY, SCHEDULER_SH, WORKERS_SH, free_port, sched_env
from test_restart_mp import ft_trained_ids

from conftest import MULTIPROC, VENV_BIN, launcher_env, uninterrupted_fit

FT_TRAIN = str(MULTIPROC / "ft_train.py")
HVDKITRUN = str(VENV_BIN / "hvdkitrun")
HANG = 600  # seconds: only a hang gets near this
HOLD = 8  # the step every rank waits in until the signal is on its way
STEPS = 36  # 3 epochs of 96 samples, 2 ranks x 4 per step
EXIT_PREEMPTED = 75


def train_args(out: Path, attempt: int, *extra: str) -> list[str]:
    return [PY, FT_TRAIN, str(out), "--mode", "fit", "--attempt", str(attempt), *extra]


def held_args(out: Path) -> list[str]:
    go = out / "go"
    return ["--hold", str(HOLD), "--hold-until", str(go), "--step-sleep", "0.05"]


class Job:
    """Processes started with their output in files, read while they run."""

    def __init__(self, root: Path):
        self.root, self.procs = root, {}

    def start(self, name: str, cmd: list[str], env: dict) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "w")
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=self.root
        )
        self.procs[name] = proc
        return proc

    def output(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text()

    def wait_until(self, what: str, ready) -> None:
        """Until ``ready()``; fails at once if a process of the job ended first."""
        deadline = time.monotonic() + HANG
        while not ready():
            ended = {n: p.returncode for n, p in self.procs.items() if p.poll() is not None}
            assert not ended, f"{what}: ended first: {ended}\n" + self.tails()
            assert time.monotonic() < deadline, f"{what}: still not after {HANG} s\n" + self.tails()
            time.sleep(0.1)

    def finish(self) -> dict[str, int]:
        return {n: p.wait(timeout=HANG) for n, p in self.procs.items()}

    def tails(self) -> str:
        return "\n".join(f"--- {n}\n{self.output(n)[-3000:]}" for n in self.procs)


def held_pids(out: Path) -> dict[int, int]:
    return {r: int((out / f"held-r{r}").read_text()) for r in (0, 1)}


def wait_held(job: Job, out: Path) -> None:
    job.wait_until(
        f"both ranks held in step {HOLD}",
        lambda: all((out / f"held-r{r}").exists() for r in (0, 1)),
    )


def forwarded(job: Job, name: str) -> bool:
    return "SIGTERM: asked" in job.output(name)


def ids_steps(out: Path, attempt: int, rank: int) -> list[int]:
    lines = (out / f"ids-a{attempt}-r{rank}.jsonl").read_text().splitlines()[1:]
    return [json.loads(line)["step"] for line in lines]


def result(out: Path, attempt: int, rank: int) -> dict:
    return json.loads((out / f"result-a{attempt}-r{rank}.json").read_text())


def check_preempted(out: Path, said: str) -> int:
    """The step P of the launcher's line ``said``: no rank trained past it, the newest
    checkpoint holds it, and no rank left ``fit``."""
    step = int(said.split("after step ")[1].split()[0].rstrip(",;"))
    assert HOLD <= step < STEPS, said
    for rank in (0, 1):
        assert ids_steps(out, 0, rank)[-1] == step, (rank, ids_steps(out, 0, rank)[-3:], step)
        assert not (out / f"result-a0-r{rank}.json").exists()
    assert sorted(p.name for p in (out / "ckpt").glob("ckpt-*"))[-1] == f"ckpt-{step:010d}"
    return step


def check_resumed(out: Path, ref_out: Path, step: int) -> None:
    """The run after the preemption resumed at ``step`` and ended as the uninterrupted one."""
    for rank in (0, 1):
        got, want = result(out, 1, rank), result(ref_out, 0, rank)
        assert got["resumed_from"] == step and got["final_step"] == want["final_step"] == STEPS
        assert ids_steps(out, 1, rank)[0] == step + 1  # zero lost steps: none redone, none skipped
        np.testing.assert_array_equal(np.asarray(got["weights"]), np.asarray(want["weights"]))
    assert ft_trained_ids(out, 1) == ft_trained_ids(ref_out, 0)


def hvdkitrun(transport: str, out: Path, attempt: int, *extra: str) -> list[str]:
    return [HVDKITRUN, "-np", "2", f"--{transport}", *train_args(out, attempt, *extra)]


@pytest.mark.parametrize(
    ("transport", "target"), [("gloo", "hvdkitrun"), ("mpi", "rank 1"), ("mpi", "hvdkitrun")]
)
def test_sigterm_stops_hvdkitrun_at_a_common_step_and_the_rerun_loses_nothing(
    tmp_path, tmp_path_factory, transport, target
):
    ref = uninterrupted_fit(tmp_path_factory)
    out = tmp_path / "job"
    out.mkdir()
    job = Job(tmp_path)
    launcher = job.start("run1", hvdkitrun(transport, out, 0, *held_args(out)), launcher_env())
    wait_held(job, out)
    if target == "hvdkitrun":
        launcher.send_signal(signal.SIGTERM)
        job.wait_until("hvdkitrun passed SIGTERM on", lambda: forwarded(job, "run1"))
    else:  # the rank's own handler notes it; the other rank learns at the next decision
        os.kill(held_pids(out)[1], signal.SIGTERM)
    (out / "go").touch()
    assert job.finish() == {"run1": EXIT_PREEMPTED}, job.tails()
    said = [ln for ln in job.output("run1").splitlines() if "hvdkitrun: preempted" in ln]
    assert len(said) == 1, job.tails()
    step = check_preempted(out, said[0])

    rerun = subprocess.run(
        hvdkitrun(transport, out, 1),
        capture_output=True,
        text=True,
        env=launcher_env(),
        cwd=tmp_path,
        timeout=HANG,
    )
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-4000:]
    check_resumed(out, ref, step)


def scheduler_job(tmp_path: Path, out: Path, attempt: int, port: int, *extra: str) -> Job:
    env = {**launcher_env(), **sched_env(port)}
    job = Job(tmp_path)
    job.start(f"scheduler{attempt}", [SCHEDULER_SH], env)
    for w in (0, 1):
        job.start(f"worker{attempt}.{w}", [WORKERS_SH, "1", *train_args(out, attempt, *extra)], env)
    return job


@pytest.mark.parametrize("target", ["scheduler", "worker"])
def test_sigterm_to_the_scheduler_or_a_worker_preempts_the_job_and_the_rerun_loses_nothing(
    tmp_path, tmp_path_factory, target
):
    ref = uninterrupted_fit(tmp_path_factory)
    out = tmp_path / "job"
    out.mkdir()
    port = free_port()
    job = scheduler_job(tmp_path, out, 0, port, *held_args(out))
    wait_held(job, out)
    if target == "scheduler":
        job.procs["scheduler0"].send_signal(signal.SIGTERM)
        told = ("worker0.0", "worker0.1")
    else:  # run_workers.sh passes it on to its worker, which passes it on to its rank
        job.procs["worker0.1"].send_signal(signal.SIGTERM)
        told = ("worker0.1",)
    job.wait_until("a worker passed SIGTERM on", lambda: any(forwarded(job, n) for n in told))
    (out / "go").touch()
    codes = job.finish()
    assert codes == dict.fromkeys(job.procs, EXIT_PREEMPTED), job.tails()
    said = [ln for ln in job.output("scheduler0").splitlines() if "job preempted" in ln]
    assert len(said) == 1, job.tails()
    step = check_preempted(out, said[0])

    rerun = scheduler_job(tmp_path, out, 1, free_port())
    codes = rerun.finish()
    assert codes == dict.fromkeys(rerun.procs, 0), rerun.tails()
    check_resumed(out, ref, step)


def test_a_job_that_cannot_stop_in_the_grace_period_is_stopped_and_says_so(tmp_path):
    """The ranks hold forever (never told to go): hvdkitrun ends the job after the grace."""
    out = tmp_path / "job"
    out.mkdir()
    job = Job(tmp_path)
    env = {**launcher_env(), "HVDKIT_PREEMPT_GRACE": "3"}
    launcher = job.start("run", hvdkitrun("gloo", out, 0, *held_args(out)), env)
    wait_held(job, out)
    launcher.send_signal(signal.SIGTERM)
    codes = job.finish()
    text = job.output("run")
    assert codes == {"run": 128 + signal.SIGTERM}, job.tails()
    assert "SIGTERM: asked 2 rank process(es)" in text
    assert "hvdkitrun: preempted" not in text
    assert not list((out / "ckpt").glob("ckpt-*")) or all(
        int(p.name[5:]) < HOLD for p in (out / "ckpt").glob("ckpt-*")
    )

"""hvdkit on a real Slurm (Debian's slurm-wlm 22.05): two nodes, each in its own namespaces.

One cluster for the whole file (tests/slurm_cluster.py). What users run:
``sbatch examples/slurm/train.sbatch`` over MPI (srun --mpi=pmix, the cluster's
default) and over Gloo (a cluster without PMIx: hvdkit starts the rendezvous),
spanning both nodes; ``examples/slurm/requeue.sbatch`` interrupted by a
preemption (``scontrol requeue``) and by a SIGTERM like the one ``--signal``
sends before the time limit, then requeued and resumed with the weights of an
uninterrupted run; and each bad setting with the message it gets.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from slurm_cluster import FINISHED, SlurmCluster, missing

from conftest import REPO, launcher_env

WHY_NOT = missing()
pytestmark = pytest.mark.skipif(
    WHY_NOT is not None,
    reason=f"NOT TESTED: hvdkit under Slurm (sbatch, srun, requeue): {WHY_NOT}; run "
    "scripts/test.sh as root (scripts/install.sh installs slurm-wlm and munge)",
)
TRAIN = str(REPO / "examples" / "slurm" / "train.sbatch")
REQUEUE = str(REPO / "examples" / "slurm" / "requeue.sbatch")
PROG = "tests/multiproc/slurm_prog.py"
DEMO_ACCURACY = "held-out accuracy 0.9778 (352/360 test digits)"  # scripts/demo.sh's
POLL_S = 0.1
JOB_POLL_S = 0.5  # as SlurmCluster.wait polls


@pytest.fixture(scope="module")
def cluster():
    with SlurmCluster(mpi_default="pmix") as c:
        yield c


def submit(cluster: SlurmCluster, name: str, *args: str, env: dict | None = None):
    """sbatch from the repository (the programs' paths are relative to it); (job id, output)."""
    out = cluster.root / "shared" / f"{name}.out"
    job = cluster.sbatch(
        "--chdir",
        str(REPO),
        "-o",
        str(out),
        *args,
        env={**launcher_env(sklearn=True), **(env or {})},
    )
    return job, out


def text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def wait_for(predicate, what: str, cluster: SlurmCluster, job: int, out: Path, timeout=300.0):
    """Poll ``predicate`` until it is true (its value), failing with the job's state, the
    cluster's and the job's output if the job ends first or ``timeout`` s pass."""
    deadline = time.monotonic() + timeout
    next_look = 0.0  # the job's state costs an scontrol process: every JOB_POLL_S
    while True:
        value = predicate()
        if value:
            return value
        now = time.monotonic()
        if now < next_look:
            time.sleep(POLL_S)
            continue
        next_look = now + JOB_POLL_S
        state = cluster.job(job).get("JobState")
        ended = state in FINISHED and not predicate()
        if ended or time.monotonic() > deadline:
            why = f"job {job} ended {state}" if ended else f"after {timeout:g} s"
            raise TimeoutError(
                f"{what} ({why})\n--- job output\n{text(out)}\n{cluster.report(job)}"
            )
        time.sleep(POLL_S)


@pytest.fixture(scope="module")
def training(cluster):
    """The three ways to train, submitted together (Slurm runs them as nodes free up)."""
    return {
        # srun over MPI: the cluster's MpiDefault is pmix
        "mpi": submit(cluster, "train-mpi", TRAIN),
        # srun over Gloo: a cluster without PMIx; hvdkit starts Horovod's rendezvous
        "gloo": submit(cluster, "train-gloo", TRAIN, env={"SLURM_MPI_TYPE": "none"}),
        # hvdkitrun in a one-node allocation: its hosts and slots from Slurm, no -H
        "hvdkitrun": submit(
            cluster,
            "train-hvdkitrun",
            "-N1",
            "--ntasks-per-node=2",
            "--wrap",
            "hvdkitrun python examples/train_digits.py",
        ),
    }


@pytest.mark.parametrize("how", ["mpi", "gloo", "hvdkitrun"])
def test_sbatch_trains_to_the_demos_accuracy(cluster, training, how):
    job, out = training[how]
    info = cluster.wait(job)
    log = text(out)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert "training on 1437 digits with 2 process(es), 719 per process" in log
    assert DEMO_ACCURACY in log, log
    if how == "hvdkitrun":
        assert (info["NodeList"], info["NumNodes"]) == ("n1", "1")
        assert "hvdkitrun: transport mpi (2 processes" in log
    else:  # two nodes, one rank each
        assert (info["NodeList"], info["NumNodes"]) == ("n[1-2]", "2")


def fingerprint(log: str) -> tuple[str, str]:
    found = re.findall(r"done at step (\d+); weights fingerprint (\w+)", log)
    assert len(found) == 1, log
    return found[0]


@pytest.fixture(scope="module")
def reference(cluster):
    """The uninterrupted run: its final step and weights fingerprint."""
    job, out = submit(
        cluster,
        "requeue-reference",
        REQUEUE,
        "--epochs",
        "2",
        env={"HVDKIT_CHECKPOINT_DIR": str(cluster.root / "shared" / "ckpt-reference")},
    )
    info = cluster.wait(job)
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "0"), text(out)
    return fingerprint(text(out))


@pytest.mark.parametrize("how", ["scontrol requeue", "scancel --signal=TERM"])
def test_preempted_job_is_requeued_and_resumes_bit_identical(cluster, reference, how):
    """``scontrol requeue``: Slurm requeues; SIGTERM alone (what ``--signal=TERM@N`` sends
    before the time limit): hvdkit stops at a step, saves it and requeues the job itself."""
    tag = how.split()[0]
    ckpt = cluster.root / "shared" / f"ckpt-{tag}"
    job, out = submit(
        cluster,
        f"requeue-{tag}",
        REQUEUE,
        "--epochs",
        "2",
        "--step-sleep",
        "0.3",
        env={"HVDKIT_CHECKPOINT_DIR": str(ckpt)},
    )
    # interrupt once a checkpoint is on disk, mid-training
    wait_for(lambda: list(ckpt.glob("ckpt-*")), f"no checkpoint in {ckpt}", cluster, job, out)
    cluster.run(*how.split(), str(job))
    signalled = time.monotonic()
    started = wait_for(
        lambda: (
            cluster.job(job).get("Restarts") == "1"
            and cluster.job(job).get("JobState") == "RUNNING"
            and time.monotonic()
        ),
        "the job was not requeued and started again",
        cluster,
        job,
        out,
    )
    resumed = wait_for(
        lambda: "attempt 1:" in text(out) and time.monotonic(),
        "the requeued job did not resume",
        cluster,
        job,
        out,
    )
    info = cluster.wait(job)
    log = text(out)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), log
    stop = re.search(
        r"hvdkit: stopped for SIGTERM after step (\d+); checkpoint on disk ([\d.]+) s after the "
        r"signal; (.*)",
        log,
    )
    assert stop, log
    step = stop.group(1)
    said = {
        "scontrol": f"Slurm is ending job {job} (COMPLETING): if it requeues it, it resumes",
        "scancel": f"requeued job {job}: it resumes from this step when it runs again",
    }[tag]
    assert stop.group(3).startswith(said), stop.group(3)
    assert f"attempt 1: 2 rank(s), resuming from step {step}" in log
    assert 0 < int(step) < int(reference[0])
    assert fingerprint(log) == reference  # same final step, bit-identical weights
    print(
        f"\n[slurm requeue, {how}] signal -> checkpoint on disk {stop.group(2)} s; "
        f"requeued run RUNNING -> training resumed {resumed - started:.2f} s; "
        f"signal -> resumed {resumed - signalled:.1f} s (cred_expire 5 s)"
    )


BAD_INPUT = f"""#!/bin/bash
out="$1"
HOROVOD_CONTROLLER=mpi srun --mpi=none -o "$out/no-pmix.%t" python {PROG}
HVDKIT_WORKER_NUM=3 srun -o "$out/worker-num.%t" python {PROG}
HVDKIT_SCHED_TIMEOUT=3 srun --mpi=none -o "$out/no-rendezvous.%t" bash -c \\
    'if [ "$SLURM_PROCID" = 0 ]; then sleep 8; else exec python {PROG}; fi'
python {PROG} > "$out/no-srun.0" 2>&1
srun -N1 -n1 --mpi=none -o "$out/one-task.%t" python {PROG}
exit 0
"""


def test_bad_settings_say_which_sbatch_line_to_change(cluster):
    shared = cluster.root / "shared"
    outs = shared / "bad"
    outs.mkdir()
    script = shared / "bad.sbatch"
    script.write_text(BAD_INPUT)
    job, log = submit(cluster, "bad", "-N2", "--ntasks-per-node=1", str(script), str(outs))
    # 1 task; the time limit is within the grace period
    short, short_log = submit(
        cluster,
        "short",
        "-n1",
        "--time=1",
        "--wrap",
        f"srun python {PROG} watch",
        env={"HVDKIT_PREEMPT_GRACE": "90"},
    )
    # --requeue and a time limit, but no --signal line
    nosig, nosig_log = submit(
        cluster, "nosignal", "-n1", "--time=5", "--requeue", "--wrap", f"srun python {PROG} watch"
    )
    for j in (job, short, nosig):
        cluster.wait(j)

    def said(name: str, rank: int = 0) -> str:
        return " ".join(text(outs / f"{name}.{rank}").split())

    for rank in (0, 1):
        assert (
            "HOROVOD_CONTROLLER=mpi but srun started this task without PMIx, so MPI cannot find "
            "the other tasks and each would train alone. Add '#SBATCH --mpi=pmix'"
        ) in said("no-pmix", rank), said("no-pmix", rank)
        assert (
            "HVDKIT_WORKER_NUM='3' but srun started 2 tasks (SLURM_STEP_NUM_TASKS=2). Under srun "
            "every task is a worker: set '#SBATCH --ntasks=3'"
        ) in said("worker-num", rank)
    assert re.search(
        r"rank 0's Gloo rendezvous on n1 \(10\.[\d.]+:\d+\) did not answer within 3 s "
        r"\(HVDKIT_SCHED_TIMEOUT;",
        said("no-rendezvous", 1),
    ), said("no-rendezvous", 1)
    assert (
        "which has 2 tasks (SLURM_NTASKS), but it was started without srun, so it would train "
        "alone as a job of size 1. Start it with `srun python ...`"
    ) in said("no-srun"), said("no-srun")
    short_text = " ".join(text(short_log).split())
    assert (
        "the job's time limit (00:01:00) is not longer than hvdkit's preemption grace period "
        "(90 s, HVDKIT_PREEMPT_GRACE): the job could not stop at a step with a checkpoint "
        "before Slurm kills it. Raise '#SBATCH --time'"
    ) in short_text, short_text
    nosig_text = " ".join(text(nosig_log).split())
    assert (
        "this job may be requeued ('--requeue') and has a time limit (00:05:00), but its script "
        "has no '#SBATCH --signal' line" in nosig_text
    ), nosig_text
    assert "'#SBATCH --signal=TERM@60'" in nosig_text
    assert "rank 0 of 1" in nosig_text  # a warning: the job goes on
    assert said("one-task").endswith("rank 0 of 1")  # one task without PMIx: the size-1 job

"""Ranks alive but in different collectives end with an error naming what each waits in.

Each case runs tests/multiproc/divergence_prog.py under hvdkitrun with a
9 s stall timeout. No speed is asserted: the stuck report and exit status
124 say that hvdkitrun ended the job; each rank's watch, started at the
divergence, prints ``WATCH EXPIRED`` only after ten stall timeouts, so that
a job hvdkitrun failed to end is a failure here rather than a hang.
"""

from __future__ import annotations

import re
import sys

import pytest

from conftest import (
    MULTIPROC,
    horovodrun,
    hvdkitrun,
    launcher_env,
    run_bounded,
    start_in_session,
)

PROG = str(MULTIPROC / "divergence_prog.py")
STALL_S = 9
WATCH_S = 10 * STALL_S  # a hang guard, far beyond any load
EXIT_STALLED = 124  # hvdkitrun's status for a stalled or stuck job


def run_diverging(tmp_path, transport, *args):
    cmd = hvdkitrun(
        transport, PROG, *args, "--watch", WATCH_S, options=("--stall-timeout", STALL_S)
    )
    code, out, timed_out = run_bounded(cmd, 600, env=launcher_env(), cwd=tmp_path)
    assert not timed_out, f"the job hung:\n{out[-3000:]}"
    return code, out


def assert_stuck(code, out, *fragments):
    assert code == EXIT_STALLED, (code, out[-3000:])
    assert f"ranks stuck in different collectives for more than {STALL_S} s" in out, out[-3000:]
    for fragment in fragments:
        assert fragment in out, (fragment, out[-3000:])
    assert "diverging at step 3" in out  # the watch was started
    assert "WATCH EXPIRED" not in out, out[-3000:]  # hvdkitrun ended it, not the watch
    assert re.search(r"finished \d+ steps", out) is None  # no rank got to the end


@pytest.mark.parametrize("transport", ["gloo", "mpi"])
def test_extra_allreduce_on_one_rank(tmp_path, transport):
    code, out = run_diverging(tmp_path, transport, "extra")
    assert_stuck(
        code,
        out,
        "rank 0 waits in gradient allreduce (step 3)",
        "rank 1 waits in allreduce 'extra'",
    )


@pytest.mark.parametrize("transport", ["gloo", "mpi"])
def test_skipped_step_on_one_rank(tmp_path, transport):
    # rank 1's later allreduces pair with rank 0's earlier ones (the same
    # operation, one step apart); at the end rank 1 gathers the weights while
    # rank 0 still waits for its last gradient allreduce.
    code, out = run_diverging(tmp_path, transport, "skip")
    assert_stuck(
        code, out, "rank 0 waits in gradient allreduce (step 7)", "rank 1 waits in allgather 'w'"
    )


# MPI only: which collective each rank waits in is hvdkit's own record, the
# same over both transports (extra and skip above check it over both).
@pytest.mark.parametrize("transport", ["mpi"])
def test_allgather_against_allreduce(tmp_path, transport):
    code, out = run_diverging(tmp_path, transport, "gather_vs_reduce")
    assert_stuck(code, out, "rank 0 waits in allgather 'g'", "rank 1 waits in allreduce 'r'")


@pytest.mark.parametrize("transport", ["gloo", "mpi"])
def test_long_rank0_only_section(tmp_path, transport):
    code, out = run_diverging(tmp_path, transport, "rank0_section", "--sleep", "3600")
    assert_stuck(
        code,
        out,
        "rank 0 is in no hvdkit collective",
        "rank 1 waits in gradient allreduce (step 3)",
    )
    assert "rank-0-only section done" not in out


@pytest.mark.parametrize("transport", ["gloo", "mpi"])
def test_short_rank0_only_section_completes(tmp_path, transport):
    code, out = run_diverging(tmp_path, transport, "rank0_section", "--sleep", "3")
    assert code == 0, out[-3000:]
    assert "rank-0-only section done" in out
    assert "[rank 0] finished 8 steps" in out and "[rank 1] finished 8 steps" in out
    assert "stuck" not in out


def test_scheduler_worker_launch_names_the_stuck_rank(tmp_path):
    import socket

    from conftest import REPO

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = launcher_env()
    env.update(
        HVDKIT_SCHED_HOST="127.0.0.1",
        HVDKIT_SCHED_PORT=str(port),
        HVDKIT_JOB_TOKEN="test-token",
        HVDKIT_WORKER_NUM="2",
        HVDKIT_SCHED_TIMEOUT="120",
        HVDKIT_STALL_TIMEOUT=str(STALL_S),
    )
    cluster = REPO / "examples" / "cluster"

    def start(cmd):
        return start_in_session(cmd, env=env, cwd=tmp_path)

    sched = start([str(cluster / "run_scheduler.sh")])
    # rank 0 in a long rank-0-only section: only rank 1's worker sees a rank
    # waiting; the scheduler asks rank 0's worker what rank 0 is doing
    prog = [sys.executable, PROG, "rank0_section", "--sleep", "3600", "--watch", str(WATCH_S)]
    workers = [start([str(cluster / "run_workers.sh"), "1", *prog]) for _ in range(2)]
    results = [p.communicate(timeout=600) for p in [sched, *workers]]
    codes = [p.returncode for p in [sched, *workers]]
    sched_out = results[0][0]
    everything = "".join(out for out, _ in results)
    assert all(c != 0 for c in codes), (codes, everything[-3000:])
    assert "rank 1 failed: ranks stuck in different collectives" in sched_out, sched_out[-3000:]
    assert "rank 1 waits in gradient allreduce (step 3)" in sched_out, sched_out[-3000:]
    # 4 done: 3 steps' gradient allreduces and hvdkit's same-start check at the first
    meanwhile = "rank 0 is in no hvdkit collective (busy in its own code; 4 done) meanwhile"
    assert meanwhile in sched_out, sched_out[-3000:]
    final = [ln for ln in sched_out.splitlines() if "job failed: rank 1 " in ln]
    assert len(final) == 1, sched_out[-3000:]
    assert final[0].endswith(
        "Meanwhile rank 0 is in no hvdkit collective (busy in its own code; 4 done); "
        "its last lines:"
    ), final
    assert "diverging at step 3" in everything
    assert "WATCH EXPIRED" not in everything, everything[-3000:]


def test_plain_horovodrun_warns(tmp_path):
    # No hvdkit launcher: each rank warns on stderr once a wait passes the
    # stall timeout. The job itself would hang, so it is stopped (its own
    # session only) as soon as the warning has been seen.
    import os
    import signal

    env = launcher_env()
    env["HVDKIT_STALL_TIMEOUT"] = "10"
    proc = start_in_session(horovodrun("gloo", PROG, "extra"), env=env, cwd=tmp_path)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if "hvdkit: WARNING: rank" in line and "has waited in" in line:
                break
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    warning = seen[-1] if seen else ""
    assert "has waited in" in warning, "".join(seen)[-3000:]
    assert (
        "rank 1 has waited in allreduce 'extra'" in warning
        or "rank 0 has waited in gradient allreduce (step 3)" in warning
    ), warning
    assert "stall timeout 10 s" in warning

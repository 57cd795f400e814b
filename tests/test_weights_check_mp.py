"""The launchers' end-of-job weight comparison (issue 51): ranks that end with different weights
fail the job, naming them, under ``hvdkitrun --check-weights`` (Gloo and MPI) and under the
scheduler/worker launch with ``HVDKIT_CHECK_WEIGHTS=1``.

The ranks here write their fingerprints without TensorFlow (tests/multiproc/weights_prog.py), so
each job starts in about a second; the ranks that write them from trained Keras weights are in
test_user_scripts_mp.py, and equal weights pass under every launcher in test_launch_mp.py's
``test_same_weights_under_every_launcher``.
"""

from __future__ import annotations

import json

from test_launch_mp import PY, SCHEDULER_SH, WORKERS_SH, finish, free_port, run, sched_env, start

from hvdkit import config

from conftest import MULTIPROC, hvdkitrun

PROG = str(MULTIPROC / "weights_prog.py")
NAMED = "the ranks ended with different trainable weights: 2 groups (rank 0; rank 1) differ in "


def test_hvdkitrun_check_weights_names_the_ranks_that_differ(transport, tmp_path):
    shared = tmp_path / "shared"  # given: kept; a stale file of an earlier job is cleared
    shared.mkdir()
    (shared / "rank.5.json").write_text(json.dumps({"rank": 5, "variables": []}))
    given = {config.WEIGHTS_DIR: str(shared)} if transport == "mpi" else {}
    cmd = hvdkitrun(transport, PROG, "apart", options=("--check-weights",))
    proc = run(cmd, tmp_path, env_extra=given)
    assert proc.returncode == config.EXIT_WEIGHTS_DIFFER == 70, proc.output[-3000:]
    assert f"hvdkitrun: {NAMED}dense/kernel. Each group trained its own model" in proc.stderr
    assert "dense/bias" not in proc.stderr and "rank 5" not in proc.stderr
    if given:
        assert sorted(p.name for p in shared.iterdir()) == ["rank.0.json", "rank.1.json"]
    equal = run(hvdkitrun(transport, PROG, "equal", options=("--check-weights",)), tmp_path)
    assert equal.returncode == 0 and "different trainable weights" not in equal.output
    assert "wrote no weight fingerprint" not in equal.output
    silent = run(hvdkitrun(transport, "-c", "pass", options=("--check-weights",)), tmp_path)
    assert silent.returncode == 0, silent.output[-3000:]  # nothing to compare is said, not failed
    assert (
        "hvdkitrun: --check-weights: ranks 0, 1 of 2 wrote no weight fingerprint, so no rank "
        "was compared: a rank writes one at exit after hvdkit.init()"
    ) in silent.stderr


def test_scheduler_check_weights_names_the_ranks_that_differ(tmp_path):
    folder = tmp_path / "weights"
    env = sched_env(
        free_port(),
        HVDKIT_SCHED_HOST="127.0.0.1",
        **{config.CHECK_WEIGHTS: "1", config.WEIGHTS_DIR: folder},
    )
    sched = start([SCHEDULER_SH], env, tmp_path)
    workers = [start([WORKERS_SH, "1", PY, PROG, "apart"], env, tmp_path) for _ in range(2)]
    (code, out), *ended = [finish(p) for p in [sched, *workers]]
    assert code == 70, out
    assert f"job failed: {NAMED}dense/kernel" in out, out
    assert "all 2 ranks finished successfully" not in out
    assert [c for c, _ in ended] == [1, 1], ended  # a worker of a failed job: 1 (worker.py)

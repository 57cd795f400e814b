"""A worker's network is cut (namespaces): it is lost, and the others go on in-process.

Host A runs the scheduler and two workers of an elastic job
(``HVDKIT_ELASTIC=1``, ``HVDKIT_MIN_WORKERS=2``), host B one worker; B's link
goes down at step 12. No connection closes: scheduler and worker each hear
nothing, not even a keep-alive, for the silence limit (the stall timeout,
at least 10 s) and count the other as lost; the two others go on in their
processes from the last save and finish the job with every sample trained.

The chaos test with three faults in one job is tests/test_chaos_three_faults_mp.py.

No test bounds wall-clock time: the waits' deadlines only turn a hang into a
failure.
"""

from __future__ import annotations

import os
import re
import subprocess
import time

import numpy as np
from test_elastic_mp import (
    FT_TRAIN,
    HANG,
    PY,
    SCHEDULER_SH,
    WORKERS_SH,
    Job,
    final_weights,
    trained_ids,
)
from test_launch_mp import namespace_pair, sched_env

from conftest import launcher_env, needs_netns


@needs_netns("a worker's network cut (namespaces)")
def test_a_worker_whose_network_is_cut_is_lost_and_the_others_go_on(tmp_path):
    """Host A: the scheduler and two workers; host B: one worker, whose link goes down."""
    tag = str(os.getpid() % 100000)
    if_b = f"cb{tag}"
    with namespace_pair(f"ca{tag}", if_b) as (a, b):
        out = tmp_path / "out"
        out.mkdir()
        env = {
            **launcher_env(),
            **sched_env(
                29731,
                worker_num=3,
                HVDKIT_SCHED_HOST="10.213.7.1",
                HVDKIT_MIN_WORKERS="2",
                HVDKIT_ELASTIC="1",
                HVDKIT_STALL_TIMEOUT="8",  # silence limit: max(8, 10) = 10 s
            ),
        }
        job = Job(tmp_path, env)
        train = [PY, FT_TRAIN, str(out), "--mode", "elastic", "--epochs", "3"]
        train += ["--samples", "96", "--every", "5", "--step-sleep", "0.3"]
        job.start("scheduler", ["ip", "netns", "exec", a, SCHEDULER_SH])
        for i in range(2):
            job.start(f"a{i}", ["ip", "netns", "exec", a, WORKERS_SH, "1", *train])
        job.wait_for("scheduler", "worker 2/3 registered")  # A's workers are ranks 0 and 1
        job.start("b", ["ip", "netns", "exec", b, WORKERS_SH, "1", *train])
        steps = out / "ids-a0-r0.jsonl"
        deadline = time.monotonic() + HANG
        while not (steps.exists() and '"step": 12' in steps.read_text()):
            assert time.monotonic() < deadline and job.procs["b"].poll() is None, job.output("b")
            time.sleep(0.1)
        subprocess.run(["ip", "-n", b, "link", "set", if_b, "down"], check=True)
        result = job.finish()
    report = "\n".join(f"--- {n} ({c})\n{o[-3000:]}" for n, (c, o) in result.items())
    sched = result["scheduler"][1]
    assert result["scheduler"][0] == 0, report
    assert re.search(
        r"rank 2 lost its worker \(pid \d+ on \S+ 10\.213\.7\.2\): no word for 10 s; "
        r"2 of 3 workers go on in-process as round 1",
        sched,
    ), report
    assert "round 1: 2 ranks train again from step 10" in sched, report
    # B's worker, cut off too, stops its rank instead of waiting forever
    assert result["b"][0] != 0 and "not even a keep-alive" in result["b"][1], report
    assert "rank 2 stopped: lost the connection to the scheduler" in result["b"][1], report
    assert [c for n, (c, _) in result.items() if n in ("a0", "a1")] == [0, 0], report
    weights = final_weights(out)
    assert len(weights) == 2, report
    np.testing.assert_array_equal(weights[0], weights[1])
    for epoch, counts in trained_ids(out).items():
        assert set(counts) == set(range(96)), (epoch, counts)

"""hvdkit keeps a second TensorFlow inter-op thread in a rank bound to one core.

Without it a bucket's allreduce waits for the end of the backward pass
(hvdkit/runtime.py). TensorFlow's thread pools are fixed when its first op
runs, so each case runs in a fresh process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import os, sys
os.sched_setaffinity(0, set(map(int, sys.argv[1].split(","))))
import tensorflow as tf
if sys.argv[2] != "0":
    tf.config.threading.set_inter_op_parallelism_threads(int(sys.argv[2]))
from hvdkit import runtime
runtime._keep_a_second_inter_op_thread()
print("inter_op", tf.config.threading.get_inter_op_parallelism_threads())
"""


def inter_op_after(cores: str, user_setting: int) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, cores, str(user_setting)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
        check=True,
    ).stdout
    return int(out.split("inter_op")[-1])


@pytest.mark.skipif(
    os.cpu_count() < 2, reason="NOT TESTED: 1 against 2 inter-op threads (needs 2 cores)"
)
def test_one_core_gets_two_inter_op_threads_unless_the_user_chose():
    assert inter_op_after("0", 0) == 2
    assert inter_op_after("0", 3) == 3  # the user's setting wins
    assert inter_op_after("0,1", 0) == 0  # TensorFlow's default already gives 2

"""Sink mode on 2 ranks: rank 1's input pipeline fails inside a sink.

Rank 1 cannot produce step 3's batch. It records its error and stays alive
until rank 0 has failed too (rank 0 leaves a marker file; at most 120 s), so
rank 0 can only be released by hvdkit shutting rank 1's runtime down, not by
rank 1's exit; then it records when it leaves and re-raises: the job ends
non-zero. Rank 0 records where and when it failed.

Usage: sink_input_error_worker.py OUTDIR
"""

import os
import sys
import time

import tensorflow as tf

import hvdkit as hvd
from hvdkit import sink
from hvdkit.errors import InputPipelineError

from _harness import Checks

hvd.init()
r = hvd.rank()
c = Checks(r, sys.argv[1])


def check(i):
    if r == 1:
        tf.debugging.assert_none_equal(i, tf.constant(7, tf.int64), message="bad record 7")
    return tf.cast(i, tf.float32)


run = sink.data_sink(
    lambda b: hvd.allreduce(tf.reduce_sum(b), op=hvd.Sum),
    tf.data.Dataset.range(10).map(check).batch(2),
    sink_size=3,
)
c.record("first_call", float(run()))  # steps 0-2
try:
    run()  # step 3: rank 1 cannot produce [6 7]; rank 0 waits in its allreduce
except (InputPipelineError, tf.errors.OpError) as exc:
    c.record("failed_at", time.time())
    c.record("error_type", type(exc).__name__)
    c.record("step", getattr(exc, "step", None))
    c.record("message", str(exc))
    c.record("notes", getattr(exc, "__notes__", []))
    c.record("initialized_after", hvd.is_initialized())
    released = os.path.join(sys.argv[1], "rank0_failed")
    if r == 1:
        # Stay alive until rank 0 has failed (an ordering hook, not a sleep): if only
        # rank 1's exit could release rank 0, rank 0 never writes the marker and rank 1
        # leaves after the bound, before rank 0 fails, and the test sees that order.
        deadline = time.monotonic() + 120
        while not os.path.exists(released) and time.monotonic() < deadline:
            time.sleep(0.05)
        c.record("left_at", time.time())
        raise
    open(released, "w").close()
    sys.exit(0)
raise AssertionError("the input error was not raised")

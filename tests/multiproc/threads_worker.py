"""HVDKIT_COMM_PRIORITY=1 on 2 ranks: Horovod's threads on SCHED_RR under Gloo only, training exact.

Run with the variable set (tests/test_threads_mp.py). Under Gloo every thread
Horovod started in ``init()`` is on ``SCHED_RR`` at priority 1 when this
process may set it (CI runs as root), TensorFlow's threads and the main
thread are not; under MPI (its transport polls while it waits) nothing
changes. With the threads favoured, ``fit`` with one allreduce per gradient
still gives one process's weights on the global batch.
"""

import os
import sys
import threading

from _equal import assert_fit_matches_one_process
from _policies import assert_shutdown_puts_every_thread_back

import hvdkit as hvd
from hvdkit import runtime
from hvdkit._comm import threads as _threads

from _harness import Checks

assert os.environ.get("HVDKIT_COMM_PRIORITY") == "1", "run me with HVDKIT_COMM_PRIORITY=1"
hvd.init()
r, n = hvd.rank(), hvd.size()
c = Checks(r, sys.argv[1])
hvd_mpi = hvd.mpi_enabled()  # (asked before the shutdown)

with c.check("policies_of_horovods_threads"):
    backend = runtime.backend()
    alive = _threads.thread_ids()
    comm = [t for t in backend.comm_threads if t in alive]
    assert comm and threading.get_native_id() not in comm, (comm, backend.comm_threads)
    others = alive - set(comm)
    assert {os.sched_getscheduler(t) for t in others} == {os.SCHED_OTHER}, others
    policies = {os.sched_getscheduler(t) for t in comm}
    if hvd.mpi_enabled():
        assert policies == {os.SCHED_OTHER}, policies
        assert backend.comm_priority.startswith("off under MPI"), backend.comm_priority
    elif os.geteuid() == 0:
        assert policies == {os.SCHED_RR}, policies
        assert {os.sched_getparam(t).sched_priority for t in comm} == {_threads.PRIORITY}
        assert backend.comm_priority == (
            f"SCHED_RR priority 1 for {len(backend.comm_threads)} of Horovod's threads"
        ), backend.comm_priority
    else:
        assert policies == {os.SCHED_OTHER} and "not permitted" in backend.comm_priority

with c.check("fit_per_gradient_allreduces_equals_single_process"):
    assert_fit_matches_one_process(
        lambda opt: hvd.DistributedOptimizer(opt, bucket_bytes=0), "fit with favoured threads"
    )

with c.check("shutdown_puts_every_thread_back_on_the_normal_policy"):
    assert_shutdown_puts_every_thread_back(hvd, backend, hvd_mpi)

c.finish()

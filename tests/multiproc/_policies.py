"""Scheduling policies of this process's threads (tests of HVDKIT_COMM_PRIORITY)."""

import os

from hvdkit._comm import threads as _threads


def policies() -> dict[int, int]:
    """``{tid: policy}`` for every thread of this process now (ended ones skipped)."""
    found = {}
    for tid in _threads.thread_ids():
        try:
            found[tid] = os.sched_getscheduler(tid)
        except ProcessLookupError:  # ended meanwhile
            continue
    return found


def assert_shutdown_puts_every_thread_back(hvd, backend, mpi: bool) -> None:
    """``hvd.shutdown()``; then no thread is left on a real-time policy.

    Under Gloo some of the threads ``init`` started are still running after the
    shutdown (Gloo's socket loops): what makes putting them back matter.
    """
    started = set(backend.comm_threads)
    hvd.shutdown()
    after = policies()
    assert set(after.values()) == {os.SCHED_OTHER}, after
    if not mpi:
        assert started & set(after), (started, sorted(after))

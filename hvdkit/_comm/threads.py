"""Horovod's communication threads ahead of TensorFlow's compute: ``HVDKIT_COMM_PRIORITY``.

While the backward pass runs, TensorFlow's compute threads keep the CPU busy
and the threads that move the gradients (Horovod's background thread, Gloo's
socket loop) wait for a turn at each wake-up: after each message, each
segment of the ring. With the setting, hvdkit puts every thread Horovod
started in ``init()`` on the real-time round-robin policy (``SCHED_RR``,
priority 1), so they run the moment they wake; TensorFlow keeps the CPU in
between. Shutting Horovod down puts them back on the normal policy: Gloo's
socket loops outlive it. ``benchmarks/overlap.py``, one core per simulated host, every
variant in the same job (docs/performance.md):

* 1 Gbit/s (wire-bound): hidden fraction 0.64-0.80 -> 0.87-0.92 in four
  jobs, the step 1.03-1.07x raw Horovod's;
* 10 Gbit/s (the core, not the wire, bounds the allreduce): the step 6-10 %
  slower, as the favoured threads take the core more often.

Hence not always: ``1`` always, ``0`` never, and ``auto`` (the default when
the ranks span several hosts) tries both on the job's own steps and keeps
the faster (:mod:`hvdkit._comm.priority_trial`). Only under Gloo: Open MPI's TCP
transport polls while it waits (397 ms of CPU for a 398 ms allreduce here),
and a polling real-time thread would starve the backward pass. All of
Horovod's threads or none: favouring one of them alone made steps of 5-11 s
(a real-time thread waiting, on the one core, for a normal one).

Setting a real-time policy needs root, ``CAP_SYS_NICE`` or an
``RLIMIT_RTPRIO`` (``ulimit -r``) of at least 1; without them nothing changes
and :func:`favour` says why. Not measured on a GPU machine.

Example::

    before = thread_ids()
    hvd.init()                                   # starts Horovod's and Gloo's threads
    comm = started_since(before)                 # {tid: name}
    favour(comm)                                 # "SCHED_RR priority 1 for 3 of Horovod's threads"
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["thread_ids", "started_since", "favour", "unfavour"]

PRIORITY = 1  # the lowest real-time priority: ahead of every normal thread, behind any other
_TASKS = Path("/proc/self/task")


def thread_ids() -> set[int]:
    """Kernel ids of this process's threads now (empty where ``/proc`` has none)."""
    try:
        return {int(t) for t in os.listdir(_TASKS)}
    except OSError:
        return set()


def _name(tid: int) -> str:
    try:
        return (_TASKS / str(tid) / "comm").read_text().strip()
    except OSError:
        return ""


def started_since(before: set[int]) -> dict[int, str]:
    """Threads started after ``before`` was taken, ``{tid: name}``, TensorFlow's own left out.

    TensorFlow names its pool threads ``tf_*``; those are compute, not communication.
    """
    named = {tid: _name(tid) for tid in thread_ids() - before}
    return {tid: name for tid, name in named.items() if name and not name.startswith("tf_")}


def favour(tids) -> str:
    """Put ``tids`` on ``SCHED_RR`` at :data:`PRIORITY`; a line saying what happened.

    A thread that ended meanwhile is skipped. Without the permission the
    first refusal stops the attempt and the line says what is missing.
    """
    done = 0
    for tid in tids:
        try:
            os.sched_setscheduler(tid, os.SCHED_RR, os.sched_param(PRIORITY))
        except ProcessLookupError:
            continue
        except PermissionError:
            return (
                f"Horovod's threads keep the normal policy: setting SCHED_RR was not permitted "
                f"(needs root, CAP_SYS_NICE or `ulimit -r` >= {PRIORITY}); the gradient "
                "allreduce overlaps the backward pass less on a busy CPU."
            )
        done += 1
    return f"SCHED_RR priority {PRIORITY} for {done} of Horovod's threads"


def unfavour(tids) -> None:
    """Put ``tids`` back on the normal policy (threads that ended are skipped)."""
    for tid in tids:
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
        except (ProcessLookupError, PermissionError):
            continue

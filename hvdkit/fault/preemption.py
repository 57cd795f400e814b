"""Preemption: ``SIGTERM`` ends a job at a step every rank agrees on, with a checkpoint of it.

Kubernetes, SLURM and spot instances send ``SIGTERM`` some seconds before they
take a machine away. :meth:`hvdkit.Checkpointer.restore` installs a handler
(:func:`watch`) that only notes the signal; the job then goes on to a step
boundary where every rank learns of it (:meth:`Watch.decide`: one small
collective about once per second of training), writes a checkpoint of that
step, waits until it is on disk, and raises :class:`Preempted` on every rank,
so the process exits with :data:`EXIT_PREEMPTED` (75, ``EX_TEMPFAIL``:
"try again"). Running the same command again resumes from that step: no
step is lost.

The signal may reach any rank (``hvdkitrun`` and the workers forward theirs
to the ranks they started). If the job has not ended ``grace`` seconds after
the signal (``HVDKIT_PREEMPT_GRACE``, default 25: Kubernetes waits 30 by
default before it kills), the handler's timer ends the process as the signal
would have, so a rank that never reaches a step boundary still leaves in time.

Example:
    >>> ckpt = hvdkit.Checkpointer("ckpt", model=model, sampler=sampler, every_steps=500)
    >>> ckpt.restore()            # installs the handler; resumes a preempted run
    >>> model.fit(..., callbacks=[..., ckpt.callback()])   # SIGTERM: exit 75 at a common step
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from .. import _phases, collectives, config, runtime
from .._comm import progress as _progress
from ..clusters import slurm as _slurm
from ..errors import ConfigurationError

__all__ = ["EXIT_PREEMPTED", "Preempted", "Watch", "watch"]

EXIT_PREEMPTED = config.EXIT_PREEMPTED
logger = logging.getLogger("hvdkit")
CHECKS_PER_GRACE = 25  # decide at least this often within one grace period...
CHECK_EVERY_MAX_S = 1.0  # ...and at least once a second
SLOW_INTERVALS = 3  # steps longer than the grace period in this many intervals: refused


class Preempted(SystemExit):
    """Raised on every rank once the job stopped for a ``SIGTERM`` at a common step.

    A :class:`SystemExit` with code :data:`EXIT_PREEMPTED`: uncaught, the
    process exits with 75 and prints nothing more. ``step`` is the step the
    checkpoint holds; ``path`` its folder on rank 0 (``None`` elsewhere).
    """

    def __init__(self, step: int, path=None):
        super().__init__(EXIT_PREEMPTED)
        self.step, self.path = step, path

    def __str__(self) -> str:
        where = f" in {self.path}" if self.path else ""
        return f"preempted: stopped after step {self.step}, checkpoint{where}; run again to resume"


class Regroup(Exception):
    """Raised on every rank at a commit boundary where a worker waits to join the job.

    :func:`hvdkit.elastic.run` catches it (as ``hvdkit.elastic.Regroup``): the
    ranks commit ``step`` in memory, leave Horovod, start it again with the
    newcomer, and go on from ``step`` (no step is trained twice). Only seen by
    code that catches every exception inside the training function: let it
    pass. Defined here, beside :attr:`Watch.regroup` that decides it, so that
    the Checkpointer raises it without importing :mod:`hvdkit.elastic`.
    """

    def __init__(self, step: int):
        super().__init__(f"a worker joins the job after step {step}")
        self.step = step


class Watch:
    """Notes ``SIGTERM`` and decides, with the other ranks, the step to stop at.

    Use :func:`watch` to get the process's one instance. ``decide`` is called
    on every rank after every step with the step count; at some of those
    steps (chosen by rank 0's clock, about once a second, the same steps on
    every rank) the ranks exchange whether any of them got the signal.
    """

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.signalled_at: float | None = None  # time.monotonic() of the first SIGTERM
        self._next = None  # the step of the next decision; None: the first call's step
        self._clock: tuple[int, float] | None = None  # (step, time) of the last decision
        self._recent: list[float] = []  # rank 0: seconds per step, the last few intervals
        self._ahead = 1  # rank 0: steps from the last decision to the next
        self._timer: threading.Timer | None = None
        # hvdkit.elastic: whether a worker waits to join (this rank's view). The same
        # exchange carries it, so a growing job needs no second collective per step.
        self.join_waiting: Callable[[], bool] | None = None
        self.regroup = False  # the last decision: every rank leaves for a bigger world

    @property
    def requested(self) -> bool:
        """Whether this process got ``SIGTERM``."""
        return self.signalled_at is not None

    def _on_signal(self, signum, _frame) -> None:
        if self.signalled_at is not None:
            return
        self.signalled_at = time.monotonic()
        self._timer = threading.Timer(self.grace_s, _end_as_signalled, args=(signum,))
        self._timer.daemon = True
        self._timer.start()

    def decide(self, step: int) -> bool:
        """True (on every rank alike) when the job must stop after ``step``.

        Also sets :attr:`regroup` alike on every rank: a worker waits to join
        the job (:mod:`hvdkit.elastic`), so the ranks leave their world after
        ``step`` (a preemption wins over it).

        Call it on every rank after the same steps. Collective at the steps
        where it decides.

        Raises:
            ConfigurationError: one step takes longer than the grace period
                (the job could never stop in time); names both.
        """
        step = int(step)
        if self._next is not None and step < self._next:
            return False
        now = time.monotonic()
        joining = self.join_waiting is not None and self.join_waiting()
        mine = (self.requested, joining, None)
        if runtime.rank() == 0:
            mine = (self.requested, joining, self._plan(step, now))
        _phases.enter("exchange")
        if runtime.size() > 1:
            said = collectives.allgather_object(mine, name="hvdkit.preemption")
        else:
            said = [mine]
        stop = any(flag for flag, _, _ in said)
        self.regroup = not stop and any(join for _, join, _ in said)
        self._next, too_slow = said[0][2]
        self._clock = (step, now)
        if too_slow is not None:
            raise ConfigurationError(
                f"one training step takes {too_slow:.1f} s, longer than the preemption grace "
                f"period of {self.grace_s:g} s ({config.PREEMPT_GRACE}): after SIGTERM the job "
                "could not reach a step to stop at in time. Raise the grace period (and the "
                "platform's, e.g. terminationGracePeriodSeconds), or make steps shorter."
            )
        return stop

    def _plan(self, step: int, now: float) -> tuple[int, float | None]:
        """Rank 0: (the next step to decide at, seconds per step if longer than the grace)."""
        if self._clock is None:  # the first step (tracing); ask again at the next
            self._ahead = 1
            return step + 1, None
        last_step, last_time = self._clock
        per_step = (now - last_time) / max(step - last_step, 1)
        self._recent = [*self._recent[-(SLOW_INTERVALS - 1) :], per_step]
        every_s = min(CHECK_EVERY_MAX_S, self.grace_s / CHECKS_PER_GRACE)
        # At most twice the last interval's steps: a few fast steps (the first after
        # tracing, a cache warm) must not plan thousands of steps ahead that may then
        # run slower (a loaded machine) and overrun the grace period.
        ahead = max(1, min(round(every_s / max(per_step, 1e-9)), 2 * self._ahead))
        self._ahead = ahead
        # Slow in every one of the last few intervals: a single long pause (an
        # evaluation, a save) between two decisions is not a slow step.
        fastest = min(self._recent)
        too_slow = len(self._recent) == SLOW_INTERVALS and fastest > self.grace_s
        return step + ahead, (fastest if too_slow else None)

    def restart(self) -> None:
        """Decide again at the next step (a new world: hvdkit.elastic)."""
        self._next, self._clock, self._recent, self._ahead = None, None, [], 1
        self.regroup = False

    def stopped(self, step: int) -> None:
        """Record that this rank stops after ``step``: its heartbeats say so to the launcher.

        Under Slurm rank 0 also asks Slurm to requeue the job, if it was
        submitted with ``--requeue`` (:func:`hvdkit.clusters.slurm.requeue_job`), and says so.
        """
        _progress.mark_preempted(step)
        took = time.monotonic() - self.signalled_at if self.signalled_at else 0.0
        requeued = _slurm.requeue_job() if runtime.rank() == 0 else None
        if requeued is not None:
            print(
                f"hvdkit: stopped for SIGTERM after step {step}; checkpoint on disk {took:.2f} s "
                f"after the signal; {requeued}",
                flush=True,
            )


_watch: Watch | None = None


def watch() -> Watch | None:
    """Install the ``SIGTERM`` handler (once per process) and return the :class:`Watch`.

    Returns ``None`` off the main thread, where Python cannot install signal
    handlers (then ``SIGTERM`` ends the process as usual).
    """
    global _watch
    if _watch is None:
        if threading.current_thread() is not threading.main_thread():
            return None
        candidate = Watch(config.preempt_grace())
        if runtime.is_initialized() and runtime.rank() == 0:
            _slurm.check_job(candidate.grace_s)
        signal.signal(signal.SIGTERM, candidate._on_signal)
        _watch = candidate
    return _watch


def _end_as_signalled(signum: int) -> None:
    """The grace period is over: end the process as the signal would have.

    Runs on the timer's thread, where Python may not change a signal's
    handler: the default action is restored through the C library, then the
    signal sent again (SIGKILL if that cannot be done).
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal(signum, None)  # SIG_DFL is the null handler
        os.kill(os.getpid(), signum)
    except (OSError, AttributeError):
        pass
    time.sleep(1.0)  # the signal is on its way; if not, nothing else will end us
    os.kill(os.getpid(), signal.SIGKILL)

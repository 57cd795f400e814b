"""A Checkpointer's stop for ``SIGTERM``: save the agreed step, then every rank leaves.

After each step of the save schedule (:meth:`hvdkit.Checkpointer.maybe_save`),
:meth:`PreemptionStop.after_step` asks the :class:`~hvdkit.fault.preemption.Watch`
whether the ranks stop here. If so, rank 0 makes sure the step is saved and
on disk, every rank learns whether that worked (nobody leaves before the
checkpoint is written), and every rank raises
:class:`~hvdkit.fault.preemption.Preempted` (exit status 75). The same
exchange says whether a worker waits to join an elastic job; then every rank
raises :class:`~hvdkit.fault.preemption.Regroup` at that step instead.

Example:
    >>> stop = PreemptionStop(wanted=True)
    >>> stop.install()                         # at restore: the SIGTERM handler
    >>> stop.after_step(ckpt, step, saved)     # may raise Preempted or Regroup
"""

from __future__ import annotations

from typing import NoReturn

from .. import collectives, config, runtime
from .._comm import meeting as _meeting
from ..errors import HvdkitError
from . import preemption

__all__ = ["PreemptionStop"]


class PreemptionStop:
    """What a Checkpointer decides with the other ranks at step boundaries.

    Args:
        wanted: Stop for ``SIGTERM`` (the Checkpointer's ``preemption=``).
            Without it, an elastic job still exchanges the join decision.
    """

    def __init__(self, wanted: bool):
        self.wanted = bool(wanted)
        self.watch: preemption.Watch | None = None  # installed by install()

    def install(self) -> None:
        """Install the ``SIGTERM`` handler and, in an elastic job, the join decision."""
        if self.wanted:
            self.watch = preemption.watch()
        elif _meeting.enabled():  # the step exchange without a SIGTERM handler
            self.watch = preemption.Watch(config.preempt_grace())
        if self.watch is not None and _meeting.enabled():
            self.watch.join_waiting = _meeting.join_waiting

    def restart(self) -> None:
        """Decide with the other ranks again at the next step (a new world)."""
        if self.watch is not None:
            self.watch.restart()

    def after_step(self, ckpt, step: int, saved: bool) -> None:
        """Every rank, after ``step`` (``saved``: the schedule saved it): stop or leave if agreed.

        ``ckpt`` is the :class:`~hvdkit.Checkpointer` (its ``save``, ``wait``,
        ``step`` and ``last_path`` are used; not imported here: it imports this).

        Raises:
            Preempted: the ranks stop for ``SIGTERM`` after ``step``, saved.
            Regroup: a worker waits to join; ``ckpt.step`` is ``step``.
            HvdkitError: rank 0 could not save the step (every rank raises).
        """
        if self.watch is None:
            return
        if self.watch.decide(step):
            self._stop(ckpt, int(step), saved)
        if self.watch.regroup:
            ckpt.step = int(step)
            raise preemption.Regroup(ckpt.step)

    def _stop(self, ckpt, step: int, saved: bool) -> NoReturn:
        """Every rank: make sure ``step`` is saved and on disk, then raise Preempted."""
        outcome = {"ok": True}
        if runtime.rank() == 0:
            try:
                if not saved:
                    ckpt.save(step)
                ckpt.wait()  # on disk before anyone leaves
            except Exception as e:  # every rank must learn of it, or the others wait
                outcome = {"ok": False, "message": f"{type(e).__name__}: {e}"}
                failure = e
        else:
            ckpt.save(step)  # records the step; rank 0 writes
        if runtime.size() > 1:  # nobody leaves before rank 0's checkpoint is written
            outcome = collectives.broadcast_object(outcome, 0)
        if not outcome["ok"]:
            if runtime.rank() == 0:
                raise failure
            raise HvdkitError(
                f"preempted after step {step}, but rank 0 could not save it: {outcome['message']}"
            )
        self.watch.stopped(step)
        raise preemption.Preempted(step, ckpt.last_path if runtime.rank() == 0 else None)

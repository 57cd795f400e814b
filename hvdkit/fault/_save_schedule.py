"""When a :class:`~hvdkit.Checkpointer` saves: every ``N`` steps, every ``T`` seconds, or both.

Every rank must save at the same steps. A step count is the same everywhere;
a clock is not, so for ``every_seconds`` rank 0's clock decides and
broadcasts the decision, together with the step of its next decision (chosen
from the measured step rate so that it decides about ten times per
interval): a collective at those steps only.

The decisions are the pure functions :func:`steps_due` and
:func:`time_due`; :class:`SaveSchedule` keeps their state and does the
broadcast.

Example:
    >>> steps_due(every_steps=100, last_step=180, step=200)
    True
    >>> time_due(every_seconds=60.0, step=50, now=70.0, last_save=0.0,
    ...          check_step=40, check_time=68.0)   # 5 steps/s: decide again in 30
    (True, 80)
"""

from __future__ import annotations

import time

from .. import collectives, runtime
from .._validate import check_int, is_number
from ..errors import ConfigurationError

__all__ = ["SaveSchedule", "steps_due", "time_due"]

CHECKS_PER_INTERVAL = 10  # every_seconds: rank 0 decides about this often per interval


def steps_due(every_steps: int, last_step: int, step: int) -> bool:
    """Whether a multiple of ``every_steps`` lies in ``(last_step, step]``."""
    return step // every_steps > last_step // every_steps


def time_due(
    every_seconds: float,
    step: int,
    now: float,
    last_save: float,
    check_step: int,
    check_time: float,
) -> tuple[bool, int]:
    """Rank 0's decision at ``step``: ``(save now, the step of the next decision)``.

    ``now`` and ``last_save`` are its clock now and at the last save;
    ``(check_step, check_time)`` the step and clock of its last decision,
    which give the step rate: the next decision comes about
    ``every_seconds / 10`` seconds of steps later (at least one step).
    """
    rate = (step - check_step) / max(now - check_time, 1e-9)
    ahead = max(1, int(rate * every_seconds / CHECKS_PER_INTERVAL))
    return now - last_save >= every_seconds, step + ahead


class SaveSchedule:
    """The save schedule of one Checkpointer; :meth:`due` at the same steps on every rank.

    Args:
        every_steps: Save when the step count reaches a multiple of it; ``None``: never.
        every_seconds: Save when this much time passed on rank 0 since the
            last save; ``None``: never.

    Raises:
        ConfigurationError: either is given and not a positive number.
    """

    def __init__(self, every_steps: int | None, every_seconds: float | None):
        problem = "must be a positive number, or None for no schedule of that kind."
        if every_steps is not None:
            every_steps = check_int(
                "every_steps",
                every_steps,
                minimum=1,
                message=f"Checkpointer: every_steps={every_steps!r} {problem}",
            )
        if every_seconds is not None and (not is_number(every_seconds) or every_seconds <= 0):
            raise ConfigurationError(f"Checkpointer: every_seconds={every_seconds!r} {problem}")
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.restart(0)

    def restart(self, step: int) -> None:
        """Count from ``step`` as if a save had just happened there (a restore, a roll back)."""
        self._last_step = self._check_step = step  # last step looked at; last decision's
        self._next_check = step + 1  # step of the next every_seconds decision
        self._last_save = self._check_time = time.monotonic()

    def saved(self) -> None:
        """Note a save now: ``every_seconds`` counts from here."""
        self._last_save = time.monotonic()

    def due(self, step: int) -> bool:
        """Whether to save after ``step``; every rank calls it at the same steps.

        ``every_steps``: ``step`` reached a multiple of it since the last
        call. ``every_seconds``: at the steps chosen by :func:`time_due`,
        rank 0's decision, broadcast.
        """
        step = int(step)
        due = False
        if self.every_steps is not None:
            due = steps_due(self.every_steps, self._last_step, step)
        self._last_step = step
        if self.every_seconds is not None and step >= self._next_check:
            decision = None
            if runtime.rank() == 0:
                now = time.monotonic()
                decision = time_due(
                    self.every_seconds,
                    step,
                    now,
                    self._last_save,
                    self._check_step,
                    self._check_time,
                )
                self._check_time, self._check_step = now, step
            if runtime.size() > 1:
                decision = collectives.broadcast_object(decision, 0)
            timed, self._next_check = decision
            due = due or timed
        return due

"""The launcher's side of a preemption: pass ``SIGTERM`` on to the ranks and give them time.

``hvdkitrun`` and a worker do the same: on ``SIGTERM`` they send it once to
each rank process of theirs (ranks found by their heartbeats, and only
processes in the launcher's own tree), keep supervising for the grace period
(``HVDKIT_PREEMPT_GRACE``) while the ranks agree on a step and checkpoint it
(:mod:`hvdkit.preemption`), and stop the job only if it has not ended by
then. The ranks' heartbeats say the step they stopped after
(:func:`preempted_step`). A ``SIGTERM`` that comes once every rank has
finished is not passed on: the job's work is over, and the ranks end as
they were ending.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import psutil

from .. import config
from .._comm import progress as _progress
from .._validate import is_int


class SigtermForwarding:
    """Forward ``SIGTERM`` to the ranks, then wait out the grace period; see :meth:`tick`.

    Example:
        >>> forward = SigtermForwarding(25.0, print, "hvdkitrun")
        >>> forward.tick(rank_processes)   # True: the ranks are given time; False: stop now
    """

    def __init__(self, grace_s: float, say: Callable[[str], None], who: str):
        self.grace_s, self._say, self._who = grace_s, say, who
        self.sent_at: float | None = None
        self.after_the_end: bool | None = None  # every rank had finished at the first tick
        self._first_at = 0.0
        self._signalled: set[int] = set()

    def ended_after_the_end(self, signals: list[str], finished: bool) -> bool:
        """Once the job's processes ended cleanly: whether ``signals`` came after its work.

        True only for ``SIGTERM`` alone, arriving once every rank had finished:
        as seen at the first :meth:`tick`, or, if no tick saw it (it came after
        the last poll and reached no rank), ``finished`` as the ranks ended.
        """
        if set(signals) != {"SIGTERM"}:
            return False
        return finished if self.after_the_end is None else self.after_the_end

    def tick(self, ranks: list[psutil.Process], finished: bool = False) -> bool:
        """Called every poll once ``SIGTERM`` arrived; False when the job must be stopped now.

        ``finished``: every rank of the job has said it finished (its
        heartbeat's bye). While that holds from the first call on, nothing is
        sent (:attr:`after_the_end`): the ranks are left to exit within the
        grace period. Otherwise (or once a rank that has not finished
        appears, e.g. the next program of a shell command) the signal is
        forwarded (and later to ranks that reported since). False at once if
        no rank of the job runs here (none has sent a heartbeat yet: none can
        have a checkpoint to write), and once the grace period is over.
        """
        now = time.monotonic()
        if self.after_the_end is None:
            self.after_the_end, self._first_at = finished, now
        elif self.after_the_end and not finished:
            self.after_the_end = False  # forwarded from now on, with a grace period of its own
        if self.after_the_end:
            if now - self._first_at <= self.grace_s:
                return True
            self._say(
                f"{self._who}: every rank had finished when SIGTERM came, but they did not "
                f"exit within the grace period of {self.grace_s:g} s; stopping the job."
            )
            return False
        fresh = [p for p in ranks if p.pid not in self._signalled]
        for p in fresh:
            try:
                p.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
            self._signalled.add(p.pid)
        if self.sent_at is None:
            if not fresh:
                self._say(
                    f"{self._who}: SIGTERM before any rank here started hvdkit "
                    "(no heartbeat yet): stopping the job."
                )
                return False
            self.sent_at = now
            self._say(
                f"{self._who}: SIGTERM: asked {len(fresh)} rank process(es) to stop at a step "
                f"every rank agrees on and checkpoint it; grace period {self.grace_s:g} s "
                f"({config.PREEMPT_GRACE})."
            )
            return True
        if now - self.sent_at > self.grace_s:
            self._say(
                f"{self._who}: the ranks did not stop within the grace period of "
                f"{self.grace_s:g} s after SIGTERM (does the script save with an "
                "hvdkit.Checkpointer? see docs/fault-tolerance.md); stopping the job. It "
                "resumes from its last checkpoint."
            )
            return False
        return True


def preempted_step(monitor) -> int | None:
    """The step the ranks stopped after for a preemption, from their heartbeats; else None.

    ``monitor`` is a :class:`~hvdkit.launch.heartbeat.HeartbeatMonitor`.
    Every rank stops after the same step; if reports differ (they cannot, short
    of a bug) the smallest is given, the safe one to resume from.
    """
    steps = []
    for status in list(monitor.ranks.values()):
        value = status.info.get(_progress.PREEMPTED)
        if is_int(value) and value >= 0:
            steps.append(value)
    return min(steps) if steps else None

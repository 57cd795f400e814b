"""On a lost peer, join the elastic job's next world and try again: the one loop for it.

Three things an elastic job does may meet a peer's death in a collective, and
each goes on the same way: leave Horovod, join the next world the scheduler
forms (:func:`hvdkit.runtime.rejoin`), let the sampler take that world's
shards, and call the same thing again there. :func:`retry` is that loop:

* :meth:`hvdkit.Checkpointer.restore` (a newcomer's restore meets the
  survivors' roll back; a peer lost during it);
* :func:`hvdkit.elastic.run` with a Checkpointer: the training function, and
  the roll back to the last commit in each new world (a peer lost during it
  is one more regroup);
* :func:`hvdkit.elastic.run` with one of Horovod's state classes: ``sync()``
  and the training function.

The two ``run`` loops also leave for a bigger world on a
:class:`~hvdkit.fault.preemption.Regroup` (a worker waits to join).

Also here, :class:`LostPeerWatch`: the thread that ends this rank's Gloo
connections once the scheduler formed a world without a lost rank, so that
the failing collective fails now instead of at Gloo's timeout.

Example:
    >>> # Checkpointer.restore: once more in each next world while a peer is lost
    >>> step = retry(lambda move: self._restore_once(), where="the restore", sampler=sampler)
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from .. import config, runtime
from .._comm import meeting as _meeting
from .preemption import Regroup

__all__ = ["LostPeerWatch", "Move", "lost_peer", "retry"]

T = TypeVar("T")


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed for a lost peer, in an elastic job."""
    return _meeting.enabled() and _meeting.peer_lost(exc)


@dataclass
class Move:
    """One change of world by :func:`retry`: who this rank was, why it left, where it went.

    Attributes:
        cause: The exception that ended the attempt (a lost peer, or a Regroup).
        old_rank, old_size: This rank's place in the world it left.
        ended: Connections :class:`LostPeerWatch` ended in that world (None: none).
        started: ``time.monotonic()`` as the rank left.
        number: Moves so far in this :func:`retry` (1 for the first).
        round: The round of the world joined.
        joined: ``time.monotonic()`` once Horovod ran in it.
    """

    cause: BaseException
    old_rank: int
    old_size: int
    ended: int | None
    started: float
    number: int
    round: int = -1
    joined: float = 0.0

    def why(self) -> str:
        """Why the rank left, for the log: ``"a worker joined"``, or the error's type."""
        why = "a worker joined" if isinstance(self.cause, Regroup) else type(self.cause).__name__
        if self.ended is not None:
            why += f" (the scheduler's word: a rank was lost; ended {self.ended} connections)"
        return why

    def report(self, rest: str) -> None:
        """Print the move (old and new rank, round, why) and ``rest`` to stderr."""
        print(
            f"hvdkit: rank {self.old_rank} of {self.old_size} is rank {runtime.rank()} of "
            f"{runtime.size()} (round {config.restart_count()}) after {self.why()}; {rest}",
            file=sys.stderr,
            flush=True,
        )


def retry(
    attempt: Callable[[Move | None], T],
    *,
    where: str | Callable[[], str] | None = None,
    regroup: bool = False,
    sampler=None,
    leave: Callable[[BaseException], None] | None = None,
) -> T:
    """Call ``attempt`` until it returns; after a lost peer, in the next world. Its result.

    ``attempt`` gets ``None`` the first time, then the :class:`Move` that
    brought the rank to the world it runs in. When a collective in it fails
    for a lost peer (in an elastic job; anything else is raised), or, with
    ``regroup``, it raises :class:`Regroup`: ``where`` (if given) is named in a
    "a peer was lost during ..." line, ``leave(exc)`` runs in the old world,
    the rank joins the next one (:func:`hvdkit.runtime.rejoin`), the
    ``sampler`` (a :class:`~hvdkit.data.ShardSampler`, if given) takes that
    world's shards (:meth:`~hvdkit.data.ShardSampler.reshard`; the state
    loaded afterwards re-shards the epoch's rest), and ``attempt`` runs again.
    A newcomer's Horovod start, put off by ``init()``, happens before the first
    call (:func:`hvdkit.runtime.start_deferred`), and in an elastic job a sampler
    whose shards are not this world's takes them.

    Raises:
        LaunchError: no next world formed (:func:`hvdkit._comm.meeting.join_next_world`).
    """
    move = None
    runtime.start_deferred()
    # In an elastic job the sampler follows the world (each move below re-shards it),
    # and a newcomer's world may be a later round's than init() saw. Elsewhere a sampler
    # may be sharded on purpose unlike the world: it is left as built.
    if (
        sampler is not None
        and _meeting.enabled()
        and (sampler.num_shards, sampler.shard_id) != (runtime.size(), runtime.rank())
    ):
        sampler.reshard()
    while True:
        try:
            return attempt(move)
        except Regroup as exc:
            if not regroup:
                raise
            cause = exc
        except Exception as exc:
            if not lost_peer(exc):
                raise
            if where is not None:
                _say_lost(where if isinstance(where, str) else where(), exc)
            cause = exc
        if leave is not None:
            leave(cause)
        number = 1 if move is None else move.number + 1
        ended = LostPeerWatch.ended
        move = Move(cause, runtime.rank(), runtime.size(), ended, time.monotonic(), number)
        with LostPeerWatch.recovering():
            move.round = runtime.rejoin()
        move.joined = time.monotonic()
        if sampler is not None:
            sampler.reshard()  # this world's size and rank


def _say_lost(where: str, exc: BaseException) -> None:
    print(
        f"hvdkit: rank {runtime.rank()} of {runtime.size()}: a peer was lost during {where} "
        f"({type(exc).__name__}); it meets the next world",
        file=sys.stderr,
        flush=True,
    )


class LostPeerWatch:
    """End Horovod's connections as soon as the scheduler formed a world without a lost rank.

    When a rank dies, its direct Gloo peers see the connection close at
    once; the other survivors wait in their collective until Gloo's timeout,
    or until a peer that already left shut Horovod down (about 1.5 s later).
    The scheduler learns of the death from the dead rank's worker within
    moments and sends each survivor's worker the new world, marked ``lost``
    (:mod:`hvdkit._comm.meeting`). This thread reads it and ends this rank's
    Gloo connections (:func:`hvdkit.runtime.abandon`), so the collective
    fails now and :func:`retry` takes the rank on. A growing world (a worker
    joins) is not marked: the ranks leave it at an agreed step instead.
    """

    POLL_S = 0.05
    _lock = threading.Lock()
    _started = False
    _recovering = False
    ended: int | None = None  # connections ended in the current world (None: not abandoned)

    @classmethod
    def start_once(cls) -> None:
        with cls._lock:
            if cls._started:
                return
            cls._started = True
        threading.Thread(target=cls._loop, name="hvdkit-lost-peer-watch", daemon=True).start()

    @classmethod
    def _loop(cls) -> None:
        folder = _meeting.shared_folder()
        while True:
            time.sleep(cls.POLL_S)
            cls.check(folder)

    @classmethod
    def check(cls, folder: str) -> bool:
        """Abandon this world if ``folder`` holds a newer world marked ``lost``; whether it did."""
        body = _meeting.read_assignment(folder)
        if body is None or not body.get("lost"):
            return False
        with cls._lock:
            if cls._recovering or cls.ended is not None or not runtime.started():
                return False
            if body["round"] <= config.restart_count():
                return False  # this world's own assignment
            cls.ended = runtime.abandon()
            return True

    @classmethod
    @contextlib.contextmanager
    def recovering(cls):
        """While a rank leaves one world and joins the next, the watch does nothing."""
        with cls._lock:
            cls._recovering = True
        try:
            yield
        finally:
            with cls._lock:
                cls._recovering, cls.ended = False, None

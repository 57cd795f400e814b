"""A Checkpointer's last commit, kept in memory on every rank: what an elastic job rolls back to.

:mod:`hvdkit.elastic` keeps one :class:`MemoryCommit` per Checkpointer and
takes a commit at each of its saves and restores; after a lost peer the
survivors :meth:`~MemoryCommit.rollback` to it in their new world, without
reading a file. Horovod's state classes (:mod:`hvdkit.fault.elastic_state`) keep
theirs in the same way (:meth:`~MemoryCommit.load`, :meth:`~MemoryCommit.sync`).

It uses only the Checkpointer's public methods (``variables``,
``state_dict``, ``load_state_dict``, ``reschedule``), and imports neither
:mod:`hvdkit.fault.checkpoint` nor :mod:`hvdkit.elastic`: both depend on it, it on
neither.

Example:
    >>> commit = MemoryCommit(ckpt)
    >>> commit.save()          # every rank, at a step they agree on
    >>> ...                    # a peer is lost; a new world formed
    >>> step = commit.rollback()
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from .. import _compat, _phases, runtime
from ..errors import HvdkitError
from . import _state_broadcast

if TYPE_CHECKING:
    from .checkpoint import Checkpointer

__all__ = ["MemoryCommit"]


class MemoryCommit:
    """The state of ``ckpt`` as of its last :meth:`save`, in this process's memory.

    Args:
        ckpt: The Checkpointer whose model, optimizer, sampler, random state,
            ``step``, ``epoch`` and ``extra`` are committed.
    """

    def __init__(self, ckpt: Checkpointer):
        self.ckpt = ckpt
        self._saved: dict | None = None  # the state_dict() and the variables' copies

    def save(self) -> None:
        """Keep a copy of every variable and of the state as of now (this rank alone)."""
        variables = self.ckpt.variables()
        # Into the last commit's arrays, as the background save does: no fresh
        # memory to first-touch at every commit.
        previous = self._saved["arrays"] if self._saved is not None else []
        previous = previous + [None] * (len(variables) - len(previous))
        arrays = [
            _compat.copy_variable(v, out) for v, out in zip(variables, previous, strict=False)
        ]
        self._saved = {**self.ckpt.state_dict(), "arrays": arrays}

    def load(self, take_state: bool = True) -> list:
        """Assign the last commit to the variables on this rank alone; the variables.

        With ``take_state`` also step, epoch, extra, random state and the
        sampler's position (Horovod's ``state.restore()``).

        Raises:
            HvdkitError: nothing was committed yet.
        """
        if self._saved is None:
            raise HvdkitError(
                "hvdkit.elastic: nothing to roll back to; call Checkpointer.restore() before "
                "training (hvdkit.elastic.run does)."
            )
        variables = self.ckpt.variables()
        for var, value in zip(variables, self._saved["arrays"], strict=True):
            var.assign(value)
        if take_state:
            self.ckpt.load_state_dict(self._state())
        return variables

    def rollback(self) -> int:
        """Go back to the last commit in a new world; its step. Every rank calls it.

        Every survivor holds the same commit; rank 0's is sent to all, in the
        same two steps as :meth:`hvdkit.Checkpointer.restore`
        (:mod:`hvdkit.fault._state_broadcast`), so a rank
        that joins the job (it calls ``restore()`` in its fresh process)
        receives it too. The sampler, on the new world's shards already
        (:func:`hvdkit.fault._next_world.retry`), re-shards the epoch's rest.
        """
        variables = self.load(take_state=False)
        return self._adopt_from_root(self._state(), variables)

    def sync(self) -> int:
        """Every rank takes rank 0's variables and state as they stand now, then commits them.

        Horovod's ``state.sync()``; the same two steps as :meth:`rollback`.
        """
        return self._adopt_from_root(self.ckpt.state_dict(), self.ckpt.variables())

    def _state(self) -> dict:
        """The committed state without the arrays, a copy."""
        return json.loads(json.dumps({k: v for k, v in self._saved.items() if k != "arrays"}))

    def _adopt_from_root(self, state: dict, variables: list) -> int:
        """Rank 0's ``state`` and ``variables`` on every rank, re-sharded, committed; the step."""
        header = {"ok": True, "state": state, "path": None}
        if runtime.size() > 1:
            header = _state_broadcast.header(header, variables)
            _state_broadcast.variables(variables)
        # The sampler took this world's shards as the rank joined it (hvdkit.fault._next_world);
        # the state it loads now shares out the rest of the epoch over them.
        _phases.enter("reshard")
        ckpt = self.ckpt
        ckpt.load_state_dict(json.loads(json.dumps(header["state"])))
        self.save()
        ckpt.reschedule()
        return ckpt.step

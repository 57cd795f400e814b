"""Horovod names hvdkit does not implement: present, so scripts import, and refused on use.

(``hvd.elastic`` is :mod:`hvdkit.elastic`: its ``run`` works, its state
classes refuse there.)

A Horovod script often names ``hvd.Adasum`` or a process set
in code it never runs (a branch, a test's op list, a default argument). With
``import hvdkit as hvd`` such a script must not die with ``AttributeError``
at the line that merely names them, and must not run something else when it
does use them: every use raises :class:`~hvdkit.errors.NotSupportedError` (a
``NotImplementedError``, the class Horovod raises for unsupported ops) that
names what to use instead.

``global_process_set`` is the one name with a meaning here: the whole job, so
``process_set=hvdkit.global_process_set`` is accepted wherever
``process_set=None`` is.

No TensorFlow here (the collectives check their arguments against these).

Example:
    >>> hvdkit.allreduce(x, op=hvdkit.Adasum)
    NotSupportedError: op=hvdkit.Adasum is not implemented in hvdkit; ...
"""

from __future__ import annotations

from typing import NoReturn

from .errors import NotSupportedError

__all__ = [
    "Adasum",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "process_set_included_op",
]

_PROCESS_SETS = (
    "hvdkit's collectives always run over the whole job; drop the process_set argument (or "
    "pass hvdkit.global_process_set), or start a separate job for each group of ranks."
)


class _AdasumOp:
    """Horovod's ``Adasum`` reduction: not implemented; any collective given it refuses."""

    name = "ADASUM"

    def __repr__(self) -> str:
        return "hvdkit.Adasum"

    def refuse(self, what: str) -> NoReturn:
        raise NotSupportedError(
            f"{what}: op=hvdkit.Adasum is not implemented in hvdkit (Horovod's adaptive "
            "summation); use op=hvdkit.Average (the default) or op=hvdkit.Sum."
        )


Adasum = _AdasumOp()


class _GlobalProcessSet:
    """Horovod's ``global_process_set``: every rank of the job, what hvdkit always uses."""

    process_set_id = 0

    def __repr__(self) -> str:
        return "hvdkit.global_process_set"


global_process_set = _GlobalProcessSet()


class ProcessSet:
    """Horovod's ``ProcessSet(ranks)``: refused; hvdkit has no process sets."""

    def __init__(self, *args, **kwargs):
        raise NotSupportedError(f"hvdkit.ProcessSet{args!r} is not supported: {_PROCESS_SETS}")


def add_process_set(process_set, *args, **kwargs) -> NoReturn:
    """Horovod's ``add_process_set``: refused (no process sets)."""
    raise NotSupportedError(f"add_process_set({process_set!r}) is not supported: {_PROCESS_SETS}")


def remove_process_set(process_set, *args, **kwargs) -> NoReturn:
    """Horovod's ``remove_process_set``: refused (no process sets)."""
    raise NotSupportedError(
        f"remove_process_set({process_set!r}) is not supported: {_PROCESS_SETS}"
    )


def process_set_included_op(process_set_id: int = 0, *args, **kwargs) -> NoReturn:
    """Horovod's ``process_set_included_op``: refused (no process sets)."""
    raise NotSupportedError(
        f"process_set_included_op({process_set_id!r}) is not supported: {_PROCESS_SETS}"
    )

"""Process sets: collectives over a subset of the job's ranks (Horovod's ``ProcessSet``).

A process set is a sorted list of global ranks. Register it either when the
job starts, ``hvdkit.init(process_sets=[...])`` (every rank passes the same
list), or later with :func:`add_process_set` when the job was started with
``HOROVOD_DYNAMIC_PROCESS_SETS=1`` (or ``init(process_sets="dynamic")``).
Then pass it as ``process_set=`` to a collective, a ``DistributedOptimizer``
or a ``DistributedGradientTape``: only its ranks take part, and ``Average``
divides by its size. ``root_rank`` stays a *global* rank, as in Horovod.

Two data-parallel groups of a 2-rank job, each rank in a set of its own::

    >>> sets = [hvdkit.ProcessSet([0]), hvdkit.ProcessSet([1])]
    >>> hvdkit.init(process_sets=sets)
    >>> mine = sets[hvdkit.rank()]
    >>> mine.rank(), mine.size()        # (0, 1) on both ranks
    >>> hvdkit.allreduce(x, process_set=mine)                  # x itself
    >>> hvdkit.allreduce(x, process_set=hvdkit.global_process_set)  # both ranks

Differences from Horovod, each to fail early instead of late: a set equal to
the whole job is accepted and *is* the global set (Horovod refuses it as a
duplicate at ``init``); a rank that calls a collective on a set it is not in
gets :class:`~hvdkit.errors.ConfigurationError` before anything is sent
(Horovod: a ``tf.errors.InvalidArgumentError`` from its engine); a set used
after :func:`remove_process_set` names the removal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import tensorflow as tf

from . import config
from ._autograph import not_converted
from ._validate import is_int
from .backends import Backend
from .errors import ConfigurationError, NotInitializedError, NotSupportedError

__all__ = [
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "process_set_included_op",
]


class ProcessSet:
    """A set of global ranks that run collectives together (Horovod's ``ProcessSet``).

    Args:
        ranks: the global ranks, in any order (kept sorted), each once.

    Attributes:
        ranks: the sorted global ranks.
        process_set_id: its id once registered (``0`` is the global set),
            ``None`` before, and again after :func:`remove_process_set`.

    Raises:
        ConfigurationError: ``ranks`` is not a collection of distinct ints.
        NotSupportedError: an mpi4py communicator was given (hvdkit takes ranks).

    Example:
        >>> evens = hvdkit.ProcessSet(range(0, hvdkit.size(), 2))
    """

    process_set_id: int | None = None
    mpi_comm = None  # Horovod's attribute; hvdkit builds sets from ranks only

    def __init__(self, ranks: Iterable[int]):
        if not isinstance(ranks, Iterable) or isinstance(ranks, (str, bytes)):
            raise NotSupportedError(
                f"ProcessSet({ranks!r}): hvdkit builds a process set from a list of global "
                "ranks (an mpi4py communicator is not supported); pass e.g. ProcessSet([0, 1])."
            )
        ranks = list(ranks)
        if any(not is_int(r) for r in ranks):
            raise ConfigurationError(
                f"ProcessSet({ranks!r}): every entry must be an integer global rank."
            )
        ranks = sorted(int(r) for r in ranks)
        if len(set(ranks)) != len(ranks):
            raise ConfigurationError(f"ProcessSet({ranks!r}) lists a rank twice; list each once.")
        self.ranks = ranks
        self._removed = False

    def size(self) -> int | None:
        """Number of ranks in the set; ``None`` while it is not registered."""
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self) -> int | None:
        """This process's index within the set; ``None`` while it is not registered.

        Raises:
            ConfigurationError: this process is not in the set (Horovod: ``ValueError``).
        """
        if self.process_set_id is None:
            return None
        me = _running().rank()
        if me not in self.ranks:
            raise ConfigurationError(
                f"rank {me} is not in {self}; ask included() first, or use hvdkit.rank()."
            )
        return self.ranks.index(me)

    @not_converted
    def included(self) -> bool | None:
        """Whether this process is one of the set's ranks (``None`` for a set without ranks)."""
        if self.process_set_id == 0:
            return True
        return _running().rank() in self.ranks if self.ranks else None

    def __repr__(self) -> str:
        if self.process_set_id == 0:
            return "hvdkit.global_process_set"
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

# every registered set but the global one: id -> the ProcessSet object the user holds
_registered: dict[int, ProcessSet] = {}
# The running job's backend, from registered() (at hvdkit.init()) to forget_all() (at
# shutdown): the runtime, which registers the sets, hands it down, so that this module
# never imports the runtime (it sits below it).
_backend: Backend | None = None
# A newcomer's put-off Horovod start (hvdkit.runtime.start_deferred), handed down by
# deferred(): a set's first use starts Horovod, as any collective does.
_start: Callable[[], bool] | None = None


def _running() -> Backend:
    if _backend is None and _start is not None:
        _start()
    if _backend is None:
        raise NotInitializedError()
    return _backend


def deferred(start: Callable[[], bool]) -> None:
    """At ``init()`` of a newcomer that starts Horovod later: ``start`` does it."""
    global _start
    _start = start


def _check_fits(ps: ProcessSet, size: int, what: str) -> None:
    if not ps.ranks:
        raise ConfigurationError(f"{what}: {ps} has no ranks; a process set needs at least one.")
    outside = [r for r in ps.ranks if not 0 <= r < size]
    if outside:
        raise ConfigurationError(
            f"{what}: {ps} has ranks {outside} outside the job's ranks [0, {size}); "
            f"use ranks between 0 and {size - 1}."
        )


def _as_set(value: Any, what: str) -> ProcessSet:
    return value if isinstance(value, ProcessSet) else ProcessSet(value)


def static_ranks(process_sets: Sequence | str | None, size: int) -> tuple[list, bool]:
    """``init(process_sets=...)`` checked: ``(sets to register, dynamic)``.

    Sets equal to the whole job are the global set and are not registered
    again; two sets with the same ranks are refused.
    """
    if process_sets is None:
        return [], False
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ConfigurationError(
                f"init(process_sets={process_sets!r}): pass a list of hvdkit.ProcessSet or "
                "the string 'dynamic'."
            )
        return [], True
    sets = [_as_set(ps, "init") for ps in process_sets]
    seen: dict[tuple, int] = {}
    for i, ps in enumerate(sets):
        _check_fits(ps, size, f"init(process_sets=...) entry {i}")
        key = tuple(ps.ranks)
        if key in seen:
            raise ConfigurationError(
                f"init(process_sets=...): entries {seen[key]} and {i} both hold ranks "
                f"{ps.ranks}; a process set may be listed once (keep one object and share it)."
            )
        seen[key] = i
    return sets, False


def registered(sets: Sequence[ProcessSet], ids: Sequence[int], backend: Backend) -> None:
    """Give the sets their ids (after ``backend`` registered them) and the global set its ranks."""
    global _backend, _start
    _backend, _start = backend, None
    _registered.clear()
    global_process_set.ranks = list(range(backend.size()))
    for ps, ps_id in zip(sets, ids, strict=True):
        ps.process_set_id, ps._removed = ps_id, False
        if ps_id:
            _registered[ps_id] = ps


def forget_all() -> None:
    """At shutdown: every set the user holds is unregistered (re-register after ``init``)."""
    global _backend, _start
    _backend, _start = None, None
    for ps in _registered.values():
        ps.process_set_id = None
    _registered.clear()


def resolve(
    process_set: Any,
    what: str,
    *,
    member: bool = True,
    not_member: type[ConfigurationError] = ConfigurationError,
) -> ProcessSet:
    """The registered set a collective runs over (``None`` is the global set).

    Raises:
        ConfigurationError: not a ProcessSet, not registered, removed, or
            (``member``) this rank is not in it (then ``not_member``, a
            subclass the caller may choose: collectives raise one that is
            also Horovod's ``tf.errors.InvalidArgumentError``).
    """
    if process_set is None or process_set is global_process_set:
        return global_process_set
    if not isinstance(process_set, ProcessSet):
        raise ConfigurationError(
            f"{what}: process_set={process_set!r} is not an hvdkit.ProcessSet; pass one "
            "registered with hvdkit.init(process_sets=[...]) or hvdkit.add_process_set, or "
            "hvdkit.global_process_set (the default)."
        )
    if process_set.process_set_id is None:
        how = (
            "was removed with remove_process_set; add it again with add_process_set"
            if process_set._removed
            else "is not registered; pass it to hvdkit.init(process_sets=[...]) or "
            "hvdkit.add_process_set first"
        )
        raise ConfigurationError(f"{what}: {process_set} {how}.")
    ps_id = process_set.process_set_id
    if ps_id and _registered.get(ps_id) is not process_set:
        # e.g. an id set by hand (Horovod: ValueError; its test does this)
        _by_id(ps_id, what)  # names the registered ids if unknown
        raise ConfigurationError(
            f"{what}: {process_set} carries the id of another registered set, "
            f"{_registered[ps_id]}; pass the ProcessSet object that "
            "init(process_sets=[...]) or add_process_set registered."
        )
    if member and process_set.process_set_id and _running().rank() not in process_set.ranks:
        raise not_member(
            f"{what}: rank {_running().rank()} is not in {process_set}; only its ranks may call a "
            "collective on it (test process_set.included() first)."
        )
    return process_set


def _require_dynamic(what: str) -> None:
    if config.get(config.HOROVOD_DYNAMIC_PROCESS_SETS) != "1" and not _running().dynamic:
        raise ConfigurationError(
            f"{what} needs {config.HOROVOD_DYNAMIC_PROCESS_SETS}=1 in the environment before "
            "hvdkit.init() (or hvdkit.init(process_sets='dynamic')); set it, or register the "
            "sets when the job starts with hvdkit.init(process_sets=[...])."
        )


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set in a running job; every rank of the job must call it.

    Needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` (as Horovod). A list of ranks is
    wrapped in a :class:`ProcessSet`.

    Returns:
        The registered set (``process_set_id`` set).

    Raises:
        ConfigurationError: dynamic sets are off, the ranks are outside the
            job, or a registered set already holds the same ranks (Horovod:
            ``ValueError``). A set equal to the whole job is the global set
            and is returned as registered with id 0.

    Example:
        >>> first = hvdkit.add_process_set([0])
        >>> hvdkit.allreduce(x, process_set=first) if first.included() else None
        >>> hvdkit.remove_process_set(first)
    """
    ps = _as_set(process_set, "add_process_set")
    _require_dynamic(f"add_process_set({ps.ranks})")
    _check_fits(ps, _running().size(), "add_process_set")
    if ps.ranks == list(range(_running().size())):
        ps.process_set_id = 0
        return ps
    same = [s for s in _registered.values() if s.ranks == ps.ranks]
    if same:
        raise ConfigurationError(
            f"add_process_set: {same[0]} already holds ranks {ps.ranks}; use that object, or "
            "remove it first."
        )
    ps_id = _running().add_process_set(ps.ranks)
    ps.process_set_id, ps._removed = ps_id, False
    _registered[ps_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set added with :func:`add_process_set`; every rank must call it.

    Returns ``False`` (and removes nothing) for the global set and for a set
    that is not registered, as Horovod. Afterwards the object's
    ``process_set_id`` is ``None`` and using it names the removal.

    Example:
        >>> hvdkit.remove_process_set(first)
        True
    """
    if not isinstance(process_set, ProcessSet) or not process_set.process_set_id:
        return False
    _require_dynamic(f"remove_process_set({process_set})")
    ps_id = process_set.process_set_id
    _running().remove_process_set(ps_id)
    _registered.pop(ps_id, None)
    process_set.process_set_id, process_set._removed = None, True
    return True


def set_size_op(process_set_id: int, name: str | None) -> tf.Tensor:
    """int32 scalar: the size of the registered set ``process_set_id`` (``0``: the job)."""
    return tf.constant(len(_by_id(process_set_id, "size_op").ranks), tf.int32, name=name)


@not_converted
def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """int32 scalar op: 1 if this process is in the set ``process_set_id``, else 0.

    Example:
        >>> hvdkit.process_set_included_op(evens.process_set_id)   # 1 on even ranks
    """
    ps = _by_id(process_set_id, "process_set_included_op")
    return tf.constant(int(ps.included()), tf.int32, name=name)


def _by_id(process_set_id: int, what: str) -> ProcessSet:
    if process_set_id == 0:
        global_process_set.ranks = list(range(_running().size()))  # NotInitializedError before init
        return global_process_set
    if process_set_id not in _registered:
        known = sorted([0, *_registered])
        raise ConfigurationError(
            f"{what}: process_set_id={process_set_id!r} is not a registered process set "
            f"(registered: {known}); pass a ProcessSet's process_set_id."
        )
    return _registered[process_set_id]

"""Which variables' gradients went through an hvdkit reduction: the record the update check reads.

Written by hvdkit's gradient paths, read by :mod:`hvdkit.keras._update_check`
when a plain Keras optimizer updates weights:

* :func:`mark_reduced`: ``reduce_gradients(..., variables=...)`` reduced these
  variables' gradients (``DistributedOptimizer``, ``DistributedGradientTape``);
* :func:`mark_local`: these stay local on purpose (``PartialDistributedGradientTape``'s
  local layers, a rank outside the process set it reduces over);
* :func:`reducing`: while active, an optimizer's update is hvdkit's own (a
  ``DistributedOptimizer`` applying reduced gradients with the optimizer it holds);
* :func:`pending_unlisted`: ``reduce_gradients`` ran without ``variables=``;
  the next update names them (for the same-start check);
* :func:`trained`: every variable an optimizer updated, minus the local ones:
  what the end-of-job fingerprint covers.

Plain Python (ids and weak references), no TensorFlow: recording costs a set
insertion per variable at trace time, nothing per step inside a ``tf.function``.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator

# id(variable) -> weak reference; the reference tells a live variable from a later
# one that reuses a freed id.
_reduced: dict[int, weakref.ref] = {}
_local: dict[int, weakref.ref] = {}
_trained: dict[int, weakref.ref] = {}  # in the order of their first update
_unlisted: list = []  # [(process set, n)] of reductions without variables=, not yet checked
_depth = threading.local()


def _add(table: dict, variables: Iterable) -> None:
    for v in variables:
        with contextlib.suppress(TypeError):  # a tensor source: no weak reference, not a weight
            table.setdefault(id(v), weakref.ref(v))


def _has(table: dict, v) -> bool:
    ref = table.get(id(v))
    return ref is not None and ref() is v


def mark_reduced(variables: Iterable) -> None:
    """These variables' gradients were reduced over the ranks by hvdkit."""
    _add(_reduced, variables)


def mark_local(variables: Iterable) -> None:
    """These variables are trained on each rank alone, on purpose."""
    _add(_local, variables)


def mark_trained(variables: Iterable) -> None:
    """An optimizer updates these variables (reduced or not)."""
    _add(_trained, variables)


def is_reduced(v) -> bool:
    return _has(_reduced, v)


def is_local(v) -> bool:
    return _has(_local, v)


def trained() -> list:
    """The live variables an optimizer updated, local ones left out, in first-update order."""
    live = [ref() for key, ref in _trained.items() if ref() is not None]
    return [v for v in live if not is_local(v)]


def note_unlisted(process_set, n: int, where) -> None:
    """``reduce_gradients`` reduced gradients over ``n`` ranks without naming their variables.

    ``where``: the graph it was traced in (or the eager context's), matched by the update.
    """
    _unlisted.append((process_set, n, where))


def pending_unlisted() -> list:
    """Take the ``(process set, n, where)`` of reductions without ``variables=`` noted so far."""
    taken = list(_unlisted)
    _unlisted.clear()
    return taken


@contextlib.contextmanager
def reducing() -> Iterator[None]:
    """While active, optimizer updates are hvdkit's own and not checked."""
    _depth.value = getattr(_depth, "value", 0) + 1
    try:
        yield
    finally:
        _depth.value -= 1


def in_reducing() -> bool:
    return getattr(_depth, "value", 0) > 0


def reset() -> None:
    """Forget everything (tests; a new job in the same process)."""
    for table in (_reduced, _local, _trained):
        table.clear()
    _unlisted.clear()

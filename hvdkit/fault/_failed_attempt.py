"""What a failed attempt of an elastic training function leaves behind, let go of safely.

When a peer is lost (a collective fails) or the ranks leave a world for a
bigger one (:class:`~hvdkit.fault.elastic.Regroup`), the attempt's
``tf.data`` iterators (Keras's ``fit`` makes one per epoch) are garbage in
reference cycles, freed whenever the garbage collector next runs: in the
middle of the next world's steps. TensorFlow's iterator destructor waits
for the iterator's autotuning thread to end its current optimisation period
(docs/limits.md; the periods double, so an iterator kept for minutes can take
a minute to free): measured 8-9 s in a survivor after a cut link, while every
other rank of the new world waited in its collective
(docs/performance-record.md, "Cut links aimed at phases").

So :func:`let_go` keeps every ``tf.data`` iterator alive at that moment for
the rest of the process (each holds its prefetched elements; one set per
recovery) and never frees it, not even as the interpreter exits, where the
same wait held ranks 95 s past the end of their training (the record,
"The epoch-end stops, found"); and it clears the frames of the exception's
traceback so that the rest of the attempt (the step's tensors, a model's
worth of gradients) is freed at once. Keras's ``fit`` re-raises with a
traceback that leaves its own frames out, so the iterators are found among
the live objects, not in the traceback.

Example::

    try:
        train(state)
    except Exception as exc:
        kept = let_go(exc)   # e.g. 1: fit's iterator, kept for good
"""

from __future__ import annotations

import ctypes
import gc
import sys
import traceback

__all__ = ["let_go", "kept"]

_KEPT: list = []  # every failed attempt's iterators (each also pinned: never freed)


def let_go(exc: BaseException) -> int:
    """Keep every live ``tf.data`` iterator; clear ``exc``'s frames. How many were kept.

    Walks the live objects once (0.1-0.2 s in a TensorFlow process with a
    model); an iterator the program still uses is only kept alive, never changed.
    """
    tf = sys.modules.get("tensorflow")
    found = []
    if tf is not None:  # no TensorFlow loaded: no tf.data iterator either
        known = {id(it) for it in _KEPT}
        exact = _subclasses(tf.data.Iterator)  # type() in a set: isinstance on an ABC is slow
        found = [obj for obj in gc.get_objects() if type(obj) in exact and id(obj) not in known]
        for it in found:
            _pin(it)
        _KEPT.extend(found)
    if exc.__traceback__ is not None:
        traceback.clear_frames(exc.__traceback__)  # (frames still running are skipped)
    return len(found)


def _pin(obj) -> None:
    """Give ``obj`` a reference nothing holds, so it is never freed, even at the interpreter's end.

    At exit Python clears the modules (this one's ``_KEPT`` too) and frees what
    only they held; a reference of no object's outlives that: the process ends
    with the iterator unfreed, its memory returned by the OS.
    """
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _subclasses(cls: type) -> set[type]:
    """``cls`` and every class derived from it, however deep."""
    found, todo = set(), [cls]
    while todo:
        c = todo.pop()
        if c not in found:
            found.add(c)
            todo.extend(c.__subclasses__())
    return found


def kept() -> list:
    """The iterators kept so far (oldest first)."""
    return list(_KEPT)

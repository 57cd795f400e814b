"""Horovod names for collectives inside a traced function, the same on every rank.

Horovod pairs the ranks' tensors by name. Left to Horovod, a name inside a
``tf.function`` comes from the graph: the name scope, which holds Keras's
per-process layer and optimizer names (``sgd``, ``sgd_1``, ...). A rank that
built one more optimizer or layer first would then wait forever for a name no
other rank sends. hvdkit's own in-graph collectives are named by what they are
and by their order in the function being traced instead (``cond`` and
``while`` bodies count in their outer function), with Horovod told to ignore
the name scope:

    name = stable_name("gradients")   # "hvdkit.gradients.0", then ".1", ...; None eagerly
"""

from __future__ import annotations

import weakref

import tensorflow as tf

from . import _compat

_FuncGraph = _compat.func_graph_class()
_counts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stable_name(kind: str) -> str | None:
    """``hvdkit.<kind>.<k>``: the k-th such name in the function being traced; None eagerly."""
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    while isinstance(getattr(graph, "outer_graph", None), _FuncGraph):
        graph = graph.outer_graph
    per_kind = _counts.setdefault(graph, {})
    index = per_kind.get(kind, 0)
    per_kind[kind] = index + 1
    return f"hvdkit.{kind}.{index}"

"""Horovod names for collectives inside a traced function, the same on every rank.

Horovod pairs the ranks' tensors by name. Left to Horovod, a name inside a
``tf.function`` comes from the graph: the name scope, which holds Keras's
per-process layer and optimizer names (``sgd``, ``sgd_1``, ...). A rank that
built one more optimizer or layer first would then wait forever for a name no
other rank sends. hvdkit's own in-graph collectives are named by what they are,
the traced function and their order in it instead (``cond`` and ``while``
bodies count in their function), with Horovod told to ignore the name scope:

    name = stable_name("gradients")   # "hvdkit.gradients.one_step_on_data.0", ".1", ...

The counter belongs to one trace of one ``tf.function``: TensorFlow traces a
function again when its first call created variables, and Keras nests its
step function in another, so a rank whose model was built inside the step
traces more often than one whose model was built before; counting per outer
graph would then give that rank other names.
"""

from __future__ import annotations

import re
import weakref

import tensorflow as tf

from .. import _compat

_BRANCH_GRAPHS = _compat.control_flow_graph_classes()
_counts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stable_name(kind: str) -> str | None:
    """``hvdkit.<kind>.<function>.<k>``: the k-th such name in this trace; None eagerly."""
    if tf.executing_eagerly():
        return None
    graph = tf.compat.v1.get_default_graph()
    while isinstance(graph, _BRANCH_GRAPHS):  # a cond/while body: its function's count
        graph = graph.outer_graph
    per_kind = _counts.setdefault(graph, {})
    index = per_kind.get(kind, 0)
    per_kind[kind] = index + 1
    function = re.sub(r"[^A-Za-z0-9_]", "_", getattr(graph, "name", "") or "graph")
    return f"hvdkit.{kind}.{function}.{index}"

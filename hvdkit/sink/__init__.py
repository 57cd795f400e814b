"""Sink mode: many training steps per host call, with the next batches already staged.

MindSpore's sink mode removes host round trips in three ways; hvdkit maps
each onto TensorFlow, on CPU and GPU, in one process or many:

===========  ==========================================  ===============================
MindSpore    what it does                                hvdkit
===========  ==========================================  ===============================
data sink    a device-side queue, filled while the       :func:`prefetch_to_device`, the
             current step runs                           last stage of a tf.data pipeline
graph sink   the whole step is one compiled graph        ``tf.function`` (every path below)
loop sink    ``sink_size`` steps per host call; the      :func:`data_sink` (functional),
             host loop and callbacks run once per sink   :func:`train` (Keras)
===========  ==========================================  ===============================

Modules: ``pipeline`` (staging, repeating, equal per-rank lengths), ``loop``
(the multi-step ``tf.function``, error attribution, slow-input warning),
``functional`` (:func:`data_sink`) and ``fit`` (:func:`train`).
"""

from .fit import train
from .functional import DataSink, JitConfig, data_sink
from .loop import SlowInputWarning
from .pipeline import prefetch_to_device

__all__ = [
    "SlowInputWarning",
    "prefetch_to_device",
    "DataSink",
    "JitConfig",
    "data_sink",
    "train",
]

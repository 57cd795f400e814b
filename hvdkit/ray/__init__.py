"""``hvdkit.ray``: the public path of :mod:`hvdkit.clusters.ray` (``run``, ``RayExecutor``)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("hvdkit.clusters.ray")

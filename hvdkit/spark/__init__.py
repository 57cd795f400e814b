"""``hvdkit.spark``: the public path of :mod:`hvdkit.clusters.spark` (``hvdkit.spark.run``)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("hvdkit.clusters.spark")

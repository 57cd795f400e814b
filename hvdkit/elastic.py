"""``hvdkit.elastic``: the public path of :mod:`hvdkit.fault.elastic`."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("hvdkit.fault.elastic")

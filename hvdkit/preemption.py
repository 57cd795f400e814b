"""``hvdkit.preemption``: the public path of :mod:`hvdkit.fault.preemption`."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("hvdkit.fault.preemption")

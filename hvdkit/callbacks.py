"""``hvdkit.callbacks``: the public path of :mod:`hvdkit.keras.callbacks`."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("hvdkit.keras.callbacks")

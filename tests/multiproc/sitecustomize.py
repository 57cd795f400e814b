"""Run at the start of every Python process the suite launches (this folder is on their PYTHONPATH).

Keras 3 imports scikit-learn whenever it is installed (for ``keras.wrappers``),
about 1 s of CPU per process on the 2-core test machine (``import tensorflow,
keras``: 4.1 s with it, 3.1–3.9 s without) and the suite starts hundreds of
them. Only the examples use scikit-learn (its digits data), and hvdkit does not
depend on it, so the processes of the suite start as a plain ``pip install
hvdkit`` would: without it. ``launcher_env(sklearn=True)`` (tests/conftest.py)
keeps it for the examples' jobs.
"""

import os
import sys

if os.environ.get("HVDKIT_TEST_SKLEARN") != "1":
    sys.modules.setdefault("sklearn", None)  # "import sklearn" raises ImportError

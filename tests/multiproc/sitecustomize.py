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

# Importing TensorFlow and Keras makes some 300 000 objects, and Python's
# collector, run every 700 new objects, walks them again and again as they come
# (603 young, 55 middle and 5 full collections: 0.6 of the import's 2.3 CPU-s on
# the 2-core test machine; performance-record.md, "A process's end"). The
# suite's processes import them with the first threshold at 10 000 and get
# Python's thresholds back once `tensorflow` is imported, so that programs run
# with the collector as users have it (processes that never import TensorFlow,
# the launchers, keep 10 000). HVDKIT_TEST_IMPORT_GC=default keeps Python's.
if os.environ.get("HVDKIT_TEST_IMPORT_GC") != "default":
    import gc
    import importlib.abc
    import importlib.machinery

    class _ThresholdsBackAfterTensorFlow(importlib.abc.MetaPathFinder):
        """Finds nothing itself; wraps the loader of `tensorflow` to restore the thresholds."""

        def __init__(self):
            self.thresholds = gc.get_threshold()
            self.done = False
            gc.set_threshold(10_000, *self.thresholds[1:])

        def find_spec(self, name, path=None, target=None):
            if self.done or name != "tensorflow":
                return None
            self.done = True  # once: a later import of it is Python's alone
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                gc.set_threshold(*self.thresholds)
                return None  # the other finders look for it as usual
            spec.loader = _RestoringLoader(spec.loader, self.thresholds)
            return spec

    class _RestoringLoader(importlib.abc.Loader):
        def __init__(self, loader, thresholds):
            self.loader, self.thresholds = loader, thresholds

        def create_module(self, spec):
            return self.loader.create_module(spec)

        def exec_module(self, module):
            module.__spec__.loader = module.__loader__ = self.loader  # the module sees its own
            try:
                self.loader.exec_module(module)
            finally:
                gc.set_threshold(*self.thresholds)

        def __getattr__(self, name):  # get_resource_reader, is_package, ...
            return getattr(self.loader, name)

    sys.meta_path.insert(0, _ThresholdsBackAfterTensorFlow())

# HVDKIT_TEST_CPU_LOG=<file>: each process appends one JSON line at exit (its CPU
# seconds, pid, wall seconds, command line and the test that launched it), to see
# where the suite's CPU goes. Processes killed by a signal write nothing.
if os.environ.get("HVDKIT_TEST_CPU_LOG"):
    import atexit
    import time

    _started = time.monotonic()

    def _log_cpu(path=os.environ["HVDKIT_TEST_CPU_LOG"]):
        import json
        import resource

        use = resource.getrusage(resource.RUSAGE_SELF)
        line = {
            "cpu": round(use.ru_utime + use.ru_stime, 2),
            "pid": os.getpid(),
            "wall": round(time.monotonic() - _started, 2),
            "argv": sys.argv[:4],
            "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
        }
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    atexit.register(_log_cpu)

# HVDKIT_TEST_STACKS=1: SIGUSR2 prints every thread's Python stack to stderr (to see
# where a process of a benchmark or a test waits, without stopping it; the signal
# ends a blocking call that it interrupts). HVDKIT_TEST_STACKS=every=N: every N
# seconds instead, from a watchdog thread.
if os.environ.get("HVDKIT_TEST_STACKS") == "1":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR2, all_threads=True)
elif os.environ.get("HVDKIT_TEST_STACKS", "").startswith("every="):
    import faulthandler

    # every N seconds, from a watchdog thread (no signal: no call is interrupted)
    faulthandler.dump_traceback_later(float(os.environ["HVDKIT_TEST_STACKS"][6:]), repeat=True)

# HVDKIT_TEST_GC_LOG=S: print each garbage collection that took S seconds or more
# (its generation, duration, objects collected) to stderr, to tell a long
# collection (a finalizer that blocks) from other waits of the main thread.
if os.environ.get("HVDKIT_TEST_GC_LOG"):
    import gc
    import time

    _gc_min_s, _gc_began = float(os.environ["HVDKIT_TEST_GC_LOG"]), [0.0]

    def _gc_timer(phase, info):
        if phase == "start":
            _gc_began[0] = time.monotonic()
            return
        took = time.monotonic() - _gc_began[0]
        if took >= _gc_min_s:
            sys.stderr.write(
                f"[gc] generation {info['generation']} took {took:.2f} s, "
                f"collected {info['collected']}\n"
            )

    gc.callbacks.append(_gc_timer)

# HVDKIT_TEST_GC_MARK=DIR: each process keeps the start time of a garbage collection
# in progress (CLOCK_MONOTONIC, 0.0 between collections) in DIR/gc-<pid>, a mapped
# 8-byte file: a watcher outside the process sees a long collection while it lasts
# (to attach a debugger to it). Writing to the mapping costs no system call.
if os.environ.get("HVDKIT_TEST_GC_MARK"):
    import gc
    import mmap
    import struct
    import time

    _mark_path = os.path.join(os.environ["HVDKIT_TEST_GC_MARK"], f"gc-{os.getpid()}")
    with open(_mark_path, "wb") as _f:
        _f.write(bytes(8))
    with open(_mark_path, "r+b") as _f:
        _gc_mark = mmap.mmap(_f.fileno(), 8)

    def _gc_marker(phase, info):
        _gc_mark[:8] = struct.pack("d", time.monotonic() if phase == "start" else 0.0)

    gc.callbacks.append(_gc_marker)

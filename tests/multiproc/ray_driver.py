"""A Ray driver script, as a user writes one: tests/test_ray.py runs it on the head node.

    python ray_driver.py SHARED_DIR RESULT_JSON

Every case in one connection to the cluster: 2 ranks against 1 on the whole
batch, the main job uninterrupted, with node n2 lost (the test kills it
when ``<shared>/killed/holding`` appears) and with a rank frozen (SIGSTOP at
``<shared>/frozen/holding``; the test sets a short stall timeout), RayExecutor's start/run/run/
shutdown, and the bad inputs. Writes what it saw to RESULT_JSON.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import cluster_train
import ray
from ray import cloudpickle

import hvdkit.ray

shared, result_path = sys.argv[1:3]
cloudpickle.register_pickle_by_value(cluster_train)  # the nodes cannot import this folder
ray.init(logging_level="ERROR")  # the cluster of this node (RAY_ADDRESS)
out: dict = {}


def record(name, call):
    start = time.monotonic()
    try:
        out[name] = {"value": call()}
    except Exception as exc:
        out[name] = {"error": f"{type(exc).__name__}: {exc}"[:3000], "type": type(exc).__name__}
    out[name]["seconds"] = time.monotonic() - start
    with open(result_path, "w") as f:
        json.dump(out, f)


record("whole_batch_2", lambda: hvdkit.ray.run(cluster_train.whole_batch, num_workers=2))
record("whole_batch_1", lambda: hvdkit.ray.run(cluster_train.whole_batch, num_workers=1))
record(
    "uninterrupted",
    lambda: hvdkit.ray.run(
        cluster_train.train, args=(os.path.join(shared, "plain"),), num_workers=2
    ),
)
record(
    "killed",
    lambda: hvdkit.ray.run(
        cluster_train.train,
        args=(os.path.join(shared, "killed"),),
        kwargs=dict(hold_at=12, hold_on="n2"),
        num_workers=2,
    ),
)

record(
    "frozen",
    lambda: hvdkit.ray.run(
        cluster_train.train,
        args=(os.path.join(shared, "frozen"),),
        kwargs=dict(hold_at=12),
        num_workers=2,
    ),
)


def executor_twice():
    executor = hvdkit.ray.RayExecutor(num_workers=2)
    executor.start()
    try:
        first = executor.run(lambda: __import__("hvdkit").init() or __import__("hvdkit").size())
        second = executor.run(lambda x: __import__("hvdkit").rank() * x, args=(10,))
    finally:
        executor.shutdown()
    return [first, second]


record("executor", executor_twice)
record("too_many", lambda: hvdkit.ray.run(cluster_train.whole_batch, num_workers=4))
record("bad_cpus", lambda: hvdkit.ray.run(cluster_train.whole_batch, cpus_per_worker=0))
lock = threading.Lock()
record("unpicklable", lambda: hvdkit.ray.run(lambda: lock.locked(), num_workers=2))


def raises():
    raise ValueError("the function's own error, 42")


record("fn_raises", lambda: hvdkit.ray.run(raises, num_workers=2))

mods = os.path.join(shared, "mods")  # a module the driver imports, not shipped to the cluster
record(
    "unshipped_module", lambda: hvdkit.ray.run(cluster_train.unshipped_train(mods), num_workers=2)
)
print("driver done", flush=True)

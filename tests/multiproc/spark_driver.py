"""A Spark driver script, as a user writes one: tests/test_spark.py submits it to its cluster.

    spark-submit --master spark://... --conf spark.driver.host=... spark_driver.py SHARED RESULT

Runs every check the test file asserts in one Spark application (a JVM and
the executors start once): ``run`` right after the session is built, 2
ranks against 1 on the whole batch, the main job uninterrupted, with a
node's executor killed (the test kills it when ``<shared>/killed/holding``
appears) and with a rank frozen (SIGSTOP at ``<shared>/frozen/holding``; the
test sets a short stall timeout), and the bad inputs. Writes what it saw to RESULT_JSON.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import cluster_train
from pyspark import cloudpickle
from pyspark.sql import SparkSession

import hvdkit.spark

shared, result_path = sys.argv[1:3]
# the executors cannot import this folder's modules: send the functions themselves
cloudpickle.register_pickle_by_value(cluster_train)
spark = SparkSession.builder.appName("hvdkit-test").getOrCreate()
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


# right after the session: the executors may not have registered yet
record("whole_batch_2", lambda: hvdkit.spark.run(cluster_train.whole_batch, num_proc=2))
record("whole_batch_1", lambda: hvdkit.spark.run(cluster_train.whole_batch, num_proc=1))
record(
    "uninterrupted",
    lambda: hvdkit.spark.run(
        cluster_train.train, args=(os.path.join(shared, "plain"),), num_proc=2
    ),
)
record(
    "killed",
    lambda: hvdkit.spark.run(
        cluster_train.train,
        args=(os.path.join(shared, "killed"),),
        kwargs=dict(hold_at=12, hold_on="n2"),
        num_proc=2,
    ),
)
record(
    "frozen",
    lambda: hvdkit.spark.run(
        cluster_train.train,
        args=(os.path.join(shared, "frozen"),),
        kwargs=dict(hold_at=12),
        num_proc=2,
    ),
)
record("default_num_proc", lambda: hvdkit.spark.run(lambda: __import__("hvdkit").init() or 7))
parquet = os.path.join(shared, "train.parquet")
spark.range(40).repartition(4).write.parquet(parquet)  # a DataFrame, written once
record(
    "dataframe", lambda: hvdkit.spark.run(cluster_train.parquet_rows, args=(parquet,), num_proc=2)
)
record("too_many", lambda: hvdkit.spark.run(cluster_train.whole_batch, num_proc=3))
lock = threading.Lock()
record("unpicklable", lambda: hvdkit.spark.run(lambda: lock.locked(), num_proc=1))


def raises():
    raise ValueError("the function's own error, 42")


record("fn_raises", lambda: hvdkit.spark.run(raises, num_proc=2))
record(
    "inside_task",
    lambda: (
        spark.sparkContext.parallelize([0], 1)
        .map(lambda _: hvdkit.spark.run(cluster_train.whole_batch, num_proc=1))
        .collect()
    ),
)
record("bad_num_proc", lambda: hvdkit.spark.run(cluster_train.whole_batch, num_proc=0))

mods = os.path.join(shared, "mods")  # a module the driver imports, not shipped to the cluster
record(
    "unshipped_module", lambda: hvdkit.spark.run(cluster_train.unshipped_train(mods), num_proc=2)
)
spark.stop()
print("driver done", flush=True)

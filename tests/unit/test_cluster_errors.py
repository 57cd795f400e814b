"""What a user of hvdkit.spark.run / hvdkit.ray.run reads when something is wrong.

Each message names what is wrong (the object, the rank, the lost executor)
and the fix. The real clusters run in tests/test_spark.py and tests/test_ray.py.
"""

from __future__ import annotations

import threading

import pytest

from hvdkit.clusters import ray as hray
from hvdkit.clusters import spark as hspark
from hvdkit.errors import ConfigurationError

LOCK = threading.Lock()


def _uses_lock():
    """A function of the driver script (pickled by value) that holds a lock."""

    def uses_lock():
        return LOCK.locked()

    uses_lock.__module__ = "__main__"  # as when defined in the driver script
    return uses_lock


def test_ray_refuses_what_its_serializer_cannot_send_naming_it(monkeypatch):
    import types

    said = (
        "Could not serialize the argument <function uses_lock> for a task or actor "
        "_Rank.call: cannot pickle '_thread.lock' object"
    )

    def refuse(*args, **kwargs):  # Ray's serializer, on the call's arguments
        raise TypeError(said)

    actor = types.SimpleNamespace(call=types.SimpleNamespace(remote=refuse))
    monkeypatch.setattr(hray, "_ray", lambda: None)
    executor = hray.RayExecutor(num_workers=2)
    executor._actors = [actor, actor]  # as after start()
    with pytest.raises(ConfigurationError) as raised:
        executor.run(_uses_lock())
    text = str(raised.value)
    sent = "_uses_lock.<locals>.uses_lock and its arguments"
    assert text.startswith(f"hvdkit.ray cannot send {sent} to the ranks (")
    assert said in text and "inside fn" in text


def test_spark_refuses_an_unpicklable_fn_with_the_same_words():
    pytest.importorskip("pyspark")
    with pytest.raises(ConfigurationError) as raised:
        hspark._pickled_call(_uses_lock(), (), None)
    said = str(raised.value)
    sent = "_uses_lock.<locals>.uses_lock and its arguments"
    assert said.startswith(f"hvdkit.spark.run cannot send {sent} to the executors: ")
    assert "cannot pickle '_thread.lock' object" in said
    with pytest.raises(ConfigurationError, match=r"hvdkit.spark.run\(fn=3\): fn must be a func"):
        hspark._pickled_call(3, (), None)


# Spark's job-abort text as py4j gives it (pyspark 4.3.0, tests/test_spark.py's cluster)
ABORTED = (
    "An error occurred while calling z:org.apache.spark.api.python.PythonRDD.collectAndServe.\n"
    ": org.apache.spark.SparkException: Job aborted due to stage failure: Could not recover "
    "from a failed barrier ResultStage. Most recent failure reason: Stage failed because "
    "barrier task ResultTask(1, {rank}) finished unsuccessfully.\n{cause}\n"
    "\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages"
    "(DAGScheduler.scala:2935)\n"
)
EXECUTOR_EXITED = (
    "ExecutorLostFailure (executor 0 exited caused by one of the running tasks) "
    "Reason: Command exited with code 137"
)


def test_a_lost_executor_is_named_by_its_rank_and_why():
    lost = hspark._failure(ABORTED.format(rank=1, cause=EXECUTOR_EXITED), {})
    assert isinstance(lost, hspark._StageLost)
    assert str(lost) == f"rank 1: {EXECUTOR_EXITED}"


def test_a_rank_that_lost_its_peer_is_named_by_its_own_line():
    cause = (
        "org.apache.spark.api.python.PythonException: Traceback (most recent call last):\n"
        '  File "/x/hvdkit/clusters/spark.py", line 433, in __call__\n'
        "RuntimeError: rank 0 lost a peer: CollectiveError: allreduce of tensor #3 failed"
    )
    lost = hspark._failure(ABORTED.format(rank=0, cause=cause), {})
    assert isinstance(lost, hspark._StageLost)
    assert str(lost) == "rank 0 lost a peer: CollectiveError: allreduce of tensor #3 failed"


def test_the_functions_own_error_names_its_rank_even_before_its_report_arrives():
    marked = f"RuntimeError: rank 1: {hspark.RANK_ERROR}\nValueError: 42\n{hspark.RANK_ERROR}"
    text = ABORTED.format(rank=1, cause="org.apache.spark.api.python.PythonException: " + marked)
    raised = hspark._failure(text, {})  # the rank's report over the relay not in yet
    assert isinstance(raised, hspark.LaunchError)
    assert str(raised) == "hvdkit.spark.run: fn raised on rank 1:\nValueError: 42"
    reported = hspark._failure(text, {0: ("lost-peer", "..."), 1: ("fn", "Traceback: boom")})
    assert str(reported) == "hvdkit.spark.run: fn raised on rank 1:\nTraceback: boom"


def test_a_rank_that_could_not_load_fn_or_send_its_value_is_not_said_to_have_raised():
    from hvdkit.clusters import _call

    why = _call.cannot_load(ModuleNotFoundError("No module named 'user_mod'"))
    assert why.startswith("cannot load fn and its arguments: ModuleNotFoundError: No module")
    loaded = hspark._failure(ABORTED.format(rank=1, cause="x"), {1: ("fn", why)})
    assert str(loaded) == f"hvdkit.spark.run: rank 1: {why}"
    value = "fn returned a value that cannot be pickled (a lock); return plain data"
    returned = hspark._failure(ABORTED.format(rank=0, cause="x"), {0: ("fn", value)})
    assert str(returned) == f"hvdkit.spark.run: rank 0: {value}"


def test_an_abort_of_no_known_kind_says_spark_own_first_line():
    lost = hspark._failure(ABORTED.format(rank=1, cause="TaskKilled (another reason)"), {})
    assert str(lost).startswith("org.apache.spark.SparkException: Job aborted due to stage")


def test_ray_without_ray_init_connects_as_any_ray_call_does(monkeypatch):
    import sys
    import types

    inits = []
    fake = types.SimpleNamespace(is_initialized=lambda: bool(inits), init=lambda: inits.append(1))
    monkeypatch.setitem(sys.modules, "ray", fake)
    assert hray._ray() is fake and inits == [1]  # ray.init(): RAY_ADDRESS, this node's cluster
    assert hray._ray() is fake and inits == [1]  # once


def test_a_fn_from_a_module_the_executor_lacks_is_the_functions_error_naming_the_fix(
    tmp_path, monkeypatch
):
    import pickle
    import subprocess
    import sys
    import types

    from hvdkit.clusters import _call

    # fn imported by the driver from its own module: pickled by reference, by the module's name
    module = types.ModuleType("user_train_not_shipped")
    exec("def train():\n    return 1\n", module.__dict__)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    call, result = tmp_path / "call", tmp_path / "result"
    call.write_bytes(pickle.dumps((module.train, (), {})))
    proc = subprocess.run(
        [sys.executable, "-m", _call.__name__, str(call), str(result)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1, proc.stderr
    kind, text = pickle.loads(result.read_bytes())[1:]  # not retried as a lost rank
    assert kind == _call.FN_ERROR
    assert "No module named 'user_train_not_shipped'" in text and "--py-files" in text
    assert "register_pickle_by_value" in text and text in proc.stderr


class _RayError(Exception):
    pass


class _RayTaskError(_RayError):
    pass


def test_ray_a_fn_from_a_module_the_workers_lack_is_not_retried_as_a_lost_rank(monkeypatch):
    import types

    from hvdkit.errors import LaunchError

    said = (  # what ray.get raised in tests/test_ray.py's cluster (Ray 2.60)
        "ray::_Rank.call() (pid=30085, ip=10.230.110.12)\n"
        "  At least one of the input arguments for this task could not be computed:\n"
        "ray.exceptions.RaySystemError: System error: No module named 'user_mod'"
    )

    def get(ref):
        raise _RayTaskError(said)

    fake = types.SimpleNamespace(
        exceptions=types.SimpleNamespace(RayError=_RayError, RayTaskError=_RayTaskError),
        wait=lambda pending, num_returns, timeout: (pending[:1], pending[1:]),
        get=get,
    )
    monkeypatch.setattr(hray, "_ray", lambda: fake)
    actor = types.SimpleNamespace(call=types.SimpleNamespace(remote=lambda *a: object()))
    executor = hray.RayExecutor(num_workers=2)
    executor._actors = [actor, actor]  # as after start()
    with pytest.raises(LaunchError) as raised:
        executor.run(len)
    assert not isinstance(raised.value, hray._RankLost)  # run() would start it again
    text = str(raised.value)
    assert text.startswith("hvdkit.ray.run: rank 0 cannot load fn and its arguments: No module")
    assert "'user_mod'" in text and "py_modules" in text and "register_pickle_by_value" in text


def test_spark_without_a_session_says_to_build_one_before_checking_anything_else():
    pyspark = pytest.importorskip("pyspark")
    assert pyspark.SparkContext._active_spark_context is None  # no JVM in unit tests
    with pytest.raises(ConfigurationError) as raised:
        hspark.run(lambda: 1, num_proc=2)
    assert str(raised.value) == (
        "hvdkit.spark.run found no active SparkContext; build one first: "
        "spark = SparkSession.builder.getOrCreate()."
    )

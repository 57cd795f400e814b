"""One process: Horovod names refused on use, Adasum, unshard's index math, the Keras registry hook.

The 2-rank side of these workflows is tests/test_keras_workflows_mp.py.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import hvdkit


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: hvdkit.elastic.run(print)(object()), "neither an hvdkit.Checkpointer"),
    ],
)
def test_horovod_only_names_import_and_refuse_on_use(call, fragment):
    with pytest.raises(hvdkit.NotSupportedError) as info:
        call()
    assert isinstance(info.value, NotImplementedError)
    assert fragment in str(info.value)


def test_elastic_answers_introspection_without_refusing():
    assert not hasattr(hvdkit.elastic, "__wrapped__")
    assert not hasattr(hvdkit.elastic, "NoSuchState")


def test_horovods_elastic_names_are_hvdkits_adapters():
    from hvdkit.fault import elastic_state

    for name in ["KerasState", "TensorFlowKerasState", "TensorFlowState", "ObjectState", "State"]:
        assert getattr(hvdkit.elastic, name) is getattr(elastic_state, name)
    assert issubclass(hvdkit.elastic.HostsUpdatedInterrupt, hvdkit.elastic.Regroup)
    for name in ["CommitStateCallback", "UpdateBatchStateCallback", "UpdateEpochStateCallback"]:
        assert issubclass(getattr(hvdkit.elastic, name), __import__("keras").callbacks.Callback)


def test_horovodrun_elastic_mode_is_refused_naming_hvdkits_launch(monkeypatch):
    from hvdkit import runtime

    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    with pytest.raises(hvdkit.NotSupportedError) as info:
        runtime._refuse_horovod_elastic()
    assert "--host-discovery-script" in str(info.value)
    assert "HVDKIT_ELASTIC=1" in str(info.value) and "run_scheduler.sh" in str(info.value)
    monkeypatch.setenv("HOROVOD_ELASTIC", "0")
    runtime._refuse_horovod_elastic()
    assert repr(hvdkit.Adasum) == "hvdkit.Adasum"


def test_adasum_and_global_process_set_in_collectives(local_runtime):
    import tensorflow as tf

    sparse = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([0]))
    with pytest.raises(NotImplementedError, match="Adasum does not support tf.IndexedSlices"):
        hvdkit.allreduce(sparse, op=hvdkit.Adasum)
    # one rank's tensor is its own adaptive sum
    assert hvdkit.allreduce(np.array([1.5, -2.0]), op=hvdkit.Adasum).tolist() == [1.5, -2.0]
    with pytest.raises(NotImplementedError, match="reducescatter does not support op=hvdkit.Ada"):
        hvdkit.reducescatter(np.ones(2), op=hvdkit.Adasum)
    got = hvdkit.allreduce(np.array([2.0]), op=hvdkit.Sum, process_set=hvdkit.global_process_set)
    assert got.tolist() == [2.0]
    with pytest.raises(hvdkit.ConfigurationError, match="'evens' is not an hvdkit.ProcessSet"):
        hvdkit.allreduce(np.array([2.0]), process_set="evens")


def test_alltoall_split_errors_are_also_invalid_argument(local_runtime):
    import tensorflow as tf

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"splits=\[2\] must be"):
        hvdkit.alltoall(tf.ones([1]), splits=[2])
    with pytest.raises(hvdkit.ConfigurationError):
        hvdkit.alltoall(tf.ones([1]), splits=[2])


def test_unshard_puts_rows_back_in_dataset_order(local_runtime):
    idx = np.array([3, 0, 2, 1])
    rows = np.array([[30], [0], [20], [10]])
    assert hvdkit.data.unshard(rows, idx).ravel().tolist() == [0, 10, 20, 30]
    out = hvdkit.data.unshard({"a": rows, "b": rows[:, 0] * 2}, idx)
    assert out["b"].tolist() == [0, 20, 40, 60]
    with pytest.raises(hvdkit.ShardingError, match=r"rows are on no rank \(first: \[4\]"):
        hvdkit.data.unshard(rows, idx, num_samples=5)
    with pytest.raises(hvdkit.ShardingError, match="rank 0: 3 rows for 4 indices"):
        hvdkit.data.unshard(rows[:3], idx)
    with pytest.raises(hvdkit.ShardingError, match="outside the dataset"):
        hvdkit.data.unshard(rows, idx, num_samples=3)


def test_import_hvdkit_stays_without_tensorflow_and_hooks_keras_once():
    code = (
        "import sys, hvdkit\n"
        "from hvdkit.keras import _registry as k\n"
        "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules\n"
        "hooks = [f for f in sys.meta_path if isinstance(f, k._AfterKerasImport)]\n"
        "k.install()\n"
        "assert len([f for f in sys.meta_path if isinstance(f, k._AfterKerasImport)]) == 1\n"
        "import keras\n"
        "assert not [f for f in sys.meta_path if isinstance(f, k._AfterKerasImport)]\n"
        "assert 'hvdkit.optimizer' not in sys.modules\n"
        "entry = keras.saving.get_custom_objects()[k.REGISTERED_NAME]\n"
        "import hvdkit.optimizer\n"
        "real = keras.saving.get_custom_objects()[k.REGISTERED_NAME]\n"
        "print(len(hooks), entry.__name__, real is hvdkit.optimizer.DistributedOptimizer)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "_DistributedOptimizerEntry", "True"]


def test_rank_zero_only_refuses_callbacks_that_change_training():
    import keras

    for cb in (
        keras.callbacks.EarlyStopping(),
        keras.callbacks.ReduceLROnPlateau(),
        keras.callbacks.TerminateOnNaN(),
        keras.callbacks.BackupAndRestore("b"),
        hvdkit.callbacks.BroadcastGlobalVariablesCallback(0),
    ):
        with pytest.raises(hvdkit.ConfigurationError, match="changes the training"):
            hvdkit.callbacks.RankZeroOnly(cb)
    ok = hvdkit.callbacks.RankZeroOnly(keras.callbacks.CSVLogger("x.csv"))
    assert isinstance(ok.callback, keras.callbacks.CSVLogger)

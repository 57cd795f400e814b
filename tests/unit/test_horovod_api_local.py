"""Horovod's names in a job of size 1 (no launcher): the same answers a script gets from Horovod."""

import inspect
import json
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import hvdkit

# name -> the horovod.tensorflow function whose parameters hvdkit's must start with, in order
SAME_SIGNATURE = [
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "grouped_allgather",
    "broadcast",
    "broadcast_",
    "reducescatter",
    "grouped_reducescatter",
    "alltoall",
    "broadcast_variables",
    "broadcast_object",
    "allgather_object",
    "size_op",
    "process_set_included_op",
    "add_process_set",
    "remove_process_set",
    "rank_op",
    "local_rank_op",
    "local_size_op",
    "start_timeline",
]


@pytest.mark.parametrize("name", SAME_SIGNATURE)
def test_parameters_in_horovods_order(name):
    horovod = pytest.importorskip("horovod.tensorflow")
    theirs = list(inspect.signature(getattr(horovod, name)).parameters)
    ours = list(inspect.signature(getattr(hvdkit, name)).parameters)
    assert ours[: len(theirs)] == theirs, (name, ours, theirs)


def test_size_op_takes_process_set_id_then_name():
    # Horovod's size_op(process_set_id=0, name=None); a string first is hvdkit's old name=
    assert list(inspect.signature(hvdkit.size_op).parameters) == ["process_set_id", "name"]


def test_scaling_is_horovods_arithmetic(local_runtime):
    out = hvdkit.allreduce(np.array([1.0, 2.0]), op=hvdkit.Sum, prescale_factor=0.5)
    assert out.tolist() == [0.5, 1.0]
    # integers: scaled in float64 and truncated toward zero, pre then post
    ints = hvdkit.allreduce(tf.constant([3, -5, 7]), prescale_factor=0.5, postscale_factor=3.0)
    assert ints.dtype == tf.int32 and ints.numpy().tolist() == [3, -6, 9]  # 3*1, 3*-2, 3*3
    half = hvdkit.allreduce(tf.constant([1.0], tf.float16), op=hvdkit.Sum, postscale_factor=0.1)
    assert half.dtype == tf.float16 and abs(float(half[0]) - 0.1) < 1e-3
    rs = hvdkit.reducescatter(np.array([[4.0], [8.0]]), postscale_factor=0.25)
    assert rs.tolist() == [[1.0], [2.0]]


def test_deprecated_average(local_runtime):
    with pytest.warns(DeprecationWarning, match="average"):
        hvdkit.allreduce(np.ones(1), average=False)
    with pytest.raises(ValueError, match="supersedes"):
        hvdkit.allreduce(np.ones(1), average=False, op=hvdkit.Sum)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hvdkit.allreduce(np.ones(1))  # no warning without average=


def test_indexed_slices(local_runtime):
    sl = tf.IndexedSlices(tf.constant([[2.0], [4.0]]), tf.constant([3, 0]))
    out = hvdkit.allreduce(sl)
    assert isinstance(out, tf.IndexedSlices) and out.dense_shape is None
    assert out.indices.numpy().tolist() == [3, 0] and out.values.numpy().tolist() == [[2.0], [4.0]]
    for op in (hvdkit.Min, hvdkit.Max, hvdkit.Product):
        with pytest.raises(NotImplementedError, match="Sum or hvdkit.Average"):
            hvdkit.allreduce(sl, op=op)
    with pytest.raises(NotImplementedError, match="prescale"):
        hvdkit.grouped_allreduce([sl], op=hvdkit.Sum, prescale_factor=2.0)


def test_process_set_and_session_refused(local_runtime):
    with pytest.raises(hvdkit.ConfigurationError, match="process_set"):
        hvdkit.allgather(np.ones(1), process_set=object())
    with pytest.raises(hvdkit.ConfigurationError, match="session"):
        hvdkit.broadcast_object(1, session=object())


def test_build_probes_are_the_installed_horovods(local_runtime):
    horovod = pytest.importorskip("horovod.tensorflow")
    for probe in ("mpi_built", "gloo_built", "nccl_built", "ccl_built", "cuda_built"):
        assert getattr(hvdkit, probe)() == getattr(horovod, probe)(), probe
    assert hvdkit.gloo_built() is True  # this installation has Gloo, even in one process
    # but no transport runs in a job of one process
    assert hvdkit.mpi_enabled() is False and hvdkit.gloo_enabled() is False
    with pytest.raises(ValueError, match="does not run over MPI"):
        hvdkit.mpi_threads_supported()
    assert hvdkit.is_homogeneous() is True


def test_topology_ops_and_join(local_runtime):
    assert [int(t) for t in (hvdkit.rank_op(), hvdkit.size_op())] == [0, 1]
    f = tf.function(lambda: (hvdkit.local_rank_op(), hvdkit.local_size_op()))
    assert [int(t) for t in f()] == [0, 1]
    joined = hvdkit.join()
    assert joined.dtype == tf.int32 and int(joined) == 0


def test_timeline_needs_dynamic_like_horovod(local_runtime, monkeypatch, tmp_path):
    monkeypatch.delenv("HOROVOD_TIMELINE", raising=False)
    with pytest.raises(ValueError, match="HOROVOD_TIMELINE=DYNAMIC"):
        hvdkit.start_timeline(str(tmp_path / "t.json"))
    monkeypatch.setenv("HOROVOD_TIMELINE", "DYNAMIC")
    hvdkit.start_timeline(str(tmp_path / "t.json"))
    hvdkit.allreduce(np.ones(1))
    hvdkit.stop_timeline()
    assert json.loads((tmp_path / "t.json").read_text()) == []  # nothing communicated


def test_broadcast_inplace_keras_and_tf_variables(local_runtime):
    v, kv = tf.Variable([1.0]), keras.Variable([2.0])
    out = hvdkit.broadcast_([v, kv], 0)
    assert [o.numpy().tolist() for o in out] == [[1.0], [2.0]]
    with pytest.raises(hvdkit.ConfigurationError, match="broadcast"):
        hvdkit.broadcast_([tf.constant(1.0)], 0)


def test_sync_batch_norm_is_keras_batch_norm_at_size_one(local_runtime):
    x = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    ref, sync = keras.layers.BatchNormalization(), hvdkit.SyncBatchNormalization()
    np.testing.assert_allclose(sync(x, training=True), ref(x, training=True), rtol=1e-6)
    np.testing.assert_allclose(sync.moving_variance, ref.moving_variance, rtol=1e-6)
    config = sync.get_config()
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(sync))
    assert type(again) is hvdkit.SyncBatchNormalization and again.get_config() == config


def test_mismatch_error_is_horovods_class_too():
    from hvdkit.collectives import TFCollectiveMismatchError

    e = TFCollectiveMismatchError("allreduce of tensor 'x' failed: rank 0: shape [2]")
    assert isinstance(e, tf.errors.FailedPreconditionError)
    assert isinstance(e, hvdkit.CollectiveMismatchError) and isinstance(e, ValueError)
    assert str(e) == e.message == "allreduce of tensor 'x' failed: rank 0: shape [2]"


def test_keras_frontend_order_name_second(local_runtime):
    # horovod.tensorflow.keras.allreduce(value, name, average, ...)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the string is a name, not the deprecated average
        out = hvdkit.allreduce(np.array([4.0]), "metric")
    assert out.tolist() == [4.0]

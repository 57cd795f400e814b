"""Runtime and collectives in one process, without a launcher (job of size 1)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import hvdkit


def test_every_runtime_function_refuses_before_init():
    hvdkit.shutdown()
    assert not hvdkit.is_initialized()
    for fn in (
        hvdkit.rank,
        hvdkit.size,
        hvdkit.local_rank,
        hvdkit.local_size,
        hvdkit.cross_rank,
        hvdkit.cross_size,
        hvdkit.barrier,
    ):
        with pytest.raises(hvdkit.NotInitializedError, match=r"call hvdkit\.init\(\)"):
            fn()
    with pytest.raises(hvdkit.NotInitializedError):
        hvdkit.allreduce(np.ones(2))
    with pytest.raises(RuntimeError):  # also the builtin it refines
        hvdkit.allgather_object(1)


def test_size_one_topology(local_runtime):
    assert hvdkit.backend_name() == "local"
    assert (hvdkit.rank(), hvdkit.size()) == (0, 1)
    assert (hvdkit.local_rank(), hvdkit.local_size()) == (0, 1)
    assert (hvdkit.cross_rank(), hvdkit.cross_size()) == (0, 1)
    hvdkit.barrier()
    hvdkit.init()  # idempotent
    assert hvdkit.size() == 1


def test_size_one_collectives_are_identity(local_runtime):
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    for op in (hvdkit.Average, hvdkit.Sum, hvdkit.Min, hvdkit.Max, hvdkit.Product):
        out = hvdkit.allreduce(x, op=op)
        assert isinstance(out, np.ndarray) and out.dtype == np.float32
        np.testing.assert_array_equal(out, x)
    t = hvdkit.allreduce(tf.constant(x))
    assert isinstance(t, tf.Tensor) and t.shape == (3, 2)
    np.testing.assert_array_equal(hvdkit.allgather(x), x)
    np.testing.assert_array_equal(hvdkit.broadcast(x, root_rank=0), x)
    np.testing.assert_array_equal(hvdkit.reducescatter(x), x)
    recv, splits = hvdkit.alltoall(x, splits=[3])
    np.testing.assert_array_equal(recv, x)
    assert splits.tolist() == [3]
    a, b = hvdkit.grouped_allreduce([x, np.int64(4)])
    np.testing.assert_array_equal(a, x)
    assert int(b) == 4
    (got,) = hvdkit.neighbor_exchange(x, send_to=[0], recv_from=[0])
    np.testing.assert_array_equal(got, x)
    assert hvdkit.broadcast_object({"a": 1}) == {"a": 1}
    assert hvdkit.allgather_object("x") == ["x"]
    v = tf.Variable([1.0, 2.0])
    hvdkit.broadcast_variables([v])
    assert v.numpy().tolist() == [1.0, 2.0]

    @tf.function
    def f(t):
        return hvdkit.allreduce(t, op=hvdkit.Sum) + hvdkit.allgather(t)

    assert f(tf.constant([1.0])).numpy().tolist() == [2.0]


def test_collective_argument_errors(local_runtime):
    with pytest.raises(hvdkit.ConfigurationError, match="does not support op='avg'"):
        hvdkit.allreduce(np.ones(1), op="avg")
    with pytest.raises(
        hvdkit.ConfigurationError, match=r"root_rank=1 is outside the job's ranks \[0, 1\)"
    ):
        hvdkit.broadcast(np.ones(1), root_rank=1)
    for slip in (False, 0.0, "0"):  # rank 0 is the only rank, yet these are no rank
        with pytest.raises(hvdkit.ConfigurationError, match="is not a rank of the job"):
            hvdkit.broadcast(np.ones(1), root_rank=slip)
    assert hvdkit.broadcast(np.ones(1), root_rank=np.int64(0)).tolist() == [1.0]
    with pytest.raises(hvdkit.ConfigurationError, match="reducescatter needs a tensor"):
        hvdkit.reducescatter(np.float32(1.0))
    with pytest.raises(hvdkit.ConfigurationError, match="one entry per rank"):
        hvdkit.alltoall(np.ones(2), splits=[1, 1])
    with pytest.raises(hvdkit.ConfigurationError, match="lists a rank twice"):
        hvdkit.neighbor_exchange(np.ones(1), send_to=[0, 0], recv_from=[])
    with pytest.raises(hvdkit.ConfigurationError, match="got 2 tensors for 1 destinations"):
        hvdkit.neighbor_exchange([np.ones(1), np.ones(1)], send_to=[0], recv_from=[0])
    with pytest.raises(ValueError):  # ConfigurationError is also a ValueError
        hvdkit.allreduce(np.ones(1), op="sum")
    assert hvdkit.allreduce(np.ones(1), op=None).tolist() == [1.0]  # Horovod: None is Average


def test_backend_selection_errors(monkeypatch):
    hvdkit.shutdown()
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(hvdkit.ConfigurationError, match="launcher started 2 processes"):
        hvdkit.init(backend="local")
    with pytest.raises(hvdkit.ConfigurationError, match="unknown backend 'nccl'"):
        hvdkit.init(backend="nccl")
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")
    with pytest.raises(hvdkit.ConfigurationError, match="intra_op_threads='many'"):
        hvdkit.init(intra_op_threads="many")
    for bad in (2.5, True):  # not an int: refused, not rounded
        with pytest.raises(hvdkit.ConfigurationError, match=f"intra_op_threads={bad!r} is not"):
            hvdkit.init(intra_op_threads=bad)
    monkeypatch.setenv("HVDKIT_INTRA_OP_THREADS", "2.5")
    with pytest.raises(hvdkit.ConfigurationError, match="HVDKIT_INTRA_OP_THREADS='2.5' is not"):
        hvdkit.init()
    monkeypatch.delenv("HVDKIT_INTRA_OP_THREADS")
    hvdkit.shutdown()
    assert not hvdkit.is_initialized()


def test_distributed_optimizer_size_one_equals_plain(local_runtime):
    def train(wrap):
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        opt = keras.optimizers.Adam(0.05)
        model.compile(optimizer=hvdkit.DistributedOptimizer(opt) if wrap else opt, loss="mse")
        x = np.linspace(-1, 1, 32, dtype="float32").reshape(8, 4)
        model.fit(x, x[:, :2] * 3, batch_size=4, epochs=3, verbose=0, shuffle=False)
        return [w.numpy() for w in model.weights]

    for a, b in zip(train(True), train(False), strict=True):
        np.testing.assert_array_equal(a, b)


def test_distributed_optimizer_forwards_configuration(local_runtime):
    inner = keras.optimizers.SGD(0.25, momentum=0.5, clipnorm=1.0)
    opt = hvdkit.DistributedOptimizer(inner)
    assert float(opt.learning_rate) == 0.25
    opt.learning_rate = 0.125
    assert float(inner.learning_rate) == 0.125
    assert opt.iterations is inner.iterations
    cfg = opt.get_config()
    assert cfg["optimizer"]["config"]["momentum"] == 0.5
    assert cfg["optimizer"]["config"]["clipnorm"] == 1.0
    clone = hvdkit.DistributedOptimizer.from_config(cfg)
    assert clone.inner_optimizer.momentum == 0.5
    assert isinstance(hvdkit.DistributedOptimizer("adam").inner_optimizer, keras.optimizers.Adam)
    with pytest.raises(hvdkit.ConfigurationError, match="options of the wrapped Keras optimizer"):
        hvdkit.DistributedOptimizer(inner, clipnorm=1.0)
    with pytest.raises(hvdkit.ConfigurationError, match=r"\['learning_rate'\]"):
        hvdkit.DistributedOptimizer(inner, learning_rate=0.1)  # never silently dropped
    with pytest.raises(hvdkit.ConfigurationError, match="does not support Horovod's"):
        hvdkit.DistributedOptimizer(inner, gradient_predivide_factor=2.0)


def test_keras_variables_stay_tensors(local_runtime):
    v = keras.Variable([1.0, 2.0])
    out = hvdkit.allreduce(v)
    assert tf.is_tensor(out) and out.numpy().tolist() == [1.0, 2.0]
    f = tf.function(lambda: hvdkit.allreduce(v, op=hvdkit.Sum) * 2.0)
    assert f().numpy().tolist() == [2.0, 4.0]


def test_apply_gradients_returns_the_applied_update_count(local_runtime):
    w = keras.Variable([[1.0]])
    opt = hvdkit.DistributedOptimizer(keras.optimizers.SGD(0.1))
    for expected in (1, 2):
        returned = opt.apply_gradients([(tf.constant([[1.0]]), w)])
        assert int(returned.numpy()) == expected


def test_failed_init_leaves_runtime_uninitialized(monkeypatch):
    hvdkit.shutdown()
    with pytest.raises(hvdkit.ConfigurationError):
        hvdkit.init(intra_op_threads=-1)
    assert not hvdkit.is_initialized()


def test_warmup_callback_keeps_horovods_argument_positions():
    with pytest.raises(hvdkit.ConfigurationError, match="momentum_correction=True"):
        hvdkit.callbacks.LearningRateWarmupCallback(0.1, 5, True)
    cbs = hvdkit.callbacks
    for make in (
        lambda spe: cbs.LearningRateWarmupCallback(0.1, 5, steps_per_epoch=spe),
        lambda spe: cbs.LearningRateScheduleCallback(0.1, 0.5, steps_per_epoch=spe),
    ):
        for bad in (True, "100", [100]):
            with pytest.raises(hvdkit.ConfigurationError, match="is not a number of batches"):
                make(bad)
        with pytest.raises(hvdkit.ConfigurationError, match=r"steps_per_epoch=0\.5 must be >= 1"):
            make(0.5)
        # a float, as Horovod accepts (len(x) / batch in ported scripts)
        assert make(62.5).steps_per_epoch == 62.5
        assert make(None).steps_per_epoch is None


def test_backward_passes_accumulates_in_one_process(local_runtime):
    # k=2 passes with half batches == 1 pass on the full batch (mean loss)
    w_ref = keras.Variable(np.zeros([2, 1], "float32"))
    w = keras.Variable(np.zeros([2, 1], "float32"))
    x = np.array([[1, 2], [3, 4], [5, 6], [7, 8]], "float32")
    y = np.array([[1], [2], [3], [4]], "float32")
    ref_opt = keras.optimizers.SGD(0.01)
    opt = hvdkit.DistributedOptimizer(keras.optimizers.SGD(0.01), backward_passes_per_step=2)

    def grad(var, xs, ys):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(xs, var) - ys))
        return tape.gradient(loss, [var])

    for _ in range(3):
        ref_opt.apply(grad(w_ref, x, y), [w_ref])
        opt.apply(grad(w, x[:2], y[:2]), [w])
        assert int(opt.iterations.numpy()) == int(ref_opt.iterations.numpy()) - 1
        opt.apply(grad(w, x[2:], y[2:]), [w])
        np.testing.assert_allclose(w.numpy(), w_ref.numpy(), rtol=1e-6)
    assert int(opt.iterations.numpy()) == 3


def test_fp16_compression_round_trip():
    x = tf.constant([1.0, 1e-3, 300.0], tf.float32)
    sent, ctx = hvdkit.Compression.fp16.compress(x)
    assert sent.dtype == tf.float16 and ctx == tf.float32
    back = hvdkit.Compression.fp16.decompress(sent, ctx)
    assert back.dtype == tf.float32
    np.testing.assert_allclose(back.numpy(), x.numpy(), rtol=1e-3)
    ints, ctx = hvdkit.Compression.fp16.compress(tf.constant([1, 2]))
    assert ints.dtype == tf.int32 and ctx is None
    assert hvdkit.Compression.none.compress(x)[0] is x
    with pytest.raises(hvdkit.ConfigurationError, match="unknown compression 'int8'"):
        hvdkit.Compression.by_name("int8")


def test_public_api_is_declared():
    for name in hvdkit.__all__:
        assert hasattr(hvdkit, name), name
    for name in ("init", "rank", "size", "DistributedOptimizer", "allreduce", "callbacks"):
        assert name in hvdkit.__all__

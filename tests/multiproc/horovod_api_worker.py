"""Horovod's API as a Horovod script uses it, on 2 ranks: numbers, classes, shapes.

argv: outdir. The run sets HOROVOD_TIMELINE=DYNAMIC.
"""

import os
import sys
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

import hvdkit as hvd

from _harness import Checks

hvd.init()
r, n = hvd.rank(), hvd.size()
c = Checks(r, sys.argv[1])
# horovodrun --mpi starts ranks with mpirun, which sets OMPI_*; --gloo does not
TRANSPORT = "mpi" if "OMPI_COMM_WORLD_SIZE" in os.environ else "gloo"
assert n == 2


def dense(slices: tf.IndexedSlices, rows: int) -> np.ndarray:
    """Sum duplicate indices: the tensor an IndexedSlices stands for."""
    return tf.math.unsorted_segment_sum(slices.values, slices.indices, rows).numpy()


with c.check("allreduce_prescale_postscale_float_and_int"):
    x = tf.constant([1.0, 2.0]) * (r + 1)  # rank0 [1, 2], rank1 [2, 4]
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    assert out.numpy().tolist() == [4.5, 9.0], out  # 3 * (0.5*1 + 0.5*2, 0.5*2 + 0.5*4)
    out = hvd.allreduce(x, op=hvd.Average, postscale_factor=2.0)
    assert out.numpy().tolist() == [3.0, 6.0], out  # 2 * mean
    xi = tf.constant([3, 5]) + r * tf.constant([1, 2])  # rank0 [3, 5], rank1 [4, 7]
    # integers are scaled in float64 and truncated on each rank before summing:
    # trunc(1.5)+trunc(2.0) = 3, trunc(2.5)+trunc(3.5) = 5
    out = hvd.allreduce(xi, op=hvd.Sum, prescale_factor=0.5)
    assert out.dtype == tf.int32 and out.numpy().tolist() == [3, 5], out
    out = hvd.allreduce(xi, op=hvd.Sum, postscale_factor=0.5)  # trunc(7/2), trunc(12/2)
    assert out.numpy().tolist() == [3, 6], out
    f = tf.function(lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.25))
    assert f(x).numpy().tolist() == [0.75, 1.5]
    g = hvd.grouped_allreduce([x, xi], op=hvd.Sum, postscale_factor=2.0)
    assert g[0].numpy().tolist() == [6.0, 12.0] and g[1].numpy().tolist() == [14, 24], g

with c.check("allreduce_deprecated_average_argument"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = hvd.allreduce(np.array([1.0 + r]), average=False)  # Sum
        a = hvd.allreduce(np.array([1.0 + r]), average=True)  # Average
        positional = hvd.allreduce(np.array([1.0 + r]), False)  # Horovod's 2nd parameter
    assert s.tolist() == [3.0] and a.tolist() == [1.5] and positional.tolist() == [3.0]
    assert sum(issubclass(w.category, DeprecationWarning) for w in caught) == 3, caught
    try:
        hvd.allreduce(np.ones(1), average=True, op=hvd.Sum)
    except ValueError as e:  # Horovod raises ValueError too
        assert "supersedes" in str(e) and isinstance(e, hvd.ConfigurationError), e
    else:
        raise AssertionError("op and average together were accepted")

with c.check("allreduce_indexed_slices_without_dense_shape"):
    vals = tf.constant([[1.0, 1.0], [2.0, 2.0]]) * (r + 1)
    sl = tf.IndexedSlices(vals, tf.constant([r, r + 1]))  # no dense_shape
    summed = hvd.allreduce(sl, op=hvd.Sum)
    assert isinstance(summed, tf.IndexedSlices) and summed.dense_shape is None
    assert summed.indices.numpy().tolist() == [0, 1, 1, 2]
    # rank0 rows 0,1 = [1],[2]; rank1 rows 1,2 = [2],[4] -> dense [1, 4, 4]
    assert dense(summed, 3).tolist() == [[1, 1], [4, 4], [4, 4]], dense(summed, 3)
    avg = hvd.allreduce(sl)  # Average (default)
    assert dense(avg, 3).tolist() == [[0.5, 0.5], [2, 2], [2, 2]]
    shaped = hvd.allreduce(tf.IndexedSlices(vals, tf.constant([r, r + 1]), tf.constant([3, 2])))
    assert shaped.dense_shape.numpy().tolist() == [3, 2]
    mixed = hvd.grouped_allreduce([sl, tf.constant([1.0 + r])], op=hvd.Sum)
    assert isinstance(mixed[0], tf.IndexedSlices) and mixed[1].numpy().tolist() == [3.0]
    assert dense(mixed[0], 3).tolist() == [[1, 1], [4, 4], [4, 4]]
    gf = tf.function(lambda v, i: hvd.allreduce(tf.IndexedSlices(v, i), op=hvd.Sum).values)
    assert gf(vals, tf.constant([r, r + 1])).shape == (4, 2)

with c.check("indexed_slices_min_max_product_and_scaling_not_implemented"):
    sl = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([r]))
    for op in (hvd.Min, hvd.Max, hvd.Product):
        try:
            hvd.allreduce(sl, op=op)
        except NotImplementedError as e:
            assert isinstance(e, hvd.NotSupportedError) and "Sum or hvdkit.Average" in str(e)
        else:
            raise AssertionError(f"{op} on IndexedSlices was accepted")
    for kwargs in ({"prescale_factor": 0.5}, {"postscale_factor": 0.5}):
        try:
            hvd.allreduce(sl, op=hvd.Sum, **kwargs)
        except NotImplementedError:
            pass
        else:
            raise AssertionError(f"{kwargs} on IndexedSlices was accepted")
    # nothing was sent: the job is still in step
    assert hvd.allreduce(np.array([1.0]), op=hvd.Sum).tolist() == [2.0]


def mismatch_cases():
    """(label, call) pairs where the two ranks disagree; each must fail on both ranks."""
    return [
        ("allreduce shape", lambda: hvd.allreduce(tf.zeros([2 + r]), name="m.ar.shape")),
        (
            "allreduce dtype",
            lambda: hvd.allreduce(
                tf.zeros([2], tf.float32 if r == 0 else tf.int32), name="m.ar.dt"
            ),
        ),
        ("allgather shape", lambda: hvd.allgather(tf.zeros([1, 2 + r]), name="m.ag.shape")),
        (
            "allgather dtype",
            lambda: hvd.allgather(tf.zeros([1], tf.float32 if r == 0 else tf.float64), name="m.ag"),
        ),
        ("broadcast shape", lambda: hvd.broadcast(tf.zeros([2 + r]), 0, name="m.bc.shape")),
        ("broadcast root", lambda: hvd.broadcast(tf.zeros([2]), root_rank=r, name="m.bc.root")),
        ("alltoall shape", lambda: hvd.alltoall(tf.zeros([2, 1 + r]), name="m.a2a.shape")),
        (
            "alltoall dtype",
            lambda: hvd.alltoall(tf.zeros([2], tf.float32 if r == 0 else tf.int32), name="m.a2a"),
        ),
    ]


with c.check("mismatch_eager_is_collective_mismatch_and_failed_precondition"):
    for label, call in mismatch_cases():
        try:
            call()
        except tf.errors.FailedPreconditionError as e:  # what a Horovod script catches
            assert isinstance(e, hvd.CollectiveMismatchError), (label, type(e))
            assert "rank 0:" in str(e) and "rank 1:" in str(e), (label, str(e))
            assert e.message == str(e)
        else:
            raise AssertionError(f"{label}: no error")
    try:
        hvd.allreduce(tf.zeros([2 + r]), name="m.again")
    except hvd.CollectiveMismatchError as e:  # and hvdkit's own class still works
        assert "'m.again'" in str(e)
    assert hvd.allreduce(np.array([1.0]), op=hvd.Sum).tolist() == [2.0]  # still usable

with c.check("mismatch_in_tf_function_is_failed_precondition"):
    for label, call in mismatch_cases():
        try:
            tf.function(call)()
        except tf.errors.FailedPreconditionError as e:
            assert "Mismatched" in str(e), (label, str(e))
        else:
            raise AssertionError(f"{label}: no error in tf.function")
    assert hvd.allreduce(np.array([1.0]), op=hvd.Sum).tolist() == [2.0]

with c.check("neighbor_exchange_mismatch_in_tf_function_is_invalid_argument"):
    # documented in docs/collectives.md: a graph assertion, on every rank
    nx = tf.function(
        lambda t: hvd.neighbor_exchange(t, send_to=[1] if r == 0 else [], recv_from=[])
    )
    try:
        nx(tf.constant([1.0]))
    except tf.errors.InvalidArgumentError as e:
        assert "neighbor_exchange pattern does not match" in str(e), str(e)[:500]
    else:
        raise AssertionError("no error for a mismatched pattern in tf.function")
    assert hvd.allreduce(np.array([1.0]), op=hvd.Sum).tolist() == [2.0]

with c.check("grouped_allgather"):
    a = np.full([r + 1, 2], r, np.int32)  # rank0: 1 row, rank1: 2 rows
    b = tf.constant([10.0 * r])
    ga, gb = hvd.grouped_allgather([a, b])
    assert ga.tolist() == [[0, 0], [1, 1], [1, 1]] and gb.numpy().tolist() == [0.0, 10.0]
    gf = tf.function(lambda x, y: hvd.grouped_allgather([x, y]))
    fa, fb = gf(tf.constant([[r, r]]), tf.constant([float(r)]))
    assert fa.numpy().tolist() == [[0, 0], [1, 1]] and fb.numpy().tolist() == [0.0, 1.0]
    assert hvd.grouped_allgather([]) == []

with c.check("reducescatter_horovod_signature_and_scaling"):
    x = np.arange(5.0).reshape(5, 1) * (r + 1)  # rank1 doubles: the sum is 3x
    out = hvd.reducescatter(x, "", None, hvd.Sum)  # Horovod's positional order
    # 5 rows over 2 ranks: rank 0 gets rows 0-2, rank 1 rows 3-4
    assert out.tolist() == ([[0.0], [3.0], [6.0]] if r == 0 else [[9.0], [12.0]]), out
    out = hvd.reducescatter(x, op=hvd.Average, prescale_factor=2.0)
    assert out.tolist() == ([[0.0], [3.0], [6.0]] if r == 0 else [[9.0], [12.0]]), out
    out = hvd.reducescatter(x, op=hvd.Sum, postscale_factor=0.5)
    assert out.tolist() == ([[0.0], [1.5], [3.0]] if r == 0 else [[4.5], [6.0]]), out
    p, q = hvd.grouped_reducescatter(
        [tf.ones([4, 2]) * (r + 1), tf.constant([1, 2, 3]) * (r + 1)], op=hvd.Sum
    )
    assert p.numpy().tolist() == [[3.0, 3.0]] * 2, p
    assert q.numpy().tolist() == ([3, 6] if r == 0 else [9]), q
    (avg,) = hvd.grouped_reducescatter([np.array([[2.0], [4.0]]) * (r + 1)])  # Average default
    assert avg.tolist() == ([[3.0]] if r == 0 else [[6.0]]), avg
    for bad in (lambda: hvd.reducescatter(np.float32(1)), lambda: hvd.grouped_reducescatter([1.0])):
        try:
            bad()
        except ValueError as e:  # a ValueError, which Horovod's scalar test accepts
            assert "scalar" in str(e)
        else:
            raise AssertionError("scalar accepted")

with c.check("broadcast_inplace"):
    v = tf.Variable([float(r), float(r)])
    kv = keras.Variable(np.full([2, 2], r + 5, np.int64))
    got = hvd.broadcast_([v, kv], 1)
    assert v.numpy().tolist() == [1.0, 1.0] and (np.asarray(kv.numpy()) == 6).all()
    assert got[0].numpy().tolist() == [1.0, 1.0] and (got[1].numpy() == 6).all()
    w = tf.Variable([[r + 1.0]])
    tf.function(lambda: hvd.broadcast_([w], root_rank=0))()
    assert w.numpy().tolist() == [[1.0]]
    m = tf.Variable([float(r)] * 3)
    hvd.broadcast_variables([m], root_rank=1, inplace=True)
    assert m.numpy().tolist() == [1.0] * 3

with c.check("topology_ops"):
    assert int(hvd.rank_op()) == r and int(hvd.size_op()) == 2
    assert int(hvd.local_rank_op()) == r and int(hvd.local_size_op()) == 2
    assert hvd.rank_op().dtype == tf.int32

    @tf.function
    def ops():
        return hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(), hvd.local_size_op()

    assert [int(t) for t in ops()] == [r, 2, r, 2]

with c.check("build_and_transport_probes"):
    import horovod.tensorflow as horovod_itself  # the oracle for what was built

    for probe in ("mpi_built", "gloo_built", "nccl_built", "ccl_built", "cuda_built"):
        assert getattr(hvd, probe)() == getattr(horovod_itself, probe)(), probe
    for probe in ("rocm_built", "ddl_built"):
        assert getattr(hvd, probe)() == getattr(horovod_itself, probe)(), probe
    assert hvd.gloo_built() is True and hvd.mpi_built() is True  # this installation
    assert hvd.mpi_enabled() == (TRANSPORT == "mpi")
    assert hvd.gloo_enabled() == (TRANSPORT == "gloo")
    assert hvd.is_homogeneous() is True
    if TRANSPORT == "mpi":
        assert hvd.mpi_threads_supported() == horovod_itself.mpi_threads_supported()
    else:
        try:
            hvd.mpi_threads_supported()
        except ValueError as e:  # Horovod raises ValueError when MPI is not enabled
            assert "gloo" in str(e)
        else:
            raise AssertionError("mpi_threads_supported answered under Gloo")

with c.check("timeline_records_named_collective"):
    path = os.path.join(sys.argv[1], "timeline.json")
    hvd.start_timeline(path)
    # inside a tf.function the name becomes Horovod's tensor name (eagerly it is the op's)
    probe = tf.function(lambda t: hvd.allreduce(t, name="timeline_probe_tensor"))
    for _ in range(3):
        probe(tf.ones([4]))
    hvd.stop_timeline()
    hvd.barrier()
    if r == 0:  # Horovod's coordinator writes the file, from a background thread
        deadline = time.time() + 120
        text = ""
        while time.time() < deadline and "timeline_probe_tensor" not in text:
            text = open(path).read() if os.path.exists(path) else ""
            time.sleep(0.5)
        assert "timeline_probe_tensor" in text, text[:500]
        assert "NEGOTIATE_ALLREDUCE" in text and text.lstrip().startswith("["), text[:500]
    hvd.barrier()

with c.check("join_allreduce_sums_active_ranks"):
    x = tf.constant([5.0, 7.0])
    if r == 0:
        last = hvd.join()  # rank 0 has no more data
        s = a = None
    else:
        s = hvd.allreduce(x, op=hvd.Sum).numpy().tolist()  # rank 0 contributes zeros
        a = hvd.allreduce(x, op=hvd.Average).numpy().tolist()
        last = hvd.join()
    c.record(f"join_sum_rank{r}", s)
    c.record(f"join_average_rank{r}", a)
    assert int(last) == 1, last  # rank 1 joined last, on every rank
    if r == 1:
        assert s == [5.0, 7.0], s
        assert a == [2.5, 3.5], a  # divided by size(), not by the active ranks
    assert hvd.allreduce(np.array([1.0]), op=hvd.Sum).tolist() == [2.0]  # normal again

with c.check("sync_batch_norm_matches_one_process_on_whole_batch"):
    rng = np.random.default_rng(7)
    full = rng.normal(3.0, 2.0, size=(8, 3)).astype(np.float32)
    for rows in ([0, 4, 8], [0, 3, 8]):  # equal halves, then 3 and 5 rows
        mine = full[rows[r] : rows[r + 1]]
        ref = keras.layers.BatchNormalization(momentum=0.5)  # one process, whole batch
        sync = hvd.SyncBatchNormalization(momentum=0.5)
        want = ref(full, training=True).numpy()[rows[r] : rows[r + 1]]
        got = sync(mine, training=True).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(sync.moving_mean.numpy(), ref.moving_mean.numpy(), rtol=1e-5)
        np.testing.assert_allclose(
            sync.moving_variance.numpy(), ref.moving_variance.numpy(), rtol=1e-5
        )
        # inference uses the (identical) moving statistics and communicates nothing
        np.testing.assert_allclose(
            sync(mine, training=False).numpy(),
            ref(full, training=False).numpy()[rows[r] : rows[r + 1]],
            rtol=1e-5,
            atol=1e-5,
        )
    # 4-D input (NHWC), inside a tf.function, channel axis -1
    img = rng.normal(size=(4, 2, 2, 2)).astype(np.float32)
    ref, sync = keras.layers.BatchNormalization(), hvd.SyncBatchNormalization()
    want = ref(img, training=True).numpy()[2 * r : 2 * r + 2]
    got = tf.function(lambda t: sync(t, training=True))(img[2 * r : 2 * r + 2]).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    try:
        hvd.SyncBatchNormalization(fused=True)
    except ValueError as e:
        assert "fused=True" in str(e)
    else:
        raise AssertionError("fused=True accepted")

with c.check("learning_rate_schedule_callback"):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    xs, ys = np.ones((8, 2), np.float32), np.zeros((8, 1), np.float32)
    cb = hvd.callbacks.LearningRateScheduleCallback(
        initial_lr=0.8, multiplier=0.5, start_epoch=1, end_epoch=3
    )
    hist = model.fit(xs, ys, batch_size=4, epochs=4, callbacks=[cb], verbose=0)
    # epoch 0: before the window (optimizer's 1.0); 1: 0.8 * 0.5**0; 2: 0.8 * 0.5**1; 3: left alone
    np.testing.assert_allclose(hist.history["lr"], [1.0, 0.8, 0.4, 0.4], rtol=1e-6)
    seen = []

    class Spy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate.numpy()))

    model.compile(optimizer=keras.optimizers.SGD(1.0), loss="mse")
    smooth = hvd.callbacks.LearningRateScheduleCallback(
        initial_lr=1.0, multiplier=lambda e: 1.0 / (1.0 + e), staircase=False
    )
    model.fit(xs, ys, batch_size=4, epochs=2, callbacks=[smooth, Spy()], verbose=0)
    # 2 batches per epoch: epochs 0, 0.5, 1, 1.5
    np.testing.assert_allclose(seen, [1.0, 1 / 1.5, 1 / 2.0, 1 / 2.5], rtol=1e-6)
    try:
        hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, momentum_correction=True)
    except ValueError as e:
        assert "momentum_correction" in str(e)
    else:
        raise AssertionError("momentum_correction=True accepted")

c.finish()

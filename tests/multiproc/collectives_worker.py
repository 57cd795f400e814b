"""Every collective on 2 ranks: values, shapes, dtypes, eager and tf.function, errors."""

import sys
import time

import numpy as np
import tensorflow as tf

import hvdkit as hvd

from _harness import Checks

hvd.init()
# Horovod warns of a stalled collective after this many seconds (60 by default):
# a mismatch must be reported long before that, when both ranks have arrived.
r, n = hvd.rank(), hvd.size()
c = Checks(r, sys.argv[1])
other = 1 - r

with c.check("topology"):
    assert n == 2 and r in (0, 1), (r, n)
    assert hvd.local_size() == 2 and hvd.local_rank() == r
    assert hvd.cross_size() == 1 and hvd.cross_rank() == 0
    assert hvd.backend_name() == "horovod"
    assert hvd.is_initialized()

DTYPES = [tf.float16, tf.float32, tf.float64, tf.int32, tf.int64]
with c.check("allreduce_ops_dtypes_eager"):
    for dt in DTYPES:
        x = tf.constant([1, 2, 6], dt) * tf.cast(r + 1, dt)  # rank0 [1,2,6], rank1 [2,4,12]
        want = {
            hvd.Sum: [3, 6, 18],
            hvd.Min: [1, 2, 6],
            hvd.Max: [2, 4, 12],
            hvd.Product: [2, 8, 72],
            hvd.Average: [1.5, 3, 9] if dt.is_floating else [1, 3, 9],  # ints truncate
        }
        for op, expected in want.items():
            out = hvd.allreduce(x, op=op)
            assert out.dtype == dt and out.shape == (3,), (dt, op, out)
            np.testing.assert_allclose(
                out.numpy().astype(np.float64), expected, err_msg=f"{dt} {op}"
            )

with c.check("allreduce_numpy_in_numpy_out"):
    out = hvd.allreduce(np.array([[r + 1.0]]), op=hvd.Sum)
    assert isinstance(out, np.ndarray) and out.shape == (1, 1) and out.dtype == np.float64
    assert out[0, 0] == 3.0

with c.check("allreduce_tf_function"):

    @tf.function
    def f(x):
        return hvd.allreduce(x, op=hvd.Sum), hvd.allreduce(x * 2.0, op=hvd.Average)

    for step in range(3):  # repeated calls of the same graph
        s, a = f(tf.fill([2, 2], float(r + step)))
        np.testing.assert_array_equal(s.numpy(), np.full([2, 2], 1.0 + 2 * step))
        np.testing.assert_array_equal(a.numpy(), np.full([2, 2], 1.0 + 2 * step))

with c.check("grouped_allreduce"):
    outs = hvd.grouped_allreduce(
        [tf.constant([1.0, 2.0]) * (r + 1), tf.constant([[r]], tf.int64), np.float32(r)], op=hvd.Sum
    )
    np.testing.assert_array_equal(outs[0].numpy(), [3.0, 6.0])
    assert outs[1].dtype == tf.int64 and outs[1].numpy().tolist() == [[1]]
    assert isinstance(outs[2], np.ndarray) and float(outs[2]) == 1.0
    g = tf.function(lambda a, b: hvd.grouped_allreduce([a, b]))(
        tf.constant([2.0 * r]), tf.constant([4.0])
    )
    np.testing.assert_array_equal([g[0].numpy()[0], g[1].numpy()[0]], [1.0, 4.0])

with c.check("allgather_uneven"):
    x = np.full([r + 1, 2], r, np.int32)  # rank0: 1 row of 0, rank1: 2 rows of 1
    out = hvd.allgather(x)
    assert out.shape == (3, 2) and out.dtype == np.int32
    assert out.tolist() == [[0, 0], [1, 1], [1, 1]]
    scal = hvd.allgather(tf.constant(float(r)))
    assert scal.shape == (2,) and scal.numpy().tolist() == [0.0, 1.0]
    gf = tf.function(
        lambda t: hvd.allgather(t), input_signature=[tf.TensorSpec([None], tf.float32)]
    )
    out = gf(tf.range(r + 2, dtype=tf.float32))
    assert out.numpy().tolist() == [0, 1, 0, 1, 2]

with c.check("broadcast"):
    for root in (0, 1):
        out = hvd.broadcast(tf.constant([r * 10.0, 5.0]), root_rank=root)
        assert out.numpy().tolist() == [root * 10.0, 5.0]
    v = tf.Variable([float(r), float(r)])
    w = tf.Variable(np.full([2, 3], r, np.int64))
    hvd.broadcast_variables([v, w], root_rank=1)
    assert v.numpy().tolist() == [1.0, 1.0] and (w.numpy() == 1).all()
    bf = tf.function(lambda t: hvd.broadcast(t, root_rank=0))
    assert bf(tf.constant([r + 7])).numpy().tolist() == [7]

with c.check("reducescatter"):
    x = np.array([[1.0], [2.0], [3.0]]) * (1 + 9 * r)  # rank1: [[10],[20],[30]]
    out = hvd.reducescatter(x, op=hvd.Sum)
    assert out.tolist() == ([[11.0], [22.0]] if r == 0 else [[33.0]]), out
    out = hvd.reducescatter(tf.constant([[2.0, 4.0], [6.0, 8.0]]) * (r + 1), op=hvd.Average)
    assert out.shape == (1, 2) and out.numpy().tolist() == (
        [[3.0, 6.0]] if r == 0 else [[9.0, 12.0]]
    )

with c.check("fp16_compression"):
    # sent as float16, returned as float32 (values exact in float16)
    a = hvd.allreduce(
        np.array([1.5, 2.25], np.float32) * (r + 1), op=hvd.Sum, compression=hvd.Compression.fp16
    )
    assert a.dtype == np.float32 and a.tolist() == [4.5, 6.75], a
    b = hvd.reducescatter(
        np.ones([4, 2], np.float32) * (r + 1), op=hvd.Sum, compression=hvd.Compression.fp16
    )
    assert b.dtype == np.float32 and b.tolist() == [[3.0, 3.0]] * 2, b

with c.check("alltoall"):
    if r == 0:
        t, splits = tf.constant([0, 1, 2]), [1, 2]
    else:
        t, splits = tf.constant([7, 8]), [2, 0]
    recv, rsplits = hvd.alltoall(t, splits=splits)
    if r == 0:
        assert recv.numpy().tolist() == [0, 7, 8] and rsplits.numpy().tolist() == [1, 2]
    else:
        assert recv.numpy().tolist() == [1, 2] and rsplits.numpy().tolist() == [2, 0]
    even = hvd.alltoall(np.arange(4).reshape(4, 1) + 10 * r)  # rows 0,1 -> rank0; 2,3 -> rank1
    want = [[0], [1], [10], [11]] if r == 0 else [[2], [3], [12], [13]]
    assert even.tolist() == want, even
    af = tf.function(lambda a: hvd.alltoall(a, splits=tf.constant([1, 1])))
    got, gs = af(tf.constant([[r, 0], [r, 1]]))
    assert got.numpy().tolist() == [[0, r], [1, r]] and gs.numpy().tolist() == [1, 1]

with c.check("neighbor_exchange"):
    out = hvd.neighbor_exchange(np.array([r, r]), send_to=[other], recv_from=[other])
    assert len(out) == 1 and out[0].tolist() == [other, other]
    # one-way: rank 0 sends a [2,3] block to itself and a [1,3] block to rank 1
    if r == 0:
        res = hvd.neighbor_exchange(
            [tf.ones([2, 3]), tf.fill([1, 3], 5.0)], send_to=[0, 1], recv_from=[0]
        )
        assert len(res) == 1 and res[0].shape == (2, 3) and float(tf.reduce_sum(res[0])) == 6.0
    else:
        res = hvd.neighbor_exchange(tf.zeros([0, 3]), send_to=[], recv_from=[0])
        assert res[0].numpy().tolist() == [[5.0, 5.0, 5.0]]
    nf = tf.function(lambda a: hvd.neighbor_exchange(a, send_to=[other], recv_from=[other]))
    assert nf(tf.constant([[float(r)]]))[0].numpy().tolist() == [[float(other)]]
    # one-way inside tf.function: rank 0's trace never uses the exchange's output
    # and rank 1's needs a shape from the gathered pattern (both once hung)
    one_way = tf.function(
        lambda a: hvd.neighbor_exchange(
            a, send_to=[1] if r == 0 else [], recv_from=[0] if r == 1 else []
        )
    )
    got = one_way(tf.fill([1, 3], 7.0 + r))
    assert [g.numpy().tolist() for g in got] == ([] if r == 0 else [[[7.0, 7.0, 7.0]]]), got
    assert hvd.allreduce(np.array([r + 1.0]), op=hvd.Sum).tolist() == [3.0]  # nothing left over

with c.check("neighbor_exchange_pattern_mismatch"):
    try:
        # rank 0 sends to 1, but rank 1 does not expect it
        hvd.neighbor_exchange(np.array([1.0]), send_to=[1] if r == 0 else [], recv_from=[])
    except hvd.CollectiveMismatchError as e:
        assert "rank 0 sends to rank 1 but rank 1 does not list 0 in recv_from" in str(e), e
    else:
        raise AssertionError("no error for a mismatched pattern")

with c.check("objects"):
    obj = hvd.broadcast_object({"seed": 123, "rank": r} if r == 0 else None, root_rank=0)
    assert obj == {"seed": 123, "rank": 0}
    assert hvd.allgather_object(("r", r)) == [("r", 0), ("r", 1)]

with c.check("mismatched_shape_names_tensor_and_ranks"):
    t0 = time.time()
    try:
        hvd.allreduce(tf.zeros([2 + r]), name="grad/dense")
    except hvd.CollectiveMismatchError as e:
        msg = str(e)
        assert "'grad/dense'" in msg, msg
        assert (
            "rank 0: shape [2] dtype float32" in msg and "rank 1: shape [3] dtype float32" in msg
        ), msg
    else:
        raise AssertionError("no error for mismatched shapes")
    try:
        hvd.allgather(tf.zeros([1, 2], tf.float32 if r == 0 else tf.float64), name="feat")
    except hvd.CollectiveMismatchError as e:
        assert "rank 0: shape [1, 2] dtype float32" in str(e) and "dtype float64" in str(e), e
    else:
        raise AssertionError("no error for mismatched dtypes")
    c.record("mismatch_seconds", time.time() - t0)  # information only: no bound asserted
    # The messages above name both ranks' shapes: only the comparison made when both
    # ranks arrived writes them (Horovod's stall check would name neither).
    # the job is still usable afterwards
    assert float(hvd.allreduce(tf.constant(1.0), op=hvd.Sum)) == 2.0

with c.check("mismatched_shape_in_tf_function_raises"):
    try:
        tf.function(lambda t: hvd.allreduce(t))(tf.zeros([4 + r]))
    except tf.errors.OpError as e:
        assert "Mismatched" in str(e), e
    else:
        raise AssertionError("no error in tf.function")

with c.check("bad_arguments"):
    c.expect_errors(
        [
            (lambda: hvd.allreduce(np.ones(2), op="mean"), "does not support op='mean'"),
            (
                lambda: hvd.reducescatter(np.ones(2), op=hvd.Max),
                "reducescatter does not support op",
            ),
            (lambda: hvd.broadcast(np.ones(2), root_rank=2), "root_rank=2 is outside"),
            (lambda: hvd.alltoall(np.ones(3)), "divisible by the number of ranks (2)"),
            (
                lambda: hvd.alltoall(np.ones(3), splits=[1, 1]),
                "sum to the tensor's first dimension (3)",
            ),
            (
                lambda: hvd.neighbor_exchange(np.ones(1), send_to=[5], recv_from=[]),
                "entries [5] that are not ranks of the job [0, 2)",
            ),
            (
                lambda: hvd.neighbor_exchange(np.ones(1), send_to=[True], recv_from=[]),
                "entries [True] that are not ranks",
            ),
        ],
        hvd.ConfigurationError,
    )

with c.check("barrier_waits_for_the_late_rank"):
    # rank 1 arrives late; rank 0 must not leave the barrier before rank 1 entered it
    if r == 1:
        time.sleep(1.0)
    arrived = time.time()
    hvd.barrier()
    left = time.time()
    times = hvd.allgather_object((arrived, left))  # one machine: one clock
    assert times[0][1] >= times[1][0], f"rank 0 left at {times[0][1]}, rank 1 came at {times[1][0]}"

with c.check("abandon_ends_a_wait_that_nothing_else_would"):  # the job's last collective
    # Rank 0 waits in an allreduce that rank 1 never joins: Horovod waits for ever (it
    # only warns of a stall). Rank 1 abandons the world instead (hvdkit.elastic does so
    # when the scheduler says a rank was lost): under Gloo rank 0's wait fails at once,
    # as for a lost peer, and so does rank 1's next collective.
    from hvdkit import runtime
    from hvdkit._comm import meeting

    if hvd.gloo_enabled():
        if r == 1:
            time.sleep(0.5)
            assert runtime.abandon() >= 1  # its connection to rank 0, at least
        try:
            hvd.allreduce(np.ones(3, np.float32), name="hvdkit.test.abandoned")
        except Exception as exc:  # whatever Horovod raises, it is classified
            assert meeting.peer_lost(exc), repr(exc)
        else:
            raise AssertionError("the allreduce returned")
        runtime.shutdown()
    else:
        assert runtime.abandon() == 0  # MPI: nothing of Open MPI's is ended (Gloo only)

c.finish()

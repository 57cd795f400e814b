"""HVDKIT_COMM_PRIORITY=1 on 2 ranks: Horovod's threads on SCHED_RR under Gloo only, training exact.

Run with the variable set (tests/test_threads_mp.py). Under Gloo every thread
Horovod started in ``init()`` is on ``SCHED_RR`` at priority 1 when this
process may set it (CI runs as root), TensorFlow's threads and the main
thread are not; under MPI (its transport polls while it waits) nothing
changes. With the threads favoured, ``fit`` with one allreduce per gradient
still gives one process's weights on the global batch.
"""

import os
import sys
import threading

import keras
import numpy as np
from _equal import assert_close, assert_same_on_all_ranks, my_rows, weights

import hvdkit as hvd
from hvdkit import _threads, runtime

from _harness import Checks

assert os.environ.get("HVDKIT_COMM_PRIORITY") == "1", "run me with HVDKIT_COMM_PRIORITY=1"
hvd.init()
r, n = hvd.rank(), hvd.size()
c = Checks(r, sys.argv[1])

with c.check("policies_of_horovods_threads"):
    backend = runtime.backend()
    alive = _threads.thread_ids()
    comm = [t for t in backend.comm_threads if t in alive]
    assert comm and threading.get_native_id() not in comm, (comm, backend.comm_threads)
    others = alive - set(comm)
    assert {os.sched_getscheduler(t) for t in others} == {os.SCHED_OTHER}, others
    policies = {os.sched_getscheduler(t) for t in comm}
    if hvd.mpi_enabled():
        assert policies == {os.SCHED_OTHER}, policies
        assert backend.comm_priority.startswith("off under MPI"), backend.comm_priority
    elif os.geteuid() == 0:
        assert policies == {os.SCHED_RR}, policies
        assert {os.sched_getparam(t).sched_priority for t in comm} == {_threads.PRIORITY}
        assert backend.comm_priority == (
            f"SCHED_RR priority 1 for {len(backend.comm_threads)} of Horovod's threads"
        ), backend.comm_priority
    else:
        assert policies == {os.SCHED_OTHER} and "not permitted" in backend.comm_priority

with c.check("fit_per_gradient_allreduces_equals_single_process"):
    rng = np.random.default_rng(3)
    X = rng.normal(size=(64, 8)).astype("float32")
    Y = (X @ rng.normal(size=(8, 3)) > 0).argmax(1).astype("int32")
    LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def model():
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)]
        )

    want = model()
    want.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    want.fit(X, Y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    got = model()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), bucket_bytes=0)
    got.compile(optimizer=opt, loss=LOSS)
    mine = my_rows(len(X), 16, r, n)
    got.fit(X[mine], Y[mine], batch_size=16 // n, epochs=2, shuffle=False, verbose=0)
    assert_close(weights(got), weights(want), rtol=1e-4, atol=1e-5)
    assert_same_on_all_ranks(weights(got), "fit with favoured threads")

c.finish()

"""HVDKIT_COMM_PRIORITY=auto on 2 ranks: the trial times both settings and keeps what it says.

Run with the variable set (tests/test_threads_mp.py). Under Gloo the trial
(hvdkit._comm.priority_trial) starts at init; a custom ``tf.function`` loop
trains until it decided. Its six windows come in the fixed order, each timed
on real steps; the policy of Horovod's threads afterwards is the one its line
names (``SCHED_RR`` only when it kept it), and ``fit`` still gives one
process's weights on the global batch. Which setting wins depends on the
machine, so neither is expected. Under MPI nothing is tried.
"""

import os
import sys

import keras
import tensorflow as tf
from _equal import assert_fit_matches_one_process, small_problem
from _policies import assert_shutdown_puts_every_thread_back

import hvdkit as hvd
from hvdkit import runtime
from hvdkit._comm import priority_trial as _priority_trial
from hvdkit._comm import threads as _threads

from _harness import Checks

assert os.environ.get("HVDKIT_COMM_PRIORITY") == "auto", "run me with HVDKIT_COMM_PRIORITY=auto"
hvd.init()
r, n = hvd.rank(), hvd.size()
c = Checks(r, sys.argv[1])
hvd_mpi = hvd.mpi_enabled()  # (asked before the shutdown)
backend = runtime.backend()
MAX_STEPS = 100_000  # a hang guard only: the trial needs a few seconds of steps

X, Y, LOSS, model = small_problem()


with c.check("the_trial_times_both_settings_and_keeps_what_it_says"):
    trial = backend._trial
    if hvd.mpi_enabled():
        assert trial is None, trial
        assert backend.comm_priority.startswith("off under MPI"), backend.comm_priority
    else:
        assert trial is not None and trial.decision is None, backend.comm_priority
        m = model()
        opt = keras.optimizers.SGD(0.01)
        x, y = tf.constant(X[:16]), tf.constant(Y[:16])

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = LOSS(y, m(x, training=True))
            tape = hvd.DistributedGradientTape(tape)
            opt.apply(tape.gradient(loss, m.trainable_variables), m.trainable_variables)
            return loss

        steps = 0
        # Each rank stops once its own trial decided; the other may need a step or two
        # more, so the ranks agree on going on with a one-element allreduce per step.
        while steps < MAX_STEPS:
            step()
            steps += 1
            undecided = tf.constant([float(trial.decision is None)])
            if float(hvd.allreduce(undecided, op=hvd.Sum)[0]) == 0.0:
                break
        assert trial.decision is not None, (steps, trial.windows, backend.comm_priority)
        if os.geteuid() != 0:  # cannot set SCHED_RR: nothing was timed
            assert trial.windows == [] and "not permitted" in backend.comm_priority
        else:
            assert [f for f, _ in trial.windows] == list(_priority_trial.ORDER), trial.windows
            assert all(0 < s < 10 for _, s in trial.windows), trial.windows
            assert steps > _priority_trial.WARMUP_STEPS + 6 * _priority_trial.MIN_WINDOW_STEPS
            kept = backend.comm_priority.startswith("auto: SCHED_RR kept for Horovod's threads")
            assert kept or backend.comm_priority.startswith("auto: normal policy kept"), (
                backend.comm_priority
            )
            assert kept is trial.decision
            alive = _threads.thread_ids()
            comm = [t for t in backend.comm_threads if t in alive]
            policies = {os.sched_getscheduler(t) for t in comm}
            assert comm and policies == ({os.SCHED_RR} if kept else {os.SCHED_OTHER}), policies
            others = {os.sched_getscheduler(t) for t in alive - set(comm)}
            assert others == {os.SCHED_OTHER}, others

with c.check("fit_after_the_trial_equals_single_process"):
    assert_fit_matches_one_process(hvd.DistributedOptimizer, "fit after the priority trial")

with c.check("shutdown_puts_every_thread_back_on_the_normal_policy"):
    assert_shutdown_puts_every_thread_back(hvd, backend, hvd_mpi)

c.finish()

"""What a user meets around training on 2 ranks (issue 35): starting apart, saving, loading.

Checks, in order (each leaves the ranks in step for the next):

* ranks that start from different weights and never broadcast fail at their
  second gradient reduction, with the variables named (a ``tf.function``
  custom loop, an eager loop, ``fit``); ``HVDKIT_SAME_START=warn`` trains on;
* Horovod's pattern (broadcast after the first step), a broadcast before
  training, the same seed everywhere and ``BroadcastGlobalVariablesCallback``
  on an unbuilt model all pass, and end with equal weights;
* "save on one rank, load on all" cannot race: ``hvdkit.save_model`` and
  ``RankZeroOnly(ModelCheckpoint)`` followed by loading on every rank, with
  rank 0's write held back by a hook until rank 1 is past the point where it
  would have looked for the file (the same hook shows the naive pattern's race);
* ``DistributedOptimizer("adam")`` and a serialized config; loading after
  ``keras.saving.get_custom_objects().clear()``; the late-broadcast warning
  once per job, on rank 0.
"""

import logging
import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import hvdkit as hvd
from hvdkit import _same_start

from _harness import Checks

hvd.init()
r, n = hvd.rank(), hvd.size()


class Said(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


UNREDUCED = "no hvdkit reduction averaged"  # hvdkit.keras._update_check's warning
everything_said = Said()  # every hvdkit warning of the job, for the checks of issue 51
logging.getLogger("hvdkit").addHandler(everything_said)
c = Checks(r, sys.argv[1])
OUT = sys.argv[1]
rng = np.random.default_rng(0)
X = rng.normal(size=(32, 6)).astype("float32")
Y = rng.normal(size=(32, 2)).astype("float32")


def model(seed, built=True):
    keras.utils.set_random_seed(seed)
    layers = [keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)]
    return keras.Sequential(([keras.Input((6,))] if built else []) + layers)


def spread(m) -> float:
    """Largest difference of any weight between the ranks."""
    mine = np.concatenate([w.numpy().ravel() for w in m.weights])
    return float(np.max(hvd.allreduce(mine, op=hvd.Max) - hvd.allreduce(mine, op=hvd.Min)))


def tape_steps(m, opt, steps, first_batch_broadcast=False, use_function=True):
    def step(x, y, first_batch):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((m(x) - y) ** 2)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(grads, m.trainable_variables, strict=True))
        if first_batch and first_batch_broadcast:  # Horovod's TF2 examples
            hvd.broadcast_variables(m.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss

    run = tf.function(step) if use_function else step
    for i in range(steps):
        run(X[:8], Y[:8], i == 0)


def wait_for(path):
    """A hook: block until the other rank created ``path`` (bounded by the test's timeout)."""
    while not os.path.exists(path):
        time.sleep(0.01)


with c.check("tape_loop_apart_fails_at_second_step_naming_variables"):
    m = model(seed=r)  # each rank its own initial weights, no broadcast
    opt = keras.optimizers.SGD(0.1)
    tape_steps(m, opt, 1)  # the first reduction: differs, deferred (Horovod may broadcast now)
    try:
        tape_steps(m, opt, 1)
    except tf.errors.InvalidArgumentError as e:
        text = str(e)
    else:
        raise AssertionError("no error at the second step")
    assert "hold different weights at their first two gradient reductions" in text, text
    assert "dense" in text.split("listed after this message")[-1], text
    assert "BroadcastGlobalVariablesCallback" in text and "HVDKIT_SAME_START=warn" in text

with c.check("eager_loop_apart_fails_at_second_step"):
    m = model(seed=10 + r)
    opt = keras.optimizers.SGD(0.1)
    tape_steps(m, opt, 1, use_function=False)
    try:
        tape_steps(m, opt, 1, use_function=False)
    except hvd.ConfigurationError as e:
        assert "hold different weights" in str(e) and "kernel" in str(e), str(e)
    else:
        raise AssertionError("no error at the second step")

with c.check("horovod_broadcast_after_first_step_passes"):
    m = model(seed=20 + r)
    opt = keras.optimizers.SGD(0.1)
    tape_steps(m, opt, 4, first_batch_broadcast=True)
    assert spread(m) == 0.0

with c.check("broadcast_before_training_checked_once_no_graph_check"):
    m = model(seed=30 + r)
    hvd.broadcast_variables(m.variables, root_rank=0)
    opt = keras.optimizers.SGD(0.1)
    tape_steps(m, opt, 3)
    assert _same_start.state(m.trainable_variables) is True  # passed at once: no counter
    assert spread(m) == 0.0

with c.check("same_seed_needs_no_broadcast"):
    m = model(seed=40)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    m.compile(optimizer=opt, loss="mse")
    m.fit(X[r::2], Y[r::2], batch_size=4, epochs=1, verbose=0)
    assert spread(m) == 0.0

with c.check("fit_apart_without_broadcast_fails"):
    m = model(seed=50 + r)
    m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    try:
        m.fit(X[r::2], Y[r::2], batch_size=4, epochs=1, verbose=0)
    except tf.errors.InvalidArgumentError as e:
        assert "hold different weights" in str(e), str(e)
    else:
        raise AssertionError("fit trained apart without an error")


with c.check("unbuilt_model_with_broadcast_callback_passes_and_warns_once_on_rank0"):
    said = Said()
    logging.getLogger("hvdkit").addHandler(said)
    for seed in (60, 70):
        m = model(seed=seed + r, built=False)
        m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
        cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
        m.fit(X[r::2], Y[r::2], batch_size=4, epochs=2, verbose=0, callbacks=[cb])
        assert spread(m) == 0.0
    logging.getLogger("hvdkit").removeHandler(said)
    late = [s for s in said.lines if "broadcast after the first batch" in s]
    assert len(late) == (1 if r == 0 else 0), said.lines

with c.check("warn_mode_trains_on_apart"):
    os.environ["HVDKIT_SAME_START"] = "warn"
    m = model(seed=80 + r)
    tape_steps(m, keras.optimizers.SGD(0.1), 3)
    assert spread(m) > 0.01  # still apart: warned, not stopped
    os.environ["HVDKIT_SAME_START"] = "off"
    m = model(seed=90 + r)
    tape_steps(m, keras.optimizers.SGD(0.1), 3, use_function=False)
    assert _same_start.state(m.trainable_variables) is True  # off: marked done, no collective
    os.environ["HVDKIT_SAME_START"] = "bogus"
    try:
        tape_steps(model(seed=1), keras.optimizers.SGD(0.1), 1, use_function=False)
    except hvd.ConfigurationError as e:
        assert "HVDKIT_SAME_START='bogus' is not error, warn or off" in str(e), str(e)
    else:
        raise AssertionError("a bad HVDKIT_SAME_START was accepted")
    del os.environ["HVDKIT_SAME_START"]

# --- save on one rank, load on all --------------------------------------------------------

with c.check("naive_save_on_rank0_then_load_races"):  # the hook makes the race certain
    path = os.path.join(OUT, "naive.keras")
    looked = os.path.join(OUT, "rank1_looked")
    m = model(seed=100)
    if r == 0:
        wait_for(looked)
        m.save(path)
    else:
        seen = os.path.exists(path)
        open(looked, "w").close()
        assert not seen  # rank 1 would have failed with "File not found"
    hvd.barrier()

with c.check("save_model_then_load_on_every_rank"):
    path = os.path.join(OUT, "my_model.keras")
    arrived = os.path.join(OUT, "rank1_in_save_model")
    m = model(seed=110 + r)
    m.compile(optimizer=hvd.DistributedOptimizer("adam"), loss="mse")
    if r == 0:
        plain_save = m.save

        def held_save(p, **kw):
            wait_for(arrived)  # rank 1 is in save_model before anything is written
            plain_save(p, **kw)

        m.save = held_save
    else:
        open(arrived, "w").close()
    hvd.save_model(m, path)
    assert os.path.exists(path)
    loaded = hvd.load_model(path)
    want = hvd.broadcast_object([w.numpy() for w in m.weights] if r == 0 else None, 0)
    for got, w in zip(loaded.weights, want, strict=True):
        np.testing.assert_array_equal(got.numpy(), w)
    assert not [f for f in os.listdir(OUT) if ".tmp-" in f]  # the temporary file was renamed

with c.check("save_model_failure_raises_on_every_rank"):
    bad = os.path.join(OUT, "no_such_dir", "m.keras")
    try:
        hvd.save_model(model(seed=1), bad)
    except hvd.ConfigurationError as e:
        assert "rank 0 could not save" in str(e) and "no_such_dir" in str(e), str(e)
    else:
        raise AssertionError("no error")

with c.check("rank_zero_only_checkpoint_then_load_on_every_rank"):
    path = os.path.join(OUT, "ckpt.keras")
    at_end = os.path.join(OUT, "rank1_at_train_end")

    class HeldCheckpoint(keras.callbacks.ModelCheckpoint):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                wait_for(at_end)  # rank 1 has finished fit's epochs: it is at on_train_end
            super().on_epoch_end(epoch, logs)

    class MarkEnd(keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            if r == 1:
                open(at_end, "w").close()

    m = model(seed=120)
    m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    cbs = [MarkEnd(), hvd.callbacks.RankZeroOnly(HeldCheckpoint(path))]
    m.fit(X[r::2], Y[r::2], batch_size=4, epochs=2, verbose=0, callbacks=cbs)
    loaded = keras.models.load_model(path)
    for got, w in zip(loaded.weights, m.weights, strict=True):
        np.testing.assert_array_equal(got.numpy(), w.numpy())

# --- frictions ------------------------------------------------------------------------------

with c.check("distributed_optimizer_takes_identifiers_and_configs"):
    opt = hvd.DistributedOptimizer("adam")
    assert type(opt.inner_optimizer) is keras.optimizers.Adam
    cfg = keras.optimizers.serialize(keras.optimizers.RMSprop(0.005))
    opt = hvd.DistributedOptimizer(cfg)
    assert type(opt.inner_optimizer) is keras.optimizers.RMSprop
    assert abs(float(opt.inner_optimizer.learning_rate) - 0.005) < 1e-9
    m = model(seed=130)
    m.compile(optimizer=hvd.DistributedOptimizer("sgd"), loss="mse")
    m.fit(X[r::2], Y[r::2], batch_size=4, epochs=1, verbose=0)
    assert spread(m) == 0.0

with c.check("load_after_custom_objects_cleared"):
    path = os.path.join(OUT, "my_model.keras")
    registered = dict(keras.saving.get_custom_objects())
    keras.saving.get_custom_objects().clear()  # as the Keras saving guide does
    try:
        try:
            keras.models.load_model(path)
        except TypeError as e:
            assert "hvdkit.load_model(path)" in str(e), str(e)
        else:
            raise AssertionError("loaded without the class registered")
        loaded = hvd.load_model(path)
        assert type(loaded.optimizer).__name__ == "DistributedOptimizer"
    finally:
        keras.saving.get_custom_objects().update(registered)

# --- weights updated with no hvdkit reduction (issue 51) ------------------------------------


def unreduced_said(run) -> list[str]:
    """The update check's warnings on this rank while ``run()`` runs."""
    said = Said()
    logging.getLogger("hvdkit").addHandler(said)
    try:
        run()
    finally:
        logging.getLogger("hvdkit").removeHandler(said)
    return [s for s in said.lines if UNREDUCED in s]


def plain_steps(m, opt, steps, use_function=True, reduce=None):
    """A custom loop: a plain tape, ``reduce`` (if given) on the gradients, ``opt.apply``."""

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((m(x) - y) ** 2)
        grads = tape.gradient(loss, m.trainable_variables)
        opt.apply(reduce(grads) if reduce else grads, m.trainable_variables)

    run = tf.function(step) if use_function else step
    for _ in range(steps):
        run(X[r::2][:8], Y[r::2][:8])


class GAN(keras.Model):
    """The Keras GAN guide's shape: two models, two optimizers, one train_step."""

    def __init__(self):
        super().__init__()
        self.g = keras.Sequential([keras.Input((2,)), keras.layers.Dense(6)], name="generator")
        self.d = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)], name="critic")

    def compile(self, d_optimizer, g_optimizer):
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

    def train_step(self, data):
        real, _ = data
        z = real[:, :2] + tf.random.normal([tf.shape(real)[0], 2])  # each rank's own noise
        with tf.GradientTape() as tape:
            d_loss = tf.reduce_mean(self.d(self.g(z))) - tf.reduce_mean(self.d(real))
        grads = tape.gradient(d_loss, self.d.trainable_weights)
        self.d_optimizer.apply_gradients(zip(grads, self.d.trainable_weights, strict=True))
        with tf.GradientTape() as tape:
            g_loss = -tf.reduce_mean(self.d(self.g(z)))
        grads = tape.gradient(g_loss, self.g.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.g.trainable_weights, strict=True))
        return {"d_loss": d_loss, "g_loss": g_loss}


with c.check("correct_training_above_gave_no_unreduced_warning"):
    assert not [s for s in everything_said.lines if UNREDUCED in s], everything_said.lines

with c.check("plain_compile_fit_warns_once_on_rank0_naming_the_optimizer"):
    m = model(seed=200)  # the same start on both ranks: only the missing reduction differs
    m.compile(optimizer=keras.optimizers.Adam(0.01, name="plain_adam"), loss="mse")
    said = unreduced_said(lambda: m.fit(X[r::2], Y[r::2], batch_size=4, epochs=2, verbose=0))
    assert len(said) == (1 if r == 0 else 0), said
    if r == 0:
        text = said[0]
        assert "Adam 'plain_adam'" in text and m.trainable_variables[0].path in text, text
        assert "hvdkit.DistributedOptimizer(optimizer)" in text, text
        assert "DistributedGradientTape" in text and "HVDKIT_UNREDUCED_UPDATE=error" in text
    assert spread(m) > 1e-4  # the mistake is real: each rank trained its own model

with c.check("gan_with_one_optimizer_unwrapped_names_only_that_one"):
    keras.utils.set_random_seed(300)
    gan = GAN()
    gan.compile(
        d_optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)),
        g_optimizer=keras.optimizers.SGD(0.01, name="g_plain"),
    )
    said = unreduced_said(lambda: gan.fit(X[r::2], Y[r::2], batch_size=4, epochs=1, verbose=0))
    assert len(said) == (1 if r == 0 else 0), said
    if r == 0:
        assert "SGD 'g_plain'" in said[0] and "generator/" in said[0], said[0]
        assert "critic" not in said[0], said[0]
    assert spread(gan.d) == 0.0 and spread(gan.g) > 1e-4  # the critic's average, apart generators

with c.check("custom_loop_plain_tape_warns_in_function_and_eagerly"):
    m1, m2 = model(seed=210), model(seed=211)
    opt1 = keras.optimizers.SGD(0.1, name="loop_sgd")
    opt2 = keras.optimizers.SGD(0.1, name="eager_sgd")
    said = unreduced_said(lambda: plain_steps(m1, opt1, 2))
    # eagerly the values carry no history: judged at the second update (no collective between)
    said += unreduced_said(lambda: plain_steps(m2, opt2, 3, use_function=False))
    assert len(said) == (2 if r == 0 else 0), said
    if r == 0:
        assert "SGD 'loop_sgd'" in said[0] and "SGD 'eager_sgd'" in said[1], said

with c.check("error_setting_raises_on_every_rank"):
    os.environ["HVDKIT_UNREDUCED_UPDATE"] = "error"
    try:
        m = model(seed=220)
        m.compile(optimizer=keras.optimizers.SGD(0.1, name="stopped_sgd"), loss="mse")
        try:
            m.fit(X[r::2], Y[r::2], batch_size=4, epochs=1, verbose=0)
        except hvd.ConfigurationError as e:
            assert "SGD 'stopped_sgd'" in str(e) and UNREDUCED in str(e), str(e)
        else:
            raise AssertionError("fit trained with a plain optimizer under =error")
        assert spread(m) == 0.0  # stopped before the first update
        # a custom step in a tf.function: AutoGraph re-raises the error of a trace as its
        # StagingError (a TensorFlow class) with hvdkit's class and message in the text
        traced = keras.optimizers.SGD(0.1, name="traced_sgd")
        try:
            plain_steps(model(seed=221), traced, 1)
        except Exception as e:  # StagingError: not public
            assert "ConfigurationError: hvdkit: the Keras optimizer SGD 'traced_sgd'" in str(e)
        else:
            raise AssertionError("a traced custom step trained with a plain optimizer")
        os.environ["HVDKIT_UNREDUCED_UPDATE"] = "bogus"
        Checks.expect_errors(
            [
                (
                    lambda: plain_steps(model(seed=1), keras.optimizers.SGD(0.1), 1, False),
                    "HVDKIT_UNREDUCED_UPDATE='bogus' is not warn, error or off",
                )
            ],
            hvd.ConfigurationError,
        )
    finally:
        del os.environ["HVDKIT_UNREDUCED_UPDATE"]


def deliberate_and_reduced_paths():
    # only evaluated and predicted with, though compiled with a plain optimizer
    m = model(seed=230)
    m.compile(optimizer="sgd", loss="mse")
    m.evaluate(X, Y, verbose=0)
    m.predict(X, verbose=0)
    # a local head on purpose: PartialDistributedGradientTape, and local_layers= in fit
    m = model(seed=231)
    opt = keras.optimizers.SGD(0.1)

    @tf.function
    def partial_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((m(x) - y) ** 2)
        tape = hvd.PartialDistributedGradientTape(tape, local_layers=[m.layers[-1]])
        opt.apply(tape.gradient(loss, m.trainable_variables), m.trainable_variables)

    for _ in range(2):
        partial_step(X[r::2][:8], Y[r::2][:8])
    m = model(seed=232)
    local_opt = hvd.PartialDistributedOptimizer(
        keras.optimizers.SGD(0.1), local_layers=[m.layers[-1]]
    )
    m.compile(optimizer=local_opt, loss="mse")
    m.fit(X[r::2], Y[r::2], batch_size=4, epochs=1, verbose=0)

    # gradients reduced by hand (examples/manual_parallel.py), then clipped: in a
    # tf.function and eagerly; and reduce_gradients without variables=
    def by_hand(grads):
        return [tf.clip_by_norm(g, 1.0) for g in hvd.grouped_allreduce(grads, op=hvd.Average)]

    plain_steps(model(seed=233), keras.optimizers.SGD(0.1), 2, reduce=by_hand)
    plain_steps(model(seed=233), keras.optimizers.SGD(0.1), 3, False, reduce=by_hand)
    plain_steps(model(seed=234), keras.optimizers.SGD(0.1), 2, reduce=hvd.reduce_gradients)
    # the wrapper's own updates: gradients accumulated over two passes
    m = model(seed=235)
    m.compile(optimizer=hvd.DistributedOptimizer("adam", backward_passes_per_step=2), loss="mse")
    m.fit(X[r::2], Y[r::2], batch_size=4, epochs=1, verbose=0)


with c.check("deliberate_and_reduced_paths_stay_silent"):
    assert unreduced_said(deliberate_and_reduced_paths) == []

with c.check("reduce_gradients_without_variables_gets_the_same_start_check"):
    m = model(seed=240 + r)  # apart, never broadcast
    plain_steps(m, keras.optimizers.SGD(0.1), 1, reduce=hvd.reduce_gradients)  # deferred
    try:
        plain_steps(m, keras.optimizers.SGD(0.1), 1, reduce=hvd.reduce_gradients)
    except tf.errors.InvalidArgumentError as e:
        assert "hold different weights" in str(e), str(e)
    else:
        raise AssertionError("no error at the second step")
    m = model(seed=250 + r)
    opt = keras.optimizers.SGD(0.1)
    plain_steps(m, opt, 1, use_function=False, reduce=hvd.reduce_gradients)
    Checks.expect_errors(
        [
            (
                lambda: plain_steps(m, opt, 1, use_function=False, reduce=hvd.reduce_gradients),
                "hold different weights",
            )
        ],
        hvd.ConfigurationError,
    )

with c.check("adasum_checks_the_same_start_over_mpi"):
    m = model(seed=260 + r)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvd.Adasum)
    if hvd.mpi_enabled():
        plain_steps(m, opt, 1)  # the first exchange: differs, deferred
        try:
            plain_steps(m, opt, 1)
        except tf.errors.InvalidArgumentError as e:
            assert "hold different weights" in str(e), str(e)
        else:
            raise AssertionError("Adasum trained apart without an error")
    else:  # Gloo: Adasum is refused before any check (Horovod's CPU Adasum is MPI's)
        refused = [(lambda: plain_steps(m, opt, 1, use_function=False), "needs MPI")]
        Checks.expect_errors(refused, hvd.NotSupportedError)

with c.check("fingerprints_name_the_ranks_that_ended_apart"):
    from hvdkit._comm import fingerprints, updates
    from hvdkit.keras import _update_check

    folder = os.path.join(OUT, "weights")
    os.makedirs(folder, exist_ok=True)
    updates.reset()  # only what this check trains
    m = model(seed=270)
    m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    m.fit(X[r::2], Y[r::2], batch_size=4, epochs=1, verbose=0)
    head = model(seed=271)  # its last layer is local on purpose: left out
    tape_opt = keras.optimizers.SGD(0.1)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((head(X[r::2][:8]) - Y[r::2][:8]) ** 2)
    tape = hvd.PartialDistributedGradientTape(tape, local_layers=[head.layers[-1]])
    tape_opt.apply(tape.gradient(loss, head.trainable_variables), head.trainable_variables)
    _update_check.write_fingerprint(folder)
    hvd.barrier()
    rows = fingerprints.read(folder)[r]["variables"]
    want = [v.path for v in m.trainable_variables + head.layers[0].trainable_variables]
    assert [row[0] for row in rows] == want, rows
    assert fingerprints.check(folder, n) is None
    hvd.barrier()  # both have read before either writes again
    apart = model(seed=272)
    apart.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    apart.fit(X[r::2], Y[r::2], batch_size=4, epochs=1, verbose=0)
    _update_check.write_fingerprint(folder)
    hvd.barrier()
    text = fingerprints.check(folder, n + 1)
    assert "2 groups (rank 0; rank 1)" in text, text
    assert apart.trainable_variables[0].path in text and m.trainable_variables[0].path not in text
    assert "rank 2 wrote no fingerprint" in text, text

with c.check("still_in_step_after_all_checks"):
    assert hvd.allreduce(np.array([1.0]), op=hvd.Sum)[0] == 2.0

c.finish()

"""A Keras user's everyday workflows on 2 ranks (issue 22), each against its reference.

Training data: rank r holds its half of every global batch of 16 rows (as in
training_worker.py), so "one process on the global batch" is the reference
and weights must match it to 1e-5. Validation data: 21 rows sharded with
shard_indices(mode="uneven"): rank 0 has 11, rank 1 has 10, so a mean of the
two ranks' numbers is not the number of the whole set; the job-wide numbers
must equal one process evaluating all 21 rows.
"""

import contextlib
import io
import os
import sys
import threading
import time

import keras
import numpy as np
import tensorflow as tf
from _equal import (
    assert_close,
    assert_same_on_all_ranks,
    computed_once_across_ranks,
    my_rows,
    weights,
)

import hvdkit as hvd
from hvdkit._comm import progress as _progress

from _harness import Checks

hvd.init()
r, n = hvd.rank(), hvd.size()
OUT = sys.argv[1]
c = Checks(r, OUT)

rng = np.random.default_rng(0)
X = rng.normal(size=(64, 8)).astype("float32")
Y = (X @ rng.normal(size=(8, 3)) > 0).argmax(1).astype("int32")
XV = rng.normal(size=(21, 8)).astype("float32")
YV = (XV @ rng.normal(size=(8, 3)) > 0).argmax(1).astype("int32")
GLOBAL_BATCH, HALF = 16, 16 // n
MINE = my_rows(64, GLOBAL_BATCH, r, n)
Xr, Yr = X[MINE], Y[MINE]
VMINE = hvd.data.shard_indices(len(XV), n, r, mode="uneven")
XVr, YVr = XV[VMINE], YV[VMINE]
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
FIT = dict(batch_size=HALF, shuffle=False, verbose=0)
REF_FIT = dict(batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)


def make_model(seed=0, *extra):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="tanh"),
            *extra,
            keras.layers.Dense(3),
        ]
    )


def compiled(opt, dist=True, seed=0, **kw):
    model = make_model(seed)
    model.compile(
        optimizer=hvd.DistributedOptimizer(opt) if dist else opt,
        loss=LOSS,
        metrics=["accuracy"],
        **kw,
    )
    return model


def path(name):
    return os.path.join(OUT, name)


def files_of(prefix):
    return sorted(f for f in os.listdir(OUT) if f.startswith(prefix))


class Record(keras.callbacks.Callback):
    """What a callback at this position of the list sees at each epoch end."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_epoch_end(self, epoch, logs=None):
        self.logs.append(dict(logs))


# ------------------------------------------------------------------ 1. save and load
with c.check("keras_file_loads_and_resumes_the_same_trajectory"):
    model = compiled(keras.optimizers.Adam(0.01))
    model.fit(Xr, Yr, epochs=2, **FIT)
    mine = path(f"resume-rank{r}.keras")
    model.save(mine)
    if r == 0:
        model.save(path("dist.keras"))  # read by the pytest side in fresh processes
    model.fit(Xr, Yr, epochs=1, **FIT)  # the trajectory to continue
    for how, load in (("hvd.load_model", hvd.load_model), ("keras", keras.models.load_model)):
        loaded = load(mine)
        assert isinstance(loaded.optimizer, hvd.DistributedOptimizer), (how, loaded.optimizer)
        assert int(loaded.optimizer.iterations.numpy()) == 8, how
        loaded.fit(Xr, Yr, epochs=1, **FIT)
        assert_close(weights(loaded), weights(model), rtol=1e-6)
        assert_same_on_all_ranks(weights(loaded), how)

with c.check("load_model_wraps_a_plain_keras_file"):
    ref = compiled(keras.optimizers.Adam(0.01), dist=False)
    ref.fit(X, Y, epochs=1, **REF_FIT)
    ref.save(path(f"plain-rank{r}.keras"))
    ref.fit(X, Y, epochs=2, **REF_FIT)
    loaded = hvd.load_model(path(f"plain-rank{r}.keras"), compression=hvd.Compression.none)
    assert isinstance(loaded.optimizer, hvd.DistributedOptimizer), loaded.optimizer
    assert isinstance(loaded.optimizer.inner_optimizer, keras.optimizers.Adam)
    assert int(loaded.optimizer.iterations.numpy()) == 4  # the loaded state is kept
    loaded.fit(Xr, Yr, epochs=2, **FIT)
    assert_close(weights(loaded), weights(ref))
    again = path(f"rewrapped-rank{r}.keras")
    loaded.save(again)
    assert isinstance(keras.models.load_model(again).optimizer, hvd.DistributedOptimizer)

with c.check("model_checkpoint_full_weights_only_and_best"):
    ref = compiled(keras.optimizers.SGD(0.2), dist=False)
    ref_hist = ref.fit(X, Y, epochs=4, validation_data=(XV, YV), **REF_FIT).history
    model = compiled(keras.optimizers.SGD(0.2))
    best_here = keras.callbacks.ModelCheckpoint(
        path(f"best-rank{r}-{{epoch}}.keras"), monitor="val_loss", save_best_only=True
    )
    hist = model.fit(
        Xr,
        Yr,
        epochs=4,
        validation_data=(XVr, YVr),
        callbacks=[
            best_here,  # before MetricAverageCallback: it must still see the job's val_loss
            hvd.callbacks.RankZeroOnly(keras.callbacks.ModelCheckpoint(path("full-{epoch}.keras"))),
            hvd.callbacks.RankZeroOnly(
                keras.callbacks.ModelCheckpoint(
                    path(f"w-rank{r}.weights.h5"), save_weights_only=True
                )
            ),
            hvd.callbacks.MetricAverageCallback(),
        ],
        **FIT,
    ).history
    np.testing.assert_allclose(hist["val_loss"], ref_hist["val_loss"], rtol=1e-5)
    best, improved = np.inf, []
    for epoch, v in enumerate(ref_hist["val_loss"], start=1):
        if v < best:
            best, improved = v, improved + [epoch]
    saved = [int(f.rsplit("-", 1)[1].split(".")[0]) for f in files_of(f"best-rank{r}-")]
    assert sorted(saved) == improved, (saved, improved)
    both = hvd.allgather_object(sorted(saved))
    assert both[0] == both[1], both
    c.record(f"best_epochs_rank{r}", saved)
    hvd.barrier()
    # Every rank loads rank 0's files (building a model on one rank only would shift
    # Keras's layer-name counters there; see docs/keras.md, SyncBatchNormalization).
    assert files_of("full-") == [f"full-{e}.keras" for e in (1, 2, 3, 4)], files_of("full-")
    last = keras.models.load_model(path("full-4.keras"))
    assert_close(weights(last), weights(model), rtol=0, atol=0)
    fresh = make_model(seed=7)
    fresh.load_weights(path("w-rank0.weights.h5"))
    assert_close(weights(fresh), weights(model), rtol=0, atol=0)
    assert not os.path.exists(path("w-rank1.weights.h5"))

with c.check("weights_h5_and_export_for_serving"):
    model = compiled(keras.optimizers.SGD(0.1))
    model.fit(Xr, Yr, epochs=1, **FIT)
    model.save_weights(path(f"m-rank{r}.weights.h5"))
    fresh = make_model(seed=3)
    fresh.load_weights(path(f"m-rank{r}.weights.h5"))
    assert_close(weights(fresh), weights(model), rtol=0, atol=0)
    if r == 0:
        model.export(path("served"), format="tf_saved_model", verbose=False)
    hvd.barrier()
    served = tf.saved_model.load(path("served"))
    np.testing.assert_allclose(
        served.serve(tf.constant(XV)).numpy(), model.predict(XV, verbose=0), rtol=1e-6
    )

with c.check("backup_and_restore_refused_for_checkpointer"):
    model = compiled(keras.optimizers.SGD(0.1))
    c.expect_errors(
        [
            (
                lambda: model.fit(
                    Xr,
                    Yr,
                    epochs=1,
                    callbacks=[keras.callbacks.BackupAndRestore(path("backup"))],
                    **FIT,
                ),
                "hvdkit.Checkpointer",
            ),
        ],
        hvd.ConfigurationError,
    )
    assert not os.path.exists(path("backup"))

# ------------------------------------------------------------------ 2. custom training steps


class CustomStep(keras.Model):
    """The Keras guides' custom train_step: compute_loss, optimizer.apply, self.metrics.

    Its logs are ``{"loss": ..., "compile_metrics": {"accuracy": ...}}``, nested.
    """

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


with c.check("subclassed_train_step_calls_optimizer_apply"):
    got, logs = {}, {}
    for label, dist in (("ref", False), ("hvd", True)):
        keras.utils.set_random_seed(0)
        m = CustomStep()
        m(X[:1])
        opt = keras.optimizers.Adam(0.01)
        m.compile(
            optimizer=hvd.DistributedOptimizer(opt) if dist else opt,
            loss=LOSS,
            metrics=["accuracy"],
        )
        if dist:
            cb = [hvd.callbacks.MetricAverageCallback()]
            h = m.fit(Xr, Yr, epochs=3, callbacks=cb, **FIT)
        else:
            h = m.fit(X, Y, epochs=3, **REF_FIT)
        got[label], logs[label] = weights(m), h.history
    assert_close(got["hvd"], got["ref"])
    assert_same_on_all_ranks(got["hvd"], "custom train_step")
    # the nested logs are flattened and made the job's: = one process
    assert sorted(logs["hvd"]) == ["accuracy", "loss"], logs["hvd"]
    assert_close(logs["hvd"]["loss"], logs["ref"]["loss"])
    assert logs["hvd"]["accuracy"] == logs["ref"]["accuracy"], logs


def gan(dist: bool, xs, batch):
    """Two models, two optimizers, one tf.function step (a GAN's shape)."""
    keras.utils.set_random_seed(5)
    gen = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8)])
    disc = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    g_opt, d_opt = keras.optimizers.Adam(0.01), keras.optimizers.SGD(0.05)
    if dist:
        g_opt, d_opt = hvd.DistributedOptimizer(g_opt), hvd.DistributedOptimizer(d_opt)
    bce = keras.losses.BinaryCrossentropy(from_logits=True)
    noise = np.random.default_rng(1).normal(size=(64, 4)).astype("float32")
    if dist:
        noise = noise[MINE]

    @tf.function
    def step(real, z):
        with tf.GradientTape() as d_tape:
            fake = gen(z)
            d_loss = bce(tf.ones([tf.shape(real)[0], 1]), disc(real)) + bce(
                tf.zeros([tf.shape(z)[0], 1]), disc(fake)
            )
        d_opt.apply(d_tape.gradient(d_loss, disc.trainable_variables), disc.trainable_variables)
        with tf.GradientTape() as g_tape:
            g_loss = bce(tf.ones([tf.shape(z)[0], 1]), disc(gen(z)))
        g_opt.apply(g_tape.gradient(g_loss, gen.trainable_variables), gen.trainable_variables)

    for _ in range(2):
        for b in range(0, len(xs), batch):
            step(xs[b : b + batch], noise[b : b + batch])
    return weights(gen) + weights(disc)


with c.check("two_wrapped_optimizers_in_one_step_gan"):
    got = gan(True, Xr, HALF)
    assert_close(got, gan(False, X, GLOBAL_BATCH))
    assert_same_on_all_ranks(got, "gan")

# ------------------------------------------------------------------ 3. callbacks that decide
with c.check("deciding_callbacks_agree_whatever_the_order"):
    ref = compiled(keras.optimizers.SGD(0.5), dist=False)
    # decisions that depend on the values: an epoch must improve val_loss by 0.01
    plateau = dict(monitor="val_loss", factor=0.5, patience=0, min_delta=0.05)
    stop = dict(monitor="val_loss", patience=2, min_delta=0.002)
    ref_stop = keras.callbacks.EarlyStopping(**stop)
    ref_hist = ref.fit(
        X,
        Y,
        epochs=6,
        validation_data=(XV, YV),
        callbacks=[keras.callbacks.ReduceLROnPlateau(**plateau), ref_stop],
        **REF_FIT,
    ).history
    c.record("deciding_reference_epochs", len(ref_hist["loss"]))
    c.record("deciding_reference_lrs", ref_hist["learning_rate"])
    for order in ("deciders_first", "metric_average_first"):
        model = compiled(keras.optimizers.SGD(0.5))
        first, last = Record(), Record()
        deciders = [
            keras.callbacks.ReduceLROnPlateau(**plateau),
            keras.callbacks.EarlyStopping(**stop),
        ]
        average = [hvd.callbacks.MetricAverageCallback()]
        cbs = deciders + average if order == "deciders_first" else average + deciders
        hist = model.fit(
            Xr, Yr, epochs=6, validation_data=(XVr, YVr), callbacks=[first, *cbs, last], **FIT
        ).history
        assert len(hist["loss"]) == len(ref_hist["loss"]), (order, hist, ref_hist)
        assert deciders[1].stopped_epoch == ref_stop.stopped_epoch, order
        for key in ("loss", "accuracy", "val_loss", "val_accuracy", "learning_rate"):
            np.testing.assert_allclose(hist[key], ref_hist[key], rtol=1e-5, err_msg=key)
        for a, b in zip(first.logs, last.logs, strict=True):  # the list's ends saw the same
            assert {k: a[k] for k in b if k in a} == {k: b[k] for k in b if k in a}, (a, b)
        assert_close(weights(model), weights(ref))
        both = hvd.allgather_object([first.logs, hist])
        assert both[0] == both[1], (order, both)

with c.check("rank_zero_only_refuses_deciding_callbacks"):
    c.expect_errors(
        [
            (
                lambda: hvd.callbacks.RankZeroOnly(keras.callbacks.EarlyStopping()),
                "changes the training",
            ),
            (
                lambda: hvd.callbacks.RankZeroOnly(keras.callbacks.ReduceLROnPlateau()),
                "changes the training",
            ),
            (
                lambda: hvd.callbacks.RankZeroOnly(hvd.callbacks.MetricAverageCallback()),
                "changes the training",
            ),
        ],
        hvd.ConfigurationError,
    )

with c.check("tensorboard_csv_progbar_on_rank_zero_only"):
    tb_dir = path(f"tb-rank{r}")
    csv_file = path(f"log-rank{r}.csv")
    horovod_way = [keras.callbacks.TensorBoard(path(f"tb2-rank{r}"))] if r == 0 else []
    model = compiled(keras.optimizers.SGD(0.1))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        model.fit(
            Xr,
            Yr,
            epochs=2,
            batch_size=HALF,
            shuffle=False,
            verbose=1 if r == 0 else 0,  # the README's one progress bar
            validation_data=(XVr, YVr),
            callbacks=[
                hvd.callbacks.RankZeroOnly(keras.callbacks.TensorBoard(tb_dir)),
                hvd.callbacks.RankZeroOnly(keras.callbacks.CSVLogger(csv_file)),
                *horovod_way,
                hvd.callbacks.MetricAverageCallback(),
            ],
        )
    text = printed.getvalue()
    if r == 0:
        assert "Epoch 2/2" in text, text
        events = [f for _, _, fs in os.walk(tb_dir) for f in fs if "tfevents" in f]
        assert len(events) >= 2, events  # train and validation writers
        assert os.listdir(path("tb2-rank0"))
        rows = open(csv_file).read().strip().splitlines()
        assert len(rows) == 3 and rows[0].startswith("epoch"), rows
    else:
        assert text == "", text
        assert not os.path.exists(tb_dir) and not os.path.exists(csv_file)
        assert not os.path.exists(path("tb2-rank1"))

# ------------------------------------------------------------------ 4. evaluation and prediction
with c.check("evaluate_reports_the_whole_set"):
    model = compiled(keras.optimizers.SGD(0.1))
    model.fit(Xr, Yr, epochs=1, **FIT)
    ref = make_model()
    ref.set_weights(model.get_weights())
    ref.compile(loss=LOSS, metrics=["accuracy"])
    sw = np.linspace(0.5, 2.0, len(XV)).astype("float32")
    want = ref.evaluate(XV, YV, batch_size=4, verbose=0, return_dict=True)
    want_sw = ref.evaluate(XV, YV, sample_weight=sw, batch_size=4, verbose=0, return_dict=True)
    local = model.evaluate(XVr, YVr, batch_size=4, verbose=0, return_dict=True)
    job = model.evaluate(
        XVr,
        YVr,
        batch_size=4,
        verbose=0,
        return_dict=True,
        callbacks=[hvd.callbacks.MetricAverageCallback()],
    )
    job_sw = model.evaluate(
        XVr,
        YVr,
        sample_weight=sw[VMINE],
        batch_size=4,
        verbose=0,
        return_dict=True,
        callbacks=[hvd.callbacks.MetricAverageCallback()],
    )
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(job[key], want[key], rtol=1e-5, err_msg=key)
        np.testing.assert_allclose(job_sw[key], want_sw[key], rtol=1e-5, err_msg=key)
    mean_of_means = float(np.mean(hvd.allgather(np.array([local["loss"]]))))
    c.record("evaluate_mean_of_rank_means_error", abs(mean_of_means - want["loss"]))
    assert abs(mean_of_means - want["loss"]) > 1e-4  # the data make the weighting matter
    after = model.evaluate(XVr, YVr, batch_size=4, verbose=0, return_dict=True)
    assert after == local, (after, local)  # without the callback: this rank's own numbers

with c.check("predict_then_unshard_in_original_order"):
    model = compiled(keras.optimizers.SGD(0.1))
    model.fit(Xr, Yr, epochs=1, **FIT)
    got = hvd.data.unshard(model.predict(XVr, batch_size=4, verbose=0), VMINE)
    np.testing.assert_allclose(got, model.predict(XV, verbose=0), rtol=1e-6, atol=1e-7)
    pad = hvd.data.shard_indices(len(XV), n, r, mode="pad")  # row 0 read twice
    got = hvd.data.unshard({"p": model.predict(XV[pad], verbose=0)}, pad, num_samples=len(XV))
    np.testing.assert_allclose(got["p"], model.predict(XV, verbose=0), rtol=1e-6, atol=1e-7)
    c.expect_errors(
        [
            (lambda: hvd.data.unshard(XVr[:3], VMINE), "differ in length"),
            (lambda: hvd.data.unshard(XVr, VMINE, num_samples=30), "on no rank"),
        ],
        hvd.ShardingError,
    )

with c.check("validation_split_and_validation_freq"):
    # each rank validates on the last quarter of its own rows; the reference trains on
    # the same global batches and validates on both quarters together
    parts = [my_rows(64, GLOBAL_BATCH, q, n) for q in range(n)]
    train_ref = np.concatenate(
        [np.concatenate([p[b : b + HALF] for p in parts]) for b in range(0, 24, HALF)]
    )
    val_ref = np.concatenate([p[24:] for p in parts])
    ref = compiled(keras.optimizers.SGD(0.3), dist=False)
    ref_hist = ref.fit(
        X[train_ref],
        Y[train_ref],
        epochs=4,
        validation_data=(X[val_ref], Y[val_ref]),
        validation_freq=2,
        **REF_FIT,
    ).history
    model = compiled(keras.optimizers.SGD(0.3))
    hist = model.fit(
        Xr,
        Yr,
        epochs=4,
        validation_split=0.25,
        validation_freq=2,
        callbacks=[hvd.callbacks.MetricAverageCallback()],
        **FIT,
    ).history
    assert len(hist["val_loss"]) == 2, hist
    np.testing.assert_allclose(hist["val_loss"], ref_hist["val_loss"], rtol=1e-5)
    np.testing.assert_allclose(hist["loss"], ref_hist["loss"], rtol=1e-5)
    assert_close(weights(model), weights(ref))

with c.check("class_weight_and_sample_weight"):
    cw = {0: 1.0, 1: 2.0, 2: 0.5}
    sw = np.linspace(0.2, 1.8, 64).astype("float32")
    for kw, kw_mine in (
        ({"class_weight": cw}, {"class_weight": cw}),
        ({"sample_weight": sw}, {"sample_weight": sw[MINE]}),
    ):
        ref = compiled(keras.optimizers.SGD(0.2), dist=False)
        ref_hist = ref.fit(X, Y, epochs=2, **kw, **REF_FIT).history
        model = compiled(keras.optimizers.SGD(0.2))
        hist = model.fit(
            Xr, Yr, epochs=2, callbacks=[hvd.callbacks.MetricAverageCallback()], **kw_mine, **FIT
        ).history
        assert_close(weights(model), weights(ref))
        np.testing.assert_allclose(hist["loss"], ref_hist["loss"], rtol=1e-5)

# ------------------------------------------------------------------ 5. the optimizer's own features
FEATURES = {
    "clipnorm": lambda: keras.optimizers.SGD(0.5, clipnorm=0.05),
    "global_clipnorm": lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.05),
    "clipvalue": lambda: keras.optimizers.SGD(0.5, clipvalue=0.01),
    "gradient_accumulation_steps": lambda: keras.optimizers.Adam(
        0.01, gradient_accumulation_steps=2
    ),
    "use_ema": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.5),
    "loss_scale_factor": lambda: keras.optimizers.SGD(0.2, loss_scale_factor=128.0),
    "learning_rate_schedule": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.CosineDecay(0.5, decay_steps=12)
    ),
    "weight_decay": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.5),
}
# The same optimizer without the feature (loss_scale_factor must change nothing): the
# features of one row share that optimizer as their baseline.
BASELINES = {
    ("clipnorm", "global_clipnorm", "clipvalue", "learning_rate_schedule"): lambda: (
        keras.optimizers.SGD(0.5)
    ),
    ("gradient_accumulation_steps", "use_ema"): lambda: keras.optimizers.Adam(0.01),
    ("weight_decay",): lambda: keras.optimizers.AdamW(0.01, weight_decay=0.0),
}
BASELINE_OF = {feature: features for features in BASELINES for feature in features}


def fit_alone(make_opt):
    """One process's weights after 3 epochs on the global batches."""

    def fit():
        ref = compiled(make_opt(), dist=False)
        ref.fit(X, Y, epochs=3, **REF_FIT)
        return weights(ref)

    return fit


with c.check("optimizer_features_through_the_wrapper"):
    # the single-process fits (a reference per feature, a baseline per optimizer), shared
    # out between the ranks
    alone = computed_once_across_ranks(
        {
            **{f: fit_alone(m) for f, m in FEATURES.items()},
            **{b: fit_alone(m) for b, m in BASELINES.items()},
        }
    )
    for feature, make_opt in FEATURES.items():
        ref = alone[feature]
        model = compiled(make_opt())
        model.fit(Xr, Yr, epochs=3, **FIT)
        try:
            assert_close(weights(model), ref)
        except AssertionError as e:
            raise AssertionError(f"{feature}: {e}") from None
        assert_same_on_all_ranks(weights(model), feature)
        if feature in BASELINE_OF:  # the feature acted: without it training ends elsewhere
            plain = alone[BASELINE_OF[feature]]
            moved = max(np.abs(a - b).max() for a, b in zip(plain, ref, strict=True))
            assert moved > 1e-4, (feature, moved)

# ------------------------------------------------------------------ 6. layers with state
with c.check("batch_normalization_keeps_local_statistics"):
    model = make_model(0, keras.layers.BatchNormalization())
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=LOSS)
    model.fit(Xr, Yr, epochs=2, **FIT)
    bn = model.layers[1]
    assert_same_on_all_ranks([w.numpy() for w in model.trainable_weights], "bn trainable")
    moving = hvd.allgather(bn.moving_mean.numpy()[None])
    assert np.abs(moving[0] - moving[1]).max() > 1e-4  # each rank's own batches
    hvd.broadcast_variables(model.non_trainable_weights, root_rank=0)  # the documented fix
    assert_same_on_all_ranks(weights(model), "bn after broadcast")

with c.check("sync_batch_normalization_equals_one_process"):
    ref = make_model(0, keras.layers.BatchNormalization(momentum=0.5))
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss=LOSS)
    ref.fit(X, Y, epochs=2, **REF_FIT)
    model = make_model(0, hvd.SyncBatchNormalization(momentum=0.5))
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=LOSS)
    model.fit(Xr, Yr, epochs=2, **FIT)
    assert_close(weights(model), weights(ref))

with c.check("dropout_with_seed_keeps_ranks_identical"):
    model = make_model(0, keras.layers.Dropout(0.5, seed=11))
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=LOSS)
    model.fit(Xr, Yr, epochs=2, **FIT)
    assert_same_on_all_ranks([w.numpy() for w in model.trainable_weights], "dropout")
    mask = (model.layers[1](tf.ones([4, 16]), training=True).numpy() == 0).astype("int32")
    both = hvd.allgather(mask[None])
    c.record("dropout_masks_equal_across_ranks", bool(np.array_equal(both[0], both[1])))

# ------------------------------------------------------------------ Horovod names, progress
with c.check("horovod_names_refused_where_unsupported"):
    sparse = tf.IndexedSlices(tf.ones([1, 3]), tf.constant([r]))
    try:
        hvd.allreduce(sparse, op=hvd.Adasum)
    except NotImplementedError as e:  # Horovod's class for it
        assert isinstance(e, hvd.NotSupportedError) and "IndexedSlices" in str(e), e
    else:
        raise AssertionError("Adasum of IndexedSlices was not refused")
    try:  # this job was started without HOROVOD_DYNAMIC_PROCESS_SETS=1
        hvd.add_process_set([0])
    except ValueError as e:  # Horovod's class for it
        assert "HOROVOD_DYNAMIC_PROCESS_SETS=1" in str(e), e
    else:
        raise AssertionError("add_process_set without dynamic sets was not refused")
    got = hvd.allreduce(np.array([r + 1.0]), op=hvd.Sum, process_set=hvd.global_process_set)
    assert got.tolist() == [3.0], got

with c.check("alltoall_errors_are_horovods_classes"):
    for call in (
        lambda: hvd.alltoall(tf.ones([n + 1])),  # uneven default split
        lambda: hvd.alltoall(tf.ones([n - 1]), splits=tf.ones([n], tf.int32)),
    ):
        try:
            call()
        except tf.errors.InvalidArgumentError as e:
            assert isinstance(e, hvd.ConfigurationError) and "alltoall" in str(e), e
        else:
            raise AssertionError("alltoall not refused")
    try:
        hvd.alltoall(tf.ones([2 * n], tf.int32 if r else tf.float32), name="kw.a2a.dtype")
    except tf.errors.FailedPreconditionError as e:
        assert isinstance(e, hvd.CollectiveMismatchError), type(e)
    else:
        raise AssertionError("dtype mismatch not raised")

with c.check("object_collectives_register_their_wait"):
    # Rank 0 enters first and a thread of it reads what its heartbeat would say; only
    # then (a file tells it) does rank 1 join. No clock decides anything.
    for what, call in (
        ("allgather_object", lambda: hvd.allgather_object({"r": r}, name="kw.obj")),
        ("broadcast_object", lambda: hvd.broadcast_object({"r": r}, root_rank=1, name="kw.b")),
    ):
        flag = path(f"seen-{what}")
        seen = []
        if r == 0:

            def watch(what=what, flag=flag, seen=seen):
                while not seen:
                    waiting = _progress.status().get(_progress.WAITING, "")
                    if waiting.startswith(what):
                        seen.append(waiting)
                        open(flag, "w").close()
                    time.sleep(0.01)

            threading.Thread(target=watch, daemon=True).start()
        else:
            while not os.path.exists(flag):
                time.sleep(0.01)
        out = call()
        if r == 0:
            assert seen and "kw." in seen[0], seen
        assert out == ([{"r": 0}, {"r": 1}] if what == "allgather_object" else {"r": 1}), out

c.finish()

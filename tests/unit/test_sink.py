"""Sink mode in one process: batch order, equivalence with plain steps, errors, Keras path."""

import time
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import hvdkit
from hvdkit import sink
from hvdkit.errors import InputPipelineError

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def ids_dataset(n=10, batch=3):
    """Batches of sample ids: [0 1 2] [3 4 5] [6 7 8] [9] for the defaults."""
    return tf.data.Dataset.range(n).batch(batch)


def recorder():
    """A step that appends its batch's first id to a list, and that list."""
    seen = tf.Variable(tf.zeros([0], tf.int64), shape=[None])

    def step(batch):
        seen.assign(tf.concat([seen, batch[:1]], 0))
        return batch[0]

    return step, seen


def make_model(seed=0, built=True):
    keras.utils.set_random_seed(seed)
    layers = [keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)]
    return keras.Sequential(([keras.Input((8,))] if built else []) + layers)


def data(n=50, batch=8):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = rng.integers(0, 3, n).astype("int32")
    return x, y, tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)  # 7 batches, last of 2


def weights(model):
    return [w.numpy() for w in model.weights]


def assert_weights_close(a, b, rtol=1e-6):
    assert len(a) == len(b)
    for u, v in zip(a, b, strict=True):
        np.testing.assert_allclose(u, v, rtol=rtol, atol=1e-7)


def train_step_for(model, opt):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    return step


# --------------------------------------------------------------------------- prefetch_to_device
def test_prefetch_to_device_on_cpu_keeps_elements(local_runtime):
    ds = ids_dataset()
    staged = sink.prefetch_to_device(ds)  # no GPU here: the CPU
    got = [b.numpy().tolist() for b in staged]
    assert got == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert next(iter(staged)).device.endswith("CPU:0")
    assert [b.numpy().tolist() for b in sink.prefetch_to_device(ds, "/cpu:0", 2)] == got


def test_prefetch_to_device_refuses_bad_arguments(local_runtime):
    ds = ids_dataset()
    with pytest.raises(hvdkit.ConfigurationError, match=r"'/gpu:0'.* sees 0 GPU"):
        sink.prefetch_to_device(ds, "/gpu:0")
    with pytest.raises(hvdkit.ConfigurationError, match=r"device='/tpu:0' is not a CPU or GPU"):
        sink.prefetch_to_device(ds, "/tpu:0")
    with pytest.raises(hvdkit.ConfigurationError, match=r"buffer_size=0 must be a positive"):
        sink.prefetch_to_device(ds, buffer_size=0)
    with pytest.raises(hvdkit.ConfigurationError, match="needs a tf.data.Dataset"):
        sink.prefetch_to_device(np.arange(3))


# --------------------------------------------------------------------------- data_sink order
@pytest.mark.parametrize(
    "sink_size, calls, expected",
    [
        # 4 batches (first ids 0 3 6 9); a sink larger than the dataset wraps inside a call
        (5, 3, [0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6]),
        # smaller: calls continue where the last stopped, across the dataset's end
        (3, 3, [0, 3, 6, 9, 0, 3, 6, 9, 0]),
        (4, 2, [0, 3, 6, 9, 0, 3, 6, 9]),
        (1, 5, [0, 3, 6, 9, 0]),
    ],
)
def test_data_sink_batch_order(local_runtime, sink_size, calls, expected):
    step, seen = recorder()
    run = sink.data_sink(step, ids_dataset(), sink_size=sink_size)
    lasts = [int(run()) for _ in range(calls)]
    assert seen.numpy().tolist() == expected  # total steps = calls * sink_size
    assert lasts == expected[sink_size - 1 :: sink_size]  # the last step's output
    assert (run.calls, run.steps_done) == (calls, calls * sink_size)


def test_data_sink_return_all_and_structures(local_runtime):
    run = sink.data_sink(lambda b: {"first": b[0], "size": tf.size(b)}, ids_dataset(), 4)
    out = run()
    assert out["first"].numpy().tolist() == 9  # the last step's
    run_all = sink.data_sink(
        lambda b: {"first": b[0], "size": tf.size(b)}, ids_dataset(), 5, return_all=True
    )
    out = run_all()
    assert out["first"].shape == (5,)
    assert out["first"].numpy().tolist() == [0, 3, 6, 9, 0]
    assert out["size"].numpy().tolist() == [3, 3, 3, 1, 3]
    # tuple elements are unpacked into fn(x, y); fn may return None
    pairs = tf.data.Dataset.from_tensor_slices((np.arange(4), -np.arange(4))).batch(2)
    total = tf.Variable(0, dtype=tf.int64)

    def add(x, y):
        total.assign_add(tf.reduce_sum(x - y))

    none_sink = sink.data_sink(add, pairs, 3)
    assert none_sink() is None
    assert int(total.numpy()) == 2 * (0 + 1 + 2 + 3) + 2 * (0 + 1)


def test_data_sink_with_a_prefetched_dataset_cycles(local_runtime):
    step, seen = recorder()
    run = sink.data_sink(step, sink.prefetch_to_device(ids_dataset(), buffer_size=2), 6)
    run()
    assert seen.numpy().tolist() == [0, 3, 6, 9, 0, 3]


# --------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("built", [True, False])
def test_data_sink_equals_plain_steps(local_runtime, built):
    """k calls of sink_size s give the weights of k*s plain steps (across epoch ends)."""
    # Reshuffled on every pass. A shuffle's seed sequence belongs to the
    # dataset object, so each loop gets its own, built the same way.
    make_ds = lambda: data()[2].shuffle(7, seed=3)
    k, s = 5, 3  # 15 steps over a dataset of 7 batches
    ref = make_model(built=built)
    ref_step = train_step_for(ref, keras.optimizers.Adam(0.01))
    batches = iter(make_ds().repeat())
    for _ in range(k * s):
        ref_step(*next(batches))
    model, opt = make_model(built=built), keras.optimizers.Adam(0.01)
    run = sink.data_sink(train_step_for(model, opt), make_ds(), sink_size=s)
    for _ in range(k):
        run()
    assert_weights_close(weights(model), weights(ref))
    assert int(opt.iterations.numpy()) == k * s


def test_data_sink_jit_compile_single_process(local_runtime):
    square_sums = lambda b: tf.reduce_sum(b * b)
    run = sink.data_sink(square_sums, ids_dataset(), 4, jit_compile=True, return_all=True)
    assert run().numpy().tolist() == [5, 50, 149, 81]


# --------------------------------------------------------------------------- errors
def bad_ids_dataset():
    def check(i):
        tf.debugging.assert_none_equal(i, tf.constant(7, tf.int64), message="bad record 7")
        return i

    return tf.data.Dataset.range(10).map(check).batch(2)  # batch [6 7] fails


def test_input_error_names_the_step_and_the_next_call_continues(local_runtime):
    step, seen = recorder()
    run = sink.data_sink(step, bad_ids_dataset(), sink_size=3)
    run()  # steps 0-2: batches [0 1] [2 3] [4 5]
    with pytest.raises(InputPipelineError) as info:
        run()  # step 3 needs [6 7]
    err = info.value
    assert isinstance(err, RuntimeError) and err.step == 3
    assert isinstance(err.__cause__, tf.errors.InvalidArgumentError)
    msg = str(err)
    assert "bad record 7" in msg and "InvalidArgumentError" in msg
    assert "failed at step 3 " in msg and "step 1 of 3 in call 2" in msg
    assert run.steps_done == 3 and run.calls == 2
    run()  # continues after the failed element
    assert seen.numpy().tolist() == [0, 2, 4, 8, 0, 2]
    assert run.steps_done == 6


def test_error_in_the_step_keeps_its_type_with_a_note(local_runtime):
    def step(batch):
        tf.debugging.assert_less(tf.reduce_max(batch), tf.constant(8, tf.int64), message="nan!")
        return batch

    run = sink.data_sink(step, tf.data.Dataset.range(10).batch(2), sink_size=3)
    run()
    with pytest.raises(tf.errors.InvalidArgumentError, match="nan!") as info:
        run()  # step 4 sees [8 9]
    assert info.value.__notes__ == [
        "hvdkit: raised by the training step at step 4 (0-based, counted since the sink was "
        "created), which is step 2 of 3 in call 2."
    ]


def test_stateless_step_error_is_pinned_to_its_step(local_runtime):
    # A step with no stateful op: the step counter must still wait for its outputs.
    def slow_sum(x):
        time.sleep(0.05)
        if x.sum() > 12:
            raise ValueError("too big")
        return x.sum()

    run = sink.data_sink(
        lambda b: tf.numpy_function(slow_sum, [b], tf.int64, stateful=False),
        tf.data.Dataset.range(20).batch(2),
        sink_size=5,
    )
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        run()  # [6 7] at step 3 sums to 13
    assert "at step 3 " in info.value.__notes__[0]


def test_empty_datasets(local_runtime):
    with pytest.raises(hvdkit.ConfigurationError, match=r"empty \(0 batches\)"):
        sink.data_sink(lambda b: b, tf.data.Dataset.range(3).batch(4, drop_remainder=True), 2)
    unknown_empty = tf.data.Dataset.range(3).filter(lambda i: i > 5).batch(2)
    run = sink.data_sink(lambda b: b, unknown_empty, 2)
    with pytest.raises(InputPipelineError, match="produced no elements"):
        run()


def test_data_sink_refuses_bad_arguments(local_runtime):
    ds = ids_dataset()
    for bad in (0, -1, True, 2.0):
        with pytest.raises(hvdkit.ConfigurationError, match=f"sink_size={bad!r} is not valid"):
            sink.data_sink(lambda b: b, ds, bad)
    with pytest.raises(hvdkit.ConfigurationError, match="is not callable"):
        sink.data_sink(3, ds)
    with pytest.raises(hvdkit.ConfigurationError, match="needs a tf.data.Dataset"):
        sink.data_sink(lambda b: b, [1, 2, 3])
    with pytest.raises(hvdkit.ConfigurationError, match="jit_compile='yes'"):
        sink.data_sink(lambda b: b, ds, jit_compile="yes")
    with pytest.raises(hvdkit.ConfigurationError, match=r"slow_input_fraction=1.5 must be in"):
        sink.data_sink(lambda b: b, ds, slow_input_fraction=1.5)


# --------------------------------------------------------------------------- slow input
def test_slow_input_is_measured_apart_from_the_step_time(local_runtime):
    # Timing only as lower bounds: a loaded machine makes every wait longer, never
    # shorter than the sleeps inside it. (Comparing the two runs' waits with each other
    # was dropped: on a loaded machine the prefetching thread itself can be starved,
    # and the fresh-clone CI of 5db70da saw the prefetched run wait longer.)
    def slow(i):
        time.sleep(0.03)
        return i

    slow_ds = tf.data.Dataset.range(100).map(lambda i: tf.py_function(slow, [i], tf.int64))
    slow_run = sink.data_sink(lambda b: b, slow_ds.batch(1), sink_size=4, slow_input_fraction=None)

    def slow_step(b):
        time.sleep(0.03)
        return b

    fast_run = sink.data_sink(
        lambda b: tf.numpy_function(slow_step, [b], tf.int64, stateful=True),
        tf.data.Dataset.range(100).batch(1).prefetch(8),
        sink_size=4,
        slow_input_fraction=None,
    )
    for run in (fast_run, fast_run, slow_run, slow_run):  # second calls: traced, started
        run()
    assert slow_run.last_input_wait >= 4 * 0.03 * 0.8  # every step waited for its batch
    assert slow_run.last_input_wait <= slow_run.last_wall_time
    assert fast_run.last_wall_time >= 4 * 0.03
    # the steps' own sleeps are not counted as waiting for input
    assert fast_run.last_input_wait <= fast_run.last_wall_time - 4 * 0.03 * 0.8


def test_slow_input_warning_follows_the_measured_fraction(local_runtime):
    # The decision from given measurements (the clock is not part of it).
    loop = sink.data_sink(lambda b: b, tf.data.Dataset.range(100).batch(1), sink_size=4)._loop

    def decide(wait, wall, calls=2):
        loop.last_input_wait, loop.last_wall_time, loop.calls = wait, wall, calls
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loop._check_input_speed()
        return [str(w.message) for w in caught if w.category is sink.SlowInputWarning]

    assert decide(0.5, 1.0, calls=1) == []  # the first call never warns (tracing)
    assert decide(0.1, 1.0) == []  # under the fraction
    said = decide(0.5, 1.0)
    assert len(said) == 1 and "waited 0.500 s for input data during 4 steps" in said[0]
    assert "took 1.000 s (50%)" in said[0]
    assert decide(0.9, 1.0) == []  # at most once per SLOW_INPUT_REPEAT_SECONDS


# --------------------------------------------------------------------------- Keras: train()
class Counter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.events = []

    def on_train_batch_end(self, batch, logs=None):
        self.events.append(("batch_end", batch))

    def on_epoch_end(self, epoch, logs=None):
        self.events.append(("epoch_end", epoch, round(float(logs["loss"]), 6)))


def compiled(built=True, **kw):
    model = make_model(built=built)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss=LOSS, metrics=["accuracy"], **kw)
    return model


def test_train_sink_size_n_equals_fit_over_the_same_batches(local_runtime):
    _, _, ds = data()  # 7 batches; 3 epochs of 4 steps cross the dataset's end
    model, counter = compiled(), Counter()
    hist = sink.train(model, 3, ds, callbacks=[counter], sink_size=4, verbose=0)
    ref, ref_counter = compiled(), Counter()
    ref_hist = ref.fit(
        ds.repeat(), epochs=3, steps_per_epoch=4, callbacks=[ref_counter], shuffle=False, verbose=0
    )
    assert_weights_close(weights(model), weights(ref))
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-6)
    # callbacks once per sink: one batch_end (steps 0..3) and one epoch_end per epoch
    assert [e[:2] for e in counter.events] == [
        ("batch_end", 3),
        ("epoch_end", 0),
        ("batch_end", 3),
        ("epoch_end", 1),
        ("batch_end", 3),
        ("epoch_end", 2),
    ]
    assert [e for e in counter.events if e[0] == "epoch_end"] == [
        e for e in ref_counter.events if e[0] == "epoch_end"
    ]
    assert ref_counter.events.count(("batch_end", 3)) == 3 and len(ref_counter.events) == 15
    assert int(model.optimizer.iterations.numpy()) == 12


def test_train_whole_dataset_per_epoch_equals_fit(local_runtime):
    _, _, ds = data()
    model, counter = compiled(), Counter()
    sink.train(model, 2, ds, callbacks=[counter], verbose=0)  # sink_size=-1
    ref = compiled()
    ref.fit(ds, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(weights(model), weights(ref))
    assert [e[:2] for e in counter.events] == [
        ("batch_end", 6),
        ("epoch_end", 0),
        ("batch_end", 6),
        ("epoch_end", 1),
    ]


class RecordingModel(keras.Sequential):
    """Records the first feature (a sample id) of every batch it trains on."""

    seen = None

    def train_step(self, data):
        x, _ = data
        RecordingModel.seen.assign(tf.concat([RecordingModel.seen, x[:1, 0]], 0))
        return super().train_step(data)


@pytest.mark.parametrize(
    "sink_size, expected",
    [
        (3, [[0, 8, 16], [24, 0, 8], [16, 24, 0]]),  # continues across epochs, cycles
        (6, [[0, 8, 16, 24, 0, 8], [16, 24, 0, 8, 16, 24], [0, 8, 16, 24, 0, 8]]),
        (-1, [[0, 8, 16, 24]] * 3),  # an epoch is the dataset
    ],
)
def test_train_epoch_boundaries_exact_batch_ids(local_runtime, sink_size, expected):
    RecordingModel.seen = tf.Variable(tf.zeros([0]), shape=[None])
    keras.utils.set_random_seed(0)
    model = RecordingModel([keras.Input((1,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=LOSS)
    ids = np.arange(30, dtype="float32")[:, None]  # 4 batches of 8 (last of 6)
    ds = tf.data.Dataset.from_tensor_slices((ids, np.zeros(30, "int32"))).batch(8)
    per_epoch = []

    class Split(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            per_epoch.append(RecordingModel.seen.numpy().astype(int).tolist())
            RecordingModel.seen.assign(tf.zeros([0]))

    sink.train(model, 3, ds, callbacks=[Split()], sink_size=sink_size, verbose=0)
    assert per_epoch == expected


def test_train_without_sink_mode_is_plain_fit(local_runtime):
    _, _, ds = data()
    model, counter = compiled(), Counter()
    sink.train(model, 2, ds, callbacks=[counter], dataset_sink_mode=False, sink_size=3, verbose=0)
    assert [e[1] for e in counter.events if e[0] == "batch_end"] == list(range(7)) * 2
    ref = compiled()
    ref.fit(ds, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(weights(model), weights(ref))


def test_train_restores_the_model_and_reuses_its_loop(local_runtime):
    _, _, ds = data()
    model = compiled(steps_per_execution=2)
    sink.train(model, 1, ds, sink_size=5, verbose=0)
    assert model.steps_per_execution == 2 and model.train_function is None
    loop = sink.fit._KERAS_LOOPS[model][3]
    sink.train(model, 2, ds, sink_size=5, initial_epoch=1, verbose=0)  # a next epoch
    assert sink.fit._KERAS_LOOPS[model][3] is loop and loop.calls == 1
    model.compile(optimizer="sgd", loss=LOSS)  # recompiled: a new loop
    sink.train(model, 1, ds, sink_size=5, verbose=0)
    assert sink.fit._KERAS_LOOPS[model][3] is not loop
    model.fit(ds, epochs=1, shuffle=False, verbose=0)  # plain fit still works afterwards
    assert int(model.optimizer.iterations.numpy()) == 5 + 7


def test_train_input_error_names_step_and_epoch(local_runtime):
    def check(x, y):
        tf.debugging.assert_less(x[0], 40.0, message="bad record 40")
        return x, y

    ids = np.arange(50, dtype="float32")[:, None] * np.ones([1, 8], "float32")
    ds = tf.data.Dataset.from_tensor_slices((ids, np.zeros(50, "int32"))).map(check).batch(10)
    model = compiled()
    with pytest.raises(InputPipelineError) as info:
        sink.train(model, 3, ds, sink_size=3, verbose=0)  # batch 4 = step 4 fails
    assert info.value.step == 4
    assert "step 2 of 3 in call 2, epoch 2" in str(info.value)
    assert "bad record 40" in str(info.value)
    assert model.steps_per_execution == 1  # restored after the failure too


def test_train_refuses_bad_arguments(local_runtime):
    _, _, ds = data()
    model = compiled()
    with pytest.raises(hvdkit.ConfigurationError, match="steps_per_epoch=5 conflicts"):
        sink.train(model, 1, ds, steps_per_epoch=5)
    for bad in (0, -2):
        with pytest.raises(hvdkit.ConfigurationError, match=f"sink_size={bad} is not valid"):
            sink.train(model, 1, ds, sink_size=bad)
    with pytest.raises(hvdkit.ConfigurationError, match="its length is infinite"):
        sink.train(model, 1, ds.repeat())
    with pytest.raises(hvdkit.ConfigurationError, match="its length is unknown"):
        sink.train(model, 1, ds.filter(lambda x, y: True))
    with pytest.raises(hvdkit.ConfigurationError, match="not compiled"):
        sink.train(make_model(), 1, ds)
    with pytest.raises(hvdkit.ConfigurationError, match="run_eagerly=True"):
        sink.train(compiled(run_eagerly=True), 1, ds)
    # sink_size > 0 handles infinite and unknown lengths
    hist = sink.train(model, 2, ds.repeat().filter(lambda x, y: True), sink_size=2, verbose=0)
    assert len(hist.history["loss"]) == 2

"""hvdkit._validate: the one rule for integer arguments, and the call sites that use it."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import hvdkit
from hvdkit._validate import check_int, is_int, is_number
from hvdkit.data import readers, sharding
from hvdkit.errors import ConfigurationError, ShardingError
from hvdkit.ops import _args
from hvdkit.sink import loop


@pytest.mark.parametrize(
    "value, expected",
    [
        (3, True),
        (0, True),
        (-2, True),
        (np.int64(3), True),
        (np.int32(-1), True),
        (np.uint8(7), True),
        (True, False),  # bool is an int to Python, not a count to hvdkit
        (False, False),
        (np.bool_(True), False),
        (2.0, False),  # an integral float is still refused
        (np.float64(2.0), False),
        ("2", False),
        (None, False),
    ],
    ids=repr,
)
def test_is_int(value, expected):
    assert is_int(value) is expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (2, True),
        (0.5, True),
        (np.float32(0.5), True),
        (np.float64(0.5), True),
        (np.int32(2), True),
        (True, False),
        (np.True_, False),
        ("0.5", False),
        (None, False),
        (1j, False),
    ],
    ids=repr,
)
def test_is_number(value, expected):
    assert is_number(value) is expected


def test_the_number_rule_is_the_same_at_every_site(local_runtime, tmp_path):
    """np.float32 and np.float64 are taken alike where a real number is wanted; True nowhere."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    for good in (np.float32(0.5), np.float64(0.5)):
        ckpt = hvdkit.Checkpointer(tmp_path, model=model, every_seconds=good)
        assert ckpt.every_seconds == 0.5
        warmup = hvdkit.callbacks.LearningRateWarmupCallback(
            0.1, warmup_epochs=1, steps_per_epoch=good * 4
        )
        assert warmup.steps_per_epoch == 2.0
        out = hvdkit.allreduce(np.ones(2, np.float32), op=hvdkit.Sum, prescale_factor=good)
        np.testing.assert_allclose(np.asarray(out), [0.5, 0.5])
    with pytest.raises(ConfigurationError, match=r"steps_per_epoch=True is not a number"):
        hvdkit.callbacks.LearningRateWarmupCallback(0.1, steps_per_epoch=True)
    with pytest.raises(ConfigurationError, match=r"prescale_factor=np.True_ must be a Python"):
        hvdkit.allreduce(np.ones(2, np.float32), op=hvdkit.Sum, prescale_factor=np.True_)


def test_numpy_integers_come_back_as_plain_ints():
    got = check_int("epoch", np.int64(3), minimum=0, fix="count from 0.")
    assert got == 3 and type(got) is int


@pytest.mark.parametrize("bad", [True, False, 2.0, np.float32(1.0), "3", None], ids=repr)
def test_what_is_not_an_integer_is_refused_naming_value_and_fix(bad):
    with pytest.raises(ConfigurationError) as info:
        check_int("num_shards", bad, minimum=1, fix="pass hvdkit.size().")
    assert str(info.value) == f"num_shards={bad!r} is not an integer; pass hvdkit.size()."


def test_below_the_minimum_names_the_value_the_minimum_and_the_fix():
    with pytest.raises(ConfigurationError) as info:
        check_int("num_shards", np.int64(0), minimum=1, fix="pass hvdkit.size().")
    assert str(info.value) == "num_shards=0 must be at least 1; pass hvdkit.size()."
    assert check_int("num_shards", 1, minimum=1) == 1  # the minimum itself is allowed
    with pytest.raises(ConfigurationError, match=r"^seed=-1 must be at least 0\.$"):
        check_int("seed", -1)  # default minimum 0, no fix given: the sentence still ends


def test_minimum_none_checks_only_the_type():
    assert check_int("shard_id", -5, minimum=None) == -5
    with pytest.raises(ConfigurationError, match="shard_id=True is not an integer"):
        check_int("shard_id", True, minimum=None)


def test_error_class_and_whole_message_are_the_callers():
    with pytest.raises(ShardingError) as info:
        check_int("epoch", -1, error=ShardingError, fix="count from 0.")
    assert isinstance(info.value, ValueError)  # HvdkitError subclasses refine ValueError
    for bad in (0, False, 1.5):
        with pytest.raises(ConfigurationError) as info:
            check_int("k", bad, minimum=1, message=f"k={bad!r} must be an int >= 1.")
        assert str(info.value) == f"k={bad!r} must be an int >= 1."


# --------------------------------------------------------------------------- call sites
# Each routed call site: its own error class and message, numpy integers in, bools and
# floats out. The messages are the ones these sites raised before the helper existed.
def test_sharding_sites():
    sharding.check_shard_args(np.int64(10), np.int32(2), np.int64(1), "pad", np.int64(3), 0)
    cases = [
        ((10, 2, 0, "pad", 2.0), r"^seed=2\.0 is not an integer; pass a non-negative int"),
        ((10, 2, -1, "pad"), r"^shard_id=-1 is outside \[0, num_shards=2\)"),
        ((10, 2, np.bool_(0), "pad"), r"^shard_id=np\.False_ is not an integer; pass hvdkit"),
        ((True, 2, 0, "pad"), r"^num_samples=True is not an integer; pass the dataset's length"),
        ((0, 2, 0, "pad"), r"^num_samples=0: the dataset is empty"),
    ]
    for args, pattern in cases:
        with pytest.raises(ShardingError, match=pattern):
            sharding.check_shard_args(*args)


def test_ops_positive_int():
    assert _args.positive_int(np.int16(4), "num_height", "slice_patches", "patch rows") == 4
    for bad in (0, True, 2.0):
        with pytest.raises(ConfigurationError) as info:
            _args.positive_int(bad, "num_height", "slice_patches", "patch rows")
        assert str(info.value) == (
            f"slice_patches: num_height={bad!r} must be a positive int (the number of patch "
            "rows); pass an int >= 1."
        )


def test_sink_size():
    assert loop.check_sink_size(np.int64(-1), True, "fix") == -1
    assert loop.check_sink_size(np.int64(3), False, "fix") == 3
    for bad, allow_whole in ((-1, False), (0, True), (-2, True), (True, True), (1.0, True)):
        with pytest.raises(ConfigurationError) as info:
            loop.check_sink_size(bad, allow_whole, "use -1 or a number of steps >= 1.")
        assert (
            str(info.value) == f"sink_size={bad!r} is not valid; use -1 or a number of steps >= 1."
        )


def test_readers_take():
    assert readers._take(np.int64(5), 10, "x") == 5 and readers._take(None, 10, "x") == 10
    for bad in (True, 5.0):
        with pytest.raises(ConfigurationError, match=r"is not an int; pass an int or None\.$"):
            readers._take(bad, 10, "x")


def test_optimizer_backward_passes_per_step():
    opt = hvdkit.DistributedOptimizer(
        keras.optimizers.SGD(0.1), backward_passes_per_step=np.int64(2)
    )
    assert opt.backward_passes_per_step == 2 and type(opt.backward_passes_per_step) is int
    for bad in (0, True, 2.0):
        with pytest.raises(ConfigurationError) as info:
            hvdkit.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=bad)
        assert str(info.value) == f"backward_passes_per_step={bad!r} must be an int >= 1."


def test_prefetch_to_device_buffer_size(local_runtime):
    ds = tf.data.Dataset.range(6).batch(2)
    staged = hvdkit.sink.prefetch_to_device(ds, buffer_size=np.int64(2))
    assert [b.numpy().tolist() for b in staged] == [[0, 1], [2, 3], [4, 5]]
    for bad in (0, True, 2.0):
        with pytest.raises(ConfigurationError) as info:
            hvdkit.sink.prefetch_to_device(ds, buffer_size=bad)
        assert str(info.value) == (
            f"prefetch_to_device: buffer_size={bad!r} must be a positive int (batches to "
            "stage), or None to let tf.data choose."
        )


def test_checkpointer_counts(local_runtime, tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    ckpt = hvdkit.Checkpointer(tmp_path, model=model, every_steps=np.int64(5), keep=np.int32(2))
    assert (ckpt.every_steps, ckpt.keep) == (5, 2)
    assert type(ckpt.every_steps) is int and type(ckpt.keep) is int
    for bad in (0, True, 5.0):
        with pytest.raises(ConfigurationError) as info:
            hvdkit.Checkpointer(tmp_path, model=model, every_steps=bad)
        assert str(info.value) == (
            f"Checkpointer: every_steps={bad!r} must be a positive number, or None for no "
            "schedule of that kind."
        )
        with pytest.raises(ConfigurationError) as info:
            hvdkit.Checkpointer(tmp_path, model=model, keep=bad)
        assert str(info.value) == (
            f"Checkpointer: keep={bad!r} must be an int >= 1 (checkpoints kept on disk)."
        )
    # every_seconds stays a positive number (floats welcome), not an int
    assert hvdkit.Checkpointer(tmp_path, model=model, every_seconds=0.5).every_seconds == 0.5
    with pytest.raises(ConfigurationError, match=r"every_seconds=True must be a positive number"):
        hvdkit.Checkpointer(tmp_path, model=model, every_seconds=True)
    for bad in (-1, True, 3.0):
        with pytest.raises(ConfigurationError) as info:
            ckpt.save(bad)
        assert str(info.value) == (
            f"Checkpointer.save: step={bad!r} must be an int >= 0 (training steps done)."
        )
    assert ckpt.save(np.int64(3)) is not None and ckpt.step == 3 and type(ckpt.step) is int

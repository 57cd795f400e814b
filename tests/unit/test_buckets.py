"""Gradient buckets: the plan (pure) and the refusals of bad bucket arguments.

Exactness against one process and the overlap in the traced graph are
checked on 2 ranks in tests/multiproc/overlap_worker.py.
"""

from __future__ import annotations

import keras
import pytest
from hypothesis import given
from hypothesis import strategies as st

import hvdkit
from hvdkit import config
from hvdkit._comm import buckets as _buckets

sizes = st.lists(st.integers(min_value=0, max_value=10_000), max_size=30)


@given(sizes, st.integers(min_value=0, max_value=40_000))
def test_by_bytes_covers_every_position_once_last_first(nbytes, limit):
    buckets = _buckets.by_bytes(nbytes, limit)
    flat = [i for b in buckets for i in b]
    assert flat == list(reversed(range(len(nbytes))))  # the backward pass's order
    assert all(buckets)
    for b in buckets[:-1]:  # every bucket but the last is closed at the limit, not before
        assert sum(nbytes[i] for i in b) >= limit
        assert sum(nbytes[i] for i in b[:-1]) < limit or len(b) == 1


def test_by_bytes_examples():
    mb = 1 << 20
    assert _buckets.by_bytes([4 * mb, 4 * mb, mb, 8 * mb], 8 * mb) == [[3], [2, 1, 0]]
    assert _buckets.by_bytes([10, 10, 10], 0) == [[2], [1], [0]]
    assert _buckets.by_bytes([10, 10, 10], 1 << 30) == [[2, 1, 0]]  # a small model: one
    assert _buckets.by_bytes([], 100) == []


@given(st.integers(min_value=0, max_value=40), st.integers(min_value=1, max_value=50))
def test_horovod_int_groups_split_evenly_in_order(count, groups):
    present = list(range(0, 2 * count, 2))  # some positions are None gradients
    out = _buckets.horovod_groups(groups, present)
    assert [i for g in out for i in g] == present
    assert len(out) == min(groups, count)
    if out:
        assert max(map(len, out)) - min(map(len, out)) <= 1
        assert sorted(map(len, out), reverse=True) == list(map(len, out))  # larger first


def test_horovod_list_groups_then_every_other_gradient_alone():
    v = [keras.Variable(float(i), name="kernel") for i in range(5)]  # same names, as Keras
    out = _buckets.horovod_groups([[v[3], v[0]], [v[4]]], [0, 1, 3, 4], v)
    assert out == [[3, 0], [4], [1]]  # v[2]'s gradient is None: not present
    # the tf.Variable inside a Keras variable names the same gradient
    from hvdkit import _compat

    assert _buckets.horovod_groups([[_compat.tf_variable(v[1])]], [0, 1], v) == [[1], [0]]
    with pytest.raises(hvdkit.ConfigurationError, match="needs the variables"):
        _buckets.horovod_groups([[v[0]]], [0])


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"groups": 0}, "groups=0 is not a grouping"),
        ({"groups": "2"}, "groups='2' is not a grouping"),
        ({"groups": True}, "groups=True is not a grouping"),
        ({"groups": [1, 2]}, "is not a grouping"),
        ({"num_groups": -1}, "num_groups=-1 must be an int >= 0"),
        ({"num_groups": 2.0}, "num_groups=2.0 must be an int >= 0"),
        ({"num_groups": 2, "groups": 3}, "disagree; pass only groups"),
        ({"bucket_bytes": -1}, "bucket_bytes=-1 is not a size"),
        ({"bucket_bytes": 1.5}, "bucket_bytes=1.5 is not a size"),
        ({"bucket_bytes": "4MB"}, "bucket_bytes='4MB' is not a size"),
    ],
)
def test_bad_grouping_arguments_are_refused_with_the_fix(kwargs, fragment, local_runtime):
    import tensorflow as tf

    for build in (
        lambda: hvdkit.DistributedOptimizer("sgd", **kwargs),
        lambda: hvdkit.DistributedGradientTape(tf.GradientTape(), **kwargs),
        lambda: hvdkit.reduce_gradients([tf.ones([2])], **kwargs),
    ):
        with pytest.raises(hvdkit.ConfigurationError, match=fragment.replace("(", r"\(")):
            build()


def test_horovod_grouping_arguments_are_accepted(local_runtime):
    opt = hvdkit.DistributedOptimizer("sgd", num_groups=2)
    assert opt.groups == 2 and opt.bucket_bytes is None
    assert hvdkit.DistributedOptimizer("sgd", groups=3, num_groups=3).groups == 3
    again = hvdkit.DistributedOptimizer.from_config(
        hvdkit.DistributedOptimizer("sgd", bucket_bytes=0).get_config()
    )
    assert again.bucket_bytes == 0 and again.groups is None


def test_bucket_bytes_from_the_environment(monkeypatch):
    monkeypatch.delenv(config.BUCKET_BYTES, raising=False)
    assert _buckets.resolve_bucket_bytes(None, "x") == config.DEFAULT_BUCKET_BYTES
    monkeypatch.setenv(config.BUCKET_BYTES, "1024")
    assert _buckets.resolve_bucket_bytes(None, "x") == 1024
    assert _buckets.resolve_bucket_bytes(0, "x") == 0  # the argument wins
    monkeypatch.setenv(config.BUCKET_BYTES, "4M")
    with pytest.raises(hvdkit.ConfigurationError, match="HVDKIT_BUCKET_BYTES='4M'"):
        _buckets.resolve_bucket_bytes(None, "x")
    monkeypatch.setenv(config.BUCKET_BYTES, "-1")
    with pytest.raises(hvdkit.ConfigurationError, match="HVDKIT_BUCKET_BYTES='-1' is not a size"):
        _buckets.resolve_bucket_bytes(None, "x")

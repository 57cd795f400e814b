"""The step check fused into DistributedOptimizer's gradient allreduce, on its own.

What 2 ranks would reduce is built by hand here (the marker of each rank's
step, averaged); tests/multiproc/mixed_precision_worker.py pairs real ranks.
"""

from __future__ import annotations

import pytest
import tensorflow as tf

from hvdkit import Average, Sum
from hvdkit import optimizer as opt_module


@pytest.fixture(autouse=True)
def two_ranks(monkeypatch):
    monkeypatch.setattr(opt_module.runtime, "size", lambda: 2)
    monkeypatch.setattr(opt_module.runtime, "rank", lambda: 0)


def reduced_markers(steps, op):
    """The marker slots after reducing one marker per rank at ``steps``."""
    total = tf.add_n([opt_module._step_marker(tf.constant(s, tf.int64), tf.float32) for s in steps])
    return total / len(steps) if op == Average else total


def check(step, steps, op=Average):
    @tf.function
    def run():
        with tf.control_dependencies([opt_module._check_step_marker(step, steps_, op)]):
            return tf.constant(0)

    steps_ = reduced_markers(steps, op)
    return run


@pytest.mark.parametrize("op", [Average, Sum])
def test_the_same_step_on_every_rank_passes(op):
    assert int(check(tf.constant(70, tf.int64), [70, 70], op)()) == 0


@pytest.mark.parametrize("op", [Average, Sum])
def test_ranks_at_different_steps_raise_naming_the_step(op):
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"rank 0 of 2 is at step.*\b70\b"):
        check(tf.constant(70, tf.int64), [70, 71], op)()


def test_the_check_is_one_assert_op_without_a_cond():
    # An Assert whose data is not all string/int32 is wrapped in a tf.cond by
    # TensorFlow: an If op on every training step (docs/performance.md).
    graph = check(tf.constant(5, tf.int64), [5, 5]).get_concrete_function().graph
    types = [op.type for op in graph.get_operations()]
    assert types.count("Assert") == 1, types
    assert "If" not in types and "StatelessIf" not in types, types


def test_a_step_beyond_int32_is_shown_modulo_2_31():
    step = tf.constant(2**31 + 70, tf.int64)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"is at step.*\b70\b"):
        check(step, [2**31 + 70, 2**31 + 71])()

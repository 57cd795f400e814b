"""The gradient allreduce's in-graph progress markers, read as the heartbeat reads them."""

from __future__ import annotations

import time

import pytest
import tensorflow as tf

from hvdkit._comm import graph_progress as _graph_progress
from hvdkit._comm import progress as _progress


def status():
    return _progress.status()


@pytest.fixture(autouse=True)
def no_wait_left_behind():
    """A test that leaves a marker entered must not make later tests see a wait."""
    yield
    entered, left, _ = _graph_progress._variables()
    left.assign(entered.numpy())
    assert _progress.WAITING not in status()


@tf.function
def enter_only(step):
    return _graph_progress.waiting(step)


@tf.function
def enter_without_step():
    return _graph_progress.waiting(None)


@tf.function
def whole_reduction(x, step):
    token = _graph_progress.waiting(step)
    with tf.control_dependencies([token]):
        reduced = [tf.identity(x) * 2.0]
    with tf.control_dependencies([_graph_progress.done(token, reduced)]):
        return tf.identity(reduced[0])


def test_markers_count_like_python_enter_and_leave():
    base = status()[_progress.COMPLETED]
    # a whole reduction in the graph: one completed, nothing waited in afterwards
    out = whole_reduction(tf.constant([1.5]), tf.constant(7, tf.int64))
    assert out.numpy().tolist() == [3.0]
    s = status()
    assert s[_progress.COMPLETED] == base + 1 and _progress.WAITING not in s
    whole_reduction(tf.constant([1.0]), tf.constant(8, tf.int64))
    assert status()[_progress.COMPLETED] == base + 2

    # entered and not left: the rank is in the gradient allreduce of that step
    enter_only(tf.constant(12, tf.int64))
    first = status()
    assert first[_progress.WAITING] == "gradient allreduce (step 12)"
    assert first[_progress.COMPLETED] == base + 2
    time.sleep(0.3)
    later = status()
    # the same wait keeps its start: the seconds waited grow, by at most the sleep + slack
    assert later[_progress.WAITING] == "gradient allreduce (step 12)"
    assert later[_progress.WAITED_S] >= first[_progress.WAITED_S] + 0.2


def test_a_python_wait_and_a_graph_wait_report_the_older_one():
    token = _progress.enter("allreduce 'x'")
    time.sleep(0.05)
    enter_without_step()  # still unmatched from here on: a graph wait without a step
    s = status()
    assert s[_progress.WAITING] == "allreduce 'x'"  # the older of the two
    _progress.leave(token)
    assert status()[_progress.WAITING] == "gradient allreduce"  # no step: no "(step ...)"


def test_probe_keeps_its_last_reading_when_the_variables_cannot_be_read():
    counters = [tf.Variable(3, dtype=tf.int64), tf.Variable(2, dtype=tf.int64)]
    counters.append(tf.Variable(5, dtype=tf.int64))
    probe = _graph_progress._Probe(counters)
    done, waits = probe()
    assert done == 2 and [w for w, _ in waits] == ["gradient allreduce (step 5)"]

    class Broken:
        def numpy(self):
            raise RuntimeError("TensorFlow is shutting down")

    probe._counters = [Broken(), Broken(), Broken()]
    again, waits_again = probe()
    assert again == 2 and waits_again == waits  # same wait, same start


def test_a_failed_allreduce_no_status_saw_is_not_waited_in_after_forget_waits():
    # hvdkit.elastic: the step's allreduce failed (never left) before a heartbeat read
    # it; Horovod is shut down and the rank rejoins: it must not be "waiting" meanwhile
    enter_only(tf.constant(12, tf.int64))
    _progress.forget_waits()
    assert _progress.WAITING not in status()
    base = status()[_progress.COMPLETED]
    whole_reduction(tf.constant([1.0]), tf.constant(13, tf.int64))  # the next world's step
    after = status()
    assert after[_progress.COMPLETED] == base + 1 and _progress.WAITING not in after
    enter_only(tf.constant(14, tf.int64))  # a new wait is seen again
    assert status()[_progress.WAITING] == "gradient allreduce (step 14)"

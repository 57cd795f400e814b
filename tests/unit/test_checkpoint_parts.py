"""The Checkpointer's parts alone (hvdkit/fault/): the background writer, the preemption stop
and the sampler's resume rule, each without a Checkpointer around it (size-1 runtime).

The Checkpointer's use of them is in tests/unit/test_checkpoint.py, tests/test_checkpoint_mp.py
and tests/test_preemption_mp.py; the save schedule in tests/unit/test_save_schedule.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import keras
import numpy as np
import pytest

import hvdkit
from hvdkit.data import ShardSampler
from hvdkit.errors import HvdkitError
from hvdkit.fault._background_write import BackgroundWriter
from hvdkit.fault._preemption_stop import PreemptionStop
from hvdkit.fault._training_state import resume_sampler
from hvdkit.fault.preemption import Preempted, Regroup


@pytest.fixture(autouse=True)
def size_one(local_runtime):
    yield


# --------------------------------------------------------------------------- background writer
def test_a_failed_write_is_raised_once_at_the_next_wait_naming_the_checkpoint(tmp_path):
    writer = BackgroundWriter(tmp_path)

    def write():
        raise OSError(28, "No space left on device")

    writer.start(7, write)
    with pytest.raises(HvdkitError, match="ckpt-0000000007 in the background failed: OSError") as e:
        writer.wait()
    assert str(tmp_path) in str(e.value) and isinstance(e.value.__cause__, OSError)
    writer.wait()  # reported once: the next wait has nothing to say


def test_a_second_writer_of_the_directory_waits_for_the_first(tmp_path):
    first, go, done = BackgroundWriter(tmp_path), threading.Event(), []
    first.start(3, lambda: (go.wait(), done.append(3)))
    second = BackgroundWriter(Path(tmp_path))
    threading.Timer(0.05, go.set).start()
    second.wait_for_others()
    assert done == [3]  # it returned only after the first write ended
    first.wait()
    BackgroundWriter(None).wait_for_others()  # no directory: nothing to wait for


def test_snapshots_reuse_their_buffers(tmp_path):
    writer = BackgroundWriter(tmp_path)
    v = keras.Variable(np.arange(6, dtype="float32").reshape(2, 3))
    (a,) = writer.snapshot([v])
    v.assign(v + 10.0)
    (b,) = writer.snapshot([v])
    assert b is a  # the same memory, written again
    np.testing.assert_array_equal(b, np.arange(6, dtype="float32").reshape(2, 3) + 10.0)


# --------------------------------------------------------------------------- preemption stop
class FakeWatch:
    """What the ranks agreed (``decide``'s answer, ``regroup``); the steps it saw."""

    def __init__(self, stop: bool, regroup: bool = False):
        self.stop, self.regroup, self.decided, self.stopped_at = stop, regroup, [], None

    def decide(self, step):
        self.decided.append(step)
        return self.stop

    def stopped(self, step):
        self.stopped_at = step


class FakeCheckpointer:
    def __init__(self, fail: bool = False):
        self.step, self.last_path, self.calls, self.fail = 0, None, [], fail

    def save(self, step):
        self.calls.append(("save", step))
        if self.fail:
            raise OSError("disk full")
        self.step, self.last_path = step, Path(f"ckpt-{step:010d}")

    def wait(self):
        self.calls.append(("wait",))


@pytest.mark.parametrize(
    ("saved", "calls"), [(False, [("save", 12), ("wait",)]), (True, [("wait",)])]
)
def test_a_stop_saves_the_step_once_waits_for_the_disk_and_raises_preempted(saved, calls):
    stop, ckpt = PreemptionStop(wanted=True), FakeCheckpointer()
    stop.watch = FakeWatch(stop=True)
    if saved:
        ckpt.last_path = Path("ckpt-0000000012")
    with pytest.raises(Preempted) as e:
        stop.after_step(ckpt, 12, saved)
    assert (e.value.code, e.value.step, e.value.path) == (75, 12, Path("ckpt-0000000012"))
    assert ckpt.calls == calls and stop.watch.stopped_at == 12


def test_rank_0_failing_to_save_raises_its_error_not_preempted():
    stop, ckpt = PreemptionStop(wanted=True), FakeCheckpointer(fail=True)
    stop.watch = FakeWatch(stop=True)
    with pytest.raises(OSError, match="disk full"):
        stop.after_step(ckpt, 5, False)
    assert stop.watch.stopped_at is None


def test_a_worker_waiting_to_join_makes_every_rank_regroup_at_the_step():
    stop, ckpt = PreemptionStop(wanted=False), FakeCheckpointer()
    stop.watch = FakeWatch(stop=False, regroup=True)
    with pytest.raises(Regroup) as e:
        stop.after_step(ckpt, 9, False)
    assert (e.value.step, ckpt.step, ckpt.calls) == (9, 9, [])


def test_without_a_watch_nothing_is_decided():
    stop, ckpt = PreemptionStop(wanted=False), FakeCheckpointer()
    stop.install()  # no SIGTERM handler wanted, no elastic job: no watch
    assert stop.watch is None
    stop.after_step(ckpt, 3, False)
    stop.restart()
    assert ckpt.calls == []


# --------------------------------------------------------------------------- sampler resume
@pytest.mark.parametrize(
    ("read", "shards_then", "epoch"),
    [
        (2, 2, 4),  # 2 of 3 per rank read: the rest of epoch 4
        (3, 2, 5),  # epoch 4 used up: the next
        (1, 3, 4),  # 3 of 6 read on 3 shards: 3 left, 2 for rank 0 of 2
        (2, 3, 5),  # all 6 read on 3 shards (cursor at N): the next
    ],
)
@pytest.mark.filterwarnings("ignore:num_shards=.* differ from this job")  # shards of another world
def test_a_used_up_epoch_resumes_as_the_next(read, shards_then, epoch):
    """N=6 read on ``shards_then`` shards, ``read`` samples each, then resumed on 2."""
    saver = ShardSampler(6, shards_then, 0)
    saver.set_epoch(4)
    saver.advance(read)
    sampler = ShardSampler(6, 2, 0)
    assert resume_sampler(sampler, saver.state_dict()) == epoch == sampler.epoch


# --------------------------------------------------------------------------- Keras callback
def test_a_batch_size_without_a_sampler_is_refused_when_the_callback_is_made(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    ckpt = hvdkit.Checkpointer(tmp_path, model=model)
    with pytest.raises(hvdkit.ConfigurationError, match="batch_size is for advancing the sampler"):
        ckpt.callback(batch_size=4)
    assert ckpt.callback().position is None  # without batch_size: nothing to advance

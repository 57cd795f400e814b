"""hvdkit.Checkpointer in one process, and the global data cursor's index math.

The multi-process behaviour (broadcast on restore, crash and resume, a change
of world size) is in tests/test_checkpoint_mp.py.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import warnings
from collections import Counter
from pathlib import Path

import keras
import numpy as np
import pytest

import hvdkit
from hvdkit.data import ShardPositionCallback, ShardSampler, shard_indices
from hvdkit.fault import checkpoint as ckmod


@pytest.fixture(autouse=True)
def size_one(local_runtime):
    """A size-1 runtime (conftest's local_runtime); forget any write hook a test set."""
    yield
    ckmod._write_hook = None


def make_model(width=8, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(width, activation="tanh"),
            keras.layers.Dropout(0.3),
            keras.layers.Dense(2),
        ]
    )
    model.compile(
        keras.optimizers.Adam(0.01),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


DATA_X = np.random.default_rng(1).normal(size=(40, 4)).astype("float32")
DATA_Y = (DATA_X[:, 0] > 0).astype("int32")


def weights(model):
    return [v.numpy().copy() for v in model.variables]


def opt_weights(model):
    return [v.numpy().copy() for v in model.optimizer.variables]


def folders(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


# --------------------------------------------------------------------------- round trip
def test_save_restore_round_trip_of_the_whole_state(tmp_path):
    model = make_model()
    sampler = ShardSampler(40, 1, 0, shuffle=True, seed=3)
    extra = {"best": 0.5, "tags": ["a"]}
    ckpt = hvdkit.Checkpointer(tmp_path, model=model, sampler=sampler, extra=extra)
    assert ckpt.restore() == 0 and folders(tmp_path) == []
    sampler.set_epoch(2)
    model.fit(
        sampler.dataset((DATA_X, DATA_Y)).batch(4).take(3),
        verbose=0,
        callbacks=[ShardPositionCallback(sampler, 4)],
    )
    random.seed(7)
    np.random.seed(8)
    extra["best"] = 0.25
    path = ckpt.save(3)
    ckpt.wait()  # written in the background
    assert path == tmp_path / "ckpt-0000000003" and folders(tmp_path) == ["ckpt-0000000003"]
    want_w, want_o = weights(model), opt_weights(model)
    want_draws = (random.random(), np.random.rand())
    assert int(model.optimizer.iterations.numpy()) == 3

    other = make_model(seed=5)  # different initial weights, unbuilt optimizer
    s2 = ShardSampler(40, 1, 0, shuffle=True, seed=3)
    e2 = {}
    c2 = hvdkit.Checkpointer(tmp_path, model=other, sampler=s2, extra=e2)
    random.seed(99)
    assert c2.restore() == 3
    for got, want in zip(weights(other), want_w, strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(opt_weights(other), want_o, strict=True):
        np.testing.assert_array_equal(got, want)
    assert (s2.epoch, s2.position, s2.cursor) == (2, 12, 12)
    assert e2 == {"best": 0.25, "tags": ["a"]} and c2.epoch == 2 and c2.step == 3
    assert (random.random(), np.random.rand()) == want_draws

    manifest = json.loads((path / "manifest.json").read_text())
    groups = Counter(e["group"] for e in manifest["variables"])
    assert groups == {"model": len(model.variables), "optimizer": len(model.optimizer.variables)}
    assert manifest["files"]["arrays.bin"]["bytes"] == (path / "arrays.bin").stat().st_size


def test_keep_retains_the_newest_and_refuses_to_save_behind_newer(tmp_path):
    model = make_model()
    ckpt = hvdkit.Checkpointer(tmp_path, model=model, keep=2)
    for step in (1, 2, 5, 9):
        ckpt.save(step)
    ckpt.wait()
    assert folders(tmp_path) == ["ckpt-0000000005", "ckpt-0000000009"]
    fresh = hvdkit.Checkpointer(tmp_path, model=make_model(), keep=2)
    with pytest.raises(hvdkit.ConfigurationError, match=r"newer checkpoints \['ckpt-0000000009'\]"):
        fresh.save(7)
    assert fresh.restore() == 9
    fresh.save(9)  # saving the same step again replaces it
    fresh.wait()
    assert folders(tmp_path) == ["ckpt-0000000005", "ckpt-0000000009"]


# --------------------------------------------------------------------------- torn / corrupt
def test_write_killed_midway_leaves_only_a_torn_temp_folder_that_restore_skips(tmp_path):
    model = make_model()
    ckpt = hvdkit.Checkpointer(tmp_path, model=model)
    ckpt.save(4)
    good = weights(model)
    model.layers[0].kernel.assign(np.zeros((4, 8), "float32"))

    class Killed(Exception):
        pass

    def hook(stage, step):
        assert (stage, step) == ("arrays", 8)
        raise Killed

    ckmod._write_hook = hook
    ckpt.save(8)  # the background write fails; wait() says so
    with pytest.raises(
        hvdkit.HvdkitError, match="ckpt-0000000008 in the background failed: Killed"
    ) as e:
        ckpt.wait()
    assert isinstance(e.value.__cause__, Killed)
    ckpt.wait()  # said once
    ckmod._write_hook = None
    names = folders(tmp_path)
    torn = names[0]  # "." sorts first
    assert names[1:] == ["ckpt-0000000004"] and torn.startswith(".tmp-ckpt-0000000008-")
    assert not (tmp_path / torn / "manifest.json").exists()

    other = make_model(seed=3)
    c2 = hvdkit.Checkpointer(tmp_path, model=other)
    with pytest.warns(ckmod.CheckpointWarning, match=rf"torn checkpoint .*{torn}"):
        assert c2.restore() == 4
    for got, want in zip(weights(other), good, strict=True):
        np.testing.assert_array_equal(got, want)
    c2.save(6)  # the next save removes the torn folder
    c2.wait()
    assert folders(tmp_path) == ["ckpt-0000000004", "ckpt-0000000006"]


def test_corrupt_payload_is_skipped_and_moved_aside(tmp_path):
    model = make_model()
    ckpt = hvdkit.Checkpointer(tmp_path, model=model)
    ckpt.save(1)
    first = weights(model)
    model.layers[0].kernel.assign(np.ones((4, 8), "float32"))
    ckpt.save(2)
    ckpt.wait()
    arrays = tmp_path / "ckpt-0000000002" / "arrays.bin"
    raw = bytearray(arrays.read_bytes())
    raw[5] ^= 0xFF
    arrays.write_bytes(bytes(raw))
    (tmp_path / "ckpt-0000000003").mkdir()  # a folder without manifest: torn
    other = make_model(seed=4)
    c2 = hvdkit.Checkpointer(tmp_path, model=other)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert c2.restore() == 1
    messages = [str(w.message) for w in caught if w.category is ckmod.CheckpointWarning]
    assert any("ckpt-0000000003: it has no manifest.json" in m for m in messages), messages
    assert any(
        "corrupt checkpoint" in m and "ckpt-0000000002" in m and "SHA-256" in m for m in messages
    ), messages
    for got, want in zip(weights(other), first, strict=True):
        np.testing.assert_array_equal(got, want)
    assert [n for n in folders(tmp_path) if n.startswith("corrupt-ckpt-0000000002-")]


def test_corrupt_manifest_is_an_error_naming_the_file(tmp_path):
    model = make_model()
    ckpt = hvdkit.Checkpointer(tmp_path, model=model)
    ckpt.save(1)
    ckpt.wait()
    manifest = tmp_path / "ckpt-0000000001" / "manifest.json"
    manifest.write_text(manifest.read_text()[:-20])
    with pytest.raises(hvdkit.DataFormatError, match=rf"{manifest}.*unreadable.*Move or delete"):
        hvdkit.Checkpointer(tmp_path, model=make_model()).restore()
    body = json.loads(json.dumps({"format": "hvdkit-checkpoint", "version": 1, "step": 1}))
    manifest.write_text(json.dumps(body))
    with pytest.raises(hvdkit.DataFormatError, match="fails its own checksum"):
        hvdkit.Checkpointer(tmp_path, model=make_model()).restore()


# --------------------------------------------------------------------------- bad input
def test_bad_input_is_refused_with_the_value_and_the_fix(tmp_path):
    model = make_model()
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for directory in (blocker, blocker / "sub"):
        with pytest.raises(hvdkit.ConfigurationError, match=rf"{directory}.* is not writable"):
            hvdkit.Checkpointer(directory, model=model).restore()
    hvdkit.Checkpointer(tmp_path / "c", model=model).save(5)
    with pytest.raises(
        hvdkit.ConfigurationError,
        match=r"ckpt-0000000005/manifest.json was written for another model: "
        r"variable 0 .* float32\[4, 8\] there, .* float32\[4, 16\] here",
    ):
        hvdkit.Checkpointer(tmp_path / "c", model=make_model(width=16)).restore()
    cases = [
        (dict(every_steps=0), "every_steps=0 must be a positive number"),
        (dict(every_seconds=-1.0), "every_seconds=-1.0"),
        (dict(keep=0), "keep=0 must be an int >= 1"),
        (dict(extra={"f": object()}), "is not a JSON-serialisable dict"),
        (dict(sampler=[1, 2]), "is not an hvdkit.data.ShardSampler"),
    ]
    for kwargs, fragment in cases:
        with pytest.raises(hvdkit.ConfigurationError, match=fragment):
            hvdkit.Checkpointer(tmp_path, model=model, **kwargs)
    with pytest.raises(hvdkit.ConfigurationError, match="is not a keras.Model"):
        hvdkit.Checkpointer(tmp_path, model="m")
    with pytest.raises(hvdkit.ConfigurationError, match="step=-1 must be an int"):
        hvdkit.Checkpointer(tmp_path, model=model).save(-1)
    unbuilt = keras.Sequential([keras.layers.Dense(2)])
    with pytest.raises(hvdkit.ConfigurationError, match="has no variables yet"):
        hvdkit.Checkpointer(tmp_path, model=unbuilt).restore()


# --------------------------------------------------------------------------- schedule
def test_every_steps_fires_when_a_multiple_is_reached_or_crossed(tmp_path):
    ckpt = hvdkit.Checkpointer(tmp_path, model=make_model(), every_steps=4)
    assert [s for s in range(1, 14) if ckpt.due(s)] == [4, 8, 12]
    ckpt2 = hvdkit.Checkpointer(tmp_path, model=make_model(), every_steps=4)
    assert [s for s in (3, 6, 9, 12, 15) if ckpt2.due(s)] == [6, 9, 12]  # sinks of 3 steps


def test_every_seconds_follows_rank_zero_clock(tmp_path, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(ckmod.time, "monotonic", lambda: now[0])
    ckpt = hvdkit.Checkpointer(tmp_path, model=make_model(), every_seconds=10)
    fired = []
    for step in range(1, 60):
        now[0] += 1.0  # one step per second
        if ckpt.maybe_save(step):
            fired.append(step)
    # decided at steps spaced ~1 s apart (10 per interval), so within a step of 10 s
    assert fired == [10, 20, 30, 40, 50], fired


# --------------------------------------------------------------------------- callback
def test_callback_counts_steps_and_needs_the_sampler_to_advance(tmp_path):
    model = make_model()
    sampler = ShardSampler(40, 1, 0, shuffle=True, seed=3)
    ckpt = hvdkit.Checkpointer(tmp_path, model=model, sampler=sampler, every_steps=4)
    ckpt.restore()
    ds = sampler.dataset((DATA_X, DATA_Y)).batch(4)
    with pytest.raises(hvdkit.ConfigurationError, match="ShardPositionCallback.*before"):
        model.fit(ds, verbose=0, callbacks=[ckpt.callback()])
    model = make_model()
    sampler = ShardSampler(40, 1, 0, shuffle=True, seed=3)
    ckpt = hvdkit.Checkpointer(tmp_path / "b", model=model, sampler=sampler, every_steps=4)
    ckpt.restore()
    model.fit(sampler.dataset((DATA_X, DATA_Y)).batch(4), verbose=0, callbacks=[ckpt.callback(4)])
    assert ckpt.step == 10 and sampler.position == 40
    ckpt.wait()
    assert folders(tmp_path / "b") == ["ckpt-0000000004", "ckpt-0000000008"]
    state = json.loads((tmp_path / "b" / "ckpt-0000000008" / "state.json").read_text())
    assert (state["sampler"]["position"], state["step"]) == (32, 8)
    # saved exactly at the end of the epoch: restore continues with the next epoch
    ckpt.save(10)
    ckpt.wait()
    s2 = ShardSampler(40, 1, 0, shuffle=True, seed=3)
    c2 = hvdkit.Checkpointer(tmp_path / "b", model=make_model(), sampler=s2)
    assert c2.restore() == 10 and (s2.epoch, s2.position, c2.epoch) == (1, 0, 1)


# --------------------------------------------------------------------------- cursor math
def expected_rest(n, s_new, mode, cursor, order):
    """The peer formula, written out: what the S' ranks read after ``cursor``."""
    rest = list(order[cursor:])
    r = len(rest)
    if mode == "uneven":
        return [rest[k::s_new] for k in range(s_new)]
    if mode == "drop":
        kept = rest[: (r // s_new) * s_new]
        return [kept[k::s_new] for k in range(s_new)]
    per = -(-r // s_new)
    padded = rest + [order[j % n] for j in range(per * s_new - r)]  # wraps to the epoch's start
    return [padded[k::s_new] for k in range(s_new)]


@pytest.mark.filterwarnings("ignore::hvdkit.data.ShardingWarning")  # other job sizes, on purpose
@pytest.mark.parametrize("mode", ["pad", "drop", "uneven"])
@pytest.mark.parametrize("n", [1, 7, 10, 24])
@pytest.mark.parametrize("s_old, s_new", [(2, 1), (3, 2), (2, 3), (1, 4), (4, 4), (3, 5)])
def test_resume_on_another_number_of_ranks_reads_the_rest_once(n, s_old, s_new, mode):
    if mode == "drop" and (n < s_old or n < s_new):
        return
    order = np.random.default_rng([11, 2]).permutation(n)
    old = [ShardSampler(n, s_old, r, shuffle=True, seed=11, mode=mode) for r in range(s_old)]
    for consumed in range(len(old[0]) + 1):
        for s in old:
            s.set_epoch(2)
            s._position = 0
            s.advance(min(consumed, len(s)))
        state = json.loads(json.dumps(old[0].state_dict()))
        cursor = min(consumed * s_old, n)
        assert state["cursor"] == cursor
        new = [ShardSampler(n, s_new, r, shuffle=True, seed=11, mode=mode) for r in range(s_new)]
        for s in new:
            s.load_state_dict(state)
            s.set_epoch(2)  # the loop's set_epoch keeps the resumed position
        got = [s.indices().tolist() for s in new]
        if s_new == s_old:  # same layout: continues each shard where it stopped
            want = [
                shard_indices(n, s_old, r, shuffle=True, seed=11, epoch=2, mode=mode)[
                    min(consumed, len(old[r])) :
                ].tolist()
                for r in range(s_old)
            ]
        else:
            want = [[int(i) for i in rank] for rank in expected_rest(n, s_new, mode, cursor, order)]
        assert got == want, (consumed, got, want)
        read = [int(i) for r, s in enumerate(old) for i in s._epoch_indices()[: s.position]]
        total = Counter(read) + Counter(i for rank in got for i in rank)
        if mode == "uneven":  # every sample of the epoch exactly once
            assert total == Counter(range(n))
        else:
            lengths = {len(g) for g in got}
            assert len(lengths) <= 1  # equal shards: no rank waits in an allreduce
            if mode == "drop":
                assert max(total.values()) == 1


@pytest.mark.filterwarnings("ignore::hvdkit.data.ShardingWarning")  # other job sizes, on purpose
def test_resume_on_two_ranks_after_three_by_hand():
    # 10 samples, no shuffle; 3 ranks read 2 each: positions 0..5 are done
    old = ShardSampler(10, 3, 0)
    old.advance(2)
    state = old.state_dict()
    assert (state["cursor"], state["start"], state["position"]) == (6, 0, 2)
    new = [ShardSampler(10, 2, r) for r in range(2)]
    for s in new:
        s.load_state_dict(state)
    assert [s.indices().tolist() for s in new] == [[6, 8], [7, 9]]
    assert [(s.start, s.position, len(s)) for s in new] == [(6, 0, 2), (6, 0, 2)]
    # ... and a resize again after rank 0 of 2 read one more: cursor 6 + 2 = 8
    new[0].advance(1)
    one = ShardSampler(10, 1, 0)
    one.load_state_dict(new[0].state_dict())
    assert one.indices().tolist() == [8, 9]
    # pad mode: 7 left over 2 ranks -> one repeat, list position 0 (sample 0)
    p = ShardSampler(10, 3, 0)
    p.advance(1)
    two = [ShardSampler(10, 2, r) for r in range(2)]
    for s in two:
        s.load_state_dict(p.state_dict())
    assert [s.indices().tolist() for s in two] == [[3, 5, 7, 9], [4, 6, 8, 0]]


@pytest.mark.filterwarnings("ignore::hvdkit.data.ShardingWarning")  # other job sizes, on purpose
def test_old_states_and_inconsistent_cursors():
    s = ShardSampler(10, 2, 0)
    v1 = {
        "version": 1,
        "epoch": 0,
        "position": 2,
        "num_samples": 10,
        "num_shards": 2,
        "shuffle": False,
        "seed": 0,
        "mode": "pad",
    }
    s.load_state_dict(v1)
    assert (s.position, s.cursor, s.indices().tolist()) == (2, 4, [4, 6, 8])
    with pytest.raises(hvdkit.ShardingError, match="num_shards: saved 3, here 2"):
        s.load_state_dict({**v1, "num_shards": 3})
    v2 = {**v1, "version": 2, "start": 0, "cursor": 5}
    with pytest.raises(hvdkit.ShardingError, match="inconsistent: cursor=5"):
        s.load_state_dict(v2)
    with pytest.raises(hvdkit.ShardingError, match=r"missing \['cursor', 'start'\]"):
        s.load_state_dict({**v1, "version": 2})


# --------------------------------------------------------------------------- background writes
def test_background_save_writes_the_state_as_it_was_when_save_returned(tmp_path):
    model = make_model()
    ckpt = hvdkit.Checkpointer(tmp_path, model=model)
    assert ckpt.background is True
    before = weights(model)
    release, held = threading.Event(), threading.Event()

    def hook(stage, step):  # the writer stops after its first array until we changed the model
        held.set()
        assert release.wait(timeout=600)

    ckmod._write_hook = hook
    try:
        ckpt.save(1)
        assert held.wait(timeout=600)
        assert folders(tmp_path)[0].startswith(".tmp-ckpt-0000000001-")  # not complete yet
        for v in model.variables:  # training goes on meanwhile
            v.assign(np.full(v.shape, 7.0, v.dtype))
        release.set()
        ckpt.wait()
    finally:
        ckmod._write_hook = None
    assert folders(tmp_path) == ["ckpt-0000000001"]
    other = make_model(seed=5)
    assert hvdkit.Checkpointer(tmp_path, model=other).restore() == 1
    for got, want in zip(weights(other), before, strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_next_save_waits_for_the_unfinished_write(tmp_path):
    ckpt = hvdkit.Checkpointer(tmp_path, model=make_model())
    release, order = threading.Event(), []

    def hook(stage, step):
        order.append(f"writing {step}")
        if step == 1:
            assert release.wait(timeout=600)

    ckmod._write_hook = hook
    try:
        ckpt.save(1)
        second = threading.Thread(target=lambda: (ckpt.save(2), order.append("save 2 returned")))
        second.start()
        second.join(timeout=0.5)
        assert second.is_alive() and order == ["writing 1"]  # held behind the first write
        release.set()
        second.join(timeout=600)
        ckpt.wait()
    finally:
        ckmod._write_hook = None
    assert order[0] == "writing 1" and order.index("save 2 returned") > 0
    assert folders(tmp_path) == ["ckpt-0000000001", "ckpt-0000000002"]


def test_synchronous_save_and_bad_background_value(tmp_path):
    ckpt = hvdkit.Checkpointer(tmp_path, model=make_model(), background=False)
    ckpt.save(3)
    assert folders(tmp_path) == ["ckpt-0000000003"]  # on disk when save returned
    with pytest.raises(hvdkit.ConfigurationError, match=r"background='yes' must be True"):
        hvdkit.Checkpointer(tmp_path, model=make_model(), background="yes")


_WRITER = """
import os, signal, sys
import numpy as np
import hvdkit
from hvdkit.fault import checkpoint as ckmod
hvdkit.init(backend="local")
import keras
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                          keras.layers.Dropout(0.3), keras.layers.Dense(2)])  # as make_model
model.compile(keras.optimizers.Adam(0.01),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.optimizer.build(model.trainable_variables)
ckpt = hvdkit.Checkpointer(sys.argv[1], model=model)
ckpt.save(4)
ckpt.wait()
np.save(os.path.join(sys.argv[1], "..", "at4.npy"), model.layers[0].kernel.numpy())
model.layers[0].kernel.assign(np.zeros((4, 8), "float32"))
if sys.argv[2] == "kill":  # SIGKILL from the writer thread, in the middle of the write
    ckmod._write_hook = lambda stage, step: os.kill(os.getpid(), signal.SIGKILL)
ckpt.save(8)
# The script ends here: the interpreter waits for the write ("exit").
"""


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_a_process_that_ends_keeps_its_last_write_and_a_killed_write_is_never_taken(tmp_path, how):
    folder = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, "-c", _WRITER, str(folder), how],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert proc.returncode == (0 if how == "exit" else -9), proc.stderr[-2000:]
    names = folders(folder)
    other = make_model(seed=3)  # the script's model
    c2 = hvdkit.Checkpointer(folder, model=other)
    if how == "exit":
        assert names == ["ckpt-0000000004", "ckpt-0000000008"]
        assert c2.restore() == 8
        np.testing.assert_array_equal(other.layers[0].kernel.numpy(), np.zeros((4, 8)))
    else:
        assert names[1:] == ["ckpt-0000000004"] and names[0].startswith(".tmp-ckpt-0000000008-")
        with pytest.warns(ckmod.CheckpointWarning, match="torn checkpoint"):
            assert c2.restore() == 4
        want = np.load(tmp_path / "at4.npy")
        np.testing.assert_array_equal(other.layers[0].kernel.numpy(), want)

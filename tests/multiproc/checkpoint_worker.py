"""hvdkit.Checkpointer on 2 ranks: broadcast on restore, agreed schedule, errors on every rank."""

import json
import os
import sys
import warnings
from pathlib import Path

import keras
import numpy as np

import hvdkit
from hvdkit.fault import checkpoint as ckmod

from _harness import Checks

hvdkit.init()
r, n = hvdkit.rank(), hvdkit.size()
c = Checks(r, sys.argv[1])
ROOT = Path(sys.argv[1]) / "ckpts"


def make_model(width=8, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(width), keras.layers.Dense(2)])
    model.compile(keras.optimizers.Adam(0.01), "mse")
    return model


def flat(model):
    return np.concatenate([np.asarray(v.numpy(), np.float64).ravel() for v in model.variables])


def same_on_all_ranks(values: np.ndarray) -> np.ndarray:
    both = hvdkit.allgather(values[None])
    assert np.array_equal(both[0], both[1]), np.abs(both[0] - both[1]).max()
    return both[0]


with c.check("fresh_restore_broadcasts_rank0_initial_weights"):
    model = make_model(seed=10 + r)  # ranks start different
    mine = flat(model)
    first = hvdkit.allgather(mine[None])
    assert not np.array_equal(first[0], first[1])
    ckpt = hvdkit.Checkpointer(ROOT / "a", model=model)
    assert ckpt.restore() == 0
    np.testing.assert_array_equal(same_on_all_ranks(flat(model)), first[0])
    assert (ROOT / "a").is_dir()

with c.check("restore_loads_on_rank0_and_broadcasts_everything"):
    model = make_model(seed=1)
    sampler = hvdkit.data.ShardSampler(40, shuffle=True, seed=2)
    extra = {"lr_scale": 2}
    ckpt = hvdkit.Checkpointer(ROOT / "b", model=model, sampler=sampler, extra=extra)
    ckpt.restore()
    model.optimizer.build(model.trainable_variables)
    model.optimizer.iterations.assign(7)
    sampler.set_epoch(1)
    sampler.advance(6)  # both ranks: 12 samples of the epoch read
    path = ckpt.save(7)
    assert (path is not None) == (r == 0)
    hvdkit.barrier()
    saved = flat(model)
    model2 = make_model(seed=20 + r)  # different on each rank
    s2 = hvdkit.data.ShardSampler(40, shuffle=True, seed=2)
    e2 = {}
    c2 = hvdkit.Checkpointer(ROOT / "b", model=model2, sampler=s2, extra=e2)
    assert c2.restore() == 7
    np.testing.assert_array_equal(same_on_all_ranks(flat(model2)), saved)
    assert int(model2.optimizer.iterations.numpy()) == 7
    assert (s2.epoch, s2.position, s2.cursor, e2) == (1, 6, 12, {"lr_scale": 2})
    c.record("restored_path", str(c2.last_path))

with c.check("every_seconds_decided_by_rank0_clock"):
    clock, real_monotonic = [0.0], ckmod.time.monotonic
    ckmod.time.monotonic = lambda: clock[0]
    try:
        ckpt = hvdkit.Checkpointer(ROOT / "c", model=make_model(), every_seconds=5)
        fired = []
        for step in range(1, 40):
            clock[0] += 1.0 if r == 0 else 100.0  # rank 1's clock races ahead: no matter
            if ckpt.maybe_save(step):
                fired.append(step)
    finally:
        ckmod.time.monotonic = real_monotonic
    gathered = hvdkit.allgather_object(fired)
    assert gathered[0] == gathered[1], gathered
    assert gathered[0] == [5, 10, 15, 20, 25, 30, 35], gathered  # rank 0: 1 s per step
    c.record("every_seconds_fired", fired)

with c.check("bad_input_raises_the_same_error_on_every_rank"):
    blocker = ROOT / "a-file"
    if r == 0:
        blocker.write_text("x")
    hvdkit.barrier()
    try:
        hvdkit.Checkpointer(blocker / "sub", model=make_model()).restore()
    except hvdkit.ConfigurationError as e:
        assert "a-file/sub' is not writable" in str(e), str(e)
    else:
        raise AssertionError("no error for a directory under a file")
    try:
        hvdkit.Checkpointer(ROOT / "b", model=make_model(width=5)).restore()
    except hvdkit.ConfigurationError as e:
        assert "ckpt-0000000007/manifest.json was written for another model" in str(e), str(e)
    else:
        raise AssertionError("no error for a checkpoint of another model")
    if r == 0:
        manifest = ROOT / "b" / "ckpt-0000000007" / "manifest.json"
        manifest.write_text("{not json")
    hvdkit.barrier()
    try:
        hvdkit.Checkpointer(ROOT / "b", model=make_model(seed=1)).restore()
    except hvdkit.DataFormatError as e:
        assert "manifest.json is unreadable" in str(e) and "Move or delete" in str(e), str(e)
    else:
        raise AssertionError("no error for a corrupt manifest")
    # rank 1 built another model than rank 0's: both raise, naming the variable; none waits
    try:
        hvdkit.Checkpointer(ROOT / "e", model=make_model(width=8 if r == 0 else 5)).restore()
    except hvdkit.ConfigurationError as e:
        said = str(e)
        assert "cannot go from rank 0 to rank 1: its variable 0 (" in said, said
        assert "is float32 [4, 5] against rank 0's float32 [4, 8]" in said, said
    else:
        raise AssertionError("no error for ranks that built different models")
    hvdkit.barrier()  # both are here: neither was left in a broadcast

with c.check("torn_checkpoint_skipped_and_previous_loaded"):
    model = make_model(seed=3)
    ckpt = hvdkit.Checkpointer(ROOT / "d", model=model)
    ckpt.restore()
    ckpt.save(2)
    want = flat(model)
    if r == 0:
        torn = ROOT / "d" / ".tmp-ckpt-0000000004-999"
        torn.mkdir()
        (torn / "arrays.bin").write_bytes(b"\0" * 10)
    hvdkit.barrier()
    model2 = make_model(seed=30 + r)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert hvdkit.Checkpointer(ROOT / "d", model=model2).restore() == 2
    texts = [str(w.message) for w in caught if w.category is ckmod.CheckpointWarning]
    if r == 0:
        assert any(".tmp-ckpt-0000000004-999" in t for t in texts), texts
    np.testing.assert_array_equal(same_on_all_ranks(flat(model2)), want)
    c.record("torn_warnings", texts)

with c.check("manifest_lists_every_variable_once"):
    if r == 0:
        m = json.loads((ROOT / "d" / "ckpt-0000000002" / "manifest.json").read_text())
        names = [e["name"] for e in m["variables"]]
        assert len(names) == len(model.variables) + len(model.optimizer.variables), names
        assert m["step"] == 2 and os.path.getsize(
            ROOT / "d" / "ckpt-0000000002" / "arrays.bin"
        ) == sum(e["nbytes"] for e in m["variables"])

c.finish()

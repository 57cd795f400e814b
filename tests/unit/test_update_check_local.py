"""The update check and the rank's fingerprint in one process (hvdkit/keras/_update_check.py):
a job of one rank is never warned about, and the fingerprint file holds the numbers of the
weights its optimizers trained (issue 51). The 2-rank behaviour is in test_user_scripts_mp.py."""

from __future__ import annotations

import json
import logging

import keras
import numpy as np
import pytest

from hvdkit._comm import updates
from hvdkit.keras import _update_check


@pytest.fixture
def said():
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("hvdkit").addHandler(handler)
    yield lines
    logging.getLogger("hvdkit").removeHandler(handler)


def test_one_rank_is_not_warned_and_its_fingerprint_holds_the_weights(
    local_runtime, said, tmp_path
):
    assert keras.optimizers.Optimizer.apply.__wrapped__ is _update_check._keras_apply
    updates.reset()
    keras.utils.set_random_seed(3)
    # a named layer: Keras numbers unnamed ones per process (dense_4 after other tests)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="dense")], name="one")
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.arange(24, dtype="float32").reshape(8, 3) / 10
    model.fit(x, x[:, :2], epochs=1, batch_size=4, verbose=0)
    assert said == []  # size 1: a plain optimizer is right
    assert [id(v) for v in updates.trained()] == [id(v) for v in model.trainable_variables]
    _update_check.write_fingerprint(str(tmp_path))
    rows = json.loads((tmp_path / "rank.0.json").read_text())["variables"]
    assert [r[0] for r in rows] == ["one/dense/kernel", "one/dense/bias"]
    for (_, total, weighted, scale), v in zip(rows, model.trainable_variables, strict=True):
        w = v.numpy().astype("float64").ravel()
        positions = np.arange(w.size) % 97 + 1
        np.testing.assert_allclose(
            [total, weighted, scale], [w.sum(), (w * positions).sum(), np.abs(w).sum()], rtol=1e-12
        )
    updates.reset()

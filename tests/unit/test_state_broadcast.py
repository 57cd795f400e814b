"""The state's broadcast of a restore and a roll back, packed (hvdkit/fault/_state_broadcast.py):
the one-process parts. Two and more ranks: tests/test_checkpoint_mp.py and the elastic
tests (a newcomer's restore meets the survivors' roll back), benchmarks/state_broadcast.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from hvdkit import collectives, runtime
from hvdkit.errors import ConfigurationError
from hvdkit.fault import _state_broadcast as sb


def test_signature_is_dtype_and_shape_in_order():
    import keras

    values = [tf.Variable(tf.zeros([2, 3])), tf.Variable(np.int64(4)), tf.zeros([0], tf.float16)]
    values.append(keras.Variable(np.zeros((1, 5), "float64")))
    assert sb.signature(values) == [
        ["float32", [2, 3]],
        ["int64", []],
        ["float16", [0]],
        ["float64", [1, 5]],
    ]


def test_chunks_close_at_chunk_bytes_and_keep_a_bigger_variable_alone(monkeypatch):
    monkeypatch.setattr(sb, "CHUNK_BYTES", 40)
    sizes = [4, 4, 2, 20, 1]  # float32 elements: 16, 16, 8, 80, 4 bytes
    group = [(i, [n]) for i, n in enumerate(sizes)]
    chunks = sb._chunks(group, 4)
    assert [[i for i, _ in c] for c in chunks] == [[0, 1, 2], [3], [4]]


@pytest.mark.parametrize(
    ("other", "says"),
    [
        ([["float32", [2, 3]]], "1 variables against rank 0's 2"),
        (
            [["float32", [3, 2]], ["int64", []]],
            "variable 0 (dense_1/kernel) is float32 [3, 2] against rank 0's float32 [2, 3] "
            "(dense/kernel)",
        ),
        (
            [["float32", [2, 3]], ["int32", []]],
            "variable 1 (sgd/iteration) is int32 [] against rank 0's int64 [] (iteration)",
        ),
    ],
)
def test_ranks_whose_variables_differ_all_raise_naming_the_first_difference(other, says):
    root = [["float32", [2, 3]], ["int64", []]]
    names = {"names": ["dense/kernel", "iteration"]}
    gathered = [{"signature": root, **names}, {"signature": root, **names}]
    gathered.append({"signature": other, "names": ["dense_1/kernel", "sgd/iteration"]})
    with pytest.raises(ConfigurationError, match="to rank 2") as info:
        sb._check_same(gathered)
    assert says in str(info.value)
    sb._check_same(gathered[:2])  # the same lists: nothing to say


def test_a_header_rank_0_marks_failed_is_returned_without_the_check(monkeypatch):
    """Rank 0 could not load: every rank raises its error, not a mismatch."""
    failed = {"ok": False, "type": "HvdkitError", "message": "on rank 0: torn"}
    gathered = [
        {"header": failed, "signature": [["float32", [1]]]},
        {"header": None, "signature": []},
    ]
    monkeypatch.setattr(collectives, "allgather_object", lambda obj: gathered)
    monkeypatch.setattr(runtime, "rank", lambda: 1)
    assert sb.header({"ok": True}, [tf.zeros([1])]) == failed


def test_variables_take_the_roots_values_packed_by_dtype(monkeypatch):
    """One broadcast per dtype and chunk, names that every rank gives alike; a receiving
    rank assigns each piece in its shape, bit for bit."""
    root_values = [
        np.array([[1.5, -0.0], [np.nan, 3.0]], "float32"),
        np.array(9, "int64"),
        np.arange(5, dtype="float32"),
    ]
    mine = [tf.Variable(np.zeros_like(v)) for v in root_values]
    sent = []

    def broadcast(flat, root, name=None):
        sent.append((name, flat.dtype.name, int(tf.size(flat))))
        same = [v for v in root_values if v.dtype == flat.dtype.as_numpy_dtype]
        return tf.constant(np.concatenate([v.reshape(-1) for v in same]))

    monkeypatch.setattr(collectives, "broadcast", broadcast)
    monkeypatch.setattr(runtime, "rank", lambda: 1)
    sb.variables(mine)
    assert sent == [("hvdkit.state.float32.0", "float32", 9), ("hvdkit.state.int64.0", "int64", 1)]
    for v, want in zip(mine, root_values, strict=True):
        assert v.numpy().tobytes() == want.tobytes()


def test_fault_tolerance_md_prints_the_recorded_benchmark():
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "benchmarks"))
    import state_broadcast

    record = json.loads((root / "benchmarks/records/state_broadcast_2026-11-29.json").read_text())
    assert all(r["equal_to_rank_0"] for run in record["runs"] for r in run["rows"])
    page = (root / "docs/fault-tolerance.md").read_text()
    assert state_broadcast.markdown_table(record["runs"]) in page

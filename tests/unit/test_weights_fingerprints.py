"""The end-of-job weight comparison's pure parts (hvdkit/_comm/fingerprints.py), the record of
reduced and local variables (hvdkit/_comm/updates.py) and the two settings (issue 51)."""

from __future__ import annotations

import gc

import pytest

from hvdkit import config
from hvdkit._comm import fingerprints, updates
from hvdkit.errors import ConfigurationError, LaunchError
from hvdkit.launch.cli import build_parser


def prints(*kernels: float) -> dict[int, dict]:
    """Rank r's file with ``dense/kernel`` summing to ``kernels[r]`` (scale 3) and a bias."""
    return {
        r: {"variables": [["dense/kernel", k, 2 * k, 3.0], ["dense/bias", 0.5, 0.5, 0.5]]}
        for r, k in enumerate(kernels)
    }


def test_groups_of_equal_ranks_within_the_tolerance():
    assert fingerprints.groups(prints(1.0, 1.0, 1.0)) == [[0, 1, 2]]
    assert fingerprints.groups(prints(1.0, 1.0 + 1e-7, 1.0)) == [[0, 1, 2]]  # 3e-6 * RTOL
    assert fingerprints.groups(prints(1.0, 1.0 + 1e-5, 1.0)) == [[0, 2], [1]]
    assert fingerprints.groups(prints(2.0, 1.0, 1.0, 2.0)) == [[0, 3], [1, 2]]


def test_verdict_names_groups_variables_and_silent_ranks():
    assert fingerprints.verdict(prints(1.0, 1.0), 2) is None
    text = fingerprints.verdict(prints(1.0, 1.5, 1.0), 4)
    assert text.startswith(
        "the ranks ended with different trainable weights: 2 groups (ranks 0, 2; rank 1) "
        "differ in dense/kernel (rank 3 wrote no fingerprint). Each group trained its own model"
    ), text
    other = prints(1.0, 1.0)
    other[1]["variables"].pop()
    assert "(the ranks trained different lists of variables)" in fingerprints.verdict(other, 2)


def test_ranks_without_a_file_are_named():
    assert fingerprints.unseen(prints(1.0, 1.0), 2) is None
    note = fingerprints.unseen(prints(1.0, 1.0), 4)
    assert note.startswith("ranks 2, 3 of 4 wrote no weight fingerprint, so only the others were")
    assert "no rank was compared" in fingerprints.unseen({}, 1)


def test_files_round_trip_and_clear(tmp_path):
    fingerprints.write(str(tmp_path), 1, [("a/kernel", 1.0, 2.0, 3.0)])
    fingerprints.write(str(tmp_path / "new"), 0, [])  # a folder this host lacks is made
    (tmp_path / "rank.0.json").write_text("{not json")  # an unreadable file is left out
    (tmp_path / "other.json").write_text("{}")
    assert fingerprints.read(str(tmp_path)) == {
        1: {"rank": 1, "variables": [["a/kernel", 1.0, 2.0, 3.0]]}
    }
    fingerprints.clear(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "other.json"]
    assert fingerprints.read(str(tmp_path / "new")) == {0: {"rank": 0, "variables": []}}


def test_scheduler_folder_needs_a_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(config.CHECK_WEIGHTS, raising=False)
    assert fingerprints.scheduler_folder() is None
    monkeypatch.setenv(config.CHECK_WEIGHTS, "1")
    monkeypatch.delenv(config.WEIGHTS_DIR, raising=False)
    with pytest.raises(LaunchError, match="HVDKIT_CHECK_WEIGHTS=1 under the scheduler/worker"):
        fingerprints.scheduler_folder()
    monkeypatch.setenv(config.WEIGHTS_DIR, str(tmp_path / "w"))
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "rank.3.json").write_text("{}")  # an earlier job's
    assert fingerprints.scheduler_folder() == str(tmp_path / "w")
    assert list((tmp_path / "w").iterdir()) == []
    monkeypatch.setenv(config.CHECK_WEIGHTS, "yes")
    with pytest.raises(LaunchError, match="HVDKIT_CHECK_WEIGHTS='yes' is not 0 or 1"):
        fingerprints.scheduler_folder()


def test_hvdkitrun_takes_check_weights():
    assert build_parser().parse_args(["--check-weights", "python", "t.py"]).check_weights
    assert not build_parser().parse_args(["python", "t.py"]).check_weights


class Weight:
    """Stands for a variable: the record keeps weak references."""


def test_record_of_reduced_local_and_trained_variables():
    updates.reset()
    a, b, c = Weight(), Weight(), Weight()
    updates.mark_trained([a, b, c])
    updates.mark_reduced([a])
    updates.mark_local([c])
    assert [updates.is_reduced(v) for v in (a, b, c)] == [True, False, False]
    assert [updates.is_local(v) for v in (a, b, c)] == [False, False, True]
    assert updates.trained() == [a, b]  # local ones are left out of the fingerprint
    del b
    gc.collect()
    assert updates.trained() == [a]  # a dropped model is no longer fingerprinted
    with updates.reducing():
        assert updates.in_reducing()
    assert not updates.in_reducing()
    updates.note_unlisted("ps", 2, "graph")
    assert updates.pending_unlisted() == [("ps", 2, "graph")] and updates.pending_unlisted() == []
    updates.reset()


def test_unreduced_update_setting(monkeypatch):
    monkeypatch.delenv(config.UNREDUCED_UPDATE, raising=False)
    assert config.unreduced_update() == "warn"
    for value in config.UNREDUCED_UPDATE_VALUES:
        monkeypatch.setenv(config.UNREDUCED_UPDATE, value)
        assert config.unreduced_update() == value
    monkeypatch.setenv(config.UNREDUCED_UPDATE, "raise")
    with pytest.raises(ConfigurationError, match="'raise' is not warn, error or off"):
        config.unreduced_update()

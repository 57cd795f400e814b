"""hvdkit._phases: every phase has a call site, and a trap fires once, where it is aimed."""

from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path

import pytest

from hvdkit import _phases

HVDKIT = Path(_phases.__file__).parent


@pytest.fixture
def traps(tmp_path, monkeypatch):
    monkeypatch.setattr(_phases, "_folder", str(tmp_path))
    monkeypatch.setattr(_phases, "_seen", {})
    monkeypatch.setattr(_phases, "_stepped_in", [])
    monkeypatch.setenv("HVDKIT_RESTART_COUNT", "0")
    acted: list[str] = []
    monkeypatch.setattr(_phases, "_act", acted.append)
    return tmp_path, acted


def trap(folder: Path, **fields) -> None:
    (folder / "trap").write_text(json.dumps(fields))


def test_every_phase_has_exactly_the_call_sites_hvdkit_names():
    """Each name of PHASES is entered somewhere in hvdkit, and nothing else is entered."""
    said = re.compile(r'_phases\.enter\(\s*"(\w+)"')
    entered = {
        m.group(1): str(p.relative_to(HVDKIT))
        for p in HVDKIT.rglob("*.py")
        for m in said.finditer(p.read_text())
    }
    entered["first_step"] = "checkpoint.py"  # a process's first "step" in a round
    assert set(entered) == set(_phases.PHASES), entered


def test_a_trap_fires_once_on_the_aimed_rank_after_the_given_entries(traps, monkeypatch):
    folder, acted = traps
    trap(folder, phase="save", action="kill", rank=1, after=1)
    _phases.enter("save", 0, 2)  # another rank
    _phases.enter("exchange", 1, 2)  # another phase
    _phases.enter("save", 1, 2)  # the entry let pass
    assert acted == [] and (folder / "trap").exists()
    _phases.enter("save", 1, 2)
    assert acted == ["kill"] and not (folder / "trap").exists()
    hit = json.loads((folder / "hit").read_text())
    assert {k: hit[k] for k in ("phase", "action", "rank", "size", "round")} == {
        "phase": "save",
        "action": "kill",
        "rank": 1,
        "size": 2,
        "round": 0,
    }
    _phases.enter("save", 1, 2)  # taken: nothing more
    assert acted == ["kill"]


def test_rank_and_size_come_from_horovods_settings_and_a_pid_aims_at_one_process(
    traps, monkeypatch
):
    folder, acted = traps
    monkeypatch.setenv("HOROVOD_RANK", "2")
    monkeypatch.setenv("HOROVOD_SIZE", "3")
    trap(folder, phase="meet", action="stop", pid=-5)
    _phases.enter("meet")
    assert acted == []
    trap(folder, phase="meet", action="stop", rank=2)
    _phases.enter("meet")
    assert acted == ["stop"]
    assert json.loads((folder / "hit").read_text())["rank"] == 2


def test_the_first_step_of_a_round_is_first_step_and_the_others_step(traps, monkeypatch):
    folder, acted = traps
    trap(folder, phase="first_step", action="exit")
    _phases.enter("step", 0, 2)
    assert acted == ["exit"]
    trap(folder, phase="first_step", action="exit")
    _phases.enter("step", 0, 2)  # the second step of round 0
    assert acted == ["exit"]
    monkeypatch.setenv("HVDKIT_RESTART_COUNT", "3")
    _phases.enter("step", 0, 2)  # the first step of round 3
    assert acted == ["exit", "exit"]


def test_pause_waits_for_its_release_and_bad_names_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(_phases, "_folder", str(tmp_path))
    waiter = threading.Thread(target=_phases._act, args=("pause",))
    waiter.start()
    waiter.join(timeout=0.3)
    assert waiter.is_alive()
    (tmp_path / f"release.{os.getpid()}").touch()
    waiter.join(timeout=60)
    assert not waiter.is_alive()
    with pytest.raises(ValueError, match="unknown phase 'stepp'"):
        _phases.enter("stepp")
    with pytest.raises(ValueError, match="unknown trap action 'boom'"):
        _phases._act("boom")


def test_nothing_happens_without_the_variable(monkeypatch, tmp_path):
    monkeypatch.setattr(_phases, "_folder", None)
    trap(tmp_path, phase="step", action="kill")
    _phases.enter("step", 0, 1)  # would SIGKILL this test if it looked
    assert (tmp_path / "trap").exists()

"""Facts written in two places are kept equal: versions installed vs setup.py, token files.

setup.py says what hvdkit supports; install.sh pins the versions the suite is
run with. Two facts, kept consistent here.
"""

from __future__ import annotations

import re
from pathlib import Path

from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[2]


def _install_sh(name: str) -> str:
    found = re.search(rf'^{name}="([^"]+)"', (REPO / "scripts" / "install.sh").read_text(), re.M)
    assert found, f"scripts/install.sh has no {name}"
    return found.group(1)


def _setup_spec(pattern: str) -> SpecifierSet:
    found = re.search(pattern, (REPO / "setup.py").read_text())
    assert found, f"setup.py has no {pattern}"
    return SpecifierSet(found.group(1))


def test_installed_keras_and_tensorflow_are_inside_setup_pys_ranges():
    keras = _install_sh("KERAS_VERSION")
    tf = _install_sh("TF_VERSION")
    assert keras in _setup_spec(r'"keras([<>=!~][^"]+)"'), (keras, "setup.py keras range")
    assert tf in _setup_spec(r'TF_SPEC = "([^"]+)"'), (tf, "setup.py TF_SPEC")


def test_cluster_scripts_default_token_file_is_the_launchers(monkeypatch, tmp_path):
    """run_scheduler.sh writes, run_workers.sh reads and hvdkit.launch.inprocess (MS_ROLE
    launch) uses the same default token file: the scripts evaluated by bash, compared."""
    import subprocess

    from hvdkit.launch.inprocess import default_token_file

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("HVDKIT_SCHED_PORT", "29123")
    monkeypatch.delenv("HVDKIT_TOKEN_FILE", raising=False)
    for script in ("run_scheduler.sh", "run_workers.sh"):
        text = (REPO / "examples" / "cluster" / script).read_text()
        line = next(
            ln for ln in text.splitlines() if "/.hvdkit/job-" in ln and "HVDKIT_TOKEN_FILE:-" in ln
        )
        expr = line[line.index('"') :]  # "${HVDKIT_TOKEN_FILE:-$HOME/.hvdkit/job-$port.token}"
        got = subprocess.run(
            ["bash", "-c", f"port=$HVDKIT_SCHED_PORT; echo {expr}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert got == default_token_file() == str(tmp_path / ".hvdkit" / "job-29123.token"), script

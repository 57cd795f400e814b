"""The versions scripts/install.sh installs lie inside the ranges setup.py declares.

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

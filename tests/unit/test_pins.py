"""Facts written in two places are kept equal: versions installed vs setup.py, token files.

hvdkit/_compat.py says which TensorFlow hvdkit supports (setup.py's extras read it,
scripts/matrix.sh tests each); install.sh pins the versions the suite is run with; setup.py
states the Python versions tested. Facts in several places, kept consistent here.
"""

from __future__ import annotations

import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]


def _install_sh(name: str) -> str:
    found = re.search(rf'^{name}="([^"]+)"', (REPO / "scripts" / "install.sh").read_text(), re.M)
    assert found, f"scripts/install.sh has no {name}"
    return found.group(1)


def _setup_arguments(monkeypatch) -> dict:
    """The keyword arguments setup.py passes to ``setup()``, captured without building."""
    import runpy

    import setuptools

    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: captured.update(kw))
    monkeypatch.chdir(REPO)
    runpy.run_path(str(REPO / "setup.py"))
    return captured


def _requirements(specs: list[str]) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, specs)}


def test_installed_keras_and_tensorflow_are_inside_the_supported_ranges(monkeypatch):
    from hvdkit import _compat
    from hvdkit.tools import doctor

    keras = _install_sh("KERAS_VERSION")
    tf = _install_sh("TF_VERSION")
    required = _requirements(_setup_arguments(monkeypatch)["install_requires"])
    assert keras in required["keras"].specifier, (keras, "setup.py keras range")
    assert required["keras"].specifier == SpecifierSet(doctor.KERAS_RANGE)
    assert _compat.tensorflow_supported(tf), (tf, _compat.SUPPORTED_TENSORFLOW)


def test_pip_install_hvdkit_leaves_tensorflow_and_its_companions_alone(monkeypatch):
    """No TensorFlow, Horovod, TensorBoard, protobuf or h5py requirement: pip would replace
    the user's TensorFlow, or compile Horovod without TensorFlow in its isolated build."""
    from hvdkit import _compat

    args = _setup_arguments(monkeypatch)
    required = _requirements(args["install_requires"])
    forbidden = {"tensorflow", "tensorflow-cpu", "tf-nightly", "horovod", "tensorboard"}
    assert not forbidden.union({"protobuf", "h5py"}) & set(required), sorted(required)
    extras = {name: _requirements(specs) for name, specs in args["extras_require"].items()}
    assert extras["cpu"]["tensorflow-cpu"].specifier == SpecifierSet(_compat.SUPPORTED_TENSORFLOW)
    assert extras["gpu"]["tensorflow"].specifier == SpecifierSet(_compat.SUPPORTED_TENSORFLOW)
    assert extras["gpu"]["tensorflow"].extras == {"and-cuda"}
    assert "horovod" not in {n for reqs in extras.values() for n in reqs}
    # TF 2.18/2.19 pin tensorboard ~=2.18/~=2.19: the test extra's range admits both
    for tb in ("2.18.0", "2.19.0", "2.20.0"):
        assert tb in extras["test"]["tensorboard"].specifier, tb


def test_python_requires_admits_exactly_the_tested_pythons(monkeypatch):
    args = _setup_arguments(monkeypatch)
    tested = sorted(
        c.rsplit(" ", 1)[1]
        for c in args["classifiers"]
        if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)
    )
    admitted = [
        f"3.{m}" for m in range(6, 20) if f"3.{m}.0" in SpecifierSet(args["python_requires"])
    ]
    assert tested == admitted == ["3.11"], (tested, admitted)


def test_matrix_covers_the_supported_range():
    from hvdkit import _compat

    text = (REPO / "scripts" / "matrix.sh").read_text()
    found = re.search(r'^TF_VERSIONS=\(\$\{HVDKIT_MATRIX_TF:-"?([^}"]+)"?\}\)', text, re.M)
    assert found, "scripts/matrix.sh has no TF_VERSIONS=(${HVDKIT_MATRIX_TF:-...})"
    versions = found.group(1).split()
    assert all(_compat.tensorflow_supported(v) for v in versions), versions
    minors = {".".join(v.split(".")[:2]) for v in versions}
    supported = {f"2.{m}" for m in range(10, 40) if _compat.tensorflow_supported(f"2.{m}.0")}
    assert minors == supported, (minors, supported)


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

"""Test helpers: running a worker script under the real launcher with 2 ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MULTIPROC = Path(__file__).resolve().parent / "multiproc"
VENV_BIN = Path(sys.executable).parent
TRANSPORTS = ["gloo", "mpi"]


def launcher_env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(MULTIPROC), str(REPO)])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if os.geteuid() == 0:  # Open MPI refuses root without these
        env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
        env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
    return env


class LaunchResult:
    def __init__(self, proc: subprocess.CompletedProcess, outdir: Path, np_: int):
        self.proc = proc
        self.returncode = proc.returncode
        self.output = proc.stdout + proc.stderr
        self.outdir = outdir
        self.ranks = []
        for r in range(np_):
            path = outdir / f"rank{r}.json"
            self.ranks.append(json.loads(path.read_text()) if path.exists() else None)

    def assert_all_passed(self, expected: list[str]) -> None:
        """The job exited 0 and every rank passed exactly the ``expected`` checks, in order."""
        assert self.returncode == 0, self.output[-5000:]
        for rank in range(len(self.ranks)):
            assert self.ranks[rank] is not None, self.output[-5000:]
            assert self.passed(rank) == expected, self.output[-2000:]

    def passed(self, rank: int) -> list[str]:
        return self.ranks[rank]["passed"]

    def values(self, rank: int) -> dict:
        return self.ranks[rank]["values"]


def launch(
    script: str,
    tmp_path: Path,
    transport: str = "gloo",
    np_: int = 2,
    args: tuple = (),
    timeout: float = 300,
    env_extra: dict | None = None,
) -> LaunchResult:
    """Run tests/multiproc/<script> with ``horovodrun -np N --<transport>``."""
    outdir = tmp_path / f"out-{transport}"
    outdir.mkdir(exist_ok=True)
    env = launcher_env()
    env.update(env_extra or {})
    cmd = [
        str(VENV_BIN / "horovodrun"),
        "-np",
        str(np_),
        f"--{transport}",
        sys.executable,
        str(MULTIPROC / script),
        str(outdir),
        *map(str, args),
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path
    )
    return LaunchResult(proc, outdir, np_)


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    return request.param

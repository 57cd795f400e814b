"""Five scripts in the shape of the Keras team's guides (examples/keras_guides), as users run
them: ``hvdkitrun -np 2`` over Gloo and MPI, compared line for line with one process (issue 35).

Rank 0's log holds exactly the lines one process prints (``model.summary()``'s box, the
progress bar's last state, every result), numbers equal to 1e-4; rank 1 prints none of them;
every script ends with equal weights on both ranks; exit 0, no hang.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from test_launch_mp import HANG_S

from conftest import MULTIPROC, VENV_BIN, launcher_env

RUNNER = str(MULTIPROC / "run_guides.py")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
TIMING = re.compile(r"\b\d+(?:\.\d+)?(?:ms|us|s)(?:/step)?\b")
NUMBER = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")


def shown(raw: str) -> list[str]:
    """The lines as a terminal ends up showing them: each line's text after its last ``\\r``."""
    lines = []
    for line in raw.replace("\r\n", "\n").split("\n"):
        parts = [p.replace("\b", "") for p in line.split("\r")]
        visible = [p for p in parts if p]
        lines.append(parts[-1] or (visible[-1] if visible else ""))
    return lines[:-1] if lines and lines[-1] == "" else lines


def comparable(line: str) -> tuple[str, list[float]]:
    text = TIMING.sub("T", ANSI.sub("", line)).rstrip()
    return NUMBER.sub("N", text), [float(x) for x in NUMBER.findall(text)]


def guide_lines(lines: list[str]) -> list[str]:
    """From the first ``===`` marker on: what the scripts printed (TensorFlow's notes excluded)."""
    start = next(i for i, ln in enumerate(lines) if ln.startswith("=== "))
    return [ln for ln in lines[start:] if not ln.startswith(("WARNING: All log", "I0000"))]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    env = launcher_env(horovod_cycle=False)  # what users run: Horovod's defaults
    for var in ("OMPI_COMM_WORLD_SIZE", "HOROVOD_SIZE", "PMI_SIZE"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, RUNNER],
        capture_output=True,
        env=env,
        timeout=HANG_S,
        cwd=tmp_path_factory.mktemp("one"),
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return guide_lines(shown(proc.stdout.decode("utf-8")))


@pytest.mark.parametrize("transport", ["gloo", "mpi"])
def test_guides_under_hvdkitrun_equal_one_process_line_for_line(transport, one_process, tmp_path):
    cmd = [str(VENV_BIN / "hvdkitrun"), "-np", "2", f"--{transport}", "--log-dir", "logs"]
    cmd.append("--check-weights")  # the ranks end with equal weights (else exit 70)
    proc = subprocess.run(
        [*cmd, sys.executable, RUNNER],
        capture_output=True,
        env=launcher_env(horovod_cycle=False),
        timeout=HANG_S,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    rank0 = guide_lines(
        (tmp_path / "logs" / "rank.0" / "stdout").read_text("utf-8").split("\n")[:-1]
    )
    log1 = tmp_path / "logs" / "rank.1" / "stdout"
    rank1 = log1.read_text("utf-8") if log1.exists() else ""
    assert "===" not in rank1 and "Test accuracy" not in rank1
    for r in (0, 1):  # no false alarm of the update check (hvdkit/keras/_update_check.py)
        log = tmp_path / "logs" / f"rank.{r}" / "stderr"
        assert "no hvdkit reduction averaged" not in (log.read_text() if log.exists() else "")
    assert len(rank0) == len(one_process), (rank0, one_process)
    for got, want in zip(rank0, one_process, strict=True):
        (g_text, g_nums), (w_text, w_nums) = comparable(got), comparable(want)
        assert g_text == w_text, (got, want)
        for g, w in zip(g_nums, w_nums, strict=True):
            assert abs(g - w) <= 1e-4 * max(1.0, abs(w)), (got, want)
    assert rank0.count("ranks hold equal weights: True") == 5
    assert sum(ln.startswith("Test accuracy:") for ln in rank0) == 1
    assert sum("conv2d" in ln for ln in rank0) >= 2  # model.summary()'s rows
    console = proc.stdout.decode("utf-8")
    assert "[rank 0] Test accuracy:" in console and "\r[rank 0] " in console  # the bar, in place

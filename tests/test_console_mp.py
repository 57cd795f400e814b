"""The launchers' console relay under what real programs print (issue 35).

tests/multiproc/console_prog.py writes, as raw bytes: 20,000 lines of a Keras
summary (box drawing), bytes that are not UTF-8, a character split over two
writes, a progress bar updated in place, a 1 MB line. Under ``hvdkitrun``
(Gloo and MPI) and the scheduler/worker launch every line must reach the
rank's log file exactly and the console, and the job must end with 0.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys

import pytest
from test_launch_mp import HANG_S, SCHEDULER_SH, WORKERS_SH, free_port, sched_env

from conftest import MULTIPROC, VENV_BIN, launcher_env

sys.path.insert(0, str(MULTIPROC))
import console_prog

PROG = str(MULTIPROC / "console_prog.py")
MAX_PIECE = 64 * 1024  # hvdkit.launch.output.MAX_PIECE, spelled out: the test does not trust it


def start(cmd, tmp_path, env_extra=None):
    """Start ``cmd``; its output is read as bytes (text mode would turn ``\\r`` into ``\\n``)."""
    env = {**launcher_env(), **(env_extra or {})}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp_path
    )


def finish(*procs) -> list[tuple[int, str, str]]:
    """Wait for ``procs``, reading all their pipes at once (a full pipe would block one)."""

    def one(proc):
        out, err = proc.communicate(timeout=HANG_S)
        return proc.returncode, out.decode("utf-8"), err.decode("utf-8")

    with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
        return list(pool.map(one, procs))


def check_logs(log_dir):
    for r in (0, 1):
        got = (log_dir / f"rank.{r}" / "stdout").read_text(encoding="utf-8").split("\n")
        want = [*console_prog.expected(r), ""]
        wrong = [i for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w]
        assert len(got) == len(want) and not wrong, (r, len(got), len(want), wrong[:3])


def check_console(stdout: str):
    lines = stdout.split("\n")
    summary = [ln for ln in lines if ln.startswith("[rank 0] " + console_prog.SUMMARY)]
    assert len(summary) == console_prog.SUMMARY_LINES
    assert sum(ln.startswith("[rank 1] rank 1 line ") for ln in lines) == 2000
    assert "[rank 0] bad \ufffd\ufffd bytes" in lines and "[rank 0] split é done" in lines
    # the bar: updated in place (a carriage return and the rank's tag), never a backspace
    assert "\r[rank 0] 5/10 " in stdout and "\b" not in stdout
    last_bar = "[rank 0] " + console_prog.bar(console_prog.BAR_STEPS)
    assert any(ln.rstrip(" ").endswith(last_bar) for ln in lines)
    longs = [ln for ln in lines if ln.startswith("[rank 0] L")]
    assert sum(len(ln) - len("[rank 0] ") for ln in longs) == console_prog.LONG
    assert max(len(ln) for ln in longs) <= MAX_PIECE + len("[rank 0] ")
    assert "[rank 0] Test accuracy: 1.0" in lines


@pytest.mark.parametrize("transport", ["gloo", "mpi"])
def test_hvdkitrun_relays_every_byte_a_program_prints(transport, tmp_path):
    cmd = [str(VENV_BIN / "hvdkitrun"), "-np", "2", f"--{transport}", "--log-dir", "logs"]
    ((code, out, err),) = finish(start([*cmd, sys.executable, PROG], tmp_path))
    assert code == 0, err[-3000:]
    check_logs(tmp_path / "logs")
    check_console(out)


def test_scheduler_and_workers_relay_every_byte(tmp_path):
    env = sched_env(free_port(), HVDKIT_LOG_DIR=str(tmp_path / "logs"))
    sched = start([SCHEDULER_SH], tmp_path, env)
    # one run_workers.sh per worker, as on two machines: each has its own console
    workers = [start([WORKERS_SH, "1", sys.executable, PROG], tmp_path, env) for _ in (0, 1)]
    ends = finish(*workers, sched)
    assert [code for code, _, _ in ends] == [0, 0, 0], [err[-2000:] for _, _, err in ends]
    check_logs(tmp_path / "logs")
    check_console("".join(out for _, out, _ in ends))

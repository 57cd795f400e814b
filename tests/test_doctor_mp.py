"""``hvdkit doctor`` for real in this venv: every check passes, both transports' 2-process
allreduce included (the jobs run under hvdkitrun, as a user's would)."""

from __future__ import annotations

import subprocess

from hvdkit.tools import install_horovod

from conftest import REPO, VENV_BIN, launcher_env


def test_doctor_reports_both_transports_working_in_this_venv():
    done = subprocess.run(
        [str(VENV_BIN / "hvdkit"), "doctor", "--timeout", "300"],
        capture_output=True,
        text=True,
        env=launcher_env(),
        cwd=REPO,
        timeout=900,
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout + done.stderr
    assert lines[-1] == "hvdkit doctor: all good", done.stdout
    marks = {line[7:].split("  ")[0].strip(): line[:6] for line in lines if line.startswith("[")}
    assert marks["allreduce, 2 processes, gloo"] == "[ok  ]", done.stdout
    assert marks["allreduce, 2 processes, mpi"] == "[ok  ]", done.stdout
    for name in ("Python", "TensorFlow", "Keras", "Horovod", "mpirun"):
        assert marks[name] == "[ok  ]", (name, done.stdout)
    tf = install_horovod.query_tensorflow()
    horovod = next(line for line in lines if line.startswith("[ok  ] Horovod "))
    assert "0.28.1 (in " in horovod and f"built for TensorFlow {tf.version}" in horovod, horovod
    assert "hvdkitrun -np 2 --gloo: 1+2 = 3.0 on both ranks" in done.stdout
    assert "hvdkitrun -np 2 --mpi: 1+2 = 3.0 on both ranks" in done.stdout

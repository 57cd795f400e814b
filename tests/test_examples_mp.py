"""The README's main job and the documented examples, under the real launcher."""

import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from hvdkit import config
from hvdkit._comm import fingerprints

from conftest import (
    REPO,
    horovodrun,
    hvdkitrun,
    launcher_env,
    run_bounded,
    shared_folder,
    start_in_session,
)


def run_example(script, transport, *args, timeout=900):
    """The example under horovodrun; a job that ends 0 must end with equal weights on both ranks
    and without the update check's warning (the fingerprints hvdkitrun --check-weights compares)."""
    cmd = horovodrun(transport, REPO / "examples" / script, *args)
    with tempfile.TemporaryDirectory() as weights:
        env = {**launcher_env(sklearn=True), config.WEIGHTS_DIR: weights}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode == 0:
            assert sorted(fingerprints.read(weights)) == [0, 1], proc.stderr[-3000:]
            assert fingerprints.check(weights, 2) is None
            assert "no hvdkit reduction averaged" not in proc.stdout + proc.stderr
    return proc


def test_demo_reaches_095_held_out_accuracy(transport):
    proc = run_example("train_digits.py", transport)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    epochs = re.findall(r"epoch\s+(\d+)/12\s+loss ([\d.]+)\s+accuracy ([\d.]+)", out)
    assert [int(e) for e, _, _ in epochs] == list(range(1, 13)), out[-3000:]  # rank 0 only
    losses = [float(loss) for _, loss, _ in epochs]
    assert losses[-1] < losses[0] / 4
    m = re.search(r"held-out accuracy ([\d.]+) \((\d+)/(\d+) test digits\)", out)
    assert m, out[-2000:]
    assert float(m.group(1)) >= 0.95 and int(m.group(3)) == 360
    assert out.count("held-out accuracy") == 1


def test_demo_fails_loudly_below_the_accuracy_bar():
    proc = run_example("train_digits.py", "gloo", "--epochs", "1", "--min-accuracy", "0.999")
    assert proc.returncode != 0


def test_manual_parallel_matches_automatic_path(transport):
    proc = run_example("manual_parallel.py", transport)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    m = re.search(r"max \|manual - automatic\| weight difference: ([\d.e+-]+)", out)
    assert m and float(m.group(1)) < 1e-5, out[-2000:]


# ------------------------------------------------ fault_tolerant_digits.py, killed from outside
FT_EXAMPLE = REPO / "examples" / "fault_tolerant_digits.py"
FINGERPRINT = re.compile(r"done at step (\d+); weights fingerprint ([0-9a-f]{16})")


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (by parent pid), read from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        kids = [p for p, parent in parents.items() if parent == pid]
        found += kids
        frontier += kids
    return found


def python_rank(pids: list[int], rank: int) -> int | None:
    """The pid among ``pids`` that is the example's Python process of ``rank``."""
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        is_python = Path(argv[0].decode()).name.startswith("python")
        runs_example = any(a.endswith(FT_EXAMPLE.name.encode()) for a in argv)
        ranks = {f"{k}={rank}".encode() for k in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK")}
        if is_python and runs_example and ranks & set(env):
            return pid
    return None


def newest_checkpoint_step(folder: Path) -> int:
    steps = [int(d.name[5:]) for d in folder.glob("ckpt-*") if (d / "manifest.json").exists()]
    return max(steps, default=0)


def uninterrupted_example(tmp_path_factory) -> re.Match:
    """The fault-tolerant example's fingerprint line, run once without a fault (over Gloo).

    It is the reference of both transports (why that holds: conftest.uninterrupted_fit;
    this example printed the same fingerprint over both).
    """

    def make(folder: Path) -> None:
        cmd = hvdkitrun("gloo", FT_EXAMPLE, folder / "ckpt")
        code, out, timed_out = run_bounded(cmd, 900, env=launcher_env(sklearn=True))
        assert not timed_out and code == 0, out[-3000:]
        (folder / "output").write_text(out)

    out = (shared_folder(tmp_path_factory, "uninterrupted-example", make) / "output").read_text()
    want = FINGERPRINT.search(out)
    assert want and want.group(1) == "116", out[-3000:]  # 4 epochs of 29 steps
    return want


def test_fault_tolerant_example_killed_from_outside_ends_with_the_same_weights(
    transport, tmp_path, tmp_path_factory
):
    """kill -9 of rank 1 mid-run, as a user would: hvdkitrun restarts, the weights match."""
    want = uninterrupted_example(tmp_path_factory)

    ckpt = tmp_path / "job"
    options = ("--max-restarts", "1", "--checkpoint-dir", ckpt)
    cmd = hvdkitrun(transport, FT_EXAMPLE, ckpt, "--step-sleep", "0.1", options=options)
    proc = start_in_session(cmd, env=launcher_env(sklearn=True))
    killed = None
    try:
        # Kill once a checkpoint of step >= 20 is complete: the job is then
        # mid-run (116 steps), whatever the machine's speed.
        while killed is None and proc.poll() is None:
            if newest_checkpoint_step(ckpt) >= 20:
                killed = python_rank(descendants(proc.pid), 1)
                if killed is not None:
                    os.kill(killed, signal.SIGKILL)
            time.sleep(0.1)
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert killed is not None, f"rank 1 was not found running before the job ended:\n{out[-3000:]}"
    assert proc.returncode == 0, out[-3000:]
    restart = re.search(
        # Open MPI reports the signal; Gloo's launcher, a shell's exit status 128 + 9
        r"restart 1/1 after rank 1 (?:signal 9|exit code 137) \(SIGKILL\); "
        r"resuming from checkpoint step (\d+)",
        out,
    )
    assert restart and 20 <= int(restart.group(1)) < 116, out[-3000:]
    assert f"attempt 1: 2 rank(s), resuming from step {restart.group(1)}" in out, out[-3000:]
    got = FINGERPRINT.search(out)
    assert got and got.groups() == want.groups(), out[-3000:]

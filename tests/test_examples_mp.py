"""The README's main job and the documented examples, under the real launcher."""

import re
import subprocess

from conftest import REPO, horovodrun, launcher_env


def run_example(script, transport, *args, timeout=900):
    cmd = horovodrun(transport, REPO / "examples" / script, *args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=launcher_env())


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

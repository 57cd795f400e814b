"""Horovod-style example scripts (only the import changed) under horovodrun -np 2."""

import re

from hvdkit import config
from hvdkit._comm import fingerprints

from conftest import REPO, horovodrun, launcher_env, run_bounded

# Horovod's examples leave the initial weights to chance. Now and then an
# unseeded run starts badly enough to be far from trained after the few
# hundred steps run here (once in CI, a final loss of 1.35 from 2.45; 60 runs
# by hand ended at 0.0009-0.24): the tests fix the seed, so a slow loss points
# at hvdkit.
SEED = "1"


def run(script, transport, tmp_path, *args):
    script = REPO / "examples" / "horovod" / script
    cmd = horovodrun(transport, script, "--outdir", tmp_path, "--seed", SEED, *args)
    weights = tmp_path / "fingerprints"  # what hvdkitrun --check-weights compares
    weights.mkdir()
    env = {**launcher_env(), config.WEIGHTS_DIR: str(weights)}
    code, out, timed_out = run_bounded(cmd, 600, env=env, cwd=tmp_path)
    assert not timed_out, out[-3000:]
    assert code == 0, out[-3000:]
    assert sorted(fingerprints.read(str(weights))) == [0, 1], out[-3000:]
    assert fingerprints.check(str(weights), 2) is None
    assert "no hvdkit reduction averaged" not in out  # the update check's warning
    return out


def losses(out):
    m = re.search(r"final loss ([\d.]+) first ([\d.]+)", out)
    assert m, out[-3000:]
    return float(m.group(1)), float(m.group(2))


def weight_spread(out):
    """The printed max |w_rank - w_0|; mpirun may put its tag before the line's end."""
    m = re.search(r"weights differ between ranks by ([\d.eE+-]+)", out)
    assert m, out[-3000:]
    return float(m.group(1))


def test_keras_fit_with_horovod_callbacks(transport, tmp_path):
    out = run("keras_mnist.py", transport, tmp_path)
    final, first = losses(out)
    assert final < first / 4, (final, first)
    assert weight_spread(out) == 0.0  # broadcast + averaged gradients
    acc = float(re.search(r"held-out accuracy ([\d.]+)", out).group(1))
    assert acc >= 0.9, out[-2000:]
    assert out.count("finished learning-rate warm-up at 0.002") == 1  # rank 0, 0.001 * size
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*.keras")) == [
        f"checkpoint-{e}.keras" for e in range(1, 5)
    ]
    assert out.count("final loss") == 1  # printed by rank 0 only


def test_gradient_tape_loop(transport, tmp_path):
    out = run("gradient_tape_mnist.py", transport, tmp_path)
    final, first = losses(out)
    assert final < first / 4, (final, first)
    assert weight_spread(out) == 0.0
    steps = [int(s) for s in re.findall(r"Step #(\d+)\t", out)]
    assert steps == list(range(0, 200, 10)), steps  # 400 job steps / 2 ranks, rank 0 prints
    assert (tmp_path / "checkpoints-1.index").exists()

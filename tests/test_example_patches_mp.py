"""examples/patches.py under the real launcher: 2 ranks, each on half of every image."""

import re

from test_examples_mp import run_example


def test_patch_example_trains_on_image_halves(transport):
    proc = run_example("patches.py", transport)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "2 rank(s), grid 1x2, patches [256, 128] of 256x256" in out, out[-2000:]
    losses = [float(v) for v in re.findall(r"step - accuracy: [\d.]+ - loss: ([\d.]+)", out)]
    assert len(losses) == 3, out[-2000:]  # 3 epochs, printed by rank 0 only
    assert losses[-1] < losses[0]
    m = re.search(r"test accuracy \(logits averaged over the 2 patch\(es\)\): ([\d.]+)", out)
    assert m and float(m.group(1)) >= 0.9, out[-2000:]

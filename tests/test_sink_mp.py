"""Sink mode with 2 processes under the launcher, over Gloo and MPI."""

import re
import subprocess

import pytest

from conftest import REPO, WorkerRun, horovodrun, launch, launcher_env

RUN = WorkerRun("sink_worker.py", timeout=900)

EXPECTED = [
    "data_sink_equals_plain_distributed_steps",
    "data_sink_distributed_optimizer_in_the_loop",
    "keras_train_sink_size_3_equals_fit",
    "keras_train_sink_size_-1_equals_fit",
    "unequal_per_rank_lengths_refused",
    "jit_compile_refused_in_a_multi_process_job",
]


@pytest.mark.parametrize("check", EXPECTED)
def test_sink(check, transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_check(check)


def test_sink_reports_exactly_these_checks(transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_reported_exactly(EXPECTED)


def test_sink_losses(transport, tmp_path_factory):
    res = RUN.result(transport, tmp_path_factory)
    v0, v1 = res.values(0), res.values(1)
    # every rank logs its own loss (the step returns the local loss) ...
    assert len(v0["data_sink_losses"]) == 3 and v0["data_sink_losses"] != v1["data_sink_losses"]
    # ... while train()'s epoch losses are rank averages (MetricAverageCallback)
    assert v0["train_3_loss"] == v1["train_3_loss"] and len(v0["train_3_loss"]) == 3
    assert v0["train_-1_loss"] == v1["train_-1_loss"] and len(v0["train_-1_loss"]) == 2


def test_input_error_on_one_rank_stops_both_at_the_same_step(transport, tmp_path):
    res = launch("sink_input_error_worker.py", tmp_path, transport, timeout=900)
    assert not res.timed_out, res.output[-3000:]
    assert res.returncode != 0
    assert "InputPipelineError" in res.output and "bad record 7" in res.output
    for r in (0, 1):
        assert res.ranks[r] is not None, res.output[-5000:]
    bad, peer = res.values(1), res.values(0)
    assert bad["error_type"] == "InputPipelineError" and bad["step"] == 3
    assert "failed at step 3 " in bad["message"] and "bad record 7" in bad["message"]
    assert "shut this rank's runtime down" in bad["message"]
    assert bad["initialized_after"] is False
    # Rank 0 was blocked in step 3's allreduce. It fails there, not later ...
    assert peer["first_call"] == bad["first_call"] == 2 * (4 + 5)  # step 2: [4 5] on both
    assert any("raised by the training step at step 3 " in note for note in peer["notes"])
    # ... and while rank 1 was still alive: released by hvdkit, not by rank 1's exit
    assert peer["failed_at"] < bad["left_at"]


def test_lenet_mnist_sink_example_loss_falls():
    cmd = horovodrun("gloo", REPO / "examples" / "lenet_sink.py")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=launcher_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    losses = [float(x) for x in re.findall(r"epoch\s+\d+\s+step\s+\d+\s+loss ([\d.]+)", out)]
    assert len(losses) >= 4, out[-3000:]  # rank 0 only, once per sink
    assert losses[-1] < 0.6 * losses[0], losses

"""Mixed precision and hvdkit's rank-local branches with 2 processes, over Gloo and MPI."""

import pytest

from conftest import WorkerRun

RUN = WorkerRun("mixed_precision_worker.py", timeout=900)

EXPECTED = [
    "fit_auto_wrapped_loss_scaling_one_rank_overflows",
    "fit_explicit_lso_around_distributed_optimizer",
    "fit_distributed_optimizer_around_lso",
    "fit_mixed_bfloat16_equals_single_process",
    "custom_loop_gradient_tape_and_scale_loss",
    "custom_loop_lso_around_distributed_optimizer",
    "fit_lso_with_backward_passes_per_step_2",
    "optimizers_at_different_steps_fail_on_every_rank",
    "broadcast_callback_model_built_on_rank0_only",
    "shard_files_called_with_other_arguments_on_one_rank",
    "still_in_step_after_all_checks",
]


@pytest.mark.parametrize("check", EXPECTED)
def test_mixed_precision(check, transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_check(check)


def test_mixed_precision_reports_exactly_these_checks(transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_reported_exactly(EXPECTED)


def test_skipped_steps_are_the_injected_ones(transport, tmp_path_factory):
    res = RUN.result(transport, tmp_path_factory)
    for r in (0, 1):
        v = res.values(r)
        for label in ("auto", "lso_outside", "dist_outside", "tape", "opt"):
            assert v[f"{label}_skipped"] == [1, 5, 9], (r, label)
        # the loss scale halved at each skip (and grew every 2 good steps)
        assert v["lso_outside_scales"][1] == v["lso_outside_scales"][0] / 2

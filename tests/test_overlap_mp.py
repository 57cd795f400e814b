"""Gradient buckets (the allreduce overlapping the backward pass) on 2 ranks, Gloo and MPI."""

import pytest

from conftest import WorkerRun

RUN = WorkerRun("overlap_worker.py", timeout=600)
SETTINGS = ["per_gradient", "small_buckets", "default", "groups_3", "num_groups_2"]
EXPECTED = [
    *(
        check
        for s in SETTINGS
        for check in (
            f"fit_{s}_equals_single_process",
            f"custom_loop_{s}_equals_single_process_with_planned_buckets",
        )
    ),
    "groups_as_lists_of_variables",
    "gradient_tape_buckets_equal_single_process",
    "first_bucket_leaves_before_the_first_layer_gradient_exists",
    "fit_steps_per_execution_buckets_equals_single_process",
    "sink_train_buckets_equals_single_process",
    "fp16_buckets_close_to_fp32",
    "backward_passes_per_step_buckets_equals_larger_batch",
    "sparse_and_dense_gradients_in_buckets",
    "mixed_precision_buckets_decide_on_averaged_gradients",
    "ranks_that_built_different_optimizers_and_layers_first_still_pair",
    "sync_batch_norm_trains_like_one_process_after_different_layers_were_built",
    "horovod_threads_on_the_normal_policy_by_default",
    "step_check_raises_on_every_rank_with_buckets",
]


@pytest.mark.parametrize("check", EXPECTED)
def test_overlap(check, transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_check(check)


def test_overlap_reports_exactly_these_checks(transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_reported_exactly(EXPECTED)

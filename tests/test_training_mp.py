"""DistributedOptimizer / callbacks equivalence with 2 processes, over Gloo and MPI."""

import pytest

from conftest import WorkerRun

RUN = WorkerRun("training_worker.py", timeout=600)

EXPECTED = [
    "fit_sgd_equals_single_process",
    "fit_adam_equals_single_process",
    "horovod_own_keras_wrapper_does_not_average",
    "fit_steps_per_execution_equals_single_process",
    "train_on_batch_equals_single_process",
    "custom_loop_distributed_optimizer",
    "custom_loop_distributed_gradient_tape",
    "apply_gradients_zip_path",
    "backward_passes_per_step_equals_larger_batch",
    "fp16_compression_close_to_fp32",
    "sparse_gradients_embedding",
    "oneflow_toy_converges_to_2_3",
    "broadcast_callback_syncs_weights_and_optimizer_state",
    "metric_average_callback",
    "learning_rate_warmup_callback",
    "rank_zero_only_callback",
    "save_and_load_model_with_distributed_optimizer",
    "bad_optimizer_arguments",
    "xla_compile_refused_with_clear_error",
]


@pytest.mark.parametrize("check", EXPECTED)
def test_training(check, transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_check(check)


def test_training_reports_exactly_these_checks(transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_reported_exactly(EXPECTED)


def test_training_values(transport, tmp_path_factory):
    res = RUN.result(transport, tmp_path_factory)
    for r in (0, 1):
        v = res.values(r)
        assert abs(v["oneflow_w"][0] - 2.0) < 1e-3 and abs(v["oneflow_w"][1] - 3.0) < 1e-3
        assert v["fp16_max_rel_err"] < 5e-3
        assert v["val_loss_local_differs"]  # so the averaging was not trivially a no-op

"""Around training, as users meet it (issue 35): ranks that start apart, save on one and load
on all, optimizer identifiers, loading after Keras's registry was cleared; weights updated with
no hvdkit reduction and the end-of-job fingerprints (issue 51). 2 ranks, Gloo and MPI; the
checks are in tests/multiproc/user_scripts_worker.py."""

import pytest

from conftest import WorkerRun

RUN = WorkerRun("user_scripts_worker.py", timeout=900)

EXPECTED = [
    "tape_loop_apart_fails_at_second_step_naming_variables",
    "eager_loop_apart_fails_at_second_step",
    "horovod_broadcast_after_first_step_passes",
    "broadcast_before_training_checked_once_no_graph_check",
    "same_seed_needs_no_broadcast",
    "fit_apart_without_broadcast_fails",
    "unbuilt_model_with_broadcast_callback_passes_and_warns_once_on_rank0",
    "warn_mode_trains_on_apart",
    "naive_save_on_rank0_then_load_races",
    "save_model_then_load_on_every_rank",
    "save_model_failure_raises_on_every_rank",
    "rank_zero_only_checkpoint_then_load_on_every_rank",
    "distributed_optimizer_takes_identifiers_and_configs",
    "load_after_custom_objects_cleared",
    "correct_training_above_gave_no_unreduced_warning",
    "plain_compile_fit_warns_once_on_rank0_naming_the_optimizer",
    "gan_with_one_optimizer_unwrapped_names_only_that_one",
    "custom_loop_plain_tape_warns_in_function_and_eagerly",
    "error_setting_raises_on_every_rank",
    "deliberate_and_reduced_paths_stay_silent",
    "reduce_gradients_without_variables_gets_the_same_start_check",
    "adasum_checks_the_same_start_over_mpi",
    "fingerprints_name_the_ranks_that_ended_apart",
    "still_in_step_after_all_checks",
]


@pytest.mark.parametrize("check", EXPECTED)
def test_user_scripts(check, transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_check(check)


def test_user_scripts_report_exactly_these_checks(transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_reported_exactly(EXPECTED)

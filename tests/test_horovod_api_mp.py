"""A Horovod script's calls, with only its import changed, on 2 ranks over Gloo and MPI."""

import pytest

from conftest import WorkerRun

RUN = WorkerRun(
    "horovod_api_worker.py",
    timeout=900,
    env_extra={"HOROVOD_TIMELINE": "DYNAMIC"},
)


CHECKS = [
    "allreduce_prescale_postscale_float_and_int",
    "allreduce_deprecated_average_argument",
    "allreduce_indexed_slices_without_dense_shape",
    "indexed_slices_min_max_product_and_scaling_not_implemented",
    "mismatch_eager_is_collective_mismatch_and_failed_precondition",
    "mismatch_in_tf_function_is_failed_precondition",
    "neighbor_exchange_mismatch_in_tf_function_is_invalid_argument",
    "grouped_allgather",
    "reducescatter_horovod_signature_and_scaling",
    "broadcast_inplace",
    "topology_ops",
    "build_and_transport_probes",
    "timeline_records_named_collective",
    "join_allreduce_sums_active_ranks",
    "sync_batch_norm_matches_one_process_on_whole_batch",
    "learning_rate_schedule_callback",
]


@pytest.mark.parametrize("check", CHECKS)
def test_horovod_api(check, transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_check(check)


def test_horovod_api_reports_exactly_these_checks(transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_reported_exactly(CHECKS)

"""Collectives with 2 processes under horovodrun, over Gloo and MPI."""

import pytest

from conftest import WorkerRun

RUN = WorkerRun("collectives_worker.py")

EXPECTED = [
    "topology",
    "allreduce_ops_dtypes_eager",
    "allreduce_numpy_in_numpy_out",
    "allreduce_tf_function",
    "grouped_allreduce",
    "allgather_uneven",
    "broadcast",
    "reducescatter",
    "fp16_compression",
    "alltoall",
    "neighbor_exchange",
    "neighbor_exchange_pattern_mismatch",
    "objects",
    "mismatched_shape_names_tensor_and_ranks",
    "mismatched_shape_in_tf_function_raises",
    "bad_arguments",
    "barrier_waits_for_the_late_rank",
    "abandon_ends_a_wait_that_nothing_else_would",
]


@pytest.mark.parametrize("check", EXPECTED)
def test_collectives(check, transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_check(check)


def test_collectives_reports_exactly_these_checks(transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_reported_exactly(EXPECTED)

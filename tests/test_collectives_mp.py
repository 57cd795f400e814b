"""Collectives with 2 processes under horovodrun, over Gloo and MPI."""

from conftest import launch

EXPECTED = [
    "topology",
    "allreduce_ops_dtypes_eager",
    "allreduce_numpy_in_numpy_out",
    "allreduce_tf_function",
    "grouped_allreduce",
    "allgather_uneven",
    "broadcast",
    "reducescatter",
    "alltoall",
    "neighbor_exchange",
    "neighbor_exchange_pattern_mismatch",
    "objects",
    "mismatched_shape_names_tensor_and_ranks",
    "mismatched_shape_in_tf_function_raises",
    "bad_arguments",
    "barrier",
]


def test_collectives_two_ranks(tmp_path, transport):
    res = launch("collectives_worker.py", tmp_path, transport)
    res.assert_all_passed(EXPECTED)
    for r in (0, 1):
        # a shape mismatch is reported within seconds, not after a timeout
        assert res.values(r)["mismatch_seconds"] < 10

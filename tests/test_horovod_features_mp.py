"""Process sets (static and dynamic), Adasum, the partial tape, BestModelCheckpoint: 2 ranks.

Adasum's numbers are Horovod's own (its allreduce called directly in the same
job); over Gloo every Adasum call must be refused naming MPI.
"""

import pytest

from conftest import WorkerRun

RUN = WorkerRun(
    "horovod_features_worker.py",
    timeout=900,
    env_extra={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"},
)

CHECKS = [
    "static_sets_rank_size_included",
    "collectives_in_own_set_see_only_this_rank",
    "collective_on_a_set_this_rank_is_not_in_is_refused",
    "dynamic_sets_remove_use_add_again",
    "optimizer_and_tape_reduce_within_the_set",
    "adasum_allreduce_is_horovods",
    "adasum_optimizer_is_horovods_delta_rule",
    "partial_tape_keeps_local_layers_local",
    "partial_optimizer_keeps_local_layers_local",
    "best_model_checkpoint_decides_job_wide_rank0_writes",
]


@pytest.mark.parametrize("check", CHECKS)
def test_horovod_feature(check, transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_check(check)


def test_horovod_features_reports_exactly_these_checks(transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_reported_exactly(CHECKS)

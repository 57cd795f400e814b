"""Horovod's elastic state classes and Keras state callbacks on 2 ranks, Gloo and MPI.

Not an elastic job: sync/restore/commit as Horovod's own ``test_elastic_state``
cases, and ``@hvdkit.elastic.run`` with the callbacks resuming mid-epoch.
The elastic launch (a lost worker, a newcomer) is
tests/test_elastic_horovod_api_mp.py.
"""

import pytest

from conftest import WorkerRun

RUN = WorkerRun("elastic_state_worker.py", timeout=600)

CHECKS = [
    "keras_state_sync_restore_commit",
    "tensorflow_and_object_state",
    "run_with_state_callbacks_resumes_mid_epoch_exactly",
    "keras_state_with_a_sampler_commits_its_position",
    "bad_input_is_refused",
]


@pytest.mark.parametrize("check", CHECKS)
def test_elastic_state(check, transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_check(check)


def test_elastic_state_reports_exactly_these_checks(transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_reported_exactly(CHECKS)

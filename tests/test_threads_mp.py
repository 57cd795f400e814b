"""HVDKIT_COMM_PRIORITY=1 on 2 ranks over Gloo and MPI (tests/multiproc/threads_worker.py)."""

import pytest

from conftest import WorkerRun

RUN = WorkerRun("threads_worker.py", timeout=300, env_extra={"HVDKIT_COMM_PRIORITY": "1"})
EXPECTED = ["policies_of_horovods_threads", "fit_per_gradient_allreduces_equals_single_process"]


@pytest.mark.parametrize("check", EXPECTED)
def test_comm_priority(check, transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_check(check)


def test_comm_priority_reports_exactly_these_checks(transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_reported_exactly(EXPECTED)

"""Horovod's threads on SCHED_RR on 2 ranks over Gloo and MPI: HVDKIT_COMM_PRIORITY=1
(tests/multiproc/threads_worker.py) and =auto (tests/multiproc/priority_trial_worker.py)."""

import pytest

from conftest import WorkerRun

RUN = WorkerRun("threads_worker.py", timeout=300, env_extra={"HVDKIT_COMM_PRIORITY": "1"})
EXPECTED = [
    "policies_of_horovods_threads",
    "fit_per_gradient_allreduces_equals_single_process",
    "shutdown_puts_every_thread_back_on_the_normal_policy",
]
TRIAL = WorkerRun(
    "priority_trial_worker.py", timeout=300, env_extra={"HVDKIT_COMM_PRIORITY": "auto"}
)
TRIAL_EXPECTED = [
    "the_trial_times_both_settings_and_keeps_what_it_says",
    "fit_after_the_trial_equals_single_process",
    "shutdown_puts_every_thread_back_on_the_normal_policy",
]


@pytest.mark.parametrize("check", EXPECTED)
def test_comm_priority(check, transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_check(check)


def test_comm_priority_reports_exactly_these_checks(transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_reported_exactly(EXPECTED)


@pytest.mark.parametrize("check", TRIAL_EXPECTED)
def test_comm_priority_auto(check, transport, tmp_path_factory):
    TRIAL.result(transport, tmp_path_factory).assert_check(check)


def test_comm_priority_auto_reports_exactly_these_checks(transport, tmp_path_factory):
    TRIAL.result(transport, tmp_path_factory).assert_reported_exactly(TRIAL_EXPECTED)

"""hvdkit.clusters.slurm.SlurmEnvironment: what an srun task, a batch script and hvdkitrun see.

The environments are the variables Slurm 22.05 gave tasks on tests/slurm_cluster.py's
cluster (srun -N2 -n4 and the batch script of sbatch -N2 -n2).
"""

from __future__ import annotations

import pytest

from hvdkit import config
from hvdkit.clusters._world import places
from hvdkit.clusters.slurm import SlurmEnvironment, expand_hostlist, expand_tasks_per_node
from hvdkit.errors import ConfigurationError

JOB = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS": "4"}


def task(rank: int, node: int, local_rank: int, per_node="2(x2)", **extra) -> dict:
    return {
        **JOB,
        "SLURM_TASKS_PER_NODE": per_node,
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_NODELIST": "n[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": per_node,
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(local_rank),
        "SLURM_NODEID": str(node),
        "SLURMD_NODENAME": f"n{node + 1}",
        **extra,
    }


def test_hostlists_and_task_counts():
    assert expand_hostlist("n[1-2]") == ["n1", "n2"]
    assert expand_hostlist("gpu[08-10,12],login,x[1-2]y") == [
        "gpu08",
        "gpu09",
        "gpu10",
        "gpu12",
        "login",
        "x1y",
        "x2y",
    ]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    for bad in ("n[3-1]", "n[a-b]"):
        with pytest.raises(ConfigurationError, match="cannot read the Slurm host list"):
            expand_hostlist(bad)
    with pytest.raises(ConfigurationError, match="tasks per node '2x'"):
        expand_tasks_per_node("2x")


def test_every_task_of_two_nodes_gets_horovods_layout():
    # (rank, node, local rank) of srun -N2 -n4 with block distribution
    got = []
    for rank, node, lr in [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]:
        env = SlurmEnvironment.detect(task(rank, node, lr))
        got.append(
            (env.rank, env.size, env.local_rank, env.local_size, env.cross_rank, env.cross_size)
        )
        assert env.rendezvous_host == "n1"
    assert got == [(0, 4, 0, 2, 0, 2), (1, 4, 1, 2, 0, 2), (2, 4, 0, 2, 1, 2), (3, 4, 1, 2, 1, 2)]


def test_uneven_nodes_cross_communicator_and_rendezvous_slots():
    # 3 tasks: two on n1, one on n2; local rank 1 exists on n1 only
    env = SlurmEnvironment.detect(task(1, 0, 1, per_node="2,1"))
    assert (env.local_size, env.cross_rank, env.cross_size) == (2, 0, 1)
    env = SlurmEnvironment.detect(task(2, 1, 0, per_node="2,1"))
    assert (env.local_size, env.cross_rank, env.cross_size) == (1, 1, 2)
    assert env.block_hosts() == ["n1", "n1", "n2"]
    world = [
        (p.hostname, p.local_rank, p.local_size, p.cross_size) for p in places(env.block_hosts())
    ]
    assert world == [("n1", 0, 2, 2), ("n1", 1, 2, 1), ("n2", 0, 1, 2)]


def test_batch_script_and_other_launchers_are_not_srun_tasks():
    batch = {**JOB, "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_PROCID": "0"}
    assert SlurmEnvironment.detect(batch) is None
    alloc = SlurmEnvironment.in_allocation(batch)
    assert (alloc.task, alloc.size, alloc.nodes, alloc.tasks_per_node) == (
        False,
        4,
        ["n1", "n2"],
        [2, 2],
    )
    assert SlurmEnvironment.detect({}) is None
    # hvdkitrun/horovodrun/mpirun inside the allocation (Open MPI's daemons are srun tasks)
    for var in config.LAUNCHER_SIZE_VARS:
        assert SlurmEnvironment.detect(task(0, 0, 0, **{var: "2"})) is None


def test_transport_follows_pmix_unless_horovod_controller_says():
    assert SlurmEnvironment.detect(task(0, 0, 0, PMIX_RANK="0")).transport() == "mpi"
    assert SlurmEnvironment.detect(task(0, 0, 0)).transport() == "gloo"
    env = task(0, 0, 0, PMIX_RANK="0", HOROVOD_CONTROLLER="gloo")
    assert SlurmEnvironment.detect(env).transport() == "gloo"
    with pytest.raises(ConfigurationError, match=r"#SBATCH --mpi=pmix"):
        SlurmEnvironment.detect(task(0, 0, 0, HOROVOD_CONTROLLER="mpi")).transport()
    with pytest.raises(ConfigurationError, match="HOROVOD_CONTROLLER='nccl'"):
        SlurmEnvironment.detect(task(0, 0, 0, HOROVOD_CONTROLLER="nccl")).transport()


def test_rendezvous_port_from_the_job_and_step_or_the_setting(monkeypatch):
    monkeypatch.delenv(config.RENDEZVOUS_PORT, raising=False)
    env = SlurmEnvironment.detect(task(0, 0, 0, SLURM_JOB_ID="1234", SLURM_STEP_ID="3"))
    assert env.rendezvous_port() == 29600 + 234 * 10 + 3
    monkeypatch.setenv(config.RENDEZVOUS_PORT, "31000")
    assert env.rendezvous_port() == 31000
    monkeypatch.setenv(config.RENDEZVOUS_PORT, "x")
    with pytest.raises(ConfigurationError, match="HVDKIT_RENDEZVOUS_PORT='x' is not a TCP port"):
        env.rendezvous_port()


def test_worker_num_must_match_the_task_count(monkeypatch):
    env = SlurmEnvironment.detect(task(0, 0, 0))
    monkeypatch.setenv(config.WORKER_NUM, "4")
    env.check_worker_num()
    monkeypatch.setenv(config.WORKER_NUM, "3")
    with pytest.raises(ConfigurationError) as err:
        env.check_worker_num()
    assert str(err.value) == (
        "HVDKIT_WORKER_NUM='3' but srun started 4 tasks (SLURM_STEP_NUM_TASKS=4). Under srun "
        "every task is a worker: set '#SBATCH --ntasks=3' (or srun -n 3), or unset "
        "HVDKIT_WORKER_NUM."
    )
    monkeypatch.delenv(config.WORKER_NUM)
    monkeypatch.setenv("MS_WORKER_NUM", "3")  # MindSpore's name: the message names it
    with pytest.raises(ConfigurationError, match=r"^MS_WORKER_NUM='3' .*or unset MS_WORKER_NUM\.$"):
        env.check_worker_num()


def test_a_task_without_slurms_numbers_is_refused():
    with pytest.raises(ConfigurationError, match="SLURM_PROCID='x' is not a number >= 0"):
        SlurmEnvironment.detect(task(0, 0, 0, SLURM_PROCID="x"))


def test_requeue_count():
    assert SlurmEnvironment.detect(task(0, 0, 0)).restarts == 0
    assert SlurmEnvironment.detect(task(0, 0, 0, SLURM_RESTART_COUNT="2")).restarts == 2


def test_hvdkitrun_in_an_allocation_takes_its_nodes_and_tasks(monkeypatch):
    from hvdkit.launch import cli

    for name, value in {**JOB, "SLURM_TASKS_PER_NODE": "2(x2)"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS", raising=False)
    parser = cli.build_parser()
    assert cli.plan(parser.parse_args(["python", "train.py"])) == (4, [("n1", 2), ("n2", 2)])
    assert cli.plan(parser.parse_args(["-np", "2", "python", "train.py"])) == (
        2,
        [("n1", 2), ("n2", 2)],
    )
    # -H wins over the allocation
    assert cli.plan(parser.parse_args(["-H", "a:1", "python", "t.py"])) == (1, [("a", 1)])


def test_job_record_time_limits_and_requeue_advice():
    from hvdkit.clusters.slurm import parse_job_record, requeue_advice, time_limit_seconds

    record = parse_job_record("JobId=7 JobState=RUNNING Requeue=1 TimeLimit=00:05:00 x=")
    assert (record["JobState"], record["Requeue"], record["x"]) == ("RUNNING", "1", "")
    assert [time_limit_seconds(v) for v in ("1-02:00:30", "00:05:00", "02:30", "7")] == [
        93630.0,
        300.0,
        150.0,
        420.0,
    ]
    assert [time_limit_seconds(v) for v in ("UNLIMITED", "Partition_Limit", "")] == [None] * 3
    with_signal = "#!/bin/bash\n#SBATCH --requeue\n#SBATCH --signal=TERM@60\nsrun python t.py\n"
    assert requeue_advice(record, with_signal, 25.0) == []
    (warning,) = requeue_advice(record, "#!/bin/bash\n#SBATCH --requeue\n", 25.0)
    assert "no '#SBATCH --signal' line" in warning and "'#SBATCH --signal=TERM@60'" in warning
    assert requeue_advice({**record, "Requeue": "0"}, "#!/bin/bash\n", 25.0) == []
    assert requeue_advice(record, None, 25.0) == []  # the script is not known: say nothing
    with pytest.raises(ConfigurationError) as err:
        requeue_advice(record, with_signal, 300.0)
    assert str(err.value).startswith(
        "the job's time limit (00:05:00) is not longer than hvdkit's preemption grace period "
        "(300 s, HVDKIT_PREEMPT_GRACE)"
    )


def test_init_refuses_srun_tasks_that_did_not_form_one_job(monkeypatch):
    # srun --mpi=pmix gave 4 tasks, but Horovod formed a job of 1 (as MPI does without PMIx)
    from hvdkit import runtime
    from hvdkit.backends.local import LocalBackend

    for var in config.LAUNCHER_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    for name, value in task(0, 0, 0, PMIX_RANK="0").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(runtime, "create", lambda *args, **kwargs: LocalBackend())
    with pytest.raises(ConfigurationError) as err:
        runtime.init(pin_gpu=False)
    assert str(err.value).startswith(
        "srun started 4 tasks but Horovod formed a job of 1: the tasks did not find each other, "
        "and each would train alone. For MPI, srun must give them PMIx ('#SBATCH --mpi=pmix'"
    )
    assert not runtime.is_initialized()


def test_init_refuses_a_batch_script_of_several_tasks_without_srun(monkeypatch):
    from hvdkit import runtime

    for var in config.LAUNCHER_SIZE_VARS:
        monkeypatch.delenv(var, raising=False)
    for name, value in {**JOB, "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_PROCID": "0"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(
        ConfigurationError, match=r"Slurm job 7, which has 4 tasks \(SLURM_NTASKS\)"
    ):
        runtime.init(pin_gpu=False)
    assert not runtime.is_initialized()
    monkeypatch.setenv("SLURM_NTASKS", "1")  # one task: a job of size 1 is what was asked for
    runtime.init(pin_gpu=False)
    assert runtime.size() == 1
    runtime.shutdown()

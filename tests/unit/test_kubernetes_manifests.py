"""examples/kubernetes/*.yaml parse and say what docs/slurm.md says they do.

They have NOT run on a Kubernetes cluster; this only catches a broken file or a
field that drifted from the launch scripts and settings they name.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from hvdkit import config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
K8S = EXAMPLES / "kubernetes"


def load(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_mpijob_runs_two_ranks_of_the_main_example():
    (job,) = load("mpijob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v2beta1", "MPIJob")
    specs = job["spec"]["mpiReplicaSpecs"]
    launcher = specs["Launcher"]["template"]["spec"]["containers"][0]["command"]
    assert launcher[:3] == ["mpirun", "-np", "2"]
    assert launcher[-1] == "/opt/hvdkit/examples/train_digits.py"
    assert (EXAMPLES / "train_digits.py").exists()
    assert specs["Worker"]["replicas"] * job["spec"]["slotsPerWorker"] == 2
    grace = specs["Worker"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > config.DEFAULT_PREEMPT_GRACE_S


def test_plain_job_scheduler_service_and_workers_agree():
    service, sched, workers = load("job.yaml")
    assert (service["kind"], sched["kind"], workers["kind"]) == ("Service", "Job", "Job")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["ports"][0]["port"] == config.DEFAULT_SCHED_PORT
    labels = sched["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    s = sched["spec"]["template"]["spec"]["containers"][0]
    w_spec = workers["spec"]["template"]["spec"]
    w = w_spec["containers"][0]
    assert s["command"] == ["/opt/hvdkit/examples/cluster/run_scheduler.sh"]
    assert w["command"][:3] == ["/opt/hvdkit/examples/cluster/run_workers.sh", "1", "python"]
    for script in ("run_scheduler.sh", "run_workers.sh"):
        assert (EXAMPLES / "cluster" / script).exists()
    s_env, w_env = env_of(s), env_of(w)
    # as many workers (one rank each) as the scheduler waits for
    assert int(s_env[config.WORKER_NUM]) == workers["spec"]["completions"] == 2
    assert workers["spec"]["parallelism"] == 2
    assert s_env[config.SCHED_HOST] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert w_env[config.SCHED_HOST] == service["metadata"]["name"]
    assert s_env[config.JOB_TOKEN] == w_env[config.JOB_TOKEN]  # the same Secret
    assert w_spec["terminationGracePeriodSeconds"] > config.DEFAULT_PREEMPT_GRACE_S

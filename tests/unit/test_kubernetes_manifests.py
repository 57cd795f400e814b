"""examples/kubernetes/*.yaml fit their schemas and say what docs/kubernetes.md says.

They have NOT run on a Kubernetes cluster. The MPIJob is validated against a
hand-written subset of the MPI Operator's v2beta1 schema (``MPIJOB`` below), the
plain Service and Jobs against a subset of Kubernetes' own (``SERVICE``, ``JOB``);
broken copies show that each check refuses what it should. The other tests catch
a field that drifted from the launch scripts and settings the manifests name.
"""

from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from hvdkit import config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
K8S = EXAMPLES / "kubernetes"


# --- The schema: facts from the Kubeflow MPI Operator at commit caa3c47fc42e ("Prepare
# v0.8.2", 2026-07-02): the v2beta1 CRD's openAPIV3Schema (manifests/base/
# kubeflow.org_mpijobs.yaml: what the API server accepts), the Go types (pkg/apis/kubeflow/
# v2beta1/types.go) and the checks the operator runs before it creates pods
# (pkg/apis/kubeflow/validation/validation.go). Written here by hand, only as far as the
# manifests need: a field they start to use must be added below from the same sources.
# The CRD preserves no unknown fields anywhere, so every object here is closed
# (additionalProperties false): the API server would drop a misspelled field, or with
# kubectl's strict field validation refuse it.


def closed(required: tuple[str, ...] = (), **properties: dict) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


STRING = {"type": "string"}
BOOL = {"type": "boolean"}
INT32 = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
INT64 = {"type": "integer"}
NONNEGATIVE_INT32 = {**INT32, "minimum": 0}  # validation.go: ValidateNonnegativeField
NONNEGATIVE_INT64 = {**INT64, "minimum": 0}
STRINGS = {"type": "array", "items": STRING}
STRING_MAP = {"type": "object", "additionalProperties": STRING}
# resource.Quantity (x-kubernetes-int-or-string): an integer, or a decimal with an
# optional binary (Ki..Ei), decimal (n..E) or exponent suffix
_DECIMAL = r"(\d+(\.\d*)?|\.\d+)"
QUANTITY = {
    "anyOf": [
        {"type": "integer"},
        {
            "type": "string",
            "pattern": rf"^[+-]?{_DECIMAL}([KMGTPE]i|[numkMGTPE]|[eE][+-]?{_DECIMAL})?$",
        },
    ]
}
QUANTITIES = {"type": "object", "additionalProperties": QUANTITY}

# core/v1 as the CRD embeds it in each replica's template
ENV_VAR = closed(
    ("name",),
    name=STRING,
    value=STRING,
    valueFrom=closed(
        fieldRef=closed(("fieldPath",), apiVersion=STRING, fieldPath=STRING),
        secretKeyRef=closed(("key",), name=STRING, key=STRING, optional=BOOL),
    ),
)
CONTAINER = closed(
    ("name",),
    name=STRING,
    image=STRING,
    command=STRINGS,
    args=STRINGS,
    env={"type": "array", "items": ENV_VAR},
    resources=closed(limits=QUANTITIES, requests=QUANTITIES),
)
POD_TEMPLATE = closed(
    metadata=closed(name=STRING, labels=STRING_MAP, annotations=STRING_MAP),
    spec=closed(
        ("containers",),
        # validation.go: at least one container per replica (as Kubernetes asks of a pod)
        containers={"type": "array", "items": CONTAINER, "minItems": 1},
        restartPolicy={"enum": ["Always", "OnFailure", "Never"]},  # core/v1 RestartPolicy
        terminationGracePeriodSeconds=INT64,
    ),
)
DNS_LABEL = {"type": "string", "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}


def resource(api_version: str, kind: str, name: dict, spec: dict) -> dict:
    """A whole object: its apiVersion, kind, metadata (``name`` for its name) and spec."""
    metadata = closed(
        ("name",), name=name, namespace=STRING, labels=STRING_MAP, annotations=STRING_MAP
    )
    return closed(
        ("apiVersion", "kind", "metadata", "spec"),
        apiVersion={"const": api_version},
        kind={"const": kind},
        metadata=metadata,
        spec=spec,
    )


def replica(replicas: dict, required: tuple[str, ...] = ()) -> dict:
    # validation.go accepts only these two restart policies (types.go also names
    # Always and ExitCode); the defaults are OnFailure (launcher) and Never (workers)
    restart = {"enum": ["Never", "OnFailure"]}
    return closed(required, replicas=replicas, restartPolicy=restart, template=POD_TEMPLATE)


MPIJOB = resource(
    "kubeflow.org/v2beta1",
    "MPIJob",
    # validation.go: "<name>-worker-<index>" must be a DNS-1035 label (checked whole in
    # test_mpijob_worker_host_names_are_dns_labels)
    DNS_LABEL,
    closed(
        ("mpiReplicaSpecs",),  # the CRD's one required field
        slotsPerWorker=NONNEGATIVE_INT32,  # default 1
        runLauncherAsWorker=BOOL,  # default false
        sshAuthMountPath=STRING,  # default /root/.ssh
        # types.go's two values; the published CRD does not enforce them
        launcherCreationPolicy={"enum": ["AtStartup", "WaitForWorkersReady"]},
        mpiImplementation={"enum": ["OpenMPI", "Intel", "MPICH"]},  # default OpenMPI
        runPolicy=closed(
            # default None; the CRD types it as a string, validation.go takes these three
            cleanPodPolicy={"enum": ["None", "Running", "All"]},
            ttlSecondsAfterFinished=NONNEGATIVE_INT32,
            activeDeadlineSeconds=NONNEGATIVE_INT64,
            backoffLimit=NONNEGATIVE_INT32,
            suspend=BOOL,
            managedBy={"enum": ["kubeflow.org/mpi-operator", "kueue.x-k8s.io/multikueue"]},
            schedulingPolicy=closed(
                minAvailable=INT32,
                queue=STRING,
                minResources=QUANTITIES,
                priorityClass=STRING,
                scheduleTimeoutSeconds=INT32,
            ),
        ),
        # The CRD takes any key here, but the operator reads only Launcher and Worker:
        # another key (a typo such as "Workers") would be ignored, so it is refused here.
        mpiReplicaSpecs=closed(
            ("Launcher",),  # validation.go: "must have Launcher replica spec"
            Launcher=replica({**INT32, "const": 1}),  # validation.go: must be 1
            # Worker replicas default to 0, which validation.go refuses: state it
            Worker=replica({**INT32, "minimum": 1}, required=("replicas",)),
        ),
    ),
)


def schema_errors(document: dict, schema: dict) -> set[tuple[tuple, str]]:
    """(path, failed keyword) of every error: empty when the document fits."""
    validator = jsonschema.Draft202012Validator(schema)
    return {(tuple(e.absolute_path), e.validator) for e in validator.iter_errors(document)}


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


def test_the_schemas_are_valid_json_schemas():
    jsonschema.Draft202012Validator.check_schema(MPIJOB)


def test_mpijob_fits_the_operators_v2beta1_schema():
    (job,) = load("mpijob.yaml")
    assert schema_errors(job, MPIJOB) == set()


def test_mpijob_worker_host_names_are_dns_labels():
    # validation.go: the last worker's host name must be a DNS-1035 label (<= 63 characters)
    (job,) = load("mpijob.yaml")
    workers = job["spec"]["mpiReplicaSpecs"]["Worker"]["replicas"]
    last = f"{job['metadata']['name']}-worker-{workers - 1}"
    assert last == "hvdkit-digits-worker-1"
    assert len(last) <= 63
    metadata = MPIJOB["properties"]["metadata"]
    assert jsonschema.Draft202012Validator(metadata).is_valid({"name": last})


def test_mpijob_launcher_and_workers_as_the_operator_runs_them():
    (job,) = load("mpijob.yaml")
    specs = job["spec"]["mpiReplicaSpecs"]
    launcher = specs["Launcher"]["template"]["spec"]["containers"][0]["command"]
    worker = specs["Worker"]["template"]["spec"]["containers"][0]
    # the operator runs /usr/sbin/sshd -De in a worker container with neither
    assert "command" not in worker and "args" not in worker
    # Open MPI's flag, so Open MPI's hostfile variables from the operator
    assert job["spec"]["mpiImplementation"] == "OpenMPI"
    assert "--allow-run-as-root" in launcher
    assert worker["resources"]["limits"] == {"cpu": "2"}


LAUNCHER = ("spec", "mpiReplicaSpecs", "Launcher")
WORKER = ("spec", "mpiReplicaSpecs", "Worker")
CONTAINER_0 = ("template", "spec", "containers", 0)


def _set(document: dict, path: tuple, value) -> None:
    *parents, last = path
    for key in parents:
        document = document[key]
    document[last] = value


def _rename(document: dict, path: tuple, new_name: str) -> None:
    *parents, last = path
    for key in parents:
        document = document[key]
    document[new_name] = document.pop(last)


# (what is wrong, the edit, (path, keyword) of the one error it must give)
BROKEN = [
    (
        "misspelled spec field",
        lambda j: _rename(j, ("spec", "slotsPerWorker"), "slotPerWorker"),
        (("spec",), "additionalProperties"),
    ),
    (
        "misspelled container field",
        lambda j: _rename(j, (*LAUNCHER, *CONTAINER_0, "command"), "commands"),
        ((*LAUNCHER, *CONTAINER_0), "additionalProperties"),
    ),
    (
        "replica type not Launcher/Worker",
        lambda j: _rename(j, WORKER, "Workers"),
        (("spec", "mpiReplicaSpecs"), "additionalProperties"),
    ),
    (
        "cleanPodPolicy not an enum value",
        lambda j: _set(j, ("spec", "runPolicy", "cleanPodPolicy"), "OnCompletion"),
        (("spec", "runPolicy", "cleanPodPolicy"), "enum"),
    ),
    (
        "mpiImplementation in the wrong case",
        lambda j: _set(j, ("spec", "mpiImplementation"), "OpenMpi"),
        (("spec", "mpiImplementation"), "enum"),
    ),
    (
        "slotsPerWorker a string",
        lambda j: _set(j, ("spec", "slotsPerWorker"), "1"),
        (("spec", "slotsPerWorker"), "type"),
    ),
    (
        "worker replicas a string",
        lambda j: _set(j, (*WORKER, "replicas"), "2"),
        ((*WORKER, "replicas"), "type"),
    ),
    (
        "two launchers",
        lambda j: _set(j, (*LAUNCHER, "replicas"), 2),
        ((*LAUNCHER, "replicas"), "const"),
    ),
    (
        "cpu limit not a quantity",
        lambda j: _set(j, (*WORKER, *CONTAINER_0, "resources", "limits", "cpu"), "two"),
        ((*WORKER, *CONTAINER_0, "resources", "limits", "cpu"), "anyOf"),
    ),
    (
        "grace period a string",
        lambda j: _set(j, (*WORKER, "template", "spec", "terminationGracePeriodSeconds"), "30"),
        ((*WORKER, "template", "spec", "terminationGracePeriodSeconds"), "type"),
    ),
]


@pytest.mark.parametrize(("wrong", "edit", "error"), BROKEN, ids=[b[0] for b in BROKEN])
def test_a_broken_mpijob_fails_the_schema_where_it_is_broken(wrong, edit, error):
    (job,) = load("mpijob.yaml")
    edit(job)
    assert schema_errors(job, MPIJOB) == {error}, wrong


# --- job.yaml's Service and Jobs, the same way: facts from kubernetes/api at commit
# 10b39a39bcee (2026-07-24): core/v1/types.go (ServiceSpec, ServicePort, Protocol) and
# batch/v1/types.go (JobSpec, CompletionMode); the non-negative counts, the port range and
# a Service name being a DNS-1035 label are Kubernetes' validation of those types.
SERVICE = resource(
    "v1",
    "Service",
    DNS_LABEL,
    closed(
        type={"enum": ["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]},
        clusterIP=STRING,  # "None": headless
        selector=STRING_MAP,
        ports={
            "type": "array",
            "items": closed(
                ("port",),
                name=STRING,
                protocol={"enum": ["TCP", "UDP", "SCTP"]},
                port={**INT32, "minimum": 1, "maximum": 65535},
                targetPort={"anyOf": [{"type": "integer"}, STRING]},
            ),
        },
    ),
)
JOB = resource(
    "batch/v1",
    "Job",
    STRING,
    closed(
        ("template",),
        parallelism=NONNEGATIVE_INT32,
        completions=NONNEGATIVE_INT32,
        completionMode={"enum": ["NonIndexed", "Indexed"]},
        backoffLimit=NONNEGATIVE_INT32,
        activeDeadlineSeconds=NONNEGATIVE_INT64,
        ttlSecondsAfterFinished=NONNEGATIVE_INT32,
        suspend=BOOL,
        template=POD_TEMPLATE,
    ),
)
POD = ("spec", "template", "spec")


def test_plain_jobs_fit_kubernetes_schemas():
    for schema in (SERVICE, JOB):
        jsonschema.Draft202012Validator.check_schema(schema)
    service, sched, workers = load("job.yaml")
    assert schema_errors(service, SERVICE) == set()
    assert schema_errors(sched, JOB) == set()
    assert schema_errors(workers, JOB) == set()


BROKEN_PLAIN = [
    (
        "misspelled Job field",
        2,
        lambda j: _rename(j, ("spec", "completions"), "completion"),
        (("spec",), "additionalProperties"),
    ),
    (
        "completionMode in the wrong case",
        2,
        lambda j: _set(j, ("spec", "completionMode"), "indexed"),
        (("spec", "completionMode"), "enum"),
    ),
    (
        "Service port a string",
        0,
        lambda j: _set(j, ("spec", "ports", 0, "port"), "29500"),
        (("spec", "ports", 0, "port"), "type"),
    ),
    (
        "env from a field that is not there",
        1,
        lambda j: _set(j, (*POD, "containers", 0, "env", 1, "valueFrom"), {"podIP": True}),
        ((*POD, "containers", 0, "env", 1, "valueFrom"), "additionalProperties"),
    ),
    (
        "pod restartPolicy not an enum value",
        2,
        lambda j: _set(j, (*POD, "restartPolicy"), "Sometimes"),
        ((*POD, "restartPolicy"), "enum"),
    ),
]


@pytest.mark.parametrize(
    ("wrong", "index", "edit", "error"), BROKEN_PLAIN, ids=[b[0] for b in BROKEN_PLAIN]
)
def test_a_broken_plain_job_fails_the_schema_where_it_is_broken(wrong, index, edit, error):
    document = load("job.yaml")[index]
    edit(document)
    assert schema_errors(document, (SERVICE, JOB, JOB)[index]) == {error}, wrong


def _is_part(excerpt, full) -> bool:
    """Whether every key and list item of ``excerpt`` is in ``full`` with the same value."""
    if isinstance(excerpt, dict):
        return isinstance(full, dict) and all(
            k in full and _is_part(v, full[k]) for k, v in excerpt.items()
        )
    if isinstance(excerpt, list):
        return (
            isinstance(full, list)
            and len(excerpt) <= len(full)
            and all(_is_part(e, f) for e, f in zip(excerpt, full, strict=False))
        )
    return excerpt == full


def test_is_part():
    full = {"a": [{"b": 1, "c": 2}, {"d": 3}], "e": "x"}
    assert _is_part({"a": [{"c": 2}]}, full)
    assert not _is_part({"a": [{"c": 3}]}, full)
    assert not _is_part({"f": 1}, full)
    assert not _is_part({"a": [{}, {}, {}]}, full)


def test_the_yaml_on_the_kubernetes_page_is_in_the_manifests():
    page = (EXAMPLES.parent / "docs" / "kubernetes.md").read_text()
    block = re.compile(r"^```yaml\n# examples/kubernetes/([\w.]+)[^\n]*\n(.*?)^```", re.M | re.S)
    excerpts = block.findall(page)
    assert [name for name, _ in excerpts] == ["mpijob.yaml", "job.yaml"]
    for name, body in excerpts:
        documents = load(name)
        for shown in (d for d in yaml.safe_load_all(body) if d):
            assert any(_is_part(shown, d) for d in documents), (name, shown)

"""Slurm: everything hvdkit knows about it, in one place.

After Lightning Fabric's ``plugins/environments/slurm.py``:
:meth:`SlurmEnvironment.detect` says whether this process is a task of an
``srun`` step, and the object holds everything hvdkit reads from Slurm's
variables (each name written once, below). The rest of this module is what
hvdkit does with them: ``srun``'s tasks meet over Gloo
(:func:`join_srun_step`, called by :func:`hvdkit.init`), ``hvdkitrun`` takes
the allocation (:func:`allocation_hosts`), a job whose tasks did not find each
other is refused (:func:`refuse_split_step`, :func:`refuse_task_without_srun`),
and on ``SIGTERM`` rank 0 checks and requeues the job (:func:`check_job`,
:func:`requeue_job`). No TensorFlow; Horovod's rendezvous only through
:mod:`hvdkit.clusters._world`.

What Slurm tells a task (Slurm 22.05, checked on the test cluster of
tests/test_slurm.py): ``SLURM_PROCID`` (rank), ``SLURM_STEP_NUM_TASKS``
(size), ``SLURM_LOCALID`` (rank on the node), ``SLURMD_NODENAME``,
``SLURM_STEP_NODELIST`` (``n[1-2]``) and ``SLURM_STEP_TASKS_PER_NODE``
(``2(x2)``). The batch script itself sees the allocation's
``SLURM_JOB_NODELIST``/``SLURM_TASKS_PER_NODE`` and ``SLURM_NTASKS``, but no
``SLURM_STEP_*``: that is how a task is told from the batch script. Under
``srun --mpi=pmix`` Open MPI's own ``OMPI_COMM_WORLD_*`` are absent (PMIx
gives ``PMIX_RANK``), so without this class a task would look unlaunched.

Example (rank 1 of ``srun -N2 -n2``)::

    >>> env = SlurmEnvironment.detect()
    >>> env.rank, env.size, env.local_rank, env.local_size, env.cross_rank, env.cross_size
    (1, 2, 0, 1, 1, 2)
    >>> env.nodes, env.rendezvous_host
    (['n1', 'n2'], 'n1')
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping

from .. import config
from ..errors import ConfigurationError
from . import _world

__all__ = [
    "SlurmEnvironment",
    "allocation_hosts",
    "check_job",
    "expand_hostlist",
    "expand_tasks_per_node",
    "join_srun_step",
    "parse_job_record",
    "refuse_split_step",
    "refuse_task_without_srun",
    "requeue_advice",
    "requeue_job",
    "time_limit_seconds",
]
logger = logging.getLogger("hvdkit.slurm")

# --- Slurm's variables hvdkit reads ---
JOB_ID = "SLURM_JOB_ID"
STEP_ID = "SLURM_STEP_ID"
PROCID = "SLURM_PROCID"
LOCALID = "SLURM_LOCALID"
NODENAME = "SLURMD_NODENAME"
STEP_NUM_TASKS = "SLURM_STEP_NUM_TASKS"  # set in srun's tasks only, not in the batch script
STEP_NODELIST = "SLURM_STEP_NODELIST"
STEP_TASKS_PER_NODE = "SLURM_STEP_TASKS_PER_NODE"
JOB_NODELIST = "SLURM_JOB_NODELIST"
TASKS_PER_NODE = "SLURM_TASKS_PER_NODE"  # the allocation's, in the batch script
NTASKS = "SLURM_NTASKS"
RESTART_COUNT = "SLURM_RESTART_COUNT"  # how often this job was requeued (absent: never)
PMIX_RANK = "PMIX_RANK"  # srun --mpi=pmix: Open MPI finds its peers through PMIx
# Horovod's own choice of controller; hvdkit honours it under srun to pick Gloo or MPI
CONTROLLER = "HOROVOD_CONTROLLER"
GLOO, MPI = "gloo", "mpi"

RENDEZVOUS_PORT_BASE = 29600  # + a number from the job and step ids (see rendezvous_port)


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list as names, in order.

    Example:
        >>> expand_hostlist("n[1-2],gpu[08-10,12],login")
        ['n1', 'n2', 'gpu08', 'gpu09', 'gpu10', 'gpu12', 'login']

    Raises:
        ConfigurationError: brackets that do not close, or a range like ``[3-1]``.
    """
    names: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", hostlist):
        parts = re.split(r"\[([^\]]*)\]", item)
        expanded = [""]
        for i, part in enumerate(parts):
            if i % 2 == 0:
                expanded = [e + part for e in expanded]
            else:
                expanded = [e + n for e in expanded for n in _bracket(part, hostlist)]
        if "[" in item and item.count("[") != item.count("]"):
            raise ConfigurationError(f"cannot read the Slurm host list {hostlist!r}")
        names += expanded
    return names


def _bracket(body: str, hostlist: str) -> list[str]:
    out = []
    for piece in body.split(","):
        lo, _, hi = piece.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ConfigurationError(f"cannot read the Slurm host list {hostlist!r}")
        width = len(lo)
        out += [str(n).zfill(width) for n in range(int(lo), int(hi or lo) + 1)]
    return out


def expand_tasks_per_node(spec: str) -> list[int]:
    """Slurm's tasks-per-node list, one count per node.

    Example:
        >>> expand_tasks_per_node("2(x3),1")
        [2, 2, 2, 1]
    """
    counts = []
    for piece in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", piece.strip())
        if m is None:
            raise ConfigurationError(f"cannot read Slurm's tasks per node {spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


class SlurmEnvironment:
    """A task of an ``srun`` step, or (``task=False``) a batch script inside an allocation.

    Attributes:
        job_id, step_id: Slurm's ids (``step_id`` is ``None`` in the batch script).
        rank, size, local_rank: this task's; ``size`` is the step's task count.
        nodes: the step's (or the allocation's) node names, in Slurm's order.
        tasks_per_node: tasks on each of ``nodes``.
        node: this task's node name.
    """

    def __init__(self, env: Mapping[str, str]):
        self._env = env
        self.job_id = env[JOB_ID]
        self.step_id = env.get(STEP_ID)
        self.task = STEP_NUM_TASKS in env
        nodelist = env.get(STEP_NODELIST if self.task else JOB_NODELIST) or env.get(JOB_NODELIST)
        per_node = env.get(STEP_TASKS_PER_NODE if self.task else TASKS_PER_NODE)
        self.nodes = expand_hostlist(nodelist or "")
        self.tasks_per_node = expand_tasks_per_node(per_node) if per_node else []
        self.node = env.get(NODENAME, "")
        if self.task:
            self.rank = self._int(PROCID, 0)
            self.size = self._int(STEP_NUM_TASKS, 1)
            self.local_rank = self._int(LOCALID, 0)
        else:
            self.rank, self.local_rank = 0, 0
            self.size = self._int(NTASKS, 1) if NTASKS in env else sum(self.tasks_per_node) or 1

    def _int(self, name: str, minimum: int) -> int:
        raw = self._env.get(name, "")
        if not raw.isdigit() or int(raw) < minimum:
            raise ConfigurationError(
                f"{name}={raw!r} is not a number >= {minimum}, yet Slurm sets it for every "
                "task; start the program with srun inside an sbatch/salloc allocation."
            )
        return int(raw)

    @classmethod
    def in_allocation(cls, env: Mapping[str, str] | None = None) -> SlurmEnvironment | None:
        """The allocation this process runs in (a batch script or a task), or ``None``."""
        env = os.environ if env is None else env
        return cls(env) if env.get(JOB_ID) else None

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> SlurmEnvironment | None:
        """This process as a task of ``srun``, or ``None``.

        ``None`` too when another launcher started it inside the allocation
        (``hvdkitrun``, ``horovodrun``, ``mpirun``: their own world size is
        set, and Open MPI even starts its daemons with ``srun``).
        """
        env = os.environ if env is None else env
        if any(env.get(v) for v in config.LAUNCHER_SIZE_VARS):
            return None
        found = cls.in_allocation(env)
        return found if found is not None and found.task else None

    # ---------------------------------------------------------------- layout
    @property
    def node_index(self) -> int:
        """This task's node's position in :attr:`nodes`."""
        if self.node in self.nodes:
            return self.nodes.index(self.node)
        return int(self._env.get("SLURM_NODEID", "0"))

    @property
    def local_size(self) -> int:
        return self.tasks_per_node[self.node_index] if self.tasks_per_node else 1

    @property
    def cross_size(self) -> int:
        """Nodes with a task of this local rank (Horovod's cross communicator)."""
        return sum(c > self.local_rank for c in self.tasks_per_node) or 1

    @property
    def cross_rank(self) -> int:
        return sum(c > self.local_rank for c in self.tasks_per_node[: self.node_index])

    def block_hosts(self) -> list[str]:
        """A node name per rank, the nodes' tasks in a block (for the rendezvous server).

        Only the counts per node matter there (how many ranks meet in each
        scope), so the server's world is the same whatever ``--distribution``
        placed the ranks.
        """
        return [n for n, c in zip(self.nodes, self.tasks_per_node, strict=False) for _ in range(c)]

    @property
    def rendezvous_host(self) -> str:
        """The node of rank 0 (the step's first node): it serves Gloo's rendezvous."""
        if not self.nodes:
            raise ConfigurationError(
                f"{STEP_NODELIST} and {JOB_NODELIST} are empty, so hvdkit cannot tell where "
                "rank 0 runs to start Gloo's rendezvous there; use srun inside an allocation "
                "(sbatch/salloc), or srun --mpi=pmix to use MPI instead."
            )
        return self.nodes[0]

    def rendezvous_port(self) -> int:
        """``HVDKIT_RENDEZVOUS_PORT``, else a port from the job and step ids (29600-39599).

        Every task computes the same one without talking to the others; two
        steps of one job running at once on a node would need different ones.
        """
        step = int(self.step_id) if (self.step_id or "").isdigit() else 0
        default = RENDEZVOUS_PORT_BASE + (int(self.job_id) % 1000) * 10 + step % 10
        return config.get_int(
            config.RENDEZVOUS_PORT,
            default,
            minimum=1,
            what="a TCP port",
            fix="choose a free port every node can reach on the first node of the step.",
        )

    @property
    def restarts(self) -> int:
        """How often Slurm requeued this job (``SLURM_RESTART_COUNT``, 0 before the first)."""
        raw = self._env.get(RESTART_COUNT, "0")
        return int(raw) if raw.isdigit() else 0

    # ---------------------------------------------------------------- transport
    def transport(self) -> str:
        """``"mpi"`` when ``srun`` gave the tasks PMIx (``--mpi=pmix``), else ``"gloo"``.

        ``HOROVOD_CONTROLLER=gloo`` or ``=mpi`` chooses explicitly.

        Raises:
            ConfigurationError: MPI asked for but the tasks have no PMIx.
        """
        asked = (self._env.get(CONTROLLER) or "").strip().lower()
        pmix = PMIX_RANK in self._env
        if asked not in ("", GLOO, MPI):
            raise ConfigurationError(
                f"{CONTROLLER}={asked!r}: under srun hvdkit uses 'gloo' or 'mpi' (or leave it "
                "unset: MPI with srun --mpi=pmix, Gloo otherwise)."
            )
        if asked == MPI and not pmix:
            raise ConfigurationError(
                f"{CONTROLLER}=mpi but srun started this task without PMIx, so MPI cannot find "
                "the other tasks and each would train alone. Add '#SBATCH --mpi=pmix' (or "
                f"'srun --mpi=pmix'; `srun --mpi=list` shows what the cluster has), or set "
                f"{CONTROLLER}=gloo."
            )
        return asked or (MPI if pmix else GLOO)

    def check_worker_num(self) -> None:
        """Refuse ``HVDKIT_WORKER_NUM`` that disagrees with the step's task count.

        Raises:
            ConfigurationError: names both numbers and the ``#SBATCH`` line.
        """
        raw = config.get(config.WORKER_NUM)
        if raw is None:
            return
        if raw.strip() != str(self.size):
            var = config.named(config.WORKER_NUM)  # MS_WORKER_NUM, if that is the one set
            raise ConfigurationError(
                f"{var}={raw!r} but srun started {self.size} tasks "
                f"({STEP_NUM_TASKS}={self.size}). Under srun every task is a worker: set "
                f"'#SBATCH --ntasks={raw.strip()}' (or srun -n {raw.strip()}), or unset "
                f"{var}."
            )


# ---------------------------------------------------------------- the job record
def parse_job_record(text: str) -> dict[str, str]:
    """``scontrol show job -o``'s ``Key=Value`` fields.

    Example:
        >>> parse_job_record("JobId=7 JobName=train Requeue=1 TimeLimit=00:05:00")["TimeLimit"]
        '00:05:00'
    """
    return dict(re.findall(r"(\w+)=(\S*)", text))


def time_limit_seconds(value: str) -> float | None:
    """Slurm's ``TimeLimit`` (``[D-]HH:MM:SS``, ``MM:SS``, ``UNLIMITED``) in seconds; None: none.

    Example:
        >>> time_limit_seconds("1-02:00:30"), time_limit_seconds("UNLIMITED")
        (93630.0, None)
    """
    days, _, clock = value.rpartition("-")
    parts = clock.split(":")
    if not all(p.isdigit() for p in parts) or len(parts) > 3 or not days.isdigit() and days:
        return None
    if len(parts) == 1:  # minutes
        parts.append("0")
    seconds = 0
    for p in parts:
        seconds = seconds * 60 + int(p)
    return float(seconds + int(days or 0) * 86400)


def requeue_advice(record: dict[str, str], script: str | None, grace_s: float) -> list[str]:
    """What is wrong with a job's preemption settings, as messages naming the #SBATCH line.

    Args:
        record: :func:`parse_job_record` of the job.
        script: the batch script's text (``scontrol write batch_script``), if known.
        grace_s: hvdkit's preemption grace period (``HVDKIT_PREEMPT_GRACE``).

    Returns:
        ``[]``, or warnings; a time limit shorter than the grace period is an error
        raised as :class:`ConfigurationError`.
    """
    limit = time_limit_seconds(record.get("TimeLimit", ""))
    if limit is not None and limit <= grace_s:
        raise ConfigurationError(
            f"the job's time limit ({record['TimeLimit']}) is not longer than hvdkit's preemption "
            f"grace period ({grace_s:g} s, {config.PREEMPT_GRACE}): the job could not stop at a "
            "step with a checkpoint before Slurm kills it. Raise '#SBATCH --time', or lower "
            f"{config.PREEMPT_GRACE}."
        )
    if record.get("Requeue") == "1" and limit is not None and script is not None:
        sbatch_lines = [ln for ln in script.splitlines() if ln.startswith("#SBATCH")]
        if not any("--signal" in ln for ln in sbatch_lines):
            return [
                "this job may be requeued ('--requeue') and has a time limit "
                f"({record['TimeLimit']}), but its script has no '#SBATCH --signal' line: at the "
                "limit Slurm kills it without warning and the work since the last checkpoint is "
                "lost (and a job killed at its limit is not requeued). Add "
                f"'#SBATCH --signal=TERM@{max(60, int(2 * grace_s))}' so that hvdkit stops at a "
                "step with a checkpoint and requeues the job (ignore this if sbatch got --signal "
                "on its command line)."
            ]
    return []


# ---------------------------------------------------------------- srun's tasks meet
def join_srun_step() -> str | None:
    """Prepare this ``srun`` task to start Horovod; its transport, or None outside ``srun``.

    Over MPI (``srun --mpi=pmix``) Open MPI finds the other ranks through PMIx
    and there is nothing to do. Over Gloo rank 0 serves Horovod's rendezvous on
    the step's first node, at a port every task derives from the job and step
    ids, and each task gets Horovod's Gloo variables (:mod:`hvdkit.clusters._world`).

    Raises:
        ConfigurationError: ``HVDKIT_WORKER_NUM`` disagrees with the task
            count, MPI was asked for without PMIx, or (Gloo) the rendezvous
            host cannot be resolved or reached within ``HVDKIT_SCHED_TIMEOUT``.
    """
    slurm = SlurmEnvironment.detect()
    if slurm is None:
        return None
    slurm.check_worker_num()
    transport = slurm.transport()
    if transport == GLOO and slurm.size > 1:
        os.environ.update(gloo_env(slurm, config.sched_timeout(ConfigurationError)))
    return transport


_server = None  # rank 0's rendezvous server: serves until the process ends


def gloo_env(slurm: SlurmEnvironment, timeout_s: float) -> dict[str, str]:
    """Horovod's Gloo settings for this task; rank 0 starts the rendezvous server first."""
    global _server
    use_mpi = "use MPI: '#SBATCH --mpi=pmix' / srun --mpi=pmix."
    host, port = slurm.rendezvous_host, slurm.rendezvous_port()
    address = _world.resolve(
        host,
        f"the first node of the step ({host}, where rank 0 runs)",
        f"make the node names resolve on every node, or {use_mpi}",
    )
    if slurm.rank == 0:
        allowed = {_world.resolve(n, f"node {n} of the step", use_mpi) for n in slurm.nodes}
        world = _world.places(slurm.block_hosts())
        try:
            _server, _ = _world.serve(address, port, allowed, world)
        except OSError as exc:
            raise ConfigurationError(
                f"rank 0 cannot listen on {address}:{port} for Gloo's rendezvous ({exc}). "
                f"Another step of this job may hold it: set {config.RENDEZVOUS_PORT} to a free "
                "port (the same for every task)."
            ) from None
    mine = _world.local_address_towards(
        address,
        port,
        timeout_s,
        "Rank 0 may have failed (see its output), or the nodes cannot reach each other on "
        f"that port: use MPI ('#SBATCH --mpi=pmix'), or set {config.RENDEZVOUS_PORT} to a "
        "port that is open.",
        where=f"on {host} ({address}:{port})",
        setting=config.SCHED_TIMEOUT,
    )
    place = _world.Place(
        rank=slurm.rank,
        size=slurm.size,
        hostname=slurm.node or socket.gethostname(),
        local_rank=slurm.local_rank,
        local_size=slurm.local_size,
        cross_rank=slurm.cross_rank,
        cross_size=slurm.cross_size,
    )
    return _world.horovod_env(place, address, port, mine, hosts=len(slurm.nodes))


def allocation_hosts() -> list[tuple[str, int]] | None:
    """``hvdkitrun`` inside an allocation: ``(node, tasks)`` for each of its nodes, else None."""
    slurm = SlurmEnvironment.in_allocation()
    if slurm is None or slurm.task or not slurm.nodes or not slurm.tasks_per_node:
        return None
    return list(zip(slurm.nodes, slurm.tasks_per_node, strict=False))


# ---------------------------------------------------------------- refusals
def refuse_split_step(tasks: int, formed: int) -> ConfigurationError:
    """srun started ``tasks`` tasks, but Horovod formed a job of ``formed``: the error to raise."""
    return ConfigurationError(
        f"srun started {tasks} tasks but Horovod formed a job of {formed}: the tasks did not "
        "find each other, and each would train alone. For MPI, srun must give them PMIx "
        "('#SBATCH --mpi=pmix' or srun --mpi=pmix; `srun --mpi=list` shows what the cluster "
        "has); or use Gloo (HOROVOD_CONTROLLER=gloo, docs/slurm.md)."
    )


def refuse_task_without_srun() -> None:
    """Refuse a process of a several-task allocation that ``srun`` did not start.

    Raises:
        ConfigurationError: it would train alone as a job of size 1.
    """
    allocation = SlurmEnvironment.in_allocation()
    if allocation is not None and not allocation.task and allocation.size > 1:
        raise ConfigurationError(
            f"this process runs in Slurm job {allocation.job_id}, which has {allocation.size} "
            f"tasks ({NTASKS}), but it was started without srun, so it would "
            "train alone as a job of size 1. Start it with `srun python ...` (or `hvdkitrun "
            "python ...`) in the batch script, or ask for one task ('#SBATCH --ntasks=1')."
        )


# ---------------------------------------------------------------- preemption: check, requeue
SCONTROL_TIMEOUT_S = 10.0


def _scontrol(*args: str) -> str | None:
    """``scontrol args``'s output; None (and a warning) when it cannot be run or fails."""
    if shutil.which("scontrol") is None:
        logger.warning("hvdkit: this is a Slurm job, but scontrol is not on PATH")
        return None
    try:
        proc = subprocess.run(
            ["scontrol", *args], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.warning("hvdkit: scontrol %s failed: %s", " ".join(args), exc)
        return None
    if proc.returncode:
        logger.warning("hvdkit: scontrol %s failed: %s", " ".join(args), proc.stderr.strip())
        return None
    return proc.stdout


def check_job(grace_s: float) -> None:
    """Rank 0 under Slurm: refuse a time limit within the grace period, warn of a missing --signal.

    Raises:
        ConfigurationError: the job's time limit is not longer than ``grace_s``.
    """
    slurm = SlurmEnvironment.in_allocation()
    if slurm is None:
        return
    record = _scontrol("show", "job", "-o", slurm.job_id)
    if record is None:
        return
    script = _scontrol("write", "batch_script", slurm.job_id, "-")
    job = parse_job_record(record)
    for warning in requeue_advice(job, script, grace_s):
        logger.warning("hvdkit: %s", warning)


def requeue_job() -> str | None:
    """Rank 0, with the checkpoint on disk: ``scontrol requeue`` this job if it asked for it.

    Lightning's way: the job stops itself at a step of its choosing, then puts
    itself back in the queue, so a time limit (with ``--signal``) or a
    preemption loses nothing. Only jobs submitted with ``--requeue`` (Slurm's
    ``Requeue=1``) are requeued. Returns what was done, for the log line; None
    outside a Slurm allocation.
    """
    slurm = SlurmEnvironment.in_allocation()
    if slurm is None:
        return None
    record = _scontrol("show", "job", "-o", slurm.job_id)
    if record is None:
        return f"could not ask Slurm about job {slurm.job_id}; not requeued"
    job = parse_job_record(record)
    if job.get("Requeue") != "1":
        return f"job {slurm.job_id} was not submitted with --requeue; submit it again to resume"
    if job.get("JobState") != "RUNNING":
        # Slurm ends the job itself: requeued (scontrol requeue, preemption) or cancelled
        # (scancel) look the same here (COMPLETING), and a job cannot be requeued twice
        return (
            f"Slurm is ending job {slurm.job_id} ({job.get('JobState')}): if it requeues it, "
            "it resumes from this step"
        )
    if _scontrol("requeue", slurm.job_id) is None:
        return f"requeueing job {slurm.job_id} failed (see the warning); submit it again to resume"
    return f"requeued job {slurm.job_id}: it resumes from this step when it runs again"

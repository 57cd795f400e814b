"""hvdkit's own environment variables (``HVDKIT_*``, MindSpore's ``MS_*`` aliases), in one place.

Their names, defaults and the one typed reader (:func:`get_int`,
:func:`get_float`, :func:`get_bool`). Explicit function arguments always
win; these are consulted only when an argument is left as ``None``.

Who writes environment variables: the launcher (:mod:`hvdkit.launch`) for
the processes it starts, and, inside a rank, three places: under ``srun``
over Gloo, ``clusters/slurm`` sets Horovod's Gloo variables before Horovod
starts; in an elastic job, ``_meeting.take`` makes the scheduler's next
assignment (Horovod's settings and :data:`RESTART_COUNT`) this process's;
``runtime`` removes :data:`ELASTIC_JOIN` once the rank has joined. Nothing
else in ``hvdkit/`` changes ``os.environ``.

Other programs' variables live with the one function that speaks that
program's contract: Horovod's Gloo launch contract in
``launch/worker.horovod_env``, Horovod's stall inspector in
``launch/heartbeat.horovod_stall_env``, Open MPI's in ``launch/transport``
(``MPI_ENV``, ``MPI_AS_ROOT_ENV``). Horovod's Gloo timeout
(:data:`GLOO_TIMEOUT`) is here because hvdkit chooses its value.
"""

from __future__ import annotations

import math
import os

from .errors import ConfigurationError, LaunchError

# --- set by launchers; read to tell whether this process is part of a job ---
HOROVOD_SIZE = "HOROVOD_SIZE"  # horovodrun --gloo, hvdkitrun, scheduler/worker
HOROVOD_RANK = "HOROVOD_RANK"  # the same launchers: this process's rank before Horovod starts
OMPI_SIZE = "OMPI_COMM_WORLD_SIZE"  # mpirun / horovodrun --mpi (Open MPI)
PMI_SIZE = "PMI_SIZE"  # MPICH / Intel MPI
LAUNCHER_SIZE_VARS = (HOROVOD_SIZE, OMPI_SIZE, PMI_SIZE)

# --- Horovod settings hvdkit honours in a job of size 1 too ---
HOROVOD_TIMELINE = "HOROVOD_TIMELINE"  # "DYNAMIC" allows start_timeline()/stop_timeline()
HOROVOD_DYNAMIC_PROCESS_SETS = "HOROVOD_DYNAMIC_PROCESS_SETS"  # "1" allows add/remove_process_set
HOROVOD_ELASTIC = "HOROVOD_ELASTIC"  # "1": horovodrun's elastic driver started us (refused)

# --- hvdkit's own settings ---
BACKEND = "HVDKIT_BACKEND"  # "horovod" | "local"; default: horovod when launched
INTRA_OP_THREADS = "HVDKIT_INTRA_OP_THREADS"  # int, or "auto"
STALL_TIMEOUT = "HVDKIT_STALL_TIMEOUT"  # seconds, used by hvdkitrun
DEFAULT_STALL_TIMEOUT_S = 120.0
LOG_DIR = "HVDKIT_LOG_DIR"
MONITOR_ADDR = "HVDKIT_MONITOR_ADDR"  # host:port of hvdkitrun's heartbeat receiver
MAX_RESTARTS = "HVDKIT_MAX_RESTARTS"  # int >= 0: restarts of a failed job (default 0)
RESTART_COUNT = "HVDKIT_RESTART_COUNT"  # set by the launcher: 0 on the first attempt
CHECKPOINT_DIR = "HVDKIT_CHECKPOINT_DIR"  # where the launcher looks for the resume step
PHASE_HOOK = "HVDKIT_PHASE_HOOK"  # tests: a folder of fault traps (hvdkit._phases)
PHASE_LOG = "HVDKIT_PHASE_LOG"  # benchmarks: a file every phase's start is added to (_phases)
BUCKET_BYTES = "HVDKIT_BUCKET_BYTES"  # int >= 0: bytes per gradient allreduce bucket
# Chosen with benchmarks/overlap.py (docs/performance.md, "Overlap"): on 2 simulated
# hosts at 1 and 10 Gbit/s, 0 (one allreduce per gradient), 1 MiB and 4 MiB gave
# steps within each other's noise, 16 MiB and a single bucket clearly slower. 4 MiB
# keeps models with less than 4 MiB of gradients on one allreduce, as before buckets.
DEFAULT_BUCKET_BYTES = 4 << 20
SAME_START = "HVDKIT_SAME_START"  # ranks holding different weights at the start: error|warn|off
UNREDUCED_UPDATE = "HVDKIT_UNREDUCED_UPDATE"  # weights updated unreduced: warn|error|off
CHECK_WEIGHTS = "HVDKIT_CHECK_WEIGHTS"  # "1": the launcher compares the ranks' weights at the end
WEIGHTS_DIR = "HVDKIT_WEIGHTS_DIR"  # set by the launcher: where each rank leaves that fingerprint
PREEMPT_GRACE = "HVDKIT_PREEMPT_GRACE"  # seconds from SIGTERM to the job's end (default 25)
CACHE_DIR = "HVDKIT_CACHE_DIR"  # built Horovod wheels (default ~/.cache/hvdkit)
COMM_PRIORITY = "HVDKIT_COMM_PRIORITY"  # Horovod's threads on SCHED_RR (Gloo): 0, 1 or auto
GC_FREEZE = "HVDKIT_GC_FREEZE"  # "0": init() leaves Python's garbage collector alone
DEFAULT_SCHED_TIMEOUT_S = 300.0
ELASTIC = "HVDKIT_ELASTIC"  # "1": the scheduler lets survivors recover in-process (Gloo)
ELASTIC_DIR = "HVDKIT_ELASTIC_DIR"  # set by a worker: where it leaves a rank's new assignment
GLOO_TIMEOUT = "HOROVOD_GLOO_TIMEOUT_SECONDS"  # Horovod's: how long a Gloo peer may be silent
ELASTIC_GLOO_TIMEOUT_S = 5  # in elastic jobs: the longest a silent Gloo peer is waited for
ELASTIC_JOIN = "HVDKIT_ELASTIC_JOIN"  # set by a worker: this rank joins running survivors

# scheduler/worker rendezvous (MindSpore's MS_* names accepted as aliases)
ROLE = "HVDKIT_ROLE"
WORKER_NUM = "HVDKIT_WORKER_NUM"
SCHED_HOST = "HVDKIT_SCHED_HOST"
SCHED_PORT = "HVDKIT_SCHED_PORT"
RENDEZVOUS_PORT = "HVDKIT_RENDEZVOUS_PORT"  # srun over Gloo: rank 0's rendezvous (docs/slurm.md)
# hvdkit.spark.run: how long to wait for the executors' task slots (Horovod's variable)
SPARK_START_TIMEOUT = "HOROVOD_SPARK_START_TIMEOUT"
DEFAULT_START_TIMEOUT_S = 600.0  # horovod.spark.run's default too; hvdkit.ray.run's
JOB_TOKEN = "HVDKIT_JOB_TOKEN"
SCHED_TIMEOUT = "HVDKIT_SCHED_TIMEOUT"  # seconds to wait for all workers (default 300)
TOKEN_FILE = "HVDKIT_TOKEN_FILE"  # where run_scheduler.sh leaves a generated token
MIN_WORKERS = "HVDKIT_MIN_WORKERS"  # continue a restarted job on this many (default: all)
REPLACE_TIMEOUT = "HVDKIT_REPLACE_TIMEOUT"  # seconds to wait for replacement workers
DEFAULT_REPLACE_TIMEOUT_S = 10.0
DEFAULT_PREEMPT_GRACE_S = 25.0  # Kubernetes waits 30 s after SIGTERM by default
EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h): stopped for SIGTERM with a checkpoint; run again
EXIT_WEIGHTS_DIFFER = 70  # EX_SOFTWARE: the job ended, its ranks with different weights
DEFAULT_SCHED_PORT = 29500  # the scheduler's TCP port when none is set
MINDSPORE_ALIASES = {
    ROLE: "MS_ROLE",
    WORKER_NUM: "MS_WORKER_NUM",
    SCHED_HOST: "MS_SCHED_HOST",
    SCHED_PORT: "MS_SCHED_PORT",
}


def get(name: str, default: str | None = None) -> str | None:
    """Value of hvdkit setting ``name``, falling back to its MindSpore alias."""
    value = os.environ.get(name)
    if value is None and name in MINDSPORE_ALIASES:
        value = os.environ.get(MINDSPORE_ALIASES[name])
    return default if value is None or value == "" else value


# HVDKIT_ROLE / MS_ROLE values: hvdkit's own, then MindSpore's, for each role.
SCHEDULER, WORKER = "scheduler", "worker"
ROLE_VALUES = {"scheduler": SCHEDULER, "MS_SCHED": SCHEDULER, "worker": WORKER, "MS_WORKER": WORKER}
PARAMETER_SERVER_ROLE = "MS_PSERVER"  # MindSpore's parameter server: no hvdkit equivalent
# Variables that say "this process is one of a scheduler/worker job".
JOB_VARS = (ROLE, WORKER_NUM, SCHED_HOST, SCHED_PORT)


def named(name: str) -> str:
    """The variable a message names for setting ``name``: the one the user set.

    hvdkit's name, unless only its MindSpore alias is set (then the alias);
    hvdkit's name too when neither is set (the one to set). Every message about
    a setting names it through this, so that an ``MS_WORKER_NUM`` user reads
    ``MS_WORKER_NUM``.

    Example:
        >>> named(WORKER_NUM)   # with only MS_WORKER_NUM=2 in the environment
        'MS_WORKER_NUM'
    """
    if os.environ.get(name) or name not in MINDSPORE_ALIASES:
        return name
    return MINDSPORE_ALIASES[name] if os.environ.get(MINDSPORE_ALIASES[name]) else name


def role() -> str | None:
    """``"scheduler"``, ``"worker"`` or ``None``, from ``HVDKIT_ROLE`` (else ``MS_ROLE``).

    Accepts hvdkit's values and MindSpore's (``MS_SCHED``, ``MS_WORKER``).

    Raises:
        LaunchError: MindSpore's parameter-server role, or an unknown value.
    """
    raw = get(ROLE)
    if raw is None:
        return None
    value = raw.strip()
    if value in ROLE_VALUES:
        return ROLE_VALUES[value]
    var = named(ROLE)
    if value == PARAMETER_SERVER_ROLE:
        raise LaunchError(
            f"{var}={raw!r}: hvdkit has no parameter-server role. It trains data-parallel "
            "with allreduce among the workers, so start one scheduler (MS_SCHED) and the "
            "workers (MS_WORKER) only, and drop the MS_PSERVER processes (and MS_SERVER_NUM)."
        )
    raise LaunchError(
        f"{var}={raw!r} is not a role; use 'scheduler' or 'worker' (MindSpore's "
        "'MS_SCHED' / 'MS_WORKER' work too)."
    )


def job_vars_set() -> list[str]:
    """Names of the scheduler/worker variables set here (``HVDKIT_*`` or ``MS_*``), in order."""
    return [named(n) for n in JOB_VARS if get(n) is not None]


def get_int(
    name: str,
    default: int | None,
    *,
    minimum: int | None = None,
    what: str = "a whole number",
    fix: str = "",
    error: type[Exception] | None = None,
) -> int:
    """The environment variable ``name`` as an int (``default`` when unset).

    The one reader of integer settings. ``"2.5"``, ``"two"`` and values below
    ``minimum`` are refused with ``error`` (default
    :class:`~hvdkit.errors.ConfigurationError`) naming the variable, the
    value and ``fix``; an unset variable with ``default=None`` asks for it.

    Example:
        >>> get_int(WORKER_NUM, None, minimum=1, fix="e.g. HVDKIT_WORKER_NUM=2")  # set to 2
        2
    """
    return _read(name, default, int, lambda v: minimum is None or v >= minimum, what, fix, error)


def get_float(
    name: str,
    default: float | None,
    *,
    positive: bool = False,
    what: str = "a number",
    fix: str = "",
    error: type[Exception] | None = None,
) -> float:
    """The environment variable ``name`` as a finite float; ``positive``: also > 0.

    Refusals as :func:`get_int` (``nan`` and ``inf`` are refused too).
    """

    def fits(v: float) -> bool:
        return math.isfinite(v) and (not positive or v > 0)

    return _read(name, default, float, fits, what, fix, error)


def get_bool(
    name: str, default: bool, *, fix: str = "", error: type[Exception] | None = None
) -> bool:
    """The environment variable ``name`` as ``0`` or ``1`` (nothing else is accepted)."""
    flags = {"0": False, "1": True}
    return _read(name, default, flags.__getitem__, lambda v: True, "0 or 1", fix, error)


def _read(name, default, parse, fits, what, fix, error):
    error = error or ConfigurationError
    raw = get(name)
    if raw is None:
        if default is None:
            raise error(f"set {named(name)}" + (f" ({fix})." if fix else "."))
        return default
    try:
        value = parse(raw.strip())
    except (KeyError, ValueError):
        value = None
    if value is None or not fits(value):
        raise error(f"{named(name)}={raw!r} is not {what}" + (f"; {fix}" if fix else "."))
    return value


def launched_size() -> int | None:
    """World size announced by a launcher in the environment, or ``None``.

    Raises:
        ConfigurationError: a launcher's size variable is set but is not an
            integer >= 1. Falling back to a job of size 1 would make every rank
            train alone, silently.
    """
    for var in LAUNCHER_SIZE_VARS:
        if os.environ.get(var):
            return get_int(
                var,
                None,
                minimum=1,
                what="a world size (an integer >= 1)",
                fix="it is set by the launcher (hvdkitrun, horovodrun, mpirun); start the job "
                f"with one, or unset {var} to run as a single process.",
            )
    return None


def restart_count() -> int:
    """The launcher's round of this process (``HVDKIT_RESTART_COUNT``), 0 when unset."""
    return get_int(RESTART_COUNT, 0, minimum=0, what="a round number (an int >= 0)")


def sched_timeout(error: type[Exception] = LaunchError) -> float:
    """Seconds a scheduler/worker job waits for the others: ``HVDKIT_SCHED_TIMEOUT``, else 300."""
    return get_float(
        SCHED_TIMEOUT,
        DEFAULT_SCHED_TIMEOUT_S,
        positive=True,
        what="a number of seconds",
        error=error,
    )


def preempt_grace() -> float:
    """Seconds from ``SIGTERM`` to the end of the job: ``HVDKIT_PREEMPT_GRACE``, else 25.

    Raises:
        ConfigurationError: the value is not a number > 0.
    """
    return get_float(
        PREEMPT_GRACE,
        DEFAULT_PREEMPT_GRACE_S,
        positive=True,
        what="a grace period",
        fix="give the seconds a job has between SIGTERM and being killed "
        f"(> 0, default {DEFAULT_PREEMPT_GRACE_S:g}).",
    )


COMM_PRIORITY_VALUES = ("0", "1", "auto")


SAME_START_VALUES = ("error", "warn", "off")


def same_start() -> str:
    """``HVDKIT_SAME_START``: what the first gradient reduction does when ranks' weights differ.

    ``"error"`` (the default) raises, ``"warn"`` logs a warning on every rank
    and trains on, ``"off"`` skips the check (:mod:`hvdkit._same_start`).

    Raises:
        ConfigurationError: the value is none of ``error``, ``warn``, ``off``.
    """
    return _read(
        SAME_START,
        "error",
        lambda v: v if v in SAME_START_VALUES else None,
        lambda v: True,
        "error, warn or off",
        "error (the default) stops a job whose ranks start from different weights, warn only "
        "says so, off skips the check (docs/training.md).",
        None,
    )


UNREDUCED_UPDATE_VALUES = ("warn", "error", "off")


def unreduced_update() -> str:
    """``HVDKIT_UNREDUCED_UPDATE``: what a job of several ranks does when a plain Keras optimizer
    updates trainable weights whose gradients no hvdkit reduction averaged.

    ``"warn"`` (the default) logs one warning per optimizer on rank 0,
    ``"error"`` raises :class:`~hvdkit.errors.ConfigurationError` on the ranks
    that do it, ``"off"`` skips the check (:mod:`hvdkit.keras._update_check`).

    Raises:
        ConfigurationError: the value is none of ``warn``, ``error``, ``off``.
    """
    return _read(
        UNREDUCED_UPDATE,
        "warn",
        lambda v: v if v in UNREDUCED_UPDATE_VALUES else None,
        lambda v: True,
        "warn, error or off",
        "warn (the default) names the optimizer on rank 0 and trains on, error stops the job, "
        "off skips the check (docs/divergence.md).",
        None,
    )


def comm_priority() -> str | None:
    """``HVDKIT_COMM_PRIORITY``: whether Horovod's threads get ``SCHED_RR`` under Gloo.

    ``"1"`` always, ``"0"`` never, ``"auto"``: try both on the job's own
    steps and keep the faster (:mod:`hvdkit._comm.priority_trial`). ``None`` when
    unset: the backend then takes ``"auto"`` if the ranks span several hosts
    and ``"0"`` on one machine, where the allreduce never waits for a wire.

    Raises:
        ConfigurationError: the value is none of ``0``, ``1``, ``auto``.
    """
    return (
        _read(
            COMM_PRIORITY,
            "",
            lambda v: v if v in COMM_PRIORITY_VALUES else None,
            lambda v: True,
            "0, 1 or auto",
            "auto (the default across hosts) tries Horovod's threads at real-time priority over "
            "TensorFlow's compute on the job's steps and keeps the faster, 1 always gives it "
            "them, 0 never (docs/performance.md).",
            None,
        )
        or None
    )

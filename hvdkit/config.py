"""Environment variables hvdkit reads, in one place.

Explicit function arguments always win; these are consulted only when an
argument is left as ``None``. Only the launcher (:mod:`hvdkit.launch`) writes
environment variables.
"""

from __future__ import annotations

import os

# --- set by launchers; read to tell whether this process is part of a job ---
HOROVOD_SIZE = "HOROVOD_SIZE"  # horovodrun --gloo, hvdkitrun, scheduler/worker
OMPI_SIZE = "OMPI_COMM_WORLD_SIZE"  # mpirun / horovodrun --mpi (Open MPI)
PMI_SIZE = "PMI_SIZE"  # MPICH / Intel MPI
LAUNCHER_SIZE_VARS = (HOROVOD_SIZE, OMPI_SIZE, PMI_SIZE)

# --- hvdkit's own settings ---
BACKEND = "HVDKIT_BACKEND"  # "horovod" | "local"; default: horovod when launched
INTRA_OP_THREADS = "HVDKIT_INTRA_OP_THREADS"  # int, or "auto"
STALL_TIMEOUT = "HVDKIT_STALL_TIMEOUT"  # seconds, used by hvdkitrun
LOG_DIR = "HVDKIT_LOG_DIR"
MONITOR_ADDR = "HVDKIT_MONITOR_ADDR"  # host:port of hvdkitrun's heartbeat receiver
MAX_RESTARTS = "HVDKIT_MAX_RESTARTS"  # int >= 0: restarts of a failed job (default 0)
RESTART_COUNT = "HVDKIT_RESTART_COUNT"  # set by the launcher: 0 on the first attempt
CHECKPOINT_DIR = "HVDKIT_CHECKPOINT_DIR"  # where the launcher looks for the resume step

# scheduler/worker rendezvous (MindSpore's MS_* names accepted as aliases)
ROLE = "HVDKIT_ROLE"
WORKER_NUM = "HVDKIT_WORKER_NUM"
SCHED_HOST = "HVDKIT_SCHED_HOST"
SCHED_PORT = "HVDKIT_SCHED_PORT"
JOB_TOKEN = "HVDKIT_JOB_TOKEN"
SCHED_TIMEOUT = "HVDKIT_SCHED_TIMEOUT"  # seconds to wait for all workers (default 300)
TOKEN_FILE = "HVDKIT_TOKEN_FILE"  # where run_scheduler.sh leaves a generated token
MIN_WORKERS = "HVDKIT_MIN_WORKERS"  # continue a restarted job on this many (default: all)
REPLACE_TIMEOUT = "HVDKIT_REPLACE_TIMEOUT"  # seconds to wait for replacement workers
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


def launched_size() -> int | None:
    """World size announced by a launcher in the environment, or ``None``.

    Raises:
        ConfigurationError: a launcher's size variable is set but is not an
            integer >= 1. Falling back to a job of size 1 would make every rank
            train alone, silently.
    """
    from .errors import ConfigurationError

    for var in LAUNCHER_SIZE_VARS:
        value = os.environ.get(var)
        if value:
            try:
                size = int(value)
            except ValueError:
                size = 0
            if size < 1:
                raise ConfigurationError(
                    f"{var}={value!r} is not a world size (an integer >= 1). It is set by "
                    "the launcher (hvdkitrun, horovodrun, mpirun); start the job with one, "
                    f"or unset {var} to run as a single process."
                )
            return size
    return None

"""What the benchmark drivers share: the environment of the jobs they launch.

env = job_env()                            # PYTHONPATH: the repository
env = job_env(REPO, REPO / "examples")     # ... and examples/
env = job_env(HOROVOD_CYCLE_TIME="0.1")    # plus one of Horovod's knobs
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def job_env(*paths: Path, **extra: str) -> dict[str, str]:
    """This process's environment for a launched benchmark job.

    TensorFlow's info logs off, ``PYTHONPATH`` = ``paths`` (default: the
    repository), ``extra`` on top, and, when running as root, Open MPI's
    consent to run as root (``mpirun`` refuses root without it).
    """
    pythonpath = os.pathsep.join(str(p) for p in (paths or (REPO,)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=pythonpath, **extra)
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env

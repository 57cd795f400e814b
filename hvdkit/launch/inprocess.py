"""A training script that is itself the scheduler or a worker (MindSpore's ``MS_ROLE`` flow).

MindSpore's CPU tutorial starts the *same* training script once with
``MS_ROLE=MS_SCHED`` and N times with ``MS_ROLE=MS_WORKER``; the role is
taken inside the script's ``init()``. :func:`hvdkit.init` calls
:func:`take_role` before it starts anything else, and the process never
comes back from it:

* **scheduler**: the process runs the scheduler, exactly as
  ``HVDKIT_ROLE=scheduler hvdkitrun`` would, and exits with the job's status
  once every worker is done. The rest of the script never runs: the
  scheduler does not train.
* **worker**: the process becomes a worker, exactly as ``HVDKIT_ROLE=worker
  hvdkitrun python script.py`` would: it registers with the scheduler, gets
  its rank, then runs *the same command line again* as a child with that
  rank's Horovod settings and without the role variables, so the child's
  ``hvdkit.init()`` starts Horovod as that rank. The worker supervises the
  child (output prefixed with the rank, heartbeats, stop on another rank's
  failure, restarts) and exits with the job's status.

Why a child rather than turning this very process into the rank: the worker
machinery (:mod:`hvdkit.launch.worker`) needs a process that outlives the
training program to stop it when another rank fails, to notice a frozen one,
and to start it again when the scheduler restarts the job; Horovod also reads
its rendezvous settings from the environment only once, in ``hvd.init()``.
The price: code that runs before ``hvdkit.init()`` runs twice on a worker
(once in the worker, once in its rank), and the worker holds whatever that
code imported.

Job token: without ``HVDKIT_JOB_TOKEN`` the scheduler writes a new token to
``HVDKIT_TOKEN_FILE`` (default ``~/.hvdkit/job-<port>.token``, mode 600,
removed when it ends) and workers on the same machine read it from there, as
``examples/cluster/run_*.sh`` do. Workers on other machines need
``HVDKIT_JOB_TOKEN``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import NoReturn

from .. import config
from ..errors import LaunchError

TOKEN_POLL_S = 0.2


def default_token_file() -> str:
    """Where a scheduler without ``HVDKIT_JOB_TOKEN`` leaves its token (as run_scheduler.sh)."""
    explicit = config.get(config.TOKEN_FILE)
    if explicit:
        return explicit
    port = config.get(config.SCHED_PORT, str(config.DEFAULT_SCHED_PORT))
    return os.path.join(os.path.expanduser("~"), ".hvdkit", f"job-{port}.token")


def script_command() -> list[str]:
    """The command line that started this interpreter, to run again as the worker's rank.

    Raises:
        LaunchError: the script came from standard input or an interactive
            session, which cannot be run a second time.
    """
    argv = list(getattr(sys, "orig_argv", []) or [sys.executable, *sys.argv])
    if not sys.argv or sys.argv[0] in ("", "-"):
        raise LaunchError(
            "the worker role runs this script's command line again as its rank, but the "
            "script came from standard input or an interactive session. Save it to a file "
            "and start it as `python train.py`."
        )
    return [sys.executable, *argv[1:]]


def take_role(role: str) -> NoReturn:
    """Run this process as the job's scheduler or as a worker, then exit with the job's status.

    Args:
        role: ``"scheduler"`` or ``"worker"`` (:func:`hvdkit.config.role`).

    Raises:
        LaunchError: a launcher (``horovodrun``, ``mpirun``, ``hvdkitrun``)
            also started this process, the script cannot be run again, or the
            scheduler/worker cannot start (bad settings, port taken, no token).
    """
    from .roles import main as role_main

    launched = config.launched_size()
    if launched is not None:
        raise LaunchError(
            f"{config.job_vars_set()[0]} asks this process to be the {role} of a "
            f"scheduler/worker job, but a launcher already started it as one of {launched} "
            f"processes. Use one way of starting the job: unset {config.named(config.ROLE)} "
            "under horovodrun/mpirun/hvdkitrun, or start the script without a launcher."
        )
    if role == config.SCHEDULER:
        if config.get(config.JOB_TOKEN) is None and config.get(config.TOKEN_FILE) is None:
            path = default_token_file()
            os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
            # roles.main writes the token there once the port is bound, and removes it at the end.
            os.environ[config.TOKEN_FILE] = path
        code = role_main(config.SCHEDULER, [])
    else:
        command = script_command()
        code = _run_worker(role_main, command)
    _flush()
    raise SystemExit(code)


def _run_worker(role_main, command: list[str]) -> int:
    """The worker, with a token from the environment or from the scheduler's token file.

    A token file left by an earlier scheduler that was killed can be read
    before this job's scheduler replaces it: when the scheduler refuses the
    token and the file has changed since, the worker registers again with
    the new one.
    """
    if config.get(config.JOB_TOKEN) is not None:
        return role_main(config.WORKER, command)
    path = default_token_file()
    deadline = time.monotonic() + _timeout()
    token = _wait_for_token(path, deadline, None)
    while True:
        os.environ[config.JOB_TOKEN] = token
        try:
            return role_main(config.WORKER, command)
        except LaunchError as exc:
            if "refused" not in str(exc) or time.monotonic() >= deadline:
                raise
            newer = _wait_for_token(path, min(deadline, time.monotonic() + 10.0), token)
            if newer == token:
                raise


def _wait_for_token(path: str, deadline: float, old: str | None) -> str:
    """The token in ``path`` once it exists (and differs from ``old``, if given)."""
    token = None
    while True:
        with contextlib.suppress(OSError):
            with open(path) as f:
                token = f.read().strip() or None
        if token is not None and token != old:
            return token
        if time.monotonic() >= deadline:
            if token is not None:
                return token
            raise LaunchError(
                f"no job token: {config.JOB_TOKEN} is not set and the scheduler's token file "
                f"{path} did not appear within {_timeout():g} s. Start the scheduler on this "
                f"machine with the same {config.named(config.SCHED_PORT)}, or set "
                f"{config.JOB_TOKEN} to the token the scheduler printed (workers on other "
                "machines)."
            )
        time.sleep(TOKEN_POLL_S)


def _timeout() -> float:
    return config.sched_timeout()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()

"""Role dispatch for ``HVDKIT_ROLE=scheduler|worker hvdkitrun``; its settings from the env.

Configured as in MindSpore's tutorials (the port defaults to
``config.DEFAULT_SCHED_PORT``)::

    HVDKIT_ROLE=scheduler HVDKIT_WORKER_NUM=8 HVDKIT_SCHED_HOST=10.0.0.1 hvdkitrun
    HVDKIT_ROLE=worker HVDKIT_SCHED_HOST=10.0.0.1 HVDKIT_JOB_TOKEN=... hvdkitrun python train.py

With ``HVDKIT_MAX_RESTARTS=N`` the scheduler restarts a failed job up to N
times; ``HVDKIT_MIN_WORKERS=M`` lets it go on with M or more workers when
others are lost for good (see :mod:`hvdkit.launch.scheduler`).

MindSpore's ``MS_ROLE``, ``MS_WORKER_NUM``, ``MS_SCHED_HOST`` and
``MS_SCHED_PORT`` are accepted as aliases. ``examples/cluster/run_scheduler.sh`` and
``examples/cluster/run_workers.sh`` wrap these.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sys

from .. import config
from ..errors import LaunchError
from .auth import write_token_file
from .restart import max_restarts


def _int_setting(name: str, default: int | None) -> int:
    return config.get_int(name, default, fix=f"e.g. {config.named(name)}=2", error=LaunchError)


def _float_setting(name: str, default: float) -> float:
    return config.get_float(name, default, what="a number of seconds", error=LaunchError)


def _elastic_setting() -> bool:
    return config.get_bool(
        config.ELASTIC,
        False,
        fix="use 1 to let the workers left after a failure go on in-process (their "
        "script trains inside hvdkit.elastic.run), or 0 (the default).",
        error=LaunchError,
    )


def _run_scheduler(host: str, port: int, timeout: float, token: str | None) -> int:
    from .scheduler import Scheduler

    worker_num = _int_setting(config.WORKER_NUM, None)
    min_workers = _int_setting(config.MIN_WORKERS, worker_num)
    replace_timeout = _float_setting(config.REPLACE_TIMEOUT, config.DEFAULT_REPLACE_TIMEOUT_S)
    restarts = max_restarts()
    token_file = config.get(config.TOKEN_FILE)
    if token is None:
        token = secrets.token_hex(16)
        if token_file:
            shown = f"written to {token_file} (mode 600)"
        else:
            shown = f"{token}  (give it to every worker as {config.JOB_TOKEN})"
        print(f"[scheduler] job token: {shown}", file=sys.stderr, flush=True)
    sched = Scheduler(  # fails early if the port is taken
        host,
        port,
        worker_num,
        token,
        timeout,
        max_restarts=restarts,
        min_workers=min_workers,
        replace_timeout_s=replace_timeout,
        elastic=_elastic_setting(),
    )
    if token_file:
        write_token_file(token_file, token)
    try:
        return sched.run()
    finally:
        if token_file:
            # A later job must not pick up this job's token.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(token_file)


def main(role: str, argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    logging.basicConfig(level=logging.INFO, format=f"[{role}] %(message)s", stream=sys.stderr)
    host = config.get(config.SCHED_HOST, "127.0.0.1")
    port = _int_setting(config.SCHED_PORT, config.DEFAULT_SCHED_PORT)
    timeout = config.sched_timeout()
    token = config.get(config.JOB_TOKEN)
    if role == "scheduler":
        if argv:
            raise LaunchError(f"the scheduler runs no program; got {argv}. Give it to the workers.")
        return _run_scheduler(host, port, timeout, token)
    if role == "worker":
        from .worker import run_worker

        if not argv:
            raise LaunchError("a worker needs the program to run, e.g. hvdkitrun python train.py")
        if token is None:
            raise LaunchError(
                f"the worker has no job token: set {config.JOB_TOKEN} to the token the scheduler "
                "printed (or set it for both before starting them)."
            )
        return run_worker(host, port, token, argv, timeout, config.get(config.LOG_DIR))
    raise LaunchError(
        f"{config.named(config.ROLE)}={role!r} is not a role; use 'scheduler' or 'worker'."
    )

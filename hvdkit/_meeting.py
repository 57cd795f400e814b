"""How a rank and its worker agree on the next world of an elastic job (files, one folder).

The worker makes a mode-700 folder for its rank (``HVDKIT_ELASTIC_DIR``).
Its files pass through it, each written whole (a rename) by one side:

* ``assign.json`` (worker -> rank): ``{"round": r, "env": {...}, "lost":
  bool}``, the Horovod settings of the rank in the job's round ``r``;
  ``lost``: round ``r`` replaces a world that lost a rank, so the rank's
  collectives in the old one can only fail (:mod:`hvdkit.elastic` ends its
  connections at once instead of waiting for Gloo's timeout);
* ``ready`` (rank -> worker): ``r``, the rank is about to start Horovod in
  round ``r``; the worker tells the scheduler;
* ``go`` (worker -> rank): ``r``, every rank of round ``r`` said ready (the
  scheduler's word): start Horovod now;
* ``resumed`` (rank 0 -> its worker): ``r s``, round ``r`` trains again from
  step ``s`` (after the roll-back); the scheduler prints it with the
  membership change;
* ``finished`` (rank -> worker): ``r``, the rank's training function
  returned in round ``r`` (:func:`hvdkit.elastic.run`): it will not meet
  another world, so the scheduler takes no newcomer from then on.

Gloo gives a rendezvous the same few seconds as any other operation
(``HOROVOD_GLOO_TIMEOUT_SECONDS``, :data:`hvdkit.config.ELASTIC_GLOO_TIMEOUT_S`
in elastic jobs), and ranks notice a lost peer up to that long apart, more on
a loaded machine: a rank that started Horovod first would time out waiting
for the others and abort. The ``go`` makes every rank start within moments
of the others.
"""

from __future__ import annotations

import json
import os
import time

from . import _phases, config

ASSIGN, READY, GO, RESUMED, FINISHED = "assign.json", "ready", "go", "resumed", "finished"
POLL_S = 0.02


def write(folder: str, name: str, text: str) -> None:
    """Write ``folder/name`` whole: a temporary file (mode 600), then a rename."""
    tmp = os.path.join(folder, f".{name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(folder, name))


def read_round(folder: str, name: str) -> int | None:
    """The round in ``ready``, ``go`` or ``finished``; None if absent or unreadable."""
    try:
        with open(os.path.join(folder, name)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def read_resumed(folder: str) -> tuple[int, int] | None:
    """``resumed``'s ``(round, step)``; None if absent or unreadable."""
    try:
        with open(os.path.join(folder, RESUMED)) as f:
            round_, step = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return None
    return round_, step


def read_assignment(folder: str) -> dict | None:
    """``assign.json``'s ``{"round", "env"}``; None if absent or unreadable."""
    try:
        with open(os.path.join(folder, ASSIGN)) as f:
            body = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(body, dict) or not isinstance(body.get("env"), dict):
        return None
    if not isinstance(body.get("round"), int):
        return None
    return body


def enabled() -> bool:
    """Whether this rank may recover in-process: a worker of an elastic job started it."""
    return bool(config.get(config.ELASTIC_DIR))


def join_waiting() -> bool:
    """Whether this rank's worker left it a next assignment (a worker waits to join)."""
    folder = config.get(config.ELASTIC_DIR)
    if not folder:
        return False
    body = read_assignment(folder)
    return body is not None and body["round"] > config.restart_count()


def take(body: dict) -> int:
    """Make ``body`` (an assignment) this process's Horovod settings; its round."""
    os.environ.update(body["env"])
    os.environ[config.RESTART_COUNT] = str(body["round"])
    return body["round"]


def meet(folder: str, round_: int, deadline: float) -> int:
    """Say ready for ``round_`` and wait for the go; the round to start Horovod in.

    If the worker hands over a newer round meanwhile (the scheduler gave up
    on ``round_``), its settings are taken and the rank meets for that one.

    Raises:
        TimeoutError: no go by ``deadline`` (a :func:`time.monotonic` value).
    """
    _phases.enter("meet")
    write(folder, READY, str(round_))
    while True:
        if (read_round(folder, GO) or -1) >= round_:
            return round_
        body = read_assignment(folder)
        if body is not None and body["round"] > round_:
            round_ = take(body)
            write(folder, READY, str(round_))
            continue
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go for round {round_}")
        time.sleep(POLL_S)

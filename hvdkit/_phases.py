"""The phases of an elastic job's life, named, each with a hook for fault-injection tests.

hvdkit calls :func:`enter` as a rank (or its worker) begins each phase of
:data:`PHASES`. Nothing happens unless the process was started with
``HVDKIT_PHASE_HOOK=<folder>`` (:data:`ACTIVE`); then a test aims one fault
at one phase by writing a *trap* into that folder, and the first process to
enter the phase (optionally: with a given rank or pid) takes it:

* ``<folder>/trap``: JSON ``{"phase": "init", "action": "stop", "rank": 1,
  "pid": null, "after": 0}``: the phase, the action (below), the rank and the
  pid that must take it (``null``: any) and how many matching entries of this
  process to let pass first.
* the taker renames ``trap`` to ``taken.<pid>`` (a rename is atomic: one taker),
  writes ``hit`` (JSON: phase, rank, size, pid, the launcher's round, time)
  and acts:

  - ``"kill"``: SIGKILL itself; ``"stop"``: SIGSTOP itself (frozen);
  - ``"exit"``: ``os._exit(1)``;
  - ``"pause"``: wait until ``<folder>/release.<pid>`` exists, so that the test can
    do what only it can (kill the worker, cut the link) at exactly that point.

``rank`` and ``size`` are those of the world the process is in or is about
to start Horovod in (Horovod's settings in its environment) unless the call
site passes them. A ``"step"`` that is a process's first in a round (the
launcher's ``HVDKIT_RESTART_COUNT``) is the phase ``"first_step"`` instead.

With ``HVDKIT_PHASE_LOG=<file>`` every process also adds a line to that file
as it enters a phase: JSON ``{"t": time.time(), "pid", "phase", "rank",
"size", "round"}``, one ``write`` of a file opened to append (whole lines
from many processes; ``benchmarks/change_of_world.py`` reads them).

Example (in a test)::

    (folder / "trap").write_text(json.dumps({"phase": "rollback", "action": "kill"}))
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from . import config

ENV = config.PHASE_HOOK

PHASES = (
    "step",  # after a training step (Checkpointer.maybe_save: every step, every rank)
    "save",  # a checkpoint save, every rank (rank 0's background write of the last may run)
    "exchange",  # the preemption check's exchange (carries the growth flag)
    "word",  # the scheduler's new world arriving at a worker (the worker takes the trap)
    "leave",  # leaving Horovod's world after a failure or for growth
    "meet",  # the ready/go meeting of a new round (survivors and newcomers)
    "init",  # Horovod's init: the Gloo rendezvous and connections (every start)
    "rollback",  # the survivors' rollback broadcast of the last commit in a new world
    "restore",  # Checkpointer.restore(): a newcomer receives the state from rank 0
    "reshard",  # after the rollback's broadcast: re-sharding the rest of the epoch
    "first_step",  # after the first training step of a process in a round
    "end",  # the training function returned (elastic.run), before the worker is told
)

_folder = os.environ.get(ENV) or None
_log = os.environ.get(config.PHASE_LOG) or None
ACTIVE = _folder is not None or _log is not None  # the step's call site tests this first
_seen: dict[str, int] = {}
_stepped_in: list[str] = []  # the round of this process's last step (first_step)


def enter(phase: str, rank: int | None = None, size: int | None = None) -> None:
    """Mark the start of ``phase`` (one of :data:`PHASES`); a trap aimed at it fires here.

    Raises:
        ValueError: ``phase`` is not one of :data:`PHASES`.
    """
    if _folder is None and _log is None:
        return
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; the phases are {', '.join(PHASES)}")
    round_ = os.environ.get(config.RESTART_COUNT, "0")
    if phase == "step" and _stepped_in != [round_]:
        _stepped_in[:] = [round_]
        phase = "first_step"
    if rank is None:
        rank, size = _env_int(config.HOROVOD_RANK), _env_int(config.HOROVOD_SIZE)
    if _log is not None:
        _add_to_log(phase, rank, size, int(round_))
    if _folder is None:
        return
    trap_path = os.path.join(_folder, "trap")
    try:
        with open(trap_path) as f:
            trap = json.load(f)
    except (OSError, ValueError):
        return
    if trap.get("phase") != phase or trap.get("rank") not in (None, rank):
        return
    if trap.get("pid") not in (None, os.getpid()):
        return
    key = f"{phase}/{rank}"
    _seen[key] = _seen.get(key, 0) + 1
    if _seen[key] <= int(trap.get("after", 0)):
        return
    try:
        os.rename(trap_path, os.path.join(_folder, f"taken.{os.getpid()}"))
    except OSError:
        return  # another process took it
    hit = {
        "phase": phase,
        "action": trap.get("action"),
        "rank": rank,
        "size": size,
        "pid": os.getpid(),
        "worker": os.getppid(),  # a rank's: its worker (the tests kill it for a lost worker)
        "round": int(round_),
        "at": time.time(),
    }
    tmp = os.path.join(_folder, f".hit.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(hit, f)
    os.replace(tmp, os.path.join(_folder, "hit"))
    _act(trap.get("action"))


def _add_to_log(phase: str, rank: int | None, size: int | None, round_: int) -> None:
    """One line to the phase log; a log that cannot be written is said once, never raised."""
    global _log
    line = {"t": time.time(), "pid": os.getpid(), "phase": phase}
    line |= {"rank": rank, "size": size, "round": round_}
    try:
        fd = os.open(_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (json.dumps(line) + "\n").encode())
        finally:
            os.close(fd)
    except OSError as exc:
        print(
            f"hvdkit: {config.PHASE_LOG}={_log!r} cannot be written ({exc}); no phase log "
            "from this process. Give a file in a writable folder.",
            file=sys.stderr,
            flush=True,
        )
        _log = None


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value is not None and value.isdigit() else None


def _act(action: str | None) -> None:
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "exit":
        os._exit(1)
    elif action == "pause":
        release = os.path.join(_folder, f"release.{os.getpid()}")
        while not os.path.exists(release):
            time.sleep(0.01)
    else:
        raise ValueError(f"unknown trap action {action!r}; use kill, stop, exit or pause")

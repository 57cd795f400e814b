"""The phases of an elastic job's life, named, each with a hook for fault-injection tests.

hvdkit calls :func:`enter` as a rank (or its worker) begins each phase of
:data:`PHASES`. Nothing happens unless the process was started with
``HVDKIT_PHASE_HOOK=<folder>``; then a test aims one fault at one phase by
writing a *trap* into that folder, and the first process to enter the phase
(optionally: with a given rank) takes it:

* ``<folder>/trap``: JSON ``{"phase": "init", "action": "stop", "rank": 1,
  "after": 0}``: the phase, the action (below), the rank that must take it
  (``null``: any) and how many matching entries to let pass first.
* the taker renames ``trap`` to ``taken.<pid>`` (a rename is atomic: one taker),
  writes ``hit`` (JSON: phase, rank, pid, the world size) and acts:

  - ``"kill"``: SIGKILL itself; ``"stop"``: SIGSTOP itself (frozen);
  - ``"exit"``: ``os._exit(1)``;
  - ``"pause"``: wait until ``<folder>/release`` exists, so that the test can
    do what only it can (kill the worker, cut the link) at exactly that point.

Example (in a test)::

    (folder / "trap").write_text(json.dumps({"phase": "rollback", "action": "kill"}))
"""

from __future__ import annotations

import json
import os
import signal
import time

ENV = "HVDKIT_PHASE_HOOK"

PHASES = (
    "step",  # a training step of an elastic run
    "save",  # a checkpoint save (the background write included)
    "exchange",  # the preemption check's exchange (carries the growth flag)
    "word",  # the scheduler's new world arriving at a worker
    "leave",  # leaving Horovod's world after a failure or for growth
    "meet",  # the ready/go meeting of a new round
    "init",  # Horovod's init: the Gloo rendezvous and connections
    "rollback",  # the rollback broadcast of the last commit in a new world
    "restore",  # a newcomer's restore() of the state from the new rank 0
    "reshard",  # re-sharding the rest of the epoch over the new world
    "first_step",  # the first training step of a new world
    "end",  # the job's end (the training function returned)
)

_folder = os.environ.get(ENV)
_seen: dict[str, int] = {}


def enter(phase: str, rank: int | None = None, size: int | None = None) -> None:
    """Mark the start of ``phase`` (one of :data:`PHASES`); a trap aimed at it fires here."""
    if not _folder:
        return
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; the phases are {', '.join(PHASES)}")
    trap_path = os.path.join(_folder, "trap")
    try:
        with open(trap_path) as f:
            trap = json.load(f)
    except (OSError, ValueError):
        return
    if trap.get("phase") != phase or trap.get("rank") not in (None, rank):
        return
    key = f"{phase}/{rank}"
    _seen[key] = _seen.get(key, 0) + 1
    if _seen[key] <= int(trap.get("after", 0)):
        return
    try:
        os.rename(trap_path, os.path.join(_folder, f"taken.{os.getpid()}"))
    except OSError:
        return  # another process took it
    hit = {"phase": phase, "rank": rank, "size": size, "pid": os.getpid(), "at": time.time()}
    with open(os.path.join(_folder, "hit.tmp"), "w") as f:
        json.dump(hit, f)
    os.replace(os.path.join(_folder, "hit.tmp"), os.path.join(_folder, "hit"))
    _act(trap.get("action"))


def _act(action: str | None) -> None:
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif action == "exit":
        os._exit(1)
    elif action == "pause":
        release = os.path.join(_folder, "release")
        while not os.path.exists(release):
            time.sleep(0.01)
    else:
        raise ValueError(f"unknown trap action {action!r}; use kill, stop, exit or pause")

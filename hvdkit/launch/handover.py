"""The hand-over folder: what a worker and its running program say to each other (elastic).

The worker makes a mode-700 folder per program (:class:`ElasticHandover`) and
gives its path to the program (``HVDKIT_ELASTIC_DIR``); the files in it are
:mod:`hvdkit._comm.meeting`'s: the program says it is ready, trains again or
finished; the worker leaves it the scheduler's ``go`` and its next world.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import tempfile

import psutil

from .. import config
from .._comm import meeting as _meeting

log = logging.getLogger("hvdkit.worker")


class ElasticHandover:
    """Where a worker leaves its running program's next assignment (``HVDKIT_ELASTIC_DIR``).

    In an elastic job (``HVDKIT_ELASTIC=1`` on the scheduler) a rank whose
    peer died leaves Horovod, waits for ``assign.json`` here (written
    atomically, mode 600 in a mode-700 folder), and joins the new world
    in-process (:mod:`hvdkit.elastic`). Horovod's Gloo timeout is shortened
    (``config.ELASTIC_GLOO_TIMEOUT_S`` unless already set): it bounds a wait
    on a silent peer where the scheduler's word cannot end it, and
    ``hvd.init``'s connect.
    """

    PREFIX = "hvdkit-elastic-"  # then this worker's pid, "-", and mkdtemp's letters

    def __init__(self, assign: dict, env: dict[str, str]):
        remove_folders_of_dead_workers(tempfile.gettempdir(), self.PREFIX)
        self.folder = tempfile.mkdtemp(prefix=f"{self.PREFIX}{os.getpid()}-")  # mode 700
        env[config.ELASTIC_DIR] = self.folder
        if assign.get("join"):  # our program joins running survivors: it meets them first
            env[config.ELASTIC_JOIN] = "1"
        env.setdefault(config.GLOO_TIMEOUT, str(config.ELASTIC_GLOO_TIMEOUT_S))
        self._first_rank = assign["rank"]
        self._awaited_ready = int(assign["round"]) if assign.get("join") else -1
        self._said_ready = -1
        self._said_resumed = -1
        self.finished: int | None = None  # the round our program finished training in

    def newly_resumed(self) -> tuple[int, int] | None:
        """``(round, step)`` our program (rank 0) newly trains again from, or None."""
        said = _meeting.read_resumed(self.folder)
        if said is None or said[0] <= self._said_resumed:
            return None
        self._said_resumed = said[0]
        return said

    def awaits_ready(self) -> bool:
        """Whether our program is to say it is ready for a world it was given (a join, a
        new world), and has not yet."""
        return self._said_ready < self._awaited_ready and self.finished is None

    def newly_ready(self) -> int | None:
        """The round our program is newly ready to start Horovod in (it said so), or None."""
        round_ = _meeting.read_round(self.folder, _meeting.READY)
        if round_ is None or round_ <= self._said_ready:
            return None
        self._said_ready = round_
        return round_

    def newly_finished(self) -> int | None:
        """The round our program finished training in, when it newly says so; else None."""
        if self.finished is not None:
            return None
        self.finished = _meeting.read_round(self.folder, _meeting.FINISHED)
        return self.finished

    def go(self, round_: int) -> None:
        """Every rank of ``round_`` is ready: our program may start Horovod."""
        _meeting.write(self.folder, _meeting.GO, str(round_))

    def hand_over(self, assign: dict, horovod: dict[str, str]) -> None:
        log.warning(
            "rank %d goes on in-process as rank %d of %d (round %d)",
            self._first_rank,
            assign["rank"],
            assign["size"],
            assign["round"],
        )
        self._awaited_ready = max(self._awaited_ready, int(assign["round"]))
        body = json.dumps(
            {"round": int(assign["round"]), "env": horovod, "lost": bool(assign.get("lost"))}
        )
        _meeting.write(self.folder, _meeting.ASSIGN, body)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def remove_folders_of_dead_workers(parent: str, prefix: str) -> None:
    """Remove the ``parent/<prefix><pid>-*`` folders of this user whose worker is gone.

    A worker removes its hand-over folder when its program ends; a worker
    killed with SIGKILL cannot, so the next worker on the machine does. A
    folder is kept while a process with its pid exists (a reused pid keeps it
    until that process ends too); symlinks and other users' entries are left.
    """
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix) :].split("-", 1)[0]
        if not pid.isdigit() or psutil.pid_exists(int(pid)):
            continue
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid == os.getuid() and stat.S_ISDIR(st.st_mode):  # a symlink is not
            shutil.rmtree(path, ignore_errors=True)

"""The restart budget of a job: how often a failed job is started again, and the log lines.

Shared by ``hvdkitrun --max-restarts N`` and the scheduler. Pure logic (no
processes), unit-tested in ``tests/unit/test_launch_logic.py``::

    budget = RestartBudget(2)
    budget.record("rank 1 killed by signal 9 (SIGKILL)")   # -> 1.0 (seconds to wait)
    budget.record("rank 0 stalled")                        # -> 2.0
    budget.record("rank 1 exit code 3")                    # -> None: spent
    budget.summary()   # every cause, one per attempt
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import config
from .._validate import is_int
from ..errors import LaunchError
from ..fault import _checkpoint_files as checkpoint_files

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 8.0


def max_restarts(value: int | None = None) -> int:
    """The restart budget: ``value`` if given, else ``HVDKIT_MAX_RESTARTS``, else 0."""
    if value is None:
        value = config.get_int(
            config.MAX_RESTARTS, 0, fix="use e.g. 2 (or 0 for none).", error=LaunchError
        )
    if value < 0:
        raise LaunchError(f"--max-restarts {value} must be >= 0 (0: never restart).")
    return value


def backoff_s(restart: int) -> float:
    """Seconds to wait before restart number ``restart`` (1, 2, ...): 1, 2, 4, then 8."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** max(0, restart - 1))


class RestartBudget:
    """Counts failures against ``limit`` restarts and keeps each cause for the final report."""

    def __init__(self, limit: int):
        if limit < 0:
            raise LaunchError(f"--max-restarts {limit} must be >= 0 (0: never restart).")
        self.limit = limit
        self.causes: list[str] = []

    @property
    def restarts(self) -> int:
        """Restarts granted so far (= the attempt number of the current attempt)."""
        return min(len(self.causes), self.limit)

    def left_line(self) -> str:
        """What is left of the budget, for the log: ``1 of 2 whole-job restarts left``."""
        left = max(0, self.limit - len(self.causes))
        return f"{left} of {self.limit} whole-job restarts left"

    def record(self, cause: str) -> float | None:
        """Note a failed attempt; seconds to wait before restarting, or ``None`` if spent."""
        self.causes.append(cause)
        if len(self.causes) > self.limit:
            return None
        return backoff_s(len(self.causes))

    def restart_line(self, who: str, resume_step: int | None) -> str:
        """The one log line of the restart just granted by :meth:`record`."""
        n = len(self.causes)
        resume = (
            f"resuming from checkpoint step {resume_step}"
            if resume_step is not None
            else "resuming from the script's own checkpoint, if any"
        )
        return f"{who}: restart {n}/{self.limit} after {self.causes[-1]}; {resume}."

    def summary(self) -> str:
        """Every cause, numbered by attempt, for the report when the job gives up."""
        attempts = len(self.causes)
        listed = "; ".join(f"attempt {i + 1}: {c}" for i, c in enumerate(self.causes))
        if self.limit == 0:
            return listed
        return f"gave up after {attempts} failed attempts ({self.limit} restarts): {listed}"


def resume_step(directory: str | Path | None) -> int | None:
    """Global step of the newest complete checkpoint in ``directory``, or ``None``.

    Reads only the ``ckpt-<step>/manifest.json`` files that
    :class:`hvdkit.Checkpointer` leaves (layout and self-checksum from
    :mod:`hvdkit.fault._checkpoint_files`; no TensorFlow): the newest folder whose
    manifest parses, holds an integer ``step`` and, where it carries
    ``manifest_sha256``, passes that self-check. A script that writes its own
    checkpoints in this layout gets the same line. Unfinished writes
    (``.tmp-*`` folders) and foreign files are skipped. The payload's
    checksums are left to ``Checkpointer.restore()``, which skips a corrupt
    checkpoint with a warning naming it, so in that rare case the script
    resumes from an older step than this line said.
    """
    if directory is None or not Path(directory).is_dir():
        return None
    found, _torn = checkpoint_files.scan(Path(directory))
    for _step, folder in found:  # newest first
        try:
            manifest = json.loads((folder / checkpoint_files.MANIFEST).read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        if not isinstance(manifest, dict):
            continue
        given = manifest.get("manifest_sha256")
        if given is not None and given != checkpoint_files.manifest_digest(manifest):
            continue
        step = manifest.get("step")
        if is_int(step) and step >= 0:
            return step
    return None

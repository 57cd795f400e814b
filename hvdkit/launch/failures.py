"""Which rank caused a failed job, and how a rank ended: one rule for every launcher.

Pure functions over what the launchers saw (exit codes, Horovod's launcher
messages, each rank's last lines), so they are unit-tested without processes.

When one rank dies, the others usually fail right after it, in their next
collective: Horovod's "has been shut down" or Gloo's "Connection closed by
peer". Those are follow-on failures; the rank to blame is the one whose
output does not show that it lost a peer::

    >>> root_cause([0, 1], {0: ["Horovod has been shut down"], 1: ["Killed"]})
    Blame(rank=1, how='')
"""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# What a healthy rank prints when its collective fails because a peer died:
# Horovod's shutdown message, or Gloo's broken connection.
FOLLOW_ON_FAILURES = ("Horovod has been shut down", "Connection closed by peer")

# horovodrun's / mpirun's lines naming a failed rank: (pattern, what group 2 is).
_LAUNCHER_REPORTS = (
    (re.compile(r"Process (\d+) exit with status code (-?\d+)"), "exit code"),  # horovodrun --gloo
    (
        re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)"),
        "signal",
    ),  # mpirun
    (re.compile(r"Process name: \[\[\d+,\d+\],(\d+)\]\s+Exit code:\s+(-?\d+)"), "exit code"),
)
# mpirun, when a rank ended (even with status 0) without MPI_Finalize.
# Open MPI wraps the message, so any whitespace may separate its words.
_MPI_IMPROPER_EXIT = re.compile(
    r"process\s+rank\s+(\d+)\s+with\s+PID\s+\d+\s+on\s+node\s+\S+\s+exiting\s+improperly"
)
# Horovod's stall inspector naming ranks missing from a collective.
_MISSING_RANKS = re.compile(r"[Mm]issing ranks:\s*([\d, ]+)")


def lost_a_peer(lines: Sequence[str]) -> bool:
    """Whether a rank's last lines show it failed only because another rank went away."""
    return any(marker in ln for ln in lines for marker in FOLLOW_ON_FAILURES)


def describe_exit(code: int) -> str:
    """``exit code 3`` or ``killed by signal 9 (SIGKILL)`` for a Popen return code."""
    if code >= 0:
        return f"exit code {code}"
    try:
        return f"killed by signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"killed by signal {-code}"


def failing_rank(launcher_lines: Sequence[str]) -> tuple[int | None, str]:
    """Rank and reason from horovodrun's / mpirun's failure messages, if present.

    >>> failing_rank(["Process 1 exit with status code 137."])
    (1, 'exit code 137 (SIGKILL)')
    """
    text = "\n".join(launcher_lines)
    for pattern, what in _LAUNCHER_REPORTS:
        m = pattern.search(text)
        if m:
            return int(m.group(1)), _ending(what, int(m.group(2)))
    m = _MPI_IMPROPER_EXIT.search(text)
    if m:
        return int(m.group(1)), "ended without finishing MPI (e.g. os._exit)"
    m = _MISSING_RANKS.search(text)
    if m:
        return (
            int(m.group(1).split(",")[0]),
            "stalled: Horovod reported it missing from a collective",
        )
    return None, ""


def reported_endings(launcher_lines: Sequence[str]) -> dict[int, str]:
    """Every rank whose ending horovodrun/mpirun reported, first report per rank.

    ``horovodrun --gloo`` prints one line per process that ended non-zero;
    mpirun names only the first.

    >>> reported_endings(["Process 0 exit with status code 1.",
    ...                   "Process 1 exit with status code 3."])
    {0: 'exit code 1', 1: 'exit code 3'}
    """
    text = "\n".join(launcher_lines)
    found: dict[int, str] = {}
    for pattern, what in _LAUNCHER_REPORTS:
        for m in pattern.finditer(text):
            found.setdefault(int(m.group(1)), _ending(what, int(m.group(2))))
    return found


def _ending(what: str, value: int) -> str:
    """``exit code 137 (SIGKILL)``, ``signal 9 (SIGKILL)``: a launcher-reported ending."""
    return f"{what} {value}{_signal_hint(what, value)}"


def _signal_hint(what: str, value: int) -> str:
    """`` (killed by SIGKILL)`` for a shell-style exit code 128+N or a signal number."""
    number = value - 128 if what == "exit code" and value > 128 else value
    if what == "exit code" and value <= 128:
        return ""
    try:
        return f" ({signal.Signals(number).name})"
    except ValueError:
        return ""


@dataclass(frozen=True)
class Blame:
    """The rank a failed job is blamed on; ``how`` says why when it is not plain."""

    rank: int
    how: str = ""


def root_cause(
    failed: Sequence[int],
    tails: Mapping[int, Sequence[str]],
    exited_ok: Sequence[int] = (),
) -> Blame | None:
    """The rank to blame for a failed job, or ``None`` if no rank is known to have failed.

    Args:
        failed: ranks known to have failed, most trusted first (the order a
            launcher reported them in).
        tails: last output lines per rank, for every rank that printed any.
        exited_ok: ranks that ended with status 0 while the job still ran.

    The rule, in order:
      1. the first rank in ``failed`` that did not merely lose a peer;
      2. a rank that exited 0 while the others still ran (they then lost it:
         a rank leaving early is not a success of the job);
      3. the one rank, not in ``failed``, whose output shows no lost peer
         (mpirun names the first rank to *exit*, often a healthy one);
      4. otherwise the first of ``failed``.

    Example:
        >>> root_cause([0], {0: ["Connection closed by peer"], 1: ["step 3"]})
        Blame(rank=1, how='went away first; the others then lost it')
    """
    if not failed:
        return None
    for r in failed:
        if not lost_a_peer(tails.get(r, ())):
            return Blame(r)
    early = [r for r in exited_ok if r not in failed]
    if early:
        return Blame(early[0], "exited 0 while the other ranks still ran; they then lost it")
    quiet = [r for r in sorted(tails) if r not in failed and not lost_a_peer(tails[r])]
    if len(quiet) == 1:
        return Blame(quiet[0], "went away first; the others then lost it")
    return Blame(failed[0])

"""Which collective this process is waiting in, for the launcher's stuck-rank check.

hvdkit's collectives mark when they start and end (eager calls from Python,
the gradient allreduce from inside the graph). The heartbeat sender puts
:func:`status` into every heartbeat, so the launcher can tell a rank that has
waited in one collective longer than the stall timeout (the others are in
another collective, or not in any) and name what each rank is doing.

No TensorFlow here: the launcher reads the same field names.

Example:
    >>> token = enter("allreduce 'x'", step=3)
    >>> status()["w"]
    "allreduce 'x' (step 3)"
    >>> leave(token)
"""

from __future__ import annotations

import itertools
import threading
import time

# heartbeat fields: completed collectives, the collective waited in, seconds waited
COMPLETED, WAITING, WAITED_S = "cc", "w", "ws"

_lock = threading.Lock()
_tokens = itertools.count(1)
_inflight: dict[int, tuple[str, float]] = {}  # token -> (description, start)
_completed = 0


def enter(what: str, step: int | None = None) -> int:
    """Mark the start of a collective; returns the token to pass to :func:`leave`."""
    label = what if step is None else f"{what} (step {step})"
    with _lock:
        token = next(_tokens)
        _inflight[token] = (label, time.monotonic())
    return token


def leave(token: int) -> None:
    """Mark the end of the collective ``token`` (whether it succeeded or failed)."""
    global _completed
    with _lock:
        if _inflight.pop(token, None) is not None:
            _completed += 1


def status() -> dict:
    """Heartbeat fields: collectives completed so far, and the oldest one still waited in."""
    with _lock:
        fields = {COMPLETED: _completed}
        if _inflight:
            label, start = min(_inflight.values(), key=lambda v: v[1])
            fields[WAITING] = label
            fields[WAITED_S] = round(time.monotonic() - start, 1)
    return fields


def start_watchdog(timeout_s: float, rank: int, interval_s: float = 5.0) -> threading.Thread:
    """Without hvdkit's launcher: warn on stderr once per collective waited in over ``timeout_s``.

    Under plain ``horovodrun``/``mpirun`` nothing else names such a wait; the
    warning cannot tell what the other ranks do, and does not stop the job.
    """
    import sys

    def loop():
        warned = set()
        while True:
            time.sleep(interval_s)
            with _lock:
                overdue = [
                    (token, label, time.monotonic() - start)
                    for token, (label, start) in _inflight.items()
                    if time.monotonic() - start > timeout_s and token not in warned
                ]
            for token, label, age in overdue:
                warned.add(token)
                sys.stderr.write(
                    f"hvdkit: WARNING: rank {rank} has waited in {label} for {age:.0f} s (stall "
                    f"timeout {timeout_s:g} s). If other ranks are in a different collective or "
                    "none, the job is stuck; hvdkitrun would have stopped it (see "
                    "docs/divergence.md).\n"
                )
                sys.stderr.flush()

    thread = threading.Thread(target=loop, name="hvdkit-watchdog", daemon=True)
    thread.start()
    return thread

"""Which collective this process is waiting in, for the launcher's stuck-rank check.

hvdkit's collectives mark when they start and end: eager calls from Python
with :func:`enter`/:func:`leave`; the gradient allreduce inside the graph
updates counters that a probe (:func:`add_probe`, registered by
:mod:`hvdkit._comm.graph_progress`) reads whenever a status is built, so a training
step makes no Python call for it. The heartbeat sender puts :func:`status`
into every heartbeat, so the launcher can tell a rank that has waited in one
collective longer than the stall timeout (the others are in another
collective, or not in any) and name what each rank is doing.

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
from collections.abc import Callable

# heartbeat fields: completed collectives, the collective waited in, seconds waited,
# the step this rank stopped after for a preemption (hvdkit.preemption)
COMPLETED, WAITING, WAITED_S, PREEMPTED = "cc", "w", "ws", "pre"

_lock = threading.Lock()
_tokens = itertools.count(1)
_inflight: dict[int, tuple[str, float]] = {}  # token -> (description, start)
_completed = 0
# A probe returns (collectives it saw completed, [(description, start), ...] waited in).
Probe = Callable[[], tuple[int, list[tuple[str, float]]]]
_probes: list[Probe] = []
_preempted_step: int | None = None
_rank_listeners: list[Callable[[int], None]] = []
_forgotten_before = float("-inf")  # waits that started earlier are over (forget_waits)


def on_rank_change(listener: Callable[[int], None]) -> None:
    """Call ``listener(new_rank)`` when this process becomes another rank (hvdkit.elastic)."""
    _rank_listeners.append(listener)


def rank_changed(rank: int) -> None:
    """This process is ``rank`` now: tell the listeners (the heartbeat sender)."""
    for listener in list(_rank_listeners):
        listener(rank)


def forget_waits() -> None:
    """Every collective waited in so far is over: Horovod was shut down (hvdkit.elastic).

    A collective that failed inside a traced step never reports its end; the
    heartbeats must not go on saying the rank waits in it while the rank
    rejoins the job.
    """
    global _forgotten_before
    with _lock:
        _inflight.clear()
        _forgotten_before = time.monotonic()
        probes = list(_probes)
    for probe in probes:  # a probe that counts entries learns that these are over
        forget = getattr(probe, "forget", None)
        if forget is not None:
            forget()


def label(what: str, step: int | None = None) -> str:
    """How a collective is named in heartbeats: ``"gradient allreduce (step 3)"``."""
    return what if step is None else f"{what} (step {step})"


def enter(what: str, step: int | None = None) -> int:
    """Mark the start of a collective; returns the token to pass to :func:`leave`."""
    with _lock:
        token = next(_tokens)
        _inflight[token] = (label(what, step), time.monotonic())
    return token


def leave(token: int) -> None:
    """Mark the end of the collective ``token`` (whether it succeeded or failed)."""
    global _completed
    with _lock:
        if _inflight.pop(token, None) is not None:
            _completed += 1


def completed_eagerly() -> int:
    """Eager collectives completed so far (the update check's sign of a reduction in between)."""
    with _lock:
        return _completed


def add_probe(probe: Probe) -> None:
    """Count what ``probe`` reports in every :func:`status` from now on."""
    with _lock:
        _probes.append(probe)


def _snapshot() -> tuple[int, list[tuple[str, float]]]:
    """Collectives completed, and every (description, start) still waited in."""
    with _lock:
        done, waits, probes = _completed, list(_inflight.values()), list(_probes)
    for probe in probes:  # outside the lock: a probe may take a moment
        seen, more = probe()
        done += seen
        waits += more
    return done, [w for w in waits if w[1] >= _forgotten_before]


def mark_preempted(step: int) -> None:
    """From now on, heartbeats say this rank stopped after ``step`` for a preemption."""
    global _preempted_step
    _preempted_step = int(step)


def status() -> dict:
    """Heartbeat fields: collectives completed so far, the oldest one still waited in.

    And, once :func:`mark_preempted` was called, the step of the preemption.
    """
    done, waits = _snapshot()
    fields = {COMPLETED: done}
    if _preempted_step is not None:
        fields[PREEMPTED] = _preempted_step
    if waits:
        what, start = min(waits, key=lambda v: v[1])
        fields[WAITING] = what
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
            now = time.monotonic()
            overdue = [
                (what, start)
                for what, start in _snapshot()[1]
                if now - start > timeout_s and (what, start) not in warned
            ]
            for what, start in overdue:
                warned.add((what, start))
                sys.stderr.write(
                    f"hvdkit: WARNING: rank {rank} has waited in {what} for {now - start:.0f} s "
                    f"(stall timeout {timeout_s:g} s). If other ranks are in a different "
                    "collective or none, the job is stuck; hvdkitrun would have stopped it (see "
                    "docs/divergence.md).\n"
                )
                sys.stderr.flush()

    thread = threading.Thread(target=loop, name="hvdkit-watchdog", daemon=True)
    thread.start()
    return thread

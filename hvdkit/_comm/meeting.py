"""How a rank and its worker agree on the next world of an elastic job (files, one folder).

The worker makes a mode-700 folder for its rank (``HVDKIT_ELASTIC_DIR``).
Its files pass through it, each written whole (a rename) by one side:

* ``assign.json`` (worker -> rank): ``{"round": r, "env": {...}, "lost":
  bool}``, the Horovod settings of the rank in the job's round ``r``;
  ``lost``: round ``r`` replaces a world that lost a rank, so the rank's
  collectives in the old one can only fail (:mod:`hvdkit.elastic` ends its
  connections at once instead of waiting for Gloo's timeout);
* ``ready`` (rank -> worker): ``r``, the rank is about to start Horovod in
  round ``r`` (a newcomer: at its first collective,
  :func:`hvdkit.runtime.start_deferred`); the worker tells the scheduler;
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

Also here, below :mod:`hvdkit.runtime` and the optimizer, because both need
them without the fault-tolerance package: :func:`join_next_world` (wait for
the next world and start in it: a failed start of :func:`hvdkit.runtime.init`,
and :func:`hvdkit.runtime.rejoin`, which :mod:`hvdkit.fault._next_world`'s one
lost-peer loop calls) and :func:`state_pending` (the optimizer's step check asks it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

from .. import _phases, config
from ..errors import CollectiveError, LaunchError

ASSIGN, READY, GO, RESUMED, FINISHED = "assign.json", "ready", "go", "resumed", "finished"
POLL_S = 0.02
# What a collective says when a peer is lost: once Horovod stopped for it (its background
# loop ended on Gloo's error), every pending and later collective fails with the first;
# the collective that met the error itself carries Gloo's message, which names its source
# file under gloo/transport/ ("Connection closed by peer", "Timed out waiting ...").
_PEER_LOST = ("Horovod has been shut down", "gloo/transport/")
# After a failed Horovod start: seconds, beyond the stall timeout and Gloo's, for the
# scheduler's word of a lost peer to come (the worker's SIGTERM grace of a stopped rank, 5 s,
# and the scheduler's round).
_START_MARGIN_S = 10.0
# ... and between two ranks of that round giving up: time for the scheduler to form the
# world without the first (its worker's report, the new round, the word to every worker).
_START_STAGGER_S = 5.0


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


def shared_folder() -> str | None:
    """The folder this rank shares with its worker (``HVDKIT_ELASTIC_DIR``); None outside one.

    The one place that reads the variable: everything else asks here.
    """
    return config.get(config.ELASTIC_DIR)


def enabled() -> bool:
    """Whether this rank may recover in-process: a worker of an elastic job started it."""
    return bool(shared_folder())


def join_waiting() -> bool:
    """Whether this rank's worker left it a next assignment (a worker waits to join)."""
    shared = shared_folder()
    if not shared:
        return False
    body = read_assignment(shared)
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


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a collective that failed for a lost peer."""
    seen = 0
    while exc is not None and seen < 8:
        text = str(exc)
        if any(words in text for words in _PEER_LOST):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def join_next_world(start: Callable[[], None], failed: CollectiveError | None = None) -> int:
    """Wait for the worker's next assignment, meet the others, call ``start``; the round.

    ``start`` starts Horovod in the assigned world (:func:`hvdkit.runtime.init`)
    and raises :class:`CollectiveError` if it cannot: a peer of the round died
    or froze while the ranks connected. Then (or from the outset, given the
    start that ``failed``) the rank waits for the world after it, which the
    scheduler forms once that peer's worker reported it (at the latest at the
    stall timeout). If none comes within the stall timeout plus Gloo's and a
    margin, nobody was lost (a peer was only slower to connect than Gloo's
    timeout) and the rank ends with a :class:`LaunchError`: its worker reports
    it, and the others go on without it, as after any lost rank. Every rank of
    the round failed its start then, at about the same time, so the ranks
    wait in turns (the last rank first, :data:`_START_STAGGER_S` apart): only
    the first to end is lost.

    Example:
        >>> runtime.shutdown()                       # a peer was lost
        >>> round_ = join_next_world(runtime.init)   # rank of the next world
    """
    folder = shared_folder()
    timeout = config.sched_timeout()
    if failed is not None:
        _say_failed_start(config.restart_count(), failed)
    while True:
        seen = config.restart_count()
        limit = timeout if failed is None else min(timeout, _after_failed_start_s())
        deadline = time.monotonic() + limit
        try:
            while True:
                body = read_assignment(folder)
                if body is not None and body["round"] > seen:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError
                time.sleep(POLL_S)
            round_ = meet(folder, take(body), deadline)
        except TimeoutError:
            if failed is not None:
                raise LaunchError(
                    f"Horovod could not start in round {seen} ({failed}) and no peer was reported "
                    f"lost within {limit:g} s: one was slower to connect than Gloo's timeout "
                    f"({config.GLOO_TIMEOUT}); raise it for a loaded machine. This rank ends."
                ) from None
            raise LaunchError(
                f"a peer was lost and no new world formed within {timeout:g} s "
                f"({config.SCHED_TIMEOUT}): fewer workers left than {config.MIN_WORKERS}, or "
                "one of them never got ready; see the scheduler's log."
            ) from None
        try:
            start()
            return round_
        except CollectiveError as exc:  # a peer of round_ died or froze while Horovod started
            failed = exc
            _say_failed_start(round_, exc)


def _say_failed_start(round_: int, exc: CollectiveError) -> None:
    print(
        f"hvdkit: Horovod could not start in round {round_} ({exc}); "
        "this rank waits for the next world",
        file=sys.stderr,
        flush=True,
    )


def _after_failed_start_s() -> float:
    """How long a rank whose Horovod start failed waits for a world without the lost peer.

    The peer's worker notices a frozen rank at the stall timeout; its
    Horovod start had Gloo's timeout; a few seconds more for the word to come.
    """
    stall = config.get_float(config.STALL_TIMEOUT, config.DEFAULT_STALL_TIMEOUT_S, positive=True)
    gloo = config.get_float(config.GLOO_TIMEOUT, config.ELASTIC_GLOO_TIMEOUT_S, positive=True)
    rank = config.get_int(config.HOROVOD_RANK, 0, minimum=0)  # in the round that failed to start
    size = config.get_int(config.HOROVOD_SIZE, rank + 1, minimum=rank + 1)
    return stall + gloo + _START_MARGIN_S + _START_STAGGER_S * (size - 1 - rank)


class StatePending:
    """Whether this rank trains before it has the job's state (Horovod's elastic example does).

    Horovod's elastic Keras example trains one step before ``run`` syncs the
    state, at the start and in its reset callback, so a newcomer's first step
    (its optimizer at step 0) meets the others' (at their step). The
    optimizer's check that every rank reduces the same step would stop that
    job; functions traced while this is true leave it out, and ``hvdkit.elastic.run``
    traces them again once the state came. Here, below the optimizer, so that it
    can ask without importing :mod:`hvdkit.fault`.
    """

    synced_once = False
    rejoined = False

    @classmethod
    def received(cls) -> None:
        cls.synced_once, cls.rejoined = True, False


def state_pending() -> bool:
    """Whether this rank of an elastic job trains before it received the job's state.

    True before the first ``restore()``/``sync()`` of this process and, with
    Horovod's state classes, between a new world and its ``sync()``.
    """
    return enabled() and (not StatePending.synced_once or StatePending.rejoined)

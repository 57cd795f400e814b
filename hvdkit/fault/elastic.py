"""In-process recovery: the ranks left after a failure keep training without a restart.

In a scheduler/worker job started with ``HVDKIT_ELASTIC=1`` (and
``HVDKIT_MIN_WORKERS`` below ``HVDKIT_WORKER_NUM``), when a rank or its
worker dies the others do not stop. Each survivor's collective fails: the
dead rank's direct Gloo peers see its connection close, and the others'
connections are ended when the scheduler's new world reaches their worker
(where that cannot be done, Horovod's Gloo timeout ends the wait:
:data:`hvdkit.config.ELASTIC_GLOO_TIMEOUT_S` in such jobs). :func:`run`
catches that failure, leaves Horovod, waits for the scheduler's new
assignment (its worker leaves it in ``HVDKIT_ELASTIC_DIR``), starts Horovod
again as a rank of the smaller world, rolls the
:class:`~hvdkit.Checkpointer`'s state back to its last save (kept in memory
on every rank), re-shards the sampler's rest of the epoch over the new
world, and calls the training function again (Horovod's
``hvd.elastic.run`` contract, with the Checkpointer as the state).
TensorFlow, the model and the optimizer stay in memory; only the steps
since the last save are trained again.

While the job runs on fewer workers than ``HVDKIT_WORKER_NUM``, a worker that
registers joins it: once its program is about to start Horovod, the
scheduler gives the others the bigger world; they agree on a step (the
preemption check's exchange carries the flag), commit it in memory, raise
:class:`Regroup` there, and :func:`run` takes them into the new world as
above, from that step (nothing is trained again). The newcomer's
``restore()`` receives the state from the new rank 0. Once the training
function has returned on a rank, the job takes no newcomer: a worker that is
ready to join then is sent away ("the job finished training") and ends with
the job's status, while the ranks run whatever the script does after
training (an evaluation, a save) in their world.

Gloo only: Open MPI cannot admit a process set change within a job, so an
``--mpi`` job (``hvdkitrun``) restarts as before (``--max-restarts``).

Horovod's elastic state classes and Keras callbacks (``KerasState``,
``TensorFlowKerasState``, ``ObjectState``, ``CommitStateCallback``, ...) are
here too, from :mod:`hvdkit.fault.elastic_state`; :func:`run` takes such a state as
Horovod's ``hvd.elastic.run`` does (sync, call, and on a reset: restore, new
world, reset callbacks, sync).

Example:
    >>> ckpt = hvdkit.Checkpointer("ckpt", model=model, sampler=sampler, every_steps=20)
    >>> @hvdkit.elastic.run
    ... def train(ckpt):
    ...     for epoch in range(sampler.epoch, EPOCHS):
    ...         sampler.set_epoch(epoch)
    ...         model.fit(sampler.dataset(data).batch(B), initial_epoch=epoch,
    ...                   epochs=epoch + 1, callbacks=[ckpt.callback(batch_size=B)])
    >>> train(ckpt)      # restores from disk first; recovers in-process after a loss
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from .. import _phases, config, runtime
from .._comm import meeting as _meeting
from .._comm.meeting import enabled
from ..errors import NotSupportedError
from . import _failed_attempt
from ._memory_commit import MemoryCommit
from .preemption import Regroup

__all__ = ["run", "enabled", "Regroup"]  # and Horovod's state classes (hvdkit.fault.elastic_state)


# Regroup (hvdkit.preemption) and enabled (hvdkit._comm.meeting, beside join_waiting) are
# defined below this module, so that the Checkpointer uses them without importing it.
def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a training function whose first argument is the job's Checkpointer.

    As Horovod's ``hvd.elastic.run``: call the decorated function with the
    state first (here a :class:`~hvdkit.Checkpointer`, with its model,
    optimizer and sampler). It restores the state (from disk, as
    :meth:`~hvdkit.Checkpointer.restore`: every rank starts alike) and calls
    the function (unless ``restore()`` ran already: a newcomer's first
    ``restore()`` receives the running job's state, and must be its only one).
    If a collective fails because a peer died, and this rank
    belongs to an elastic job, it rejoins the job's new world, rolls the
    state back to its last save, resets the model's compiled Keras functions,
    and calls the function again; it returns what the function finally
    returns. Write the function so that it continues from the state
    (``range(sampler.epoch, ...)``, ``initial_epoch``) and build any
    ``tf.function`` of your own inside it: the world size may have changed.

    Outside an elastic job it restores and calls the function once.

    The state may instead be one of Horovod's (:class:`KerasState`,
    :class:`ObjectState`, ...: :mod:`hvdkit.fault.elastic_state`); then the loop is
    Horovod's: ``state.sync()``, the call, and after a lost peer
    ``state.restore()`` (its last commit), the new world,
    ``state.on_reset()`` (its reset callbacks) and ``sync()`` again; after
    ``state.commit()`` found a worker waiting to join, the same without the
    restore.

    Before each recovery every live ``tf.data`` iterator is kept for the rest
    of the process, and the failed attempt's frames are cleared
    (:mod:`hvdkit.fault._failed_attempt`: freed later, a failed ``fit``'s
    iterator could stop the rank for seconds in the middle of the next world).

    Raises:
        NotSupportedError: the first argument is neither a Checkpointer nor
            one of Horovod's state classes, naming the hvdkit way.
    """

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        from .checkpoint import Checkpointer
        from .elastic_state import State

        if isinstance(state, State):
            return _run_state(func, state, args, kwargs)
        if not isinstance(state, Checkpointer):
            raise NotSupportedError(
                f"hvdkit.elastic.run: the state {state!r} is neither an hvdkit.Checkpointer "
                "nor one of Horovod's state classes. Pass hvdkit.Checkpointer(dir, model=..., "
                "sampler=..., every_steps=N) (its saves are the commits), or "
                "hvdkit.elastic.KerasState(model, ...) as in Horovod."
            )
        commit = _commit_of(state)
        if not state.restored:  # in the next world again if a peer is lost meanwhile
            state.restore()
        elif commit is not None:  # restored before run(): that state is the first commit
            _on_checkpointer(commit, "restore")
        if enabled():  # (after the restore, whose own rejoin the watch must not see)
            _LostPeerWatch.start_once()
        while True:
            try:
                result = func(state, *args, **kwargs)
            except Regroup as exc:
                _recover(commit, exc)
            except Exception as exc:
                if not enabled() or not _meeting.peer_lost(exc):
                    raise
                _recover(commit, exc)
            else:
                _phases.enter("end")
                _say_finished()
                return result

    return wrapper


def _run_state(func: Callable[..., Any], state, args: tuple, kwargs: dict) -> Any:
    """Horovod's elastic loop for one of its state classes, on hvdkit's elastic runtime."""
    if enabled():
        _LostPeerWatch.start_once()
    rejoined = False
    while True:
        try:
            if rejoined:
                state.on_reset()
            pending = _meeting.state_pending()
            state.sync()
            _meeting.StatePending.received()
            if pending:  # functions traced before the state came lack the step check
                for model in _models_of(state):
                    _reset_compiled_functions(model)
            if rejoined and runtime.rank() == 0:
                _meeting.write(
                    _meeting.shared_folder(),
                    _meeting.RESUMED,
                    f"{config.restart_count()} {state._commits}",
                )
            result = func(state, *args, **kwargs)
        except Regroup as exc:
            cause = exc
        except Exception as exc:
            if not enabled() or not _meeting.peer_lost(exc):
                raise
            state.restore()
            cause = exc
        else:
            _say_finished()
            return result
        with _LostPeerWatch.recovering():
            _rejoin_state(state, cause)
        rejoined = True


def __getattr__(name: str):
    from . import elastic_state

    if name in elastic_state.__all__:
        return getattr(elastic_state, name)
    raise AttributeError(f"module 'hvdkit.elastic' has no attribute {name!r}")


# ---------------------------------------------------------------- a Checkpointer's commits
# (issue 36) The in-memory commit and roll-back of a Checkpointer live here, over its
# public methods (MemoryCommit); the Checkpointer itself only saves and restores.
_COMMITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _commit_of(ckpt) -> MemoryCommit | None:
    """In an elastic job, the commit kept for ``ckpt``: taken at each of its saves and restores.

    Every rank saves and restores at the same steps, so every survivor holds
    the same commit when a peer is lost. ``None`` outside an elastic job
    (nothing to roll back in a job that restarts).
    """
    if not enabled():
        return None
    if ckpt not in _COMMITS:
        commit = _COMMITS[ckpt] = MemoryCommit(ckpt)
        ckpt.add_listener(lambda event, _ckpt: _on_checkpointer(commit, event))
    return _COMMITS[ckpt]


def _on_checkpointer(commit: MemoryCommit, event: str) -> None:
    """After the Checkpointer's restore or save (``event``): commit it in memory."""
    commit.save()
    if event == "restore":
        _meeting.StatePending.received()


def _say_finished() -> None:
    """Tell this rank's worker that training is over: it must not be taken into a new world."""
    folder = _meeting.shared_folder()
    if folder:
        _meeting.write(folder, _meeting.FINISHED, str(config.restart_count()))


def _recover(commit: MemoryCommit, exc: BaseException) -> None:
    _failed_attempt.let_go(exc)
    if isinstance(exc, Regroup):  # every rank left at the same step: commit it
        commit.save()
    _recover_now(commit, exc)


def _recover_now(commit: MemoryCommit, exc: BaseException) -> None:
    """Rejoin and roll back; once more for each peer lost meanwhile, never an exit for it.

    The roll back's broadcast is the new world's first collective: a peer lost
    during it (or during the start) makes it fail like any step's, and every
    survivor holds the same commit still, so the next world rolls back to it.
    The lost-peer watch is on from the new world's start, so a loss the
    scheduler announces ends the broadcast at once.
    """
    started, (old_rank, old_size), ended = time.monotonic(), _where(), _LostPeerWatch.ended
    again = 0
    while True:
        with _LostPeerWatch.recovering():
            round_ = runtime.rejoin()
        joined = time.monotonic()
        try:
            _phases.enter("rollback")
            step = commit.rollback()
            break
        except Exception as lost:
            if not _meeting.peer_lost(lost):
                raise
            _say_lost_meanwhile(f"round {round_}'s roll back", lost)
            again += 1
    _meeting.StatePending.received()
    for model in _models_of(commit.ckpt):
        _reset_compiled_functions(model)
    if runtime.rank() == 0:  # the scheduler's membership line names the step
        _meeting.write(_meeting.shared_folder(), _meeting.RESUMED, f"{round_} {step}")
    back = "went on from" if isinstance(exc, Regroup) else "rolled back to"
    _say_rejoined(
        old_rank,
        old_size,
        round_,
        _why(exc, ended),
        f"{back} step {step}; {joined - started:.2f} s to rejoin, "
        f"{time.monotonic() - joined:.2f} s to roll back"
        + (f"; {again} more regroup(s) for a peer lost meanwhile" if again else ""),
    )


def _say_lost_meanwhile(where: str, exc: BaseException) -> None:
    print(
        f"hvdkit: rank {runtime.rank()} of {runtime.size()}: a peer was lost during {where} "
        f"({type(exc).__name__}); it meets the next world",
        file=sys.stderr,
        flush=True,
    )


def _rejoin_state(state, exc: BaseException) -> None:
    """Horovod's state: the new world; the reset callbacks and the sync come in the loop."""
    _failed_attempt.let_go(exc)
    started, (old_rank, old_size), ended = time.monotonic(), _where(), _LostPeerWatch.ended
    round_ = runtime.rejoin()
    _meeting.StatePending.rejoined = True
    for model in _models_of(state):
        _reset_compiled_functions(model)
    back = "goes on from" if isinstance(exc, Regroup) else "restored"
    _say_rejoined(
        old_rank,
        old_size,
        round_,
        _why(exc, ended),
        f"{back} commit {state._commits}; {time.monotonic() - started:.2f} s to rejoin",
    )


def _where() -> tuple[int, int]:
    return runtime.rank(), runtime.size()


def _why(exc: BaseException, ended: int | None) -> str:
    why = "a worker joined" if isinstance(exc, Regroup) else type(exc).__name__
    if ended is not None:
        why += f" (the scheduler's word: a rank was lost; ended {ended} connections)"
    return why


def _say_rejoined(old_rank: int, old_size: int, round_: int, why: str, rest: str) -> None:
    print(
        f"hvdkit: rank {old_rank} of {old_size} is rank {runtime.rank()} of {runtime.size()} "
        f"(round {round_}) after {why}; {rest}",
        file=sys.stderr,
        flush=True,
    )


def _models_of(state) -> list:
    model = getattr(state, "model", None)
    return [] if model is None else [model]


def _reset_compiled_functions(model) -> None:
    """Keras traces train/test/predict functions once; the world changed, so trace again."""
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)


class _LostPeerWatch:
    """End Horovod's connections as soon as the scheduler formed a world without a lost rank.

    When a rank dies, its direct Gloo peers see the connection close at
    once; the other survivors wait in their collective until Gloo's timeout,
    or until a peer that already left shut Horovod down (about 1.5 s later).
    The scheduler learns of the death from the dead rank's worker within
    moments and sends each survivor's worker the new world, marked ``lost``
    (:mod:`hvdkit._comm.meeting`). This thread reads it and ends this rank's
    Gloo connections (:func:`hvdkit.runtime.abandon`), so the collective
    fails now and :func:`run` recovers. A growing world (a worker joins) is
    not marked: the ranks leave it at an agreed step instead.
    """

    POLL_S = 0.05
    _lock = threading.Lock()
    _started = False
    _recovering = False
    ended: int | None = None  # connections ended in the current world (None: not abandoned)

    @classmethod
    def start_once(cls) -> None:
        with cls._lock:
            if cls._started:
                return
            cls._started = True
        threading.Thread(target=cls._loop, name="hvdkit-lost-peer-watch", daemon=True).start()

    @classmethod
    def _loop(cls) -> None:
        folder = _meeting.shared_folder()
        while True:
            time.sleep(cls.POLL_S)
            cls.check(folder)

    @classmethod
    def check(cls, folder: str) -> bool:
        """Abandon this world if ``folder`` holds a newer world marked ``lost``; whether it did."""
        body = _meeting.read_assignment(folder)
        if body is None or not body.get("lost"):
            return False
        with cls._lock:
            if cls._recovering or cls.ended is not None or not runtime.is_initialized():
                return False
            if body["round"] <= config.restart_count():
                return False  # this world's own assignment
            cls.ended = runtime.abandon()
            return True

    @classmethod
    @contextlib.contextmanager
    def recovering(cls):
        """While :func:`run` leaves one world and joins the next, the watch does nothing."""
        with cls._lock:
            cls._recovering = True
        try:
            yield
        finally:
            with cls._lock:
                cls._recovering, cls.ended = False, None

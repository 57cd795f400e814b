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
registers joins it: once its program reaches its first collective (its
``restore()``: ``hvdkit.init()`` puts a newcomer's Horovod start off until
then, :func:`hvdkit.runtime.start_deferred`), the scheduler gives the others
the bigger world; they agree on a step (the
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

import functools
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
from ._next_world import LostPeerWatch, Move, retry
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
    of the process (never freed, not even at exit), and the failed attempt's
    frames are cleared (:mod:`hvdkit.fault._failed_attempt`: freeing a failed
    ``fit``'s iterator waits for its tf.data autotuner, seconds in the middle of
    the next world or at the process's end).

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
            LostPeerWatch.start_once()

        def attempt(move: Move | None):
            if move is not None:
                _roll_back(commit, move)
            return func(state, *args, **kwargs)

        def leave(exc: BaseException) -> None:
            _failed_attempt.let_go(exc)
            if isinstance(exc, Regroup):  # every rank left at the same step: commit it
                commit.save()

        result = retry(attempt, regroup=True, sampler=state.sampler, leave=leave)
        _phases.enter("end")
        _say_finished()
        return result

    return wrapper


def _run_state(func: Callable[..., Any], state, args: tuple, kwargs: dict) -> Any:
    """Horovod's elastic loop for one of its state classes, on hvdkit's elastic runtime."""
    from .elastic_state import TensorFlowKerasState

    if enabled():
        LostPeerWatch.start_once()

    def attempt(move: Move | None):
        if move is not None:
            _meeting.StatePending.rejoined = True
            for model in _models_of(state):
                _reset_compiled_functions(model)
            back = "goes on from" if isinstance(move.cause, Regroup) else "restored"
            move.report(
                f"{back} commit {state._commits}; {time.monotonic() - move.started:.2f} s to rejoin"
            )
            state.on_reset()
        pending = _meeting.state_pending()
        state.sync()
        _meeting.StatePending.received()
        if pending:  # functions traced before the state came lack the step check
            for model in _models_of(state):
                _reset_compiled_functions(model)
        if move is not None and runtime.rank() == 0:
            _meeting.write(
                _meeting.shared_folder(),
                _meeting.RESUMED,
                f"{config.restart_count()} {state._commits}",
            )
        return func(state, *args, **kwargs)

    def leave(exc: BaseException) -> None:
        if not isinstance(exc, Regroup):  # a lost peer: back to the last commit
            state.restore()
        _failed_attempt.let_go(exc)

    sampler = state.checkpointer.sampler if isinstance(state, TensorFlowKerasState) else None
    result = retry(attempt, regroup=True, sampler=sampler, leave=leave)
    _say_finished()
    return result


def __getattr__(name: str):
    from . import elastic_state

    if name in elastic_state.__all__:
        return getattr(elastic_state, name)
    raise AttributeError(f"module 'hvdkit.elastic' has no attribute {name!r}")


# ---------------------------------------------------------------- a Checkpointer's commits
# The in-memory commit and roll-back of a Checkpointer live here, over its public
# methods (MemoryCommit); the Checkpointer knows nothing of them, only its listeners.
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


def _roll_back(commit: MemoryCommit, move: Move) -> None:
    """In the world ``move`` joined: every rank goes back to the last commit, and says so.

    The roll back's broadcast is the new world's first collective: a peer lost
    during it (or during the start) makes it fail like any step's, and every
    survivor holds the same commit still, so the next world rolls back to it
    (one more regroup, never an exit for it). The lost-peer watch is on from
    the new world's start, so a loss the scheduler announces ends the
    broadcast at once.
    """

    def once(again: Move | None) -> tuple[int, Move | None]:
        _phases.enter("rollback")
        return commit.rollback(), again

    step, again = retry(
        once,
        where=lambda: f"round {config.restart_count()}'s roll back",
        sampler=commit.ckpt.sampler,
    )
    last = again or move  # the world this rank trains in now
    _meeting.StatePending.received()
    for model in _models_of(commit.ckpt):
        _reset_compiled_functions(model)
    if runtime.rank() == 0:  # the scheduler's membership line names the step
        _meeting.write(_meeting.shared_folder(), _meeting.RESUMED, f"{last.round} {step}")
    back = "went on from" if isinstance(move.cause, Regroup) else "rolled back to"
    move.report(
        f"{back} step {step}; {last.joined - move.started:.2f} s to rejoin, "
        f"{time.monotonic() - last.joined:.2f} s to roll back"
        + (f"; {again.number} more regroup(s) for a peer lost meanwhile" if again else "")
    )


def _models_of(state) -> list:
    model = getattr(state, "model", None)
    return [] if model is None else [model]


def _reset_compiled_functions(model) -> None:
    """Keras traces train/test/predict functions once; the world changed, so trace again."""
    for name in ("train_function", "test_function", "predict_function"):
        if getattr(model, name, None) is not None:
            setattr(model, name, None)

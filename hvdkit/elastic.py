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
from collections.abc import Callable
from typing import Any

from . import _meeting, _progress, config, runtime
from .errors import LaunchError, NotSupportedError

__all__ = ["run", "enabled", "Regroup"]  # and Horovod's other names, refused with hvdkit's way

# What a collective says once Horovod stopped for a failed peer (its background loop
# ended on Gloo's error): every pending and later collective fails with it.
_PEER_LOST = ("Horovod has been shut down",)


class Regroup(Exception):
    """Raised on every rank at a commit boundary where a worker waits to join the job.

    :func:`run` catches it: the ranks leave Horovod, start it again with the
    newcomer, and go on from ``step`` (committed in memory just before, so no
    step is trained twice). Only seen by code that catches every exception
    inside the training function: let it pass.
    """

    def __init__(self, step: int):
        super().__init__(f"a worker joins the job after step {step}")
        self.step = step


def enabled() -> bool:
    """Whether this rank may recover in-process: a worker of an elastic job started it."""
    return bool(config.get(config.ELASTIC_DIR))


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

    Raises:
        NotSupportedError: the first argument is not a Checkpointer (e.g.
            Horovod's ``KerasState``), naming the hvdkit way.
    """

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        from .checkpoint import Checkpointer

        if not isinstance(state, Checkpointer):
            raise NotSupportedError(
                f"hvdkit.elastic.run: the state {state!r} is not an hvdkit.Checkpointer. "
                "hvdkit's state is a Checkpointer (model, optimizer, sampler, step and epoch; "
                "its saves are the commits): hvdkit.Checkpointer(dir, model=..., sampler=..., "
                "every_steps=N), then call the decorated function with it."
            )
        if not state.restored:
            state.restore()
        if enabled():
            _LostPeerWatch.start_once()
        while True:
            try:
                result = func(state, *args, **kwargs)
            except Regroup as exc:
                _recover(state, exc)
            except Exception as exc:
                if not enabled() or not _peer_lost(exc):
                    raise
                _recover(state, exc)
            else:
                _say_finished()
                return result

    return wrapper


# Horovod's other hvd.elastic names, and what hvdkit has instead.
_HOROVOD_NAMES = {
    "State": "hvdkit.Checkpointer",
    "ObjectState": "hvdkit.Checkpointer(extra={...})",
    "KerasState": "hvdkit.Checkpointer(dir, model=model, sampler=sampler)",
    "TensorFlowKerasState": "hvdkit.Checkpointer(dir, model=model, sampler=sampler)",
    "TensorFlowState": "hvdkit.Checkpointer(dir, model=model, sampler=sampler)",
    "CommitStateCallback": "ckpt.callback() with every_steps=N (each save is a commit)",
    "UpdateBatchStateCallback": "ckpt.callback(batch_size=B) (it counts steps and batches)",
    "UpdateEpochStateCallback": "ckpt.callback() and initial_epoch=sampler.epoch",
}


def __getattr__(name: str):
    if name in _HOROVOD_NAMES:
        raise NotSupportedError(
            f"hvdkit.elastic.{name} is Horovod's; hvdkit's elastic state is its Checkpointer: "
            f"use {_HOROVOD_NAMES[name]} with @hvdkit.elastic.run (docs/fault-tolerance.md)."
        )
    raise AttributeError(f"module 'hvdkit.elastic' has no attribute {name!r}")


def join_waiting() -> bool:
    """Whether this rank's worker left it a next assignment (a worker waits to join)."""
    folder = config.get(config.ELASTIC_DIR)
    if not folder:
        return False
    body = _meeting.read_assignment(folder)
    return body is not None and body["round"] > config.restart_count()


def _say_finished() -> None:
    """Tell this rank's worker that training is over: it must not be taken into a new world."""
    folder = config.get(config.ELASTIC_DIR)
    if folder:
        _meeting.write(folder, _meeting.FINISHED, str(config.restart_count()))


def _peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a collective that failed for a lost peer."""
    seen = 0
    while exc is not None and seen < 8:
        text = str(exc)
        if any(words in text for words in _PEER_LOST):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _recover(ckpt, exc: BaseException) -> None:
    with _LostPeerWatch.recovering():
        _recover_now(ckpt, exc)


def _recover_now(ckpt, exc: BaseException) -> None:
    started = time.monotonic()
    old_rank, old_size = runtime.rank(), runtime.size()
    ended = _LostPeerWatch.ended
    runtime.shutdown()
    _progress.forget_waits()  # not "stuck in a collective" while it rejoins
    round_ = _join_next_world()
    _progress.rank_changed(runtime.rank())  # the heartbeats speak for the new rank
    joined = time.monotonic()
    step = ckpt._rollback()
    for model in _models_of(ckpt):
        _reset_compiled_functions(model)
    if runtime.rank() == 0:  # the scheduler's membership line names the step
        _meeting.write(config.get(config.ELASTIC_DIR), _meeting.RESUMED, f"{round_} {step}")
    why = "a worker joined" if isinstance(exc, Regroup) else type(exc).__name__
    if ended is not None:
        why += f" (the scheduler's word: a rank was lost; ended {ended} connections)"
    back = "went on from" if isinstance(exc, Regroup) else "rolled back to"
    print(
        f"hvdkit: rank {old_rank} of {old_size} is rank {runtime.rank()} of {runtime.size()} "
        f"(round {round_}) after {why}; {back} step {step}; "
        f"{joined - started:.2f} s to rejoin, {time.monotonic() - joined:.2f} s to roll back",
        file=sys.stderr,
        flush=True,
    )


def _join_next_world() -> int:
    """Wait for the worker's next assignment, meet the others, start Horovod; the round."""
    folder = config.get(config.ELASTIC_DIR)
    seen = config.restart_count()
    timeout = config.sched_timeout()
    deadline = time.monotonic() + timeout
    try:
        while True:
            body = _meeting.read_assignment(folder)
            if body is not None and body["round"] > seen:
                break
            if time.monotonic() > deadline:
                raise TimeoutError
            time.sleep(_meeting.POLL_S)
        round_ = _meeting.meet(folder, _meeting.take(body), deadline)
    except TimeoutError:
        raise LaunchError(
            f"a peer was lost and no new world formed within {timeout:g} s "
            f"({config.SCHED_TIMEOUT}): fewer workers left than {config.MIN_WORKERS}, or "
            "one of them never got ready; see the scheduler's log."
        ) from None
    runtime.init()
    return round_


def _models_of(ckpt) -> list:
    return [ckpt.model]


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
    (:mod:`hvdkit._meeting`). This thread reads it and ends this rank's
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
        folder = config.get(config.ELASTIC_DIR)
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

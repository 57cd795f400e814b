"""Horovod's elastic state API (``hvd.elastic.KerasState``, its callbacks) on hvdkit's runtime.

A Horovod script keeps its training state in a state object, commits it
every few batches, and trains inside ``@hvd.elastic.run``; these classes give
it the same calls over hvdkit's pieces, reached as ``hvdkit.elastic.<Name>``:

* :class:`TensorFlowKerasState` / :class:`KerasState` hold a memory-only
  :class:`~hvdkit.Checkpointer` (``directory=None``) for the model, the
  optimizer, the random state and, if given, an
  :class:`~hvdkit.data.ShardSampler`; their keyword arguments (``batch=0,
  epoch=0``) are attributes committed with it, as Horovod's.
* :meth:`State.commit` keeps the state in memory on every rank, then asks the
  other ranks (about once a second, on the exchange hvdkit's preemption check
  uses) whether a worker waits to join; if so every rank raises
  :class:`HostsUpdatedInterrupt` at the same commit.
* :func:`hvdkit.elastic.run` runs Horovod's loop: ``sync()``, the training
  function, and after a lost peer ``restore()``, the new world,
  ``on_reset()`` (the reset callbacks) and ``sync()`` again.

Where hvdkit is exact and Horovod is not: with a sampler the data position
is committed and re-sharded over the new world (every sample once); without
one, :class:`UpdateBatchStateCallback` ends the first epoch after a reset
after the batches that were left, where Horovod trains one batch again (and
on Keras 3 the whole epoch: Keras 3 ignores its change of
``params["steps"]``). So ``state.batch`` counts the batches done in the
epoch (Horovod: the index of the last one).

Example (Horovod's elastic Keras example, import changed):
    >>> state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    >>> callbacks = [hvd.elastic.UpdateEpochStateCallback(state),
    ...              hvd.elastic.UpdateBatchStateCallback(state),
    ...              hvd.elastic.CommitStateCallback(state)]
    >>> @hvd.elastic.run
    ... def train(state):
    ...     state.model.fit(dataset, steps_per_epoch=500 // hvd.size(),
    ...                     epochs=24 - state.epoch, callbacks=callbacks)
    >>> train(state)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import keras
import numpy as np

from .. import collectives, runtime
from .._comm import meeting as _meeting
from .._validate import check_int
from ..data.sampler import ShardSampler
from ..errors import ConfigurationError
from . import preemption
from ._memory_commit import MemoryCommit
from .checkpoint import Checkpointer

__all__ = [
    "State",
    "ObjectState",
    "TensorFlowKerasState",
    "KerasState",
    "TensorFlowState",
    "CommitStateCallback",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "HostsUpdatedInterrupt",
]


class HostsUpdatedInterrupt(preemption.Regroup):
    """Raised by :meth:`State.commit` on every rank when a worker waits to join (Horovod's name).

    :func:`hvdkit.elastic.run` catches it, takes the ranks into the bigger
    world and syncs the state there (nothing is trained again). Let it pass
    if the training function catches exceptions.
    """

    def __init__(self, commit: int):
        super().__init__(commit)
        self.skip_sync = False  # Horovod's field: a newcomer always needs the state here


class State:
    """Horovod's elastic state: commit, restore, sync, and callbacks after a reset.

    Subclasses say what is kept (:meth:`save`, :meth:`restore`,
    :meth:`sync`). ``bcast_object`` and ``get_rank`` are Horovod's arguments;
    ``None`` uses hvdkit's :func:`~hvdkit.broadcast_object` and
    :func:`~hvdkit.rank`.
    """

    def __init__(
        self,
        bcast_object: Callable[[Any], Any] | None = None,
        get_rank: Callable[[], int] | None = None,
    ):
        self._bcast_object = bcast_object or (lambda obj: collectives.broadcast_object(obj, 0))
        self._rank = get_rank or runtime.rank
        self._reset_callbacks: list[Callable[[], Any]] = []
        self._commits = 0  # commits so far, the same on every rank (sync sends rank 0's)
        self._watch: preemption.Watch | None = None

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Call ``callbacks`` after every reset (a new world), before the state is synced.

        Raises:
            ConfigurationError: an entry is not callable.
        """
        callbacks = list(callbacks)
        for cb in callbacks:
            if not callable(cb):
                raise ConfigurationError(
                    f"register_reset_callbacks: {cb!r} is not callable; pass a list of "
                    "functions taking no argument."
                )
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """:meth:`reset`, then the registered callbacks (run by :func:`hvdkit.elastic.run`)."""
        self.reset()
        for cb in self._reset_callbacks:
            cb()

    def commit(self) -> None:
        """Keep the state in memory (:meth:`save`), then :meth:`check_host_updates`."""
        self._commits += 1
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` on every rank alike if a worker waits to join.

        Only in an elastic job (:func:`hvdkit.elastic.enabled`); the ranks
        exchange their view about once a second of commits, not at each.
        """
        if not _meeting.enabled():
            return
        if self._watch is None:
            # No SIGTERM handling and no step-length limit: only the join decision.
            self._watch = preemption.Watch(float("inf"))
            self._watch.join_waiting = _meeting.join_waiting
        self._watch.decide(self._commits)
        if self._watch.regroup:
            raise HostsUpdatedInterrupt(self._commits)

    def _synced(self) -> None:
        """After a sync: decide again from the next commit (a new world may have formed)."""
        if self._watch is not None:
            self._watch.restart()

    def save(self) -> None:
        """Keep the state in this rank's memory."""
        raise NotImplementedError(f"{type(self).__name__} does not implement save()")

    def restore(self) -> None:
        """Go back to the last commit on this rank, undoing later changes."""
        raise NotImplementedError(f"{type(self).__name__} does not implement restore()")

    def sync(self) -> None:
        """Give every rank rank 0's state, and commit it."""
        raise NotImplementedError(f"{type(self).__name__} does not implement sync()")

    def reset(self) -> None:
        """Called first on a reset, before the reset callbacks; nothing by default."""


class ObjectState(State):
    """Python values kept as attributes: ``ObjectState(epoch=0, batch=0).epoch``.

    :meth:`save` keeps the attributes' current values (references, as
    Horovod), :meth:`restore` sets them back, :meth:`sync` sends rank 0's
    last saved values to every rank.

    Example:
        >>> state = hvdkit.elastic.ObjectState(epoch=0)
        >>> state.epoch = 3; state.commit(); state.epoch = 4; state.restore()
        >>> state.epoch
        3
    """

    def __init__(
        self,
        bcast_object: Callable[[Any], Any] | None = None,
        get_rank: Callable[[], int] | None = None,
        **kwargs: Any,
    ):
        super().__init__(bcast_object, get_rank)
        self._saved_state = dict(kwargs)
        self._set_attrs()

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        self._saved_state, self._commits = self._bcast_object((self._saved_state, self._commits))
        self._set_attrs()
        self._synced()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


class TensorFlowKerasState(ObjectState):
    """A Keras model and its optimizer, plus attributes (Horovod's class of the same name).

    Args:
        model: A built ``keras.Model``.
        optimizer: Its optimizer; ``None``: ``model.optimizer``.
        backend: Horovod's TF1 argument; ignored (eager TF2 only).
        sampler: hvdkit's addition: the :class:`~hvdkit.data.ShardSampler`
            feeding the model; its position is committed, restored and, in a
            new world, re-sharded, so every sample is trained once.
        **kwargs: Attributes committed with the model (``batch=0, epoch=0``).

    The model's and the optimizer's variables and the random state are kept
    by a memory-only :class:`~hvdkit.Checkpointer` (:attr:`checkpointer`).

    Raises:
        ConfigurationError: the model is not a built ``keras.Model``, or
            ``sampler`` is not a ShardSampler.
    """

    def __init__(
        self,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer | None = None,
        backend: Any = None,
        *,
        sampler: ShardSampler | None = None,
        **kwargs: Any,
    ):
        if not isinstance(model, keras.Model) or not model.built:
            raise ConfigurationError(
                f"{type(self).__name__}: model={model!r} must be a built keras.Model; build it "
                "first (model.build(input_shape), or start it with keras.Input(...))."
            )
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        self.backend = backend
        self.sampler = sampler
        self.checkpointer = Checkpointer(
            None,
            model=model,
            optimizer=self.optimizer,
            sampler=sampler,
            preemption=False,
            background=False,
        )
        self._memory = MemoryCommit(self.checkpointer)  # its commits
        self._memory.save()
        super().__init__(**kwargs)

    def save(self) -> None:
        self.checkpointer.step = self._commits
        self._memory.save()
        super().save()

    def restore(self) -> None:
        self._memory.load()
        self._commits = self.checkpointer.step
        super().restore()

    def sync(self) -> None:
        self.checkpointer.step = self._commits
        self._commits = self._memory.sync()
        super().sync()


class KerasState(TensorFlowKerasState):
    """Horovod's ``horovod.tensorflow.keras.elastic.KerasState``; :class:`TensorFlowKerasState`."""

    def __init__(
        self,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer | None = None,
        **kwargs: Any,
    ):
        super().__init__(model, optimizer, **kwargs)


class TensorFlowState(ObjectState):
    """A list of TensorFlow/Keras variables, plus attributes (Horovod's class of the same name).

    Raises:
        ConfigurationError: ``variables`` is missing (TF1's global variables
            do not exist in TF2: pass the list).
    """

    def __init__(self, variables: list | None = None, session: Any = None, **kwargs: Any):
        if not variables:
            raise ConfigurationError(
                f"TensorFlowState: variables={variables!r}; pass the list of variables to "
                "keep (TF2 has no tf.global_variables()), e.g. model.variables."
            )
        self.variables = list(variables)
        self.session = session
        self._values = self._copy()
        super().__init__(**kwargs)

    def _copy(self) -> list[np.ndarray]:
        return [np.array(v.numpy(), copy=True) for v in self.variables]

    def save(self) -> None:
        self._values = self._copy()
        super().save()

    def restore(self) -> None:
        for var, value in zip(self.variables, self._values, strict=True):
            var.assign(value)
        super().restore()

    def sync(self) -> None:
        if runtime.size() > 1:
            collectives.broadcast_variables(self.variables, 0)
        self._values = self._copy()
        super().sync()


class CommitStateCallback(keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches and at every epoch's end.

    Raises:
        ConfigurationError: ``batches_per_commit`` is not an int >= 1.
    """

    def __init__(self, state: State, batches_per_commit: int = 1):
        super().__init__()
        self.state = state
        self.batches_per_commit = check_int(
            "batches_per_commit",
            batches_per_commit,
            minimum=1,
            message=(
                f"CommitStateCallback: batches_per_commit={batches_per_commit!r} must be an "
                "int >= 1 (batches between two commits)."
            ),
        )
        self.batches_remaining = self.batches_per_commit

    def on_train_begin(self, logs=None):
        self.batches_remaining = self.batches_per_commit  # every rank counts from here alike

    def on_train_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch, logs=None):
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the batches done in the epoch; after a reset, train only the rest.

    ``state.batch`` is 0 at an epoch's start and ``n`` after its ``n``-th
    batch. In the first epoch of a ``fit`` that starts with ``state.batch =
    b > 0`` (a reset mid-epoch) the epoch ends after ``steps_per_epoch - b``
    batches, so the job trains as many batches as without the reset. Keras 3
    ignores a change of ``params["steps"]`` (Horovod's way), so the epoch is
    ended with ``model.stop_training``, cleared again at its end. Not with a
    sampler on the state: its dataset already holds only the rest.
    """

    def __init__(self, state: State):
        super().__init__()
        self.state = state
        self._done_before = 0
        self._first_epoch = True
        self._offset = 0
        self._last: int | None = None
        self._cut = False

    def on_train_begin(self, logs=None):
        self._done_before = int(getattr(self.state, "batch", 0) or 0)
        self._first_epoch, self._cut = True, False

    def on_epoch_begin(self, epoch, logs=None):
        self._offset = self._done_before if self._first_epoch else 0
        steps = (self.params or {}).get("steps")
        self._last = None
        if self._offset and steps and getattr(self.state, "sampler", None) is None:
            # at least one: Keras runs an epoch's first batch before anyone can end it
            self._last = max(1, steps - self._offset)

    def on_train_batch_end(self, batch, logs=None):
        self.state.batch = self._offset + batch + 1
        if self._last is not None and batch + 1 >= self._last and not self.model.stop_training:
            self.model.stop_training, self._cut = True, True

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0
        self._first_epoch = False
        if self._cut:  # only this epoch was to end early, not the fit
            self.model.stop_training, self._cut = False, False


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Set ``state.epoch`` to the epochs done, counted across resets (Horovod's rule).

    At each epoch's end ``state.epoch`` becomes its value when ``fit``
    started plus the epochs this ``fit`` finished, so pass
    ``epochs=N - state.epoch`` (not ``initial_epoch``), as Horovod's example.
    """

    def __init__(self, state: State):
        super().__init__()
        self.state = state
        self.initial_epoch = int(getattr(state, "epoch", 0) or 0)

    def on_train_begin(self, logs=None):
        self.initial_epoch = int(getattr(self.state, "epoch", 0) or 0)

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = self.initial_epoch + epoch + 1

"""Epoch and resume state: :class:`ShardSampler` and its Keras callback.

A sampler turns :func:`~hvdkit.data.shard_indices` into a loop: it knows the
epoch (so the shuffle changes every epoch) and how many samples of this
epoch's shard were consumed, and builds the ``tf.data.Dataset`` of what is
left. Its ``state_dict()`` is a small JSON-friendly dict; saved next to the
model checkpoint, it lets a restarted job continue at the same sample.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from ..errors import ConfigurationError, ShardingError
from . import _pipeline
from .sharding import check_int, check_shard_args, resolve_shards, shard_indices, shard_length

__all__ = ["ShardSampler", "ShardPositionCallback"]
_STATE_VERSION = 1


class ShardSampler:
    """This rank's share of ``num_samples`` samples, epoch by epoch, with a resumable position.

    The sampler holds ``epoch`` and ``position`` (samples of this epoch's
    shard already consumed). :meth:`dataset` builds the ``tf.data.Dataset``
    of the rest of the current epoch; :meth:`state_dict` and
    :meth:`load_state_dict` save and restore the position, so that a
    restarted job neither repeats nor skips a sample.

    Args:
        num_samples: Dataset length ``N``.
        num_shards: ``S``; ``None`` (with ``shard_id=None``) means ``hvdkit.size()``.
        shard_id: This shard; ``None`` means ``hvdkit.rank()``.
        shuffle: Reshuffle all ``N`` samples every epoch (same order on all ranks).
        seed: Seed of the permutations; must be the same on every rank.
        mode: ``"pad"`` (default), ``"drop"`` or ``"uneven"``; see :func:`shard_indices`.

    Example:
        >>> reader = hvdkit.data.MnistReader(DATA_PATH)           # random access
        >>> sampler = hvdkit.data.ShardSampler(len(reader), shuffle=True, seed=1)
        >>> for epoch in range(sampler.epoch, EPOCHS):
        ...     sampler.set_epoch(epoch)
        ...     for images, labels in sampler.dataset(reader).batch(32):
        ...         train_step(images, labels)
        ...         sampler.advance(len(labels))
        ...         save({"weights": ..., "data": sampler.state_dict()})
    """

    def __init__(
        self,
        num_samples: int,
        num_shards: int | None = None,
        shard_id: int | None = None,
        *,
        shuffle: bool = False,
        seed: int = 0,
        mode: str = "pad",
    ):
        num_shards, shard_id = resolve_shards(num_shards, shard_id)
        check_shard_args(num_samples, num_shards, shard_id, mode, seed)
        self.num_samples = int(num_samples)
        self.num_shards = num_shards
        self.shard_id = shard_id
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.mode = mode
        self._epoch = 0
        self._position = 0

    def __len__(self) -> int:
        """Samples this shard reads in a whole epoch."""
        return shard_length(self.num_samples, self.num_shards, self.shard_id, self.mode)

    def __repr__(self) -> str:
        return (
            f"ShardSampler(num_samples={self.num_samples}, num_shards={self.num_shards}, "
            f"shard_id={self.shard_id}, shuffle={self.shuffle}, seed={self.seed}, "
            f"mode={self.mode!r}, epoch={self._epoch}, position={self._position})"
        )

    @property
    def epoch(self) -> int:
        """The current epoch (0 until :meth:`set_epoch` or :meth:`load_state_dict`)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Samples of the current epoch's shard already consumed, in ``[0, len(self)]``."""
        return self._position

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch``; its shuffle order differs from every other epoch's.

        The position restarts at 0 when the epoch changes and is kept when it
        does not, so a loop that calls ``set_epoch(e)`` at the top of every
        epoch also resumes correctly after :meth:`load_state_dict`.
        """
        epoch = check_int("epoch", epoch, 0, "pass the epoch number, counting from 0.")
        if epoch != self._epoch:
            self._epoch = epoch
            self._position = 0

    def indices(self) -> np.ndarray:
        """int64 indices still to read this epoch: ``shard_indices(...)[position:]``."""
        return self._epoch_indices()[self._position :]

    def _epoch_indices(self) -> np.ndarray:
        return shard_indices(
            self.num_samples,
            self.num_shards,
            self.shard_id,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=self._epoch,
            mode=self.mode,
        )

    def advance(self, count: int) -> None:
        """Record that ``count`` more samples of this epoch were consumed (e.g. one batch).

        Raises:
            ShardingError: ``count`` is negative or runs past the end of the epoch.
        """
        count = check_int("count", count, 0, "pass the number of samples just consumed.")
        if self._position + count > len(self):
            raise ShardingError(
                f"advance({count}) at position {self._position} passes the end of epoch "
                f"{self._epoch}, which has {len(self)} samples on this shard; call "
                "set_epoch(epoch + 1) to start the next epoch."
            )
        self._position += count

    def state_dict(self) -> dict:
        """A JSON-serialisable snapshot: epoch, position and the settings they refer to.

        The snapshot has no ``shard_id``: in pad and drop mode every rank is at
        the same position, so rank 0 can save it for all.

        Example:
            >>> json.dump(sampler.state_dict(), open("data_state.json", "w"))
        """
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "position": self._position,
            "num_samples": self.num_samples,
            "num_shards": self.num_shards,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "mode": self.mode,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict` snapshot.

        A position past this shard's length (possible in uneven mode, where
        shards differ by one) is clipped to it.

        Raises:
            ShardingError: the snapshot was taken with other settings (a
                position means nothing for another ``N``, ``S``, seed or mode),
                or keys are missing.
        """
        mine = self.state_dict()
        missing = sorted(set(mine) - set(state))
        if missing:
            raise ShardingError(
                f"sampler state is missing {missing}; pass a dict made by "
                "ShardSampler.state_dict()."
            )
        keys = ("version", "num_samples", "num_shards", "shuffle", "seed", "mode")
        diff = [f"{k}: saved {state[k]!r}, here {mine[k]!r}" for k in keys if state[k] != mine[k]]
        if diff:
            raise ShardingError(
                f"cannot resume: the saved sampler state differs ({'; '.join(diff)}). "
                "Create the ShardSampler with the saved settings, or start the epoch "
                "afresh with set_epoch() instead of load_state_dict()."
            )
        epoch = check_int("epoch", state["epoch"], 0, "the saved state is corrupt.")
        position = check_int("position", state["position"], 0, "the saved state is corrupt.")
        self._epoch = epoch
        # In uneven mode shards differ by one sample; a rank that already
        # finished its shorter shard simply has nothing left.
        self._position = min(position, len(self))

    def dataset(self, source: Any, *, chunk_size: int = 256) -> tf.data.Dataset:
        """A ``tf.data.Dataset`` of the samples left in this epoch, in reading order.

        Args:
            source: What to read, of length ``num_samples``: a reader with
                ``__len__``, ``read(indices)`` and ``element_spec`` (such as
                :class:`~hvdkit.data.MnistReader`); a numpy array or a
                tuple/dict of arrays with equal first dimension; or a
                ``tf.data.Dataset`` of known length. Readers and arrays are
                read index by index, as are datasets that support random
                access (``range``, ``from_tensor_slices``, ``map``, ``batch``,
                ``zip``...), so that only this shard's elements are decoded.
                Other datasets (``TFRecordDataset``, ``interleave``,
                ``filter``...) are read in full and filtered, and yield this
                shard's elements in stored order instead of reading order.
            chunk_size: Indices read per call of ``source.read``.

        Returns:
            A dataset of ``len(self) - position`` elements with the source's
            element structure.

        Raises:
            ShardingError: ``source`` has another length than ``num_samples``.
        """
        source = _pipeline.as_source(source)
        length = _pipeline.source_length(source)
        if length != self.num_samples:
            raise ShardingError(
                f"the source has {length} samples but this ShardSampler was made for "
                f"num_samples={self.num_samples}; create it with ShardSampler(len(source), ...)."
            )
        return _pipeline.select(source, self._epoch_indices(), self._position, chunk_size)


class ShardPositionCallback(keras.callbacks.Callback):
    """Keeps a :class:`ShardSampler`'s position in step with ``model.fit``.

    The sampler's dataset holds one epoch, so call ``fit`` once per epoch;
    after each batch the callback advances the sampler, so its
    ``state_dict()`` can be saved next to a mid-epoch checkpoint.

    Args:
        sampler: The sampler whose :meth:`ShardSampler.dataset` is being fitted.
        batch_size: Samples per batch on this rank (the last batch may be smaller).

    Example:
        >>> for epoch in range(sampler.epoch, EPOCHS):
        ...     sampler.set_epoch(epoch)
        ...     ds = sampler.dataset(reader).batch(32)
        ...     model.fit(ds, initial_epoch=epoch, epochs=epoch + 1,
        ...               callbacks=[hvdkit.data.ShardPositionCallback(sampler, 32)])
    """

    def __init__(self, sampler: ShardSampler, batch_size: int):
        super().__init__()
        self.sampler = sampler
        self.batch_size = check_int("batch_size", batch_size, 1, "pass the per-rank batch size.")
        self._start = 0
        self._epochs_begun = 0

    def on_train_begin(self, logs=None):
        self._start = self.sampler.position
        self._epochs_begun = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epochs_begun += 1
        if self._epochs_begun > 1:
            raise ConfigurationError(
                f"ShardPositionCallback saw a second epoch ({epoch}) in one fit() call, but "
                "a ShardSampler's dataset holds a single epoch; call fit once per epoch "
                "with initial_epoch=e, epochs=e + 1 after sampler.set_epoch(e)."
            )

    def on_train_batch_end(self, batch, logs=None):
        # Keras reports the index of the last batch of each step (also with
        # steps_per_execution > 1), so the position follows from it.
        done = min((batch + 1) * self.batch_size, len(self.sampler) - self._start)
        self.sampler.advance(self._start + done - self.sampler.position)

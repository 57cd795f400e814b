"""Epoch and resume state: :class:`ShardSampler` and its Keras callback.

A sampler turns :func:`~hvdkit.data.shard_indices` into a loop: it knows the
epoch (so the shuffle changes every epoch) and how many samples of this
epoch's shard were consumed, and builds the ``tf.data.Dataset`` of what is
left. Its ``state_dict()`` is a small JSON-friendly dict; saved next to the
model checkpoint (:class:`hvdkit.Checkpointer` does it), it lets a restarted
job continue at the same sample.

The saved position is global: the *cursor*, how many samples of the epoch's
list (``0..N-1`` or its ``(seed, epoch)`` permutation) the whole job has
read. Rank ``r`` of ``S`` reads list positions ``r, r + S, r + 2S, ...``, so
after every rank read ``p`` samples the job has read positions ``0 .. p*S-1``
and nothing else. A job restarted on ``S'`` ranks shards positions
``cursor .. N-1`` over its ``S'`` ranks (:func:`shard_indices` with
``start=cursor``): every sample of the epoch is read exactly once, whatever
``S`` and ``S'`` are. With 10 samples, 3 ranks that read 2 each (cursor 6),
then 2 ranks::

    list position   0 1 2 3 4 5 | 6 7 8 9
    S=3, read       0 1 2 0 1 2 |             (rank that read it)
    S'=2, to read               | 0 1 0 1

Padding and dropping apply to the rest of the list after a change of size:
pad mode gives every rank ``ceil(R/S')`` samples of the ``R = N - cursor``
left, the missing ones taken from the start of the epoch's list (samples
already read this epoch: ``ceil(R/S')*S' - R`` repeats, where an
uninterrupted run would have repeated ``ceil(N/S)*S - N``); drop mode skips
the last ``R % S'`` (where an uninterrupted run skips the last ``N % S``).
With ``S' = S`` both are exactly the uninterrupted run's. Pad mode's repeats
can be kept out of training: ``dataset(source, mask_padding=True)`` gives
them Keras ``sample_weight`` 0, so every sample of the epoch trains exactly
once, before and after any change of size, and every rank still takes the
same number of steps.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from ..errors import ConfigurationError, ShardingError
from . import _pipeline
from .sharding import (
    check_int,
    check_shard_args,
    check_start,
    resolve_shards,
    shard_indices,
    shard_length,
    shard_weights,
)

__all__ = ["ShardSampler", "ShardPositionCallback"]
_STATE_VERSION = 2
_STATE_KEYS = ("version", "epoch", "position", "num_samples", "num_shards", "shuffle", "seed")


class ShardSampler:
    """This rank's share of ``num_samples`` samples, epoch by epoch, with a resumable position.

    The sampler holds ``epoch`` and ``position`` (samples of this epoch's
    shard already consumed). :meth:`dataset` builds the ``tf.data.Dataset``
    of the rest of the current epoch; :meth:`state_dict` and
    :meth:`load_state_dict` save and restore the position, so that a
    restarted job neither repeats nor skips a sample, also on another
    number of ranks (see :attr:`cursor`).

    Args:
        num_samples: Dataset length ``N``.
        num_shards: ``S``; ``None`` (with ``shard_id=None``) means ``hvdkit.size()``.
        shard_id: This shard; ``None`` means ``hvdkit.rank()``.
        shuffle: Reshuffle all ``N`` samples every epoch (same order on all ranks).
        seed: Seed of the permutations; must be the same on every rank.
        mode: ``"pad"`` (default), ``"drop"`` or ``"uneven"``; see :func:`shard_indices`.

    Example:
        >>> reader = hvdkit.data.MnistReader(DATA_PATH, "train")  # random access
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
        # list position where this epoch's sharding began: 0, or the cursor
        # of a resume on another number of shards
        self._start = 0

    def __len__(self) -> int:
        """Samples this shard reads in the epoch (from :attr:`start` on, after a resize)."""
        return shard_length(
            self.num_samples, self.num_shards, self.shard_id, self.mode, self._start
        )

    def __repr__(self) -> str:
        return (
            f"ShardSampler(num_samples={self.num_samples}, num_shards={self.num_shards}, "
            f"shard_id={self.shard_id}, shuffle={self.shuffle}, seed={self.seed}, "
            f"mode={self.mode!r}, epoch={self._epoch}, position={self._position}, "
            f"cursor={self.cursor})"
        )

    @property
    def epoch(self) -> int:
        """The current epoch (0 until :meth:`set_epoch` or :meth:`load_state_dict`)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Samples of the current epoch's shard already consumed, in ``[0, len(self)]``."""
        return self._position

    @property
    def start(self) -> int:
        """List position where this epoch's sharding began.

        0, except after :meth:`load_state_dict` of a state saved with another
        number of shards: then the saved :attr:`cursor`, and this shard reads
        ``shard_indices(..., start=start)``.
        """
        return self._start

    @property
    def cursor(self) -> int:
        """Samples of this epoch's list the whole job has read, in ``[0, num_samples]``.

        ``start + position * num_shards``, capped at ``N`` (pad mode's last
        round passes it). It assumes, as synchronous training guarantees,
        that every rank has read as many samples as this one (in uneven mode,
        ranks with a shorter shard simply have none left); rank 0, whose
        shard is never shorter than another's, gives the job's cursor.

        Example:
            >>> s = ShardSampler(10, 3, 0); s.advance(2); s.cursor
            6
        """
        return min(self._start + self._position * self.num_shards, self.num_samples)

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
            self._start = 0

    def indices(self) -> np.ndarray:
        """int64 indices still to read this epoch: ``shard_indices(...)[position:]``."""
        return self._epoch_indices()[self._position :]

    def weights(self) -> np.ndarray:
        """float32 weights of :meth:`indices`: 0 for pad mode's repeats, else 1.

        See :func:`~hvdkit.data.shard_weights`; :meth:`dataset` with
        ``mask_padding=True`` adds them to the elements.
        """
        weights = shard_weights(
            self.num_samples, self.num_shards, self.shard_id, mode=self.mode, start=self._start
        )
        return weights[self._position :]

    def _epoch_indices(self) -> np.ndarray:
        return shard_indices(
            self.num_samples,
            self.num_shards,
            self.shard_id,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=self._epoch,
            mode=self.mode,
            start=self._start,
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
        """A JSON-serialisable snapshot: epoch, position, cursor and the settings they refer to.

        The snapshot has no ``shard_id``: every rank is at the same position
        (in uneven mode, rank 0's is the job's), so rank 0 can save it for
        all. ``cursor`` is the job's global position (:attr:`cursor`);
        ``start`` and ``position`` place this layout within it.

        Example:
            >>> json.dump(sampler.state_dict(), open("data_state.json", "w"))
        """
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "position": self._position,
            "start": self._start,
            "cursor": self.cursor,
            "num_samples": self.num_samples,
            "num_shards": self.num_shards,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "mode": self.mode,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from a :meth:`state_dict` snapshot, on this or another number of shards.

        Saved with the same ``num_shards``, the sampler continues at the saved
        ``position`` of its shard (clipped to the shard's length in uneven
        mode, where shards differ by one). Saved with another number of
        shards, it re-shards the rest of the epoch: ``start`` becomes the
        saved ``cursor`` and ``position`` 0, so the ranks there now read
        positions ``cursor .. N-1`` of the epoch's list once between them
        (see the module docstring for what pad and drop mode do then).

        Raises:
            ShardingError: the snapshot was taken with another ``N``, seed,
                shuffle or mode (a position means nothing for those), keys
                are missing or corrupt, or a snapshot of version 1 (no global
                cursor) is loaded on another number of shards.
        """
        if not isinstance(state, dict):
            raise ShardingError(
                f"sampler state is a {type(state).__name__}; pass a dict made by "
                "ShardSampler.state_dict()."
            )
        version = state.get("version")
        needed = _STATE_KEYS + ("mode",) + (("start", "cursor") if version != 1 else ())
        missing = sorted(set(needed) - set(state))
        if missing:
            raise ShardingError(
                f"sampler state is missing {missing}; pass a dict made by "
                "ShardSampler.state_dict()."
            )
        if version not in (1, _STATE_VERSION):
            raise ShardingError(
                f"sampler state has version {version!r}; this hvdkit reads versions 1 and "
                f"{_STATE_VERSION}. Save it again with this hvdkit's ShardSampler.state_dict()."
            )
        mine = self.state_dict()
        keys = ("num_samples", "shuffle", "seed", "mode")
        if version == 1:  # no global cursor: the position is per shard, S must match
            keys += ("num_shards",)
        diff = [f"{k}: saved {state[k]!r}, here {mine[k]!r}" for k in keys if state[k] != mine[k]]
        if diff:
            raise ShardingError(
                f"cannot resume: the saved sampler state differs ({'; '.join(diff)}). "
                "Create the ShardSampler with the saved settings, or start the epoch "
                "afresh with set_epoch() instead of load_state_dict()."
            )
        corrupt = "the saved state is corrupt."
        epoch = check_int("epoch", state["epoch"], 0, corrupt)
        position = check_int("position", state["position"], 0, corrupt)
        saved_shards = check_int("num_shards", state["num_shards"], 1, corrupt)
        if version == 1:
            start, cursor = 0, min(position * saved_shards, self.num_samples)
        else:
            start = check_start(state["start"], self.num_samples)
            cursor = check_start(state["cursor"], self.num_samples)
            if cursor != min(start + position * saved_shards, self.num_samples):
                raise ShardingError(
                    f"sampler state is inconsistent: cursor={cursor}, but start={start} + "
                    f"position={position} * num_shards={saved_shards} says otherwise; "
                    "the saved state is corrupt."
                )
        self._epoch = epoch
        if saved_shards == self.num_shards:
            self._start = start
            # In uneven mode shards differ by one sample; a rank that already
            # finished its shorter shard simply has nothing left.
            self._position = min(position, len(self))
        else:  # re-shard what the whole job had not read yet over these shards
            self._start = cursor
            self._position = 0

    def reshard(self, num_shards: int | None = None, shard_id: int | None = None) -> None:
        """Read as shard ``shard_id`` of ``num_shards`` from here on (the world changed).

        The job's :attr:`cursor` is kept: on another number of shards the rest
        of the epoch (positions ``cursor .. N-1`` of its list) is shared out
        again, ``start`` becomes the cursor and ``position`` 0, exactly as
        :meth:`load_state_dict` does with a state of another number of shards;
        on the same number only ``shard_id`` changes. ``None`` means
        ``hvdkit.size()`` / ``hvdkit.rank()``. The elastic roll-back calls it
        before loading the committed state into the new world.

        Example:
            >>> s = ShardSampler(12, 2, 0); s.advance(3); s.reshard(3, 1)
            >>> s.start, s.position, len(s)
            (6, 0, 2)
        """
        num_shards, shard_id = resolve_shards(num_shards, shard_id)
        check_shard_args(self.num_samples, num_shards, shard_id, self.mode, self.seed)
        if num_shards != self.num_shards:
            self._start, self._position = self.cursor, 0
        self.num_shards, self.shard_id = num_shards, shard_id

    def dataset(
        self, source: Any, *, chunk_size: int = 256, mask_padding: bool = False
    ) -> tf.data.Dataset:
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
            mask_padding: Add a float32 ``sample_weight`` to each ``(x, y)``
                element, 0 for pad mode's repeats (:meth:`weights`), so that
                ``fit`` trains every sample of the epoch exactly once (a
                repeat still takes its place in the batch; Keras's default
                loss reduction divides by the batch size). A custom loop
                passes the third element to the loss as ``sample_weight``.

        Returns:
            A dataset of ``len(self) - position`` elements with the source's
            element structure (``(x, y, sample_weight)`` with ``mask_padding``).

        Raises:
            ShardingError: ``source`` has another length than ``num_samples``,
                or ``mask_padding`` is asked of a source whose elements are not
                ``(x, y)`` pairs.

        Example:
            >>> ds = sampler.dataset((images, labels), mask_padding=True).batch(32)
            >>> model.fit(ds, ...)   # (x, y, sample_weight): repeats weigh 0
        """
        source = _pipeline.as_source(source)
        length = _pipeline.source_length(source)
        if length != self.num_samples:
            raise ShardingError(
                f"the source has {length} samples but this ShardSampler was made for "
                f"num_samples={self.num_samples}; create it with ShardSampler(len(source), ...)."
            )
        selected = _pipeline.select(source, self._epoch_indices(), self._position, chunk_size)
        if not mask_padding:
            return selected
        spec = selected.element_spec
        if not (isinstance(spec, tuple) and len(spec) == 2):
            raise ShardingError(
                "mask_padding=True adds a sample_weight to (x, y) elements, giving Keras's "
                f"(x, y, sample_weight); this source's elements are {spec}. Make them (x, y) "
                "pairs (a tuple of features and labels), or weigh pad mode's repeats yourself "
                "with ShardSampler.weights()."
            )
        weights = tf.data.Dataset.from_tensor_slices(self.weights())
        return tf.data.Dataset.zip(selected, weights).map(lambda xy, w: (*xy, w))


class ShardPositionCallback(keras.callbacks.Callback):
    """Keeps a :class:`ShardSampler`'s position in step with ``model.fit``.

    The sampler's dataset holds one epoch, so call ``fit`` once per epoch;
    after each batch the callback advances the sampler, so its
    ``state_dict()`` can be saved next to a mid-epoch checkpoint. List it
    before callbacks that save the position (``Checkpointer.callback()``).

    A fit call may span several Keras epochs only while the data epoch is
    not used up (``hvdkit.sink.train`` with ``sink_size``, where a Keras epoch
    is one sink, or ``steps_per_epoch`` shorter than the dataset).

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
        # Keras numbers batches from 0 again in every epoch of a fit call.
        self._start = self.sampler.position
        if self._epochs_begun > 1 and self.sampler.position >= len(self.sampler):
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

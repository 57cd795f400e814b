"""Which samples each rank reads: the index math, and ``shard()`` for files and datasets.

Every rank computes its own share from ``(num_samples, num_shards, shard_id,
seed, epoch)`` alone, so no communication is needed to agree on it. With
``N = 10`` samples on ``S = 3`` ranks and no shuffle::

    position in the list   0 1 2 3 4 5 6 7 8 9 | 10 11   (10, 11 wrap to 0, 1)
    mode="pad"    rank 0:  0     3     6     9           -> [0, 3, 6, 9]
                  rank 1:    1     4     7     |  0      -> [1, 4, 7, 0]
                  rank 2:      2     5     8   |     1   -> [2, 5, 8, 1]
    mode="drop"   rank r:  positions r, r+3, r+6          -> [0,3,6] [1,4,7] [2,5,8]
    mode="uneven" rank r:  positions r, r+3, ...  (< 10)  -> [0,3,6,9] [1,4,7] [2,5,8]

``"pad"`` (the default) gives every rank ``ceil(N/S)`` samples, repeating a
few from the start of the list; ``"drop"`` gives ``floor(N/S)`` and skips the
tail; ``"uneven"`` covers every sample exactly once but lets ranks differ by
one sample, which makes synchronous training hang or fail on the last step
unless the loop expects it. With ``shuffle=True`` the list is a permutation
drawn from ``(seed, epoch)``, the same on every rank.
"""

from __future__ import annotations

import numbers
import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from .. import _validate, runtime
from ..errors import ConfigurationError, ShardingError
from . import _pipeline

__all__ = ["MODES", "ShardingWarning", "shard_indices", "shard_weights", "shard"]

MODES = ("pad", "drop", "uneven")


class ShardingWarning(UserWarning):
    """Sharding settings that work, but are probably not what was meant.

    Silence it where the setting is deliberate::

        warnings.filterwarnings("ignore", category=hvdkit.data.ShardingWarning)
    """


# --------------------------------------------------------------------------- checks
# check_int, check_shard_args, resolve_shards and shard_length are shared with
# sampler.py; they are not part of hvdkit.data's public API.
def check_int(name: str, value: Any, minimum: int | None, fix: str) -> int:
    """``value`` as an int, or a ShardingError naming it, the minimum and ``fix``."""
    return _validate.check_int(name, value, minimum=minimum, fix=fix, error=ShardingError)


def check_shard_args(num_samples, num_shards, shard_id, mode, seed=0, epoch=0) -> None:
    """Validate the arguments shared by every sharding entry point."""
    if mode not in MODES:
        raise ShardingError(
            f"mode={mode!r} is not one of {MODES}; use 'pad' (equal sizes, repeats a few "
            "samples), 'drop' (equal sizes, skips the tail) or 'uneven' (exact cover, "
            "sizes differ by one)."
        )
    check_int(
        "num_shards", num_shards, 1, "pass the number of ranks that read the data (hvdkit.size())."
    )
    check_int("shard_id", shard_id, None, "pass hvdkit.rank().")
    if not 0 <= shard_id < num_shards:
        raise ShardingError(
            f"shard_id={shard_id} is outside [0, num_shards={num_shards}); pass a shard_id "
            f"between 0 and {num_shards - 1} (usually hvdkit.rank())."
        )
    check_int("num_samples", num_samples, None, "pass the dataset's length.")
    if num_samples < 1:
        raise ShardingError(
            f"num_samples={num_samples}: the dataset is empty, so there is nothing to shard; "
            "check the path, split or filter that produced it."
        )
    if mode == "drop" and num_samples < num_shards:
        raise ShardingError(
            f"mode='drop' with num_samples={num_samples} and num_shards={num_shards} gives "
            f"every shard floor({num_samples}/{num_shards}) = 0 samples; use mode='pad' "
            "(each shard gets 1, some repeated) or fewer shards."
        )
    fix = "pass a non-negative int (the permutation is drawn from (seed, epoch))."
    check_int("seed", seed, 0, fix)
    check_int("epoch", epoch, 0, fix)


def resolve_shards(num_shards: int | None, shard_id: int | None) -> tuple[int, int]:
    """``(num_shards, shard_id)``, defaulting to ``(hvdkit.size(), hvdkit.rank())``.

    Explicit values that disagree with the running job are allowed (every rank
    evaluating the same shard is a valid choice) but warned about, because
    more often they are a copy-paste slip that makes ranks read overlapping data.

    Raises:
        ShardingError: only one of the two is given, or one is out of range.
        NotInitializedError: both are ``None`` and ``hvdkit.init()`` was not called.
    """
    if num_shards is None and shard_id is None:
        rank, size = runtime.job_rank_size(
            "num_shards/shard_id",
            "pass num_shards=1, shard_id=0 to read all the data in this process.",
        )
        return size, rank
    if num_shards is None or shard_id is None:
        raise ShardingError(
            f"num_shards={num_shards!r} and shard_id={shard_id!r}: give both or neither; "
            "leave both as None to use hvdkit.size() and hvdkit.rank()."
        )
    check_shard_args(1, num_shards, shard_id, "pad")
    if runtime.is_initialized() and (num_shards, shard_id) != (runtime.size(), runtime.rank()):
        warnings.warn(
            f"num_shards={num_shards}, shard_id={shard_id} differ from this job's size "
            f"{runtime.size()} and rank {runtime.rank()}, so ranks may read overlapping or "
            "incomplete data. Leave num_shards and shard_id as None to follow the job, or "
            "ignore this warning if it is deliberate.",
            ShardingWarning,
            stacklevel=3,
        )
    return int(num_shards), int(shard_id)


# --------------------------------------------------------------------------- index math
def shard_length(
    num_samples: int, num_shards: int, shard_id: int, mode: str, start: int = 0
) -> int:
    """``len(shard_indices(num_samples, num_shards, shard_id, mode=mode, start=start))``."""
    rest = num_samples - start
    if mode == "pad":
        return -(-rest // num_shards)
    if mode == "drop":
        return rest // num_shards
    return len(range(shard_id, rest, num_shards))


def _order(num_samples: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    # SeedSequence hashes (seed, epoch) together: every rank draws the same
    # permutation without communicating, and neighbouring epochs are unrelated.
    return np.random.default_rng([seed, epoch]).permutation(num_samples).astype(np.int64)


def shard_indices(
    num_samples: int,
    num_shards: int,
    shard_id: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    mode: str = "pad",
    start: int = 0,
) -> np.ndarray:
    """Indices of the samples shard ``shard_id`` reads in one epoch, in reading order.

    Shard ``r`` takes positions ``r, r + S, r + 2S, ...`` of the sample list
    (``0..N-1``, or its ``(seed, epoch)`` permutation when ``shuffle``):

    * ``"pad"``: ``ceil(N/S)`` indices; positions past ``N`` wrap to the start,
      so the first ``ceil(N/S)*S - N`` samples of the list are read twice
      (more often when ``S > N``).
    * ``"drop"``: ``floor(N/S)`` indices; the last ``N % S`` samples are skipped.
    * ``"uneven"``: every sample exactly once; shard sizes differ by at most one.

    ``start`` (a resume point, see :class:`ShardSampler`) shards only the
    rest of the list, positions ``start .. N-1``, the same way: shard ``r``
    takes positions ``start + r, start + r + S, ...``; pad mode wraps past
    ``N`` to the start of the list (samples already read this epoch), drop
    mode skips the last ``(N - start) % S``. With ``start = p * S`` this is
    ``shard_indices(...)[p:]``, so the ranks there now share exactly what the
    whole job had not read yet, whatever ``S`` was before.

    Args:
        num_samples: ``N``, the dataset length (>= 1).
        num_shards: ``S`` (>= 1), usually ``hvdkit.size()``.
        shard_id: In ``[0, S)``, usually ``hvdkit.rank()``.
        shuffle: Read a permutation drawn from ``(seed, epoch)`` instead of ``0..N-1``.
        seed: Non-negative int; the same on every rank.
        epoch: Non-negative int; another epoch gives another permutation.
        mode: ``"pad"`` (default), ``"drop"`` or ``"uneven"``.
        start: Position of the list where sharding begins, in ``[0, N]``
            (default 0: the whole epoch).

    Returns:
        int64 array of shape ``[ceil(R/S)]`` (pad), ``[floor(R/S)]`` (drop) or
        ``[len(range(shard_id, R, S))]`` (uneven), where ``R = N - start``.
        Within one shard the indices are distinct in every mode (pad mode
        with ``S > N`` aside).

    Raises:
        ShardingError: ``num_shards < 1``, ``shard_id`` outside ``[0, S)``,
            ``N < 1``, ``N < S`` in drop mode, unknown ``mode``, negative
            ``seed``/``epoch``, ``start`` outside ``[0, N]``.

    Example:
        >>> [shard_indices(10, 3, r).tolist() for r in range(3)]
        [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]
        >>> [shard_indices(10, 3, r, mode="drop").tolist() for r in range(3)]
        [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
        >>> [shard_indices(10, 2, r, start=6).tolist() for r in range(2)]  # 6 read, S=3 -> 2
        [[6, 8], [7, 9]]
    """
    check_shard_args(num_samples, num_shards, shard_id, mode, seed, epoch)
    order = _order(int(num_samples), shuffle, int(seed), int(epoch))
    return order[_positions(num_samples, num_shards, shard_id, mode, start) % num_samples]


def shard_weights(
    num_samples: int, num_shards: int, shard_id: int, *, mode: str = "pad", start: int = 0
) -> np.ndarray:
    """Per entry of :func:`shard_indices` (same arguments): 1 if it is read for the first time.

    0 marks pad mode's repeats, the entries whose list position wrapped past
    ``N`` to samples the epoch already read (the shuffle does not change
    which entries those are). Used as Keras ``sample_weight`` they train the
    epoch's samples exactly once while every shard still takes as many steps.

    Returns:
        float32 array of the shape of ``shard_indices(...)``: all ones in drop
        and uneven mode.

    Example:
        >>> [shard_weights(10, 3, r).tolist() for r in range(3)]
        [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]]
    """
    check_shard_args(num_samples, num_shards, shard_id, mode)
    positions = _positions(num_samples, num_shards, shard_id, mode, start)
    return (positions < num_samples).astype(np.float32)


def _positions(num_samples, num_shards, shard_id, mode, start) -> np.ndarray:
    """List positions shard ``shard_id`` reads, before pad mode wraps them past ``N``."""
    start = check_start(start, num_samples)
    length = shard_length(num_samples, num_shards, shard_id, mode, start)
    return start + shard_id + num_shards * np.arange(length, dtype=np.int64)


def check_start(start: Any, num_samples: int) -> int:
    """``start`` as an int in ``[0, num_samples]``, or a ShardingError."""
    start = check_int("start", start, 0, "pass the number of samples already read (>= 0).")
    if start > num_samples:
        raise ShardingError(
            f"start={start} is past the end of the epoch's {num_samples} samples; pass a "
            f"position between 0 and {num_samples}."
        )
    return start


# --------------------------------------------------------------------------- shard()
def _is_file_list(source: Any) -> bool:
    return (
        isinstance(source, (list, tuple))
        and len(source) > 0
        and all(isinstance(f, (str, os.PathLike)) for f in source)
    )


def shard(
    source: Any,
    num_shards: int | None = None,
    shard_id: int | None = None,
    *,
    shuffle: bool = False,
    seed: int = 0,
    epoch: int = 0,
    mode: str = "pad",
    reader=None,
    records_per_file: int | Sequence[int] | None = None,
) -> tf.data.Dataset:
    """This rank's part of ``source`` as a ``tf.data.Dataset`` (one epoch).

    * A list of file paths is sharded **by file**: shard ``r`` gets the
      files :func:`shard_indices` gives for ``len(files)`` items and opens no
      other file. In ``"pad"``/``"drop"`` mode every rank then yields the same
      number of records: ranks whose files hold fewer records than the
      largest (pad) repeat their first records, ranks with more stop at the
      smallest (drop). That needs the records per file: given by
      ``records_per_file``, or, for the default TFRecord reader, counted from
      each record's 8-byte length field (in a launched job each rank
      counts only its own files and the totals are exchanged, so every rank
      must call ``shard`` together). With fewer files than shards every rank
      reads all files and keeps its elements, with a :class:`ShardingWarning`.
    * Anything else is sharded **by element**, as in :meth:`~hvdkit.data.ShardSampler.dataset`:
      readers, arrays and random-access datasets are read by index, so only
      this rank's elements are decoded; other datasets are filtered.
      A ``tf.data.Dataset`` of unknown length can only be sharded with
      ``mode="uneven", shuffle=False`` (like ``Dataset.shard``).

    For N=10 elements and 2 ranks without shuffle, rank 0 reads
    ``[0, 2, 4, 6, 8]`` and rank 1 ``[1, 3, 5, 7, 9]``; with N=5 in pad mode
    rank 0 reads ``[0, 2, 4]`` and rank 1 ``[1, 3, 0]``.

    Args:
        source: List of file paths, reader, array(s), or ``tf.data.Dataset``.
        num_shards: ``S``; ``None`` (with ``shard_id=None``) means ``hvdkit.size()``.
        shard_id: This shard; ``None`` means ``hvdkit.rank()``.
        shuffle: Shuffle files (file lists) or elements with ``(seed, epoch)``.
        seed: Same on every rank.
        epoch: Which epoch's order to produce.
        mode: ``"pad"`` (default), ``"drop"`` or ``"uneven"``.
        reader: File lists only: function from a scalar string path tensor
            to a dataset of that file's records; default ``tf.data.TFRecordDataset``.
        records_per_file: File lists only: records in each file (one int if
            all files are alike); required in pad/drop mode with a custom ``reader``.

    Returns:
        ``tf.data.Dataset`` with the element structure of the source (for
        files, of the reader). Its length is known unless the source's
        length was unknown.

    Raises:
        ShardingError: invalid shard arguments (see :func:`shard_indices`), a
            dataset of unknown length where the length is needed, or record
            counts that cannot balance the shards.
        DataFormatError: a TFRecord file is missing or truncated.

    Example:
        >>> files = sorted(glob.glob("/data/train-*.tfrecord"))
        >>> ds = hvdkit.data.shard(files, shuffle=True, epoch=epoch)  # hvdkit: own files only
        >>> ds = ds.map(parse).batch(32)
    """
    if _is_file_list(source):
        num_shards, shard_id = resolve_shards(num_shards, shard_id)
        files = [os.fspath(f) for f in source]
        return _shard_files(
            files, num_shards, shard_id, shuffle, seed, epoch, mode, reader, records_per_file
        )
    if reader is not None or records_per_file is not None:
        raise ConfigurationError(
            "reader= and records_per_file= apply to a list of file paths only; "
            f"got a {type(source).__name__}. Drop them, or pass the list of files."
        )
    if isinstance(source, (str, os.PathLike)):
        raise ShardingError(
            f"shard() got one path, {os.fspath(source)!r}; pass a list of files ([path]) "
            "or, for one file, its dataset."
        )
    source = _pipeline.as_source(source)
    length = _pipeline.source_length(source)
    num_shards, shard_id = resolve_shards(num_shards, shard_id)
    if length is None:
        if mode == "uneven" and not shuffle:
            check_shard_args(1, num_shards, shard_id, mode, seed, epoch)
            return source.shard(num_shards, shard_id)
        raise ShardingError(
            f"the dataset's length is unknown, but mode={mode!r}"
            f"{' with shuffle=True' if shuffle else ''} needs it to give every rank its "
            "share. Declare it with dataset.apply(tf.data.experimental.assert_cardinality(n)), "
            "pass the list of files instead, or use mode='uneven', shuffle=False."
        )
    idx = shard_indices(
        length, num_shards, shard_id, shuffle=shuffle, seed=seed, epoch=epoch, mode=mode
    )
    return _pipeline.select(source, idx)


def _records_per_file(files: list[str], records_per_file) -> list[int] | None:
    """Records in each file if known without reading, else ``None`` (count TFRecords)."""
    if records_per_file is None:
        return None
    if isinstance(records_per_file, numbers.Integral):
        records_per_file = [records_per_file] * len(files)
    counts = list(records_per_file)
    if len(counts) != len(files):
        raise ShardingError(
            f"records_per_file has {len(counts)} entries for {len(files)} files; give one "
            "count per file, or one int for all."
        )
    fix = "pass the number of records in each file."
    return [check_int("records_per_file entry", c, 0, fix) for c in counts]


def _shard_files(files, num_shards, shard_id, shuffle, seed, epoch, mode, reader, known):
    counts = _records_per_file(files, known)
    if counts is None and reader is not None and (mode != "uneven" or shuffle):
        raise ShardingError(
            f"mode={mode!r} needs the number of records in each file to give every rank "
            "the same number of elements, and hvdkit can count them only for the default "
            "TFRecord reader; pass records_per_file=<int or list>, or mode='uneven'."
        )
    count = _pipeline.count_tfrecords
    if len(files) < num_shards:
        warnings.warn(
            f"{len(files)} files for {num_shards} shards: sharding by file would leave "
            f"{num_shards - len(files)} ranks without a file, so every rank opens all files "
            "and keeps its own records (element sharding). Write at least as many files as "
            "ranks (ideally a multiple) so that each rank reads only its own files.",
            ShardingWarning,
            stacklevel=3,
        )
        stream = _pipeline.read_files(files, reader)
        if counts is None and mode == "uneven" and not shuffle:
            check_shard_args(1, num_shards, shard_id, mode, seed, epoch)
            return stream.shard(num_shards, shard_id)
        total = sum(counts) if counts is not None else sum(count(f) for f in files)
        idx = shard_indices(
            total, num_shards, shard_id, shuffle=shuffle, seed=seed, epoch=epoch, mode=mode
        )
        return _pipeline.keep_positions(stream, idx)

    def assigned(q):
        return shard_indices(
            len(files), num_shards, q, shuffle=shuffle, seed=seed, epoch=epoch, mode=mode
        )

    mine = [files[i] for i in assigned(shard_id)]
    stream = _pipeline.read_files(mine, reader)
    if mode == "uneven":
        if counts is not None:
            own = sum(counts[i] for i in assigned(shard_id))
            stream = stream.apply(tf.data.experimental.assert_cardinality(own))
        return stream
    if counts is not None:
        totals = [sum(counts[i] for i in assigned(q)) for q in range(num_shards)]
    else:
        # Counted locally, never exchanged: shard() is not a collective call, so
        # a rank that calls it alone (a rank-0-only evaluation) or with other
        # arguments than the others cannot leave them waiting. Pass
        # records_per_file to skip counting.
        totals = [sum(count(files[i]) for i in assigned(q)) for q in range(num_shards)]
    target = max(totals) if mode == "pad" else min(totals)
    if target == 0 or totals[shard_id] == 0:
        empty = [q for q, t in enumerate(totals) if t == 0]
        raise ShardingError(
            f"the files of shard(s) {empty} hold no records (records per shard: {totals}), "
            f"so mode={mode!r} cannot give every rank the same number; remove empty files "
            "or use mode='uneven'."
        )
    return _pipeline.fit_length(stream, totals[shard_id], target)

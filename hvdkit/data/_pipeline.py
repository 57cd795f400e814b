"""tf.data building blocks for the sharder: no sharding policy, only mechanics.

Given the indices a shard must read (from :func:`hvdkit.data.shard_indices`),
these turn a source into a ``tf.data.Dataset`` of exactly those elements:

* readers (``__len__``, ``read(indices)``, ``element_spec``) and arrays are
  read in chunks of indices through ``tf.py_function``, so a reader touches
  only the shard's records; :func:`gather_passes` draws new indices for
  every pass over the dataset (a reshuffle per epoch);
* datasets with random access go through ``tf.data.experimental.at``, so
  their ``map`` functions run only on the shard's elements;
* other datasets are read in stored order and filtered by position.
"""

from __future__ import annotations

import functools
import itertools
import os
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from .._autograph import not_converted
from ..errors import DataFormatError, ShardingError


class ArraySource:
    """Random access to a numpy array or a tuple/dict of arrays of equal length."""

    def __init__(self, arrays: Any):
        self.arrays = tf.nest.map_structure(np.asarray, arrays)
        flat = tf.nest.flatten(self.arrays)
        lengths = {a.shape[0] if a.ndim else None for a in flat}
        if len(lengths) != 1 or None in lengths:
            shapes = [a.shape for a in flat]
            raise ShardingError(
                f"arrays to shard must share their first dimension; got shapes {shapes}. "
                "Pass arrays with one row per sample."
            )
        self._length = lengths.pop()
        self.element_spec = tf.nest.map_structure(
            lambda a: tf.TensorSpec(a.shape[1:], tf.as_dtype(a.dtype)), self.arrays
        )

    def __len__(self) -> int:
        return self._length

    def read(self, indices: np.ndarray):
        return tf.nest.map_structure(lambda a: a[indices], self.arrays)


def as_source(source: Any):
    """A reader, an :class:`ArraySource`, or the ``tf.data.Dataset`` itself."""
    if isinstance(source, tf.data.Dataset):
        return source
    if hasattr(source, "read") and hasattr(source, "element_spec") and hasattr(source, "__len__"):
        return source
    try:
        return ArraySource(source)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ShardingError):
            raise
        raise ShardingError(
            f"cannot shard a {type(source).__name__}: pass a list of file paths, a reader "
            "(with __len__, read(indices), element_spec), numpy arrays or a tf.data.Dataset."
        ) from exc


def source_length(source: Any) -> int | None:
    """Number of elements, or ``None`` for a dataset of unknown or infinite length."""
    if not isinstance(source, tf.data.Dataset):
        return len(source)
    n = int(source.cardinality())
    return n if n >= 0 else None


def _random_access(dataset: tf.data.Dataset) -> bool:
    # There is no public "supports random access" query; reading element 0
    # is the cheapest reliable probe.
    try:
        tf.data.experimental.at(dataset, 0)
    except tf.errors.UnimplementedError:
        return False
    return True


def is_sequential(source: Any) -> bool:
    """Whether ``source`` can only be read front to back (no random access)."""
    return isinstance(source, tf.data.Dataset) and not _random_access(source)


def _known_length(dataset: tf.data.Dataset, n: int) -> tf.data.Dataset:
    return dataset.apply(tf.data.experimental.assert_cardinality(n))


def gather(source: Any, indices: np.ndarray, chunk_size: int = 256) -> tf.data.Dataset:
    """Elements ``indices`` of a reader, array source or random-access dataset, in order."""
    index_ds = tf.data.Dataset.from_tensor_slices(np.asarray(indices, np.int64))
    if isinstance(source, tf.data.Dataset):
        out = index_ds.map(
            lambda i: tf.data.experimental.at(source, i),
            num_parallel_calls=tf.data.AUTOTUNE,
            deterministic=True,
        )
        return _known_length(out, len(indices))
    return _read_chunks(source, index_ds.batch(chunk_size), len(indices))


def _read_chunks(source: Any, chunks: tf.data.Dataset, length: int) -> tf.data.Dataset:
    """The elements of a reader or array source at each 1-D int64 chunk of ``chunks``, unbatched."""
    spec = source.element_spec
    flat_spec = tf.nest.flatten(spec)

    def read_chunk(chunk):
        return tf.nest.flatten(source.read(chunk.numpy()))

    @not_converted  # tf.data's map would rewrite it with AutoGraph in every process
    def read(chunk):
        flat = tf.py_function(read_chunk, [chunk], [s.dtype for s in flat_spec])
        for tensor, s in zip(flat, flat_spec, strict=True):
            tensor.set_shape([None, *s.shape])
        return tf.nest.pack_sequence_as(spec, flat)

    out = chunks.map(read, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).unbatch()
    return _known_length(out, length)


def gather_passes(
    source: Any,
    indices_of_pass: Callable[[int], np.ndarray],
    length: int,
    chunk_size: int = 256,
) -> tf.data.Dataset:
    """Elements of a reader or array source; pass ``k`` reads ``indices_of_pass(k)``, in order.

    A pass is one iteration over the returned dataset: each ``iter(ds)``,
    each Keras epoch, each repetition of ``ds.repeat()``. The passes of one
    dataset are numbered 0, 1, 2, ... in the order they read their first
    element; the number comes from a counter the dataset holds, so the same
    calls in every process give every process the same numbers.
    ``indices_of_pass(k)`` must return ``length`` indices for every ``k``:
    the dataset declares that cardinality.
    """
    passes = itertools.count()  # next() on a count is atomic: concurrent passes differ

    def chunks():
        indices = np.asarray(indices_of_pass(next(passes)), np.int64)
        for start in range(0, len(indices), chunk_size):
            yield indices[start : start + chunk_size]

    index_chunks = tf.data.Dataset.from_generator(
        chunks, output_signature=tf.TensorSpec([None], tf.int64)
    )
    return _read_chunks(source, index_chunks, length)


def select(
    source: Any, indices: np.ndarray, skip: int = 0, chunk_size: int = 256
) -> tf.data.Dataset:
    """The elements of ``source`` at ``indices``, minus the first ``skip`` of them.

    Readers, arrays and random-access datasets give them in the order of
    ``indices``; sequential datasets in stored order.
    """
    if is_sequential(source):
        return keep_positions(source, indices).skip(skip)
    return gather(source, indices[skip:], chunk_size)


def keep_positions(dataset: tf.data.Dataset, indices: np.ndarray) -> tf.data.Dataset:
    """Elements of a sequential ``dataset`` at ``indices``, in stored order.

    ``indices`` must be distinct (true of one shard in every mode); reading
    order is lost, as it would need the whole shard in memory.
    """
    n = int(indices.max()) + 1 if len(indices) else 0
    mask = np.zeros(n, bool)
    mask[indices] = True
    table = tf.constant(mask)
    out = dataset.take(n).enumerate().filter(lambda i, _: table[i]).map(lambda _, element: element)
    return _known_length(out, len(indices))


def read_files(files: list[str], reader=None) -> tf.data.Dataset:
    """Records of ``files`` in order; ``reader`` maps one path to a dataset (default TFRecord)."""
    paths = tf.data.Dataset.from_tensor_slices(tf.constant(files, tf.string))
    return paths.flat_map(reader or tf.data.TFRecordDataset)


def fit_length(dataset: tf.data.Dataset, length: int, target: int) -> tf.data.Dataset:
    """Cut ``dataset`` (of ``length`` elements) to ``target``, or wrap around to reach it."""
    if target > length:
        dataset = dataset.repeat()
    return _known_length(dataset.take(target), target)


# TFRecord framing: uint64 length, uint32 masked CRC of the length, data,
# uint32 masked CRC of the data.
_TFRECORD_HEADER = 12
_TFRECORD_OVERHEAD = 16


@functools.lru_cache(maxsize=4096)
def _count_tfrecords(path: str, size: int, mtime_ns: int) -> int:
    count, offset = 0, 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while offset < size:
            header = os.pread(fd, 8, offset)
            if len(header) < 8:
                break
            (length,) = struct.unpack("<Q", header)
            end = offset + length + _TFRECORD_OVERHEAD
            if end > size:
                raise DataFormatError(
                    f"TFRecord file {path} is truncated: record {count} at byte {offset} "
                    f"needs {length + _TFRECORD_OVERHEAD} bytes (up to byte {end}) but the "
                    f"file has {size} bytes. Rewrite the file, or leave it out."
                )
            count += 1
            offset = end
    finally:
        os.close(fd)
    if offset != size:
        raise DataFormatError(
            f"TFRecord file {path} is truncated: {size - offset} stray bytes after record "
            f"{count} (a record header is {_TFRECORD_HEADER} bytes). Rewrite the file."
        )
    return count


def count_tfrecords(path: str) -> int:
    """Records in a TFRecord file, reading only the 8-byte length of each record.

    Raises:
        DataFormatError: the file is missing or its last record is cut short.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DataFormatError(
            f"TFRecord file {path} does not exist; check the list of files passed to shard()."
        ) from None
    return _count_tfrecords(path, st.st_size, st.st_mtime_ns)

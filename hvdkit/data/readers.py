"""MNIST (IDX) and CIFAR-10 (binary) readers that read only this rank's records.

Two layers:

* :class:`MnistReader` and :class:`Cifar10Reader` give random access
  (``len(reader)``, ``reader.read(indices)``) and read each requested record
  with a positioned read, so a rank reads about ``1/S`` of the bytes. Use
  them with :class:`~hvdkit.data.ShardSampler` to resume mid-epoch.
* :func:`MnistDataset` and :func:`Cifar10Dataset` take MindSpore's arguments
  (``usage``, ``num_samples``, ``num_shards``, ``shard_id``, ``shuffle``)
  with MindSpore's meaning: every split present unless ``usage`` names one;
  shuffled unless ``shuffle=False``, with a new order on every pass over the
  dataset; without ``num_shards`` every process reads *all* the records,
  ``num_shards="auto"`` shards them over this job (``hvdkit.size()`` shards,
  this process reads shard ``hvdkit.rank()``); ``num_samples`` caps each
  shard. They return a ``tf.data.Dataset`` of ``(image, label)`` pairs.

Element structure, for both: ``image`` uint8 ``[H, W, C]`` (MNIST
``[28, 28, 1]``, CIFAR-10 ``[32, 32, 3]`` in RGB, channels last) and
``label`` int32 scalar.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import tensorflow as tf

from .._validate import check_int, is_int
from ..errors import ConfigurationError, DataFormatError, ShardingError
from . import _pipeline
from .sharding import resolve_shards, shard_indices

__all__ = ["MnistReader", "Cifar10Reader", "MnistDataset", "Cifar10Dataset"]

AUTO = "auto"  # num_shards="auto": shard over this job

USAGES = ("train", "test", "all")
MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_IDX_IMAGES_MAGIC, _IDX_LABELS_MAGIC = 2051, 2049  # 0x00000803, 0x00000801
CIFAR10_DIR = "cifar-10-batches-bin"
CIFAR10_FILES = {
    "train": tuple(f"data_batch_{i}.bin" for i in range(1, 6)),
    "test": ("test_batch.bin",),
}
CIFAR10_RECORD = 1 + 3 * 32 * 32  # label byte, then the R, G and B planes of 32x32
CIFAR10_FILE_RECORDS = 10000


SPLITS = ("train", "test")  # the order in which None/'all' reads the splits present


def _splits(usage: str | None, files: dict[str, tuple[Path, ...]], what: str) -> tuple[str, ...]:
    """The splits ``usage`` reads: one named split, or (None/'all') every split present.

    A split is present when any of its ``files`` (or a ``.gz`` of one) exists;
    its other files are then required, and reading them names any missing one.
    As in MindSpore, None and 'all' read whatever splits are there; at least
    one must be.
    """
    if usage in SPLITS:
        return (usage,)
    if usage is not None and usage != "all":
        raise ConfigurationError(
            f"usage={usage!r} is not one of {USAGES} or None; None and 'all' read every "
            "split present (train, then test)."
        )

    def present(path: Path) -> bool:
        return path.exists() or path.with_name(path.name + ".gz").exists()

    found = tuple(split for split in SPLITS if any(present(f) for f in files[split]))
    if not found:
        root = files[SPLITS[0]][0].parent
        names = {split: ", ".join(f.name for f in files[split]) for split in SPLITS}
        looked = "; ".join(f"{split}: {names[split]}" for split in SPLITS)
        where = f"{root} holds none of them" if root.is_dir() else f"{root} is not a directory"
        raise DataFormatError(
            f"usage={usage!r} reads every {what} split present, but {where} (looked for "
            f"{looked}). Point dataset_dir at the directory with these files, uncompressed."
        )
    return found


def _file_size(path: Path, what: str) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        hint = ""
        if path.with_name(path.name + ".gz").exists():
            hint = f" {path.name}.gz is there: decompress it with `gunzip {path}.gz`."
        raise DataFormatError(
            f"{what} file {path} does not exist; dataset_dir must hold {path.name}.{hint}"
        ) from None


class _Records:
    """Fixed-size records behind a header in one or more files, read on demand.

    Records are numbered across ``parts`` (``(path, header_bytes, count)``)
    in order. :meth:`read` reads each contiguous run of requested records
    with one positioned read, and nothing else.
    """

    def __init__(self, parts: list[tuple[Path, int, int]], record_bytes: int):
        self.parts = parts
        self.record_bytes = record_bytes
        self.starts = np.cumsum([0] + [count for _, _, count in parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, index: int) -> tuple[Path, int]:
        """File and record number within it of record ``index``."""
        part = int(np.searchsorted(self.starts, index, side="right")) - 1
        return self.parts[part][0], index - int(self.starts[part])

    def read(self, indices: np.ndarray) -> np.ndarray:
        """uint8 array ``[len(indices), record_bytes]``, rows in the order of ``indices``."""
        indices = np.asarray(indices, np.int64).reshape(-1)
        wanted, inverse = np.unique(indices, return_inverse=True)
        rows = np.empty((len(wanted), self.record_bytes), np.uint8)
        if not len(wanted):
            return rows
        part_of = np.searchsorted(self.starts, wanted, side="right") - 1
        breaks = np.flatnonzero((np.diff(wanted) != 1) | (np.diff(part_of) != 0)) + 1
        bounds = zip(np.r_[0, breaks], np.r_[breaks, len(wanted)], strict=True)
        fds: dict[int, int] = {}
        try:
            for a, b in bounds:
                part = int(part_of[a])
                path, header, _ = self.parts[part]
                if part not in fds:
                    fds[part] = os.open(path, os.O_RDONLY)
                offset = header + (int(wanted[a]) - int(self.starts[part])) * self.record_bytes
                got = os.preadv(fds[part], [memoryview(rows[a:b]).cast("B")], offset)
                if got != (b - a) * self.record_bytes:
                    raise DataFormatError(
                        f"{path} ended at byte {offset + got} while reading records "
                        f"{int(wanted[a])}..{int(wanted[b - 1])}: the file shrank after it was "
                        "opened. Copy the dataset again and restart."
                    )
        finally:
            for fd in fds.values():
                os.close(fd)
        return rows[inverse.reshape(-1)]


def _take(num_samples: int | None, available: int, what: str) -> int:
    if num_samples is None:
        return available
    num_samples = check_int(
        "num_samples",
        num_samples,
        minimum=None,  # the range, 1..available, is checked below with what holds them
        message=f"num_samples={num_samples!r} is not an int; pass an int or None.",
    )
    if not 1 <= num_samples <= available:
        raise ConfigurationError(
            f"num_samples={num_samples} but {what} holds {available} records; pass a number "
            f"from 1 to {available}, or None for all."
        )
    return num_samples


class _ImageLabelReader:
    """What both readers share: length, element spec and index checks."""

    image_shape: tuple[int, int, int]

    def _set_length(self, num_samples: int | None, available: int, what: str) -> None:
        self._length = _take(num_samples, available, what)
        self.element_spec = (
            tf.TensorSpec(self.image_shape, tf.uint8),
            tf.TensorSpec([], tf.int32),
        )

    def __len__(self) -> int:
        return self._length

    def read(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """Images uint8 ``[k, H, W, C]`` and labels int32 ``[k]`` of records ``indices``."""
        indices = np.asarray(indices, np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= self._length):
            bad = indices[(indices < 0) | (indices >= self._length)][0]
            raise ShardingError(f"index {bad} is outside the reader's records [0, {self._length}).")
        return self._decode(indices)

    def _decode(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError


# --------------------------------------------------------------------------- MNIST
def _read_idx_header(path: Path, magic: int, ndim: int) -> tuple[int, ...]:
    """Counts in the header of an IDX file ``(n, *dims)``, checked against its size."""
    what = "MNIST images" if magic == _IDX_IMAGES_MAGIC else "MNIST labels"
    size = _file_size(path, what)
    header_bytes = 4 * (1 + ndim)
    with open(path, "rb") as f:
        header = f.read(header_bytes)
    if len(header) < header_bytes:
        raise DataFormatError(
            f"{what} file {path} is truncated: {size} bytes, less than its "
            f"{header_bytes}-byte header. Download it again."
        )
    found, *shape = struct.unpack(f">{1 + ndim}I", header)
    if found != magic:
        gz = " It looks gzip-compressed: gunzip it first." if header[:2] == b"\x1f\x8b" else ""
        raise DataFormatError(
            f"{path} is not an {what} IDX file: magic number {found:#010x}, expected "
            f"{magic:#010x}.{gz}"
        )
    record = int(np.prod(shape[1:], dtype=np.int64))
    expected = header_bytes + shape[0] * record
    if size != expected:
        state = "is truncated" if size < expected else f"has {size - expected} extra bytes"
        raise DataFormatError(
            f"{what} file {path} {state}: expected {expected} bytes (a {header_bytes}-byte "
            f"header + {shape[0]} records of {record} bytes), found {size}. Download it again."
        )
    return tuple(shape)


class MnistReader(_ImageLabelReader):
    """Random access to the MNIST IDX files in ``dataset_dir``.

    ``dataset_dir`` holds ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
    ``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte`` (uncompressed).
    Headers and file sizes are checked when the reader is made.

    Args:
        dataset_dir: Directory of the IDX files.
        usage: ``"train"`` (60,000 records), ``"test"`` (10,000), or
            ``None``/``"all"`` (default): every split whose files are in
            ``dataset_dir``, train first (70,000 with both). The same meaning
            as in :func:`MnistDataset`.
        num_samples: Use only the first ``num_samples`` records of the files
            (in ``1..len``); ``None`` for all. Unlike ``num_samples`` of
            :func:`MnistDataset`, which caps each shard after shuffling.

    Attributes:
        splits: The splits read, in order, e.g. ``("train", "test")``.

    Raises:
        DataFormatError: no split's files are in ``dataset_dir``; a file of a
            split is missing, has the wrong magic number, or its size does not
            match its header (the message names the file and the expected size).
        ConfigurationError: bad ``usage`` or ``num_samples``.

    Example:
        >>> reader = hvdkit.data.MnistReader("/data/mnist", "test")
        >>> images, labels = reader.read([0, 1])
        >>> images.shape, images.dtype, labels.dtype
        ((2, 28, 28, 1), dtype('uint8'), dtype('int32'))
        >>> len(hvdkit.data.MnistReader("/data/mnist"))       # both splits there
        70000
    """

    def __init__(self, dataset_dir: str | os.PathLike, usage: str | None = None, num_samples=None):
        root = Path(dataset_dir)
        files = {split: tuple(root / name for name in MNIST_FILES[split]) for split in SPLITS}
        self.splits = _splits(usage, files, "MNIST")
        image_parts, label_parts, sizes = [], [], set()
        for split in self.splits:
            image_file, label_file = files[split]
            n_images, rows, cols = _read_idx_header(image_file, _IDX_IMAGES_MAGIC, 3)
            (n_labels,) = _read_idx_header(label_file, _IDX_LABELS_MAGIC, 1)
            if n_images != n_labels:
                raise DataFormatError(
                    f"{image_file} holds {n_images} images but {label_file} holds {n_labels} "
                    "labels; the two files come from different downloads. Download both again."
                )
            sizes.add((rows, cols))
            image_parts.append((image_file, 16, n_images))
            label_parts.append((label_file, 8, n_labels))
        if len(sizes) > 1:
            raise DataFormatError(
                f"the MNIST splits in {root} have different image sizes {sorted(sizes)}; "
                "use usage='train' or 'test' alone."
            )
        self.image_shape = (*sizes.pop(), 1)
        self._images = _Records(image_parts, self.image_shape[0] * self.image_shape[1])
        self._labels = _Records(label_parts, 1)
        what = f"MNIST {'+'.join(self.splits)} in {root}"
        self._set_length(num_samples, len(self._images), what)

    def _decode(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        images = self._images.read(indices).reshape(-1, *self.image_shape)
        return images, self._labels.read(indices)[:, 0].astype(np.int32)


# --------------------------------------------------------------------------- CIFAR-10
class Cifar10Reader(_ImageLabelReader):
    """Random access to the CIFAR-10 binary files.

    ``dataset_dir`` is the ``cifar-10-batches-bin`` directory or its parent;
    it holds ``data_batch_1.bin`` ... ``data_batch_5.bin`` and
    ``test_batch.bin``, each a sequence of 3,073-byte records: one label byte
    (0-9), then the red, green and blue 32x32 planes, row by row.

    Args:
        dataset_dir: See above.
        usage: ``"train"`` (50,000 records), ``"test"`` (10,000), or
            ``None``/``"all"`` (default): every split whose files are there,
            train first (60,000 with both). The same meaning as in
            :func:`Cifar10Dataset`.
        num_samples: Use only the first ``num_samples`` records of the files
            (in ``1..len``); ``None`` for all. Unlike ``num_samples`` of
            :func:`Cifar10Dataset`, which caps each shard after shuffling.

    Attributes:
        splits: The splits read, in order, e.g. ``("train",)``.

    Raises:
        DataFormatError: no split's files are there; a file of a split is
            missing or not a whole number of records (the message names the
            file and the expected size); a label byte above 9 is found while
            reading.
        ConfigurationError: bad ``usage`` or ``num_samples``.

    Example:
        >>> reader = hvdkit.data.Cifar10Reader("/data")     # finds cifar-10-batches-bin/
        >>> images, labels = reader.read([0])
        >>> images.shape                                     # HWC, RGB
        (1, 32, 32, 3)
    """

    image_shape = (32, 32, 3)

    def __init__(self, dataset_dir: str | os.PathLike, usage: str | None = None, num_samples=None):
        root = Path(dataset_dir)
        if (root / CIFAR10_DIR).is_dir():
            root = root / CIFAR10_DIR
        files = {split: tuple(root / name for name in CIFAR10_FILES[split]) for split in SPLITS}
        self.splits = _splits(usage, files, "CIFAR-10")
        parts = []
        for split in self.splits:
            for path in files[split]:
                size = _file_size(path, "CIFAR-10")
                if size == 0 or size % CIFAR10_RECORD:
                    whole = size // CIFAR10_RECORD
                    raise DataFormatError(
                        f"CIFAR-10 file {path} has {size} bytes, not a whole number of "
                        f"{CIFAR10_RECORD}-byte records (1 label byte + 3072 image bytes): it is "
                        f"truncated. Expected {(whole + 1) * CIFAR10_RECORD} bytes for "
                        f"{whole + 1} records ({CIFAR10_FILE_RECORDS * CIFAR10_RECORD} for a "
                        "full batch file). Download it again."
                    )
                parts.append((path, 0, size // CIFAR10_RECORD))
        self._records = _Records(parts, CIFAR10_RECORD)
        what = f"CIFAR-10 {'+'.join(self.splits)} in {root}"
        self._set_length(num_samples, len(self._records), what)

    def _decode(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        records = self._records.read(indices)
        labels = records[:, 0].astype(np.int32)
        if labels.size and labels.max() > 9:
            row = int(np.argmax(labels))
            path, number = self._records.locate(int(indices[row]))
            raise DataFormatError(
                f"record {number} of {path} has label byte {labels[row]}, but CIFAR-10 labels "
                "are 0-9; is this the CIFAR-100 binary format (two label bytes)?"
            )
        planes = records[:, 1:].reshape(-1, 3, 32, 32)
        return np.ascontiguousarray(planes.transpose(0, 2, 3, 1)), labels


# --------------------------------------------------------------------------- datasets
def MnistDataset(  # named like MindSpore's class, so ported scripts keep the call
    dataset_dir: str | os.PathLike,
    usage: str | None = None,
    num_samples: int | None = None,
    num_shards: int | str | None = None,
    shard_id: int | str | None = None,
    shuffle: bool | None = None,
    seed: int = 0,
    mode: str = "pad",
    epoch: int = 0,
) -> tf.data.Dataset:
    """MNIST ``(image, label)`` pairs as a ``tf.data.Dataset``, with MindSpore's defaults.

    As MindSpore's ``MnistDataset``: every split present in ``dataset_dir``
    (``usage=None``), in a random order that changes on every pass over the
    dataset (``shuffle=None``), and without ``num_shards`` *every* record in
    every process (what the manual-parallel and dataset-slicing tutorials
    need). With ``num_shards=S, shard_id=r`` it is shard ``r`` of ``S``;
    ``num_shards="auto"`` means this job's shards: ``S = hvdkit.size()``,
    ``r = hvdkit.rank()``. With 2 ranks and 10 records, ``shuffle=False``
    and ``num_shards="auto"`` give rank 0 records ``0, 2, 4, 6, 8`` and rank
    1 records ``1, 3, 5, 7, 9``.

    A pass is one iteration over the dataset (each ``for x in ds``, each
    Keras epoch, each repetition of ``ds.repeat()``). When shuffled, pass
    ``k`` reads the order of epoch ``epoch + k``: the permutation
    ``shard_indices(N, S, r, shuffle=True, seed=seed, epoch=epoch + k)``.
    Every process draws it from the same ``(seed, epoch + k)``, so in each
    pass the shards are disjoint and together cover every record (``"pad"``
    repeats a few; see :func:`~hvdkit.data.shard_indices`). Rebuilding the
    dataset each epoch with ``epoch=e`` and reading it once gives epoch
    ``e``'s order as well.

    Args:
        dataset_dir: Directory of the IDX files (see :class:`MnistReader`).
        usage: ``None`` or ``"all"`` (default): every split whose files are
            there, train then test; ``"train"`` or ``"test"``: that split.
        num_samples: At most this many records per shard (without
            ``num_shards``: in all), taken from the start of this pass's
            order, so with shuffling a different random subset each pass.
            An int ``>= 1``; more than the shard holds means the whole shard.
            ``None``: no cap.
        num_shards: ``None`` (read everything: MindSpore's meaning, unlike
            :func:`~hvdkit.data.shard` and ``ShardSampler``, where ``None``
            means this job), an int ``S >= 1`` (with
            ``shard_id``), or ``"auto"`` (this job: ``hvdkit.size()``; needs
            ``hvdkit.init()``). Explicit values that differ from the job are
            allowed; they warn (:class:`ShardingWarning`) unless they are
            ``num_shards=1, shard_id=0`` (everything, on purpose).
        shard_id: With an int ``num_shards``, in ``[0, S)``; with ``"auto"``,
            leave it ``None`` (or ``"auto"``): it is ``hvdkit.rank()``.
        shuffle: ``None`` or ``True`` (default): a new random order every
            pass, the same on every process; ``False``: stored order.
        seed: Seed of the shuffle; the same on every process.
        mode: ``"pad"`` (default), ``"drop"`` or ``"uneven"``; see
            :func:`~hvdkit.data.shard_indices`.
        epoch: The order of the first pass (pass ``k`` uses ``epoch + k``).

    Returns:
        Dataset of ``(image uint8 [28, 28, 1], label int32 [])`` with a known
        length: ``ceil(N/S)`` elements in pad mode, ``floor(N/S)`` in drop
        mode, ``N`` records over ``S`` shards; at most ``num_samples``
        (``S = 1`` without ``num_shards``).

    Raises:
        ShardingError: only one of ``num_shards``/``shard_id`` given as an
            int, ``shard_id`` outside ``[0, S)``, or ``"auto"`` with an int
            ``shard_id``.
        ConfigurationError: bad ``usage``, ``shuffle`` or ``num_samples``.
        DataFormatError: see :class:`MnistReader`.
        NotInitializedError: ``num_shards="auto"`` before ``hvdkit.init()``.

    Example:
        >>> ds = hvdkit.data.MnistDataset(DATA_PATH, "train",
        ...                               num_shards="auto")  # hvdkit: this rank's share
        >>> len(ds)                                           # on each of 2 ranks
        30000
        >>> model.fit(ds.map(scale).batch(32), epochs=EPOCHS)  # reshuffled every epoch
    """
    reader = MnistReader(dataset_dir, usage)
    return _dataset(reader, num_samples, num_shards, shard_id, shuffle, seed, epoch, mode)


def Cifar10Dataset(  # named like MindSpore's class, so ported scripts keep the call
    dataset_dir: str | os.PathLike,
    usage: str | None = None,
    num_samples: int | None = None,
    num_shards: int | str | None = None,
    shard_id: int | str | None = None,
    shuffle: bool | None = None,
    seed: int = 0,
    mode: str = "pad",
    epoch: int = 0,
) -> tf.data.Dataset:
    """CIFAR-10 ``(image, label)`` pairs as a ``tf.data.Dataset``, with MindSpore's defaults.

    Arguments and passes as :func:`MnistDataset`: every split present,
    shuffled anew on every pass, everything without ``num_shards``, this
    job's shard with ``num_shards="auto"``, ``num_samples`` per shard;
    ``dataset_dir`` as :class:`Cifar10Reader`.

    Returns:
        Dataset of ``(image uint8 [32, 32, 3] RGB, label int32 [])``.

    Example:
        >>> ds = hvdkit.data.Cifar10Dataset(DATA_PATH, num_shards=hvdkit.size(),
        ...                                 shard_id=hvdkit.rank()).batch(64)
        >>> len(ds)            # 2 ranks, train + test: 30,000 records each
        469
    """
    reader = Cifar10Reader(dataset_dir, usage)
    return _dataset(reader, num_samples, num_shards, shard_id, shuffle, seed, epoch, mode)


def _check_shuffle(shuffle) -> bool:
    if shuffle is None:
        return True  # MindSpore: no sampler and shuffle=None is a global shuffle
    if isinstance(shuffle, (bool, np.bool_)):
        return bool(shuffle)
    raise ConfigurationError(
        f"shuffle={shuffle!r} is not True, False or None; pass None or True for a new random "
        "order every pass (MindSpore's default), or False for the stored order."
    )


def _check_cap(num_samples) -> int | None:
    if num_samples is None:
        return None
    return check_int(
        "num_samples",
        num_samples,
        minimum=1,
        message=f"num_samples={num_samples!r} is not an int >= 1; pass the most records each "
        "shard may read (all of them if it holds fewer), or None for no cap.",
    )


def _dataset(
    reader, num_samples, num_shards, shard_id, shuffle, seed, epoch, mode
) -> tf.data.Dataset:
    """``reader``'s shard with MindSpore's meaning of the dataset arguments.

    Unshuffled, the indices are fixed and read as :func:`~hvdkit.data.shard`
    reads them; shuffled, every pass draws its own (see ``gather_passes``).
    """
    shuffle = _check_shuffle(shuffle)
    cap = _check_cap(num_samples)
    if num_shards == AUTO:
        if shard_id not in (None, AUTO):
            raise ShardingError(
                f"num_shards='auto' with shard_id={shard_id!r}: 'auto' takes this job's "
                "size and this process's rank; leave shard_id as None, or pass both as ints."
            )
        num_shards = shard_id = None  # resolve_shards: hvdkit.size() / hvdkit.rank()
    elif shard_id == AUTO:
        raise ShardingError(
            f"shard_id='auto' with num_shards={num_shards!r}: pass num_shards='auto' for "
            "this job's shards, or both as ints."
        )
    elif num_shards is None and shard_id is None:
        num_shards, shard_id = 1, 0  # MindSpore's default: every record
    if is_int(num_shards) and is_int(shard_id) and (num_shards, shard_id) == (1, 0):
        num_shards, shard_id = 1, 0  # one shard on purpose: no ShardingWarning
    else:
        num_shards, shard_id = resolve_shards(num_shards, shard_id)
    n = len(reader)

    def indices(order_epoch: int) -> np.ndarray:
        idx = shard_indices(
            n, num_shards, shard_id, shuffle=shuffle, seed=seed, epoch=order_epoch, mode=mode
        )
        return idx if cap is None else idx[:cap]

    first = indices(epoch)  # checks mode, seed and epoch now, not in the first pass
    if not shuffle:
        return _pipeline.gather(reader, first)
    length = len(first)  # the same in every pass: the shard's size depends on N, S, r only
    epoch = int(epoch)
    return _pipeline.gather_passes(reader, lambda k: indices(epoch + k), length)

"""Tiny data files in the exact MNIST IDX, CIFAR-10 binary and TFRecord formats.

Every sample carries its id, so a test can tell exactly which samples a rank
read: MNIST images hold ``id // 256`` and ``id % 256`` in their first two
pixels, CIFAR images in the first two bytes of the red plane, and TFRecord
records are the id as 8 little-endian bytes.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

CIFAR_TRAIN = [f"data_batch_{i}.bin" for i in range(1, 6)]
CIFAR_TEST = "test_batch.bin"


def _images_with_ids(ids: np.ndarray, shape: tuple[int, ...], seed: int) -> np.ndarray:
    images = np.random.default_rng(seed).integers(0, 256, (len(ids), *shape), dtype=np.uint8)
    flat = images.reshape(len(ids), -1)
    flat[:, 0], flat[:, 1] = ids // 256, ids % 256
    return images


def write_mnist(directory: Path, split: str = "train", n: int = 10, first_id: int = 0):
    """Write ``<split>-images-idx3-ubyte`` / ``-labels-idx1-ubyte``; returns (images, labels).

    ``split`` is ``"train"`` or ``"t10k"``. Images are ``[n, 28, 28]`` uint8.
    """
    ids = np.arange(first_id, first_id + n)
    images = _images_with_ids(ids, (28, 28), seed=first_id)
    labels = (ids * 7 % 10).astype(np.uint8)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{split}-images-idx3-ubyte").write_bytes(
        struct.pack(">IIII", 2051, n, 28, 28) + images.tobytes()
    )
    (directory / f"{split}-labels-idx1-ubyte").write_bytes(
        struct.pack(">II", 2049, n) + labels.tobytes()
    )
    return images, labels


def mnist_ids(images: np.ndarray) -> np.ndarray:
    flat = np.asarray(images).reshape(len(images), -1).astype(np.int64)
    return flat[:, 0] * 256 + flat[:, 1]


def write_cifar(path: Path, n: int, first_id: int = 0):
    """Write one CIFAR-10 binary file of ``n`` records; returns (images HWC, labels)."""
    ids = np.arange(first_id, first_id + n)
    planes = _images_with_ids(ids, (3, 32, 32), seed=first_id + 1)  # CHW, as stored
    labels = (ids % 10).astype(np.uint8)
    records = np.concatenate([labels[:, None], planes.reshape(n, -1)], axis=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(records.tobytes())
    return planes.transpose(0, 2, 3, 1), labels


def cifar_ids(images_hwc: np.ndarray) -> np.ndarray:
    red = np.asarray(images_hwc)[..., 0].reshape(len(images_hwc), -1).astype(np.int64)
    return red[:, 0] * 256 + red[:, 1]


def write_tfrecords(directory: Path, counts: list[int]) -> list[str]:
    """One TFRecord file per entry of ``counts``; record ids run on across files."""
    import tensorflow as tf

    directory.mkdir(parents=True, exist_ok=True)
    paths, next_id = [], 0
    for f, count in enumerate(counts):
        path = str(directory / f"part-{f:03d}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(next_id, next_id + count):
                writer.write(struct.pack("<q", i))
        paths.append(path)
        next_id += count
    return paths


def record_id(record) -> int:
    return struct.unpack("<q", bytes(record))[0]

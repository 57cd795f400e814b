"""MNIST IDX and CIFAR-10 binary readers on tiny files written in the exact formats."""

import os
import struct

import numpy as np
import pytest
import tensorflow as tf
from datafiles import CIFAR_TEST, CIFAR_TRAIN, cifar_ids, mnist_ids, write_cifar, write_mnist

import hvdkit
from hvdkit.data import Cifar10Dataset, Cifar10Reader, MnistDataset, MnistReader, shard_indices


@pytest.fixture
def mnist_dir(tmp_path):
    write_mnist(tmp_path, "train", n=11)
    write_mnist(tmp_path, "t10k", n=4, first_id=100)
    return tmp_path


@pytest.fixture
def cifar_dir(tmp_path):
    root = tmp_path / "cifar-10-batches-bin"
    for f, name in enumerate(CIFAR_TRAIN):
        write_cifar(root / name, n=3, first_id=10 * f)  # ids 0-2, 10-12, ..., 40-42
    write_cifar(root / CIFAR_TEST, n=2, first_id=90)
    return tmp_path


def collect(ds):
    images, labels = zip(*ds.as_numpy_iterator(), strict=True)
    return np.stack(images), np.array(labels)


def test_mnist_values_shapes_dtypes(mnist_dir):
    images, labels = write_mnist(mnist_dir, "train", n=11)  # same content, returned
    reader = MnistReader(mnist_dir)
    assert len(reader) == 11
    assert reader.element_spec == (
        tf.TensorSpec([28, 28, 1], tf.uint8),
        tf.TensorSpec([], tf.int32),
    )
    got_images, got_labels = reader.read([10, 0, 10])
    assert got_images.shape == (3, 28, 28, 1) and got_images.dtype == np.uint8
    assert got_labels.dtype == np.int32 and got_labels.tolist() == labels[[10, 0, 10]].tolist()
    np.testing.assert_array_equal(got_images[..., 0], images[[10, 0, 10]])

    ds = MnistDataset(mnist_dir, num_shards=1, shard_id=0)
    assert ds.element_spec == reader.element_spec and int(ds.cardinality()) == 11
    all_images, all_labels = collect(ds)
    np.testing.assert_array_equal(all_images[..., 0], images)
    assert all_labels.tolist() == labels.tolist()


def test_mnist_usage_num_samples_and_shards(mnist_dir):
    assert len(MnistReader(mnist_dir, "test")) == 4
    both = MnistReader(mnist_dir, "all")
    assert len(both) == 15
    assert mnist_ids(both.read([10, 11, 14])[0]).tolist() == [10, 100, 103]
    assert len(MnistReader(mnist_dir, "all", num_samples=12)) == 12
    for mode in ("pad", "drop", "uneven"):
        for r in range(3):
            ds = MnistDataset(
                mnist_dir, "all", num_samples=13, num_shards=3, shard_id=r, shuffle=True,
                seed=4, epoch=2, mode=mode,
            )  # fmt: skip
            idx = shard_indices(13, 3, r, shuffle=True, seed=4, epoch=2, mode=mode)
            ids = mnist_ids(collect(ds)[0]).tolist()
            assert ids == [i if i < 11 else 100 + i - 11 for i in idx.tolist()]


def test_cifar_values_shapes_dtypes_and_channel_order(cifar_dir):
    first, first_labels = write_cifar(cifar_dir / "cifar-10-batches-bin" / CIFAR_TRAIN[0], n=3)
    reader = Cifar10Reader(cifar_dir)  # the parent of cifar-10-batches-bin works too
    assert len(reader) == 15 and len(Cifar10Reader(cifar_dir / "cifar-10-batches-bin")) == 15
    images, labels = reader.read([2, 0])
    assert images.shape == (2, 32, 32, 3) and images.dtype == np.uint8 and images.flags.c_contiguous
    np.testing.assert_array_equal(images, first[[2, 0]])
    assert labels.dtype == np.int32 and labels.tolist() == first_labels[[2, 0]].tolist()
    # HWC from the stored R, G, B planes: pixel (row 1, col 2) of channel c is plane byte 32 + 2
    raw = np.frombuffer(
        (cifar_dir / "cifar-10-batches-bin" / CIFAR_TRAIN[0]).read_bytes(), np.uint8
    )
    assert [images[1, 1, 2, c] for c in range(3)] == [raw[1 + c * 1024 + 34] for c in range(3)]
    assert cifar_ids(reader.read(np.arange(15))[0]).tolist() == [
        10 * f + i for f in range(5) for i in range(3)
    ]
    assert cifar_ids(Cifar10Reader(cifar_dir, "test").read([1, 0])[0]).tolist() == [91, 90]
    assert len(Cifar10Reader(cifar_dir, "all")) == 17


def test_cifar_dataset_shards_across_files(cifar_dir):
    seen = []
    for r in range(2):
        ds = Cifar10Dataset(cifar_dir, num_shards=2, shard_id=r, shuffle=True, seed=1)
        assert ds.element_spec[0] == tf.TensorSpec([32, 32, 3], tf.uint8)
        images, labels = collect(ds)
        idx = shard_indices(15, 2, r, shuffle=True, seed=1)
        want = [10 * (i // 3) + i % 3 for i in idx.tolist()]
        assert cifar_ids(images).tolist() == want and labels.tolist() == [w % 10 for w in want]
        seen += want
    assert len(seen) == 16 and set(seen) == {10 * f + i for f in range(5) for i in range(3)}


def test_reader_reads_only_the_requested_records(mnist_dir, monkeypatch):
    calls = []
    real = os.preadv

    def spy(fd, buffers, offset):
        calls.append((sum(len(b) for b in buffers), offset))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", spy)
    MnistReader(mnist_dir).read([3, 4, 9, 3])  # records 3-4 are one run, 9 another
    assert calls == [(2 * 784, 16 + 3 * 784), (784, 16 + 9 * 784), (2, 8 + 3), (1, 8 + 9)]


def test_truncated_and_missing_files_name_the_file_and_expected_size(mnist_dir, cifar_dir):
    images = mnist_dir / "train-images-idx3-ubyte"
    data = images.read_bytes()
    images.write_bytes(data[:-100])
    expected = 16 + 11 * 784
    with pytest.raises(hvdkit.DataFormatError) as info:
        MnistReader(mnist_dir)
    msg = str(info.value)
    assert str(images) in msg and "is truncated" in msg
    assert f"expected {expected} bytes" in msg and f"found {expected - 100}" in msg
    images.write_bytes(data + b"xx")
    with pytest.raises(hvdkit.DataFormatError, match="has 2 extra bytes"):
        MnistReader(mnist_dir)
    images.write_bytes(struct.pack(">I", 2049) + data[4:])
    with pytest.raises(
        hvdkit.DataFormatError, match=r"magic number 0x00000801, expected 0x00000803"
    ):
        MnistReader(mnist_dir)
    images.write_bytes(data)
    (mnist_dir / "t10k-labels-idx1-ubyte").rename(mnist_dir / "t10k-labels-idx1-ubyte.gz")
    with pytest.raises(
        hvdkit.DataFormatError, match=r"t10k-labels-idx1-ubyte does not exist.*gunzip"
    ):
        MnistReader(mnist_dir, "test")
    write_mnist(mnist_dir, "t10k", n=3)
    (mnist_dir / "t10k-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, 2) + b"\0\0")
    with pytest.raises(hvdkit.DataFormatError, match=r"holds 3 images but .* holds 2 labels"):
        MnistReader(mnist_dir, "test")

    batch = cifar_dir / "cifar-10-batches-bin" / CIFAR_TRAIN[3]
    batch.write_bytes(batch.read_bytes()[:-10])
    with pytest.raises(hvdkit.DataFormatError) as info:
        Cifar10Reader(cifar_dir)
    msg = str(info.value)
    assert str(batch) in msg and "9209 bytes" in msg and "Expected 9219 bytes for 3 records" in msg
    batch.unlink()
    with pytest.raises(hvdkit.DataFormatError, match=r"data_batch_4.bin does not exist"):
        Cifar10Reader(cifar_dir)
    assert isinstance(info.value, ValueError)


def test_bad_arguments(mnist_dir, cifar_dir):
    with pytest.raises(hvdkit.ConfigurationError, match=r"usage='valid' is not one of"):
        MnistReader(mnist_dir, "valid")
    with pytest.raises(hvdkit.ConfigurationError, match=r"num_samples=12 but .* holds 11 records"):
        MnistReader(mnist_dir, num_samples=12)
    with pytest.raises(hvdkit.ShardingError, match=r"index 11 is outside"):
        MnistReader(mnist_dir).read([11])
    with pytest.raises(hvdkit.ShardingError, match="shard_id=2 is outside"):
        MnistDataset(mnist_dir, num_shards=2, shard_id=2)
    bad = cifar_dir / "cifar-10-batches-bin" / CIFAR_TEST
    data = bytearray(bad.read_bytes())
    data[3073] = 57  # label byte of record 1
    bad.write_bytes(bytes(data))
    with pytest.raises(
        hvdkit.DataFormatError, match=r"record 1 of .*test_batch.bin has label byte 57"
    ):
        Cifar10Reader(cifar_dir, "test").read([0, 1])


def test_without_num_shards_every_record_is_read_as_in_mindspore(mnist_dir, cifar_dir, recwarn):
    # MindSpore's MnistDataset(path) / Cifar10Dataset(path) read everything: no sharding
    # unless asked, whatever the job; no hvdkit.init() needed for that.
    hvdkit.shutdown()
    assert mnist_ids(collect(MnistDataset(mnist_dir))[0]).tolist() == list(range(11))
    want = [10 * f + i for f in range(5) for i in range(3)]
    assert cifar_ids(collect(Cifar10Dataset(cifar_dir))[0]).tolist() == want
    assert not [w for w in recwarn if issubclass(w.category, hvdkit.data.ShardingWarning)]


def test_num_shards_auto_follows_the_job(mnist_dir, local_runtime):
    # size 1 here: "auto" is shard 0 of 1; the 2-rank split is in tests/test_sharding_mp.py
    ds = MnistDataset(mnist_dir, num_shards="auto", shard_id="auto")
    assert mnist_ids(collect(ds)[0]).tolist() == list(range(11))
    with pytest.raises(hvdkit.ShardingError, match=r"num_shards='auto' with shard_id=1"):
        MnistDataset(mnist_dir, num_shards="auto", shard_id=1)
    with pytest.raises(hvdkit.ShardingError, match=r"shard_id='auto' with num_shards=2"):
        MnistDataset(mnist_dir, num_shards=2, shard_id="auto")
    with pytest.raises(hvdkit.ShardingError, match="give both or neither"):
        MnistDataset(mnist_dir, num_shards=2)


def test_num_shards_auto_needs_init(mnist_dir):
    hvdkit.shutdown()
    with pytest.raises(hvdkit.NotInitializedError, match="hvdkit.init"):
        MnistDataset(mnist_dir, num_shards="auto")

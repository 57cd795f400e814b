"""MNIST IDX and CIFAR-10 binary readers on tiny files written in the exact formats.

The fixtures hold both splits: MNIST train ids 0-10 and test ids 100-103 (15
records; index i < 11 is id i, index 11 + j is id 100 + j); CIFAR-10 train
ids 0-2, 10-12, ..., 40-42 (index 3f + i is id 10f + i) and test ids 90, 91.
"""

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


MNIST_IDS = list(range(11)) + [100, 101, 102, 103]  # stored order: train, then test


def collect(ds):
    images, labels = zip(*ds.as_numpy_iterator(), strict=True)
    return np.stack(images), np.array(labels)


def mnist_id(indices) -> np.ndarray:
    """Ids of the mnist_dir fixture's records at ``indices`` (train 0-10, then test 100-103)."""
    return np.asarray(MNIST_IDS)[np.asarray(indices)]


def ids_of(ds) -> list[int]:
    """The ids of one pass over ``ds`` (a new iterator), in reading order."""
    return mnist_ids(collect(ds)[0]).tolist()


def test_mnist_values_shapes_dtypes(mnist_dir):
    images, labels = write_mnist(mnist_dir, "train", n=11)  # same content, returned
    reader = MnistReader(mnist_dir, "train")
    assert len(reader) == 11 and reader.splits == ("train",)
    assert reader.element_spec == (
        tf.TensorSpec([28, 28, 1], tf.uint8),
        tf.TensorSpec([], tf.int32),
    )
    got_images, got_labels = reader.read([10, 0, 10])
    assert got_images.shape == (3, 28, 28, 1) and got_images.dtype == np.uint8
    assert got_labels.dtype == np.int32 and got_labels.tolist() == labels[[10, 0, 10]].tolist()
    np.testing.assert_array_equal(got_images[..., 0], images[[10, 0, 10]])

    ds = MnistDataset(mnist_dir, "train", num_shards=1, shard_id=0, shuffle=False)
    assert ds.element_spec == reader.element_spec and int(ds.cardinality()) == 11
    all_images, all_labels = collect(ds)
    np.testing.assert_array_equal(all_images[..., 0], images)
    assert all_labels.tolist() == labels.tolist()


def test_mnist_usage_num_samples_and_shards(mnist_dir):
    assert len(MnistReader(mnist_dir, "test")) == 4
    both = MnistReader(mnist_dir, "all")
    assert len(both) == 15
    assert mnist_ids(both.read([10, 11, 14])[0]).tolist() == [10, 100, 103]
    # the readers' num_samples keeps the first records of the files
    assert len(MnistReader(mnist_dir, "all", num_samples=12)) == 12
    # the datasets' caps each shard's order after shuffling (see test_num_samples_*)
    for mode in ("pad", "drop", "uneven"):
        for r in range(3):
            ds = MnistDataset(
                mnist_dir, "all", num_samples=4, num_shards=3, shard_id=r, shuffle=True,
                seed=4, epoch=2, mode=mode,
            )  # fmt: skip
            idx = shard_indices(15, 3, r, shuffle=True, seed=4, epoch=2, mode=mode)[:4]
            assert mnist_ids(collect(ds)[0]).tolist() == mnist_id(idx).tolist()


def test_cifar_values_shapes_dtypes_and_channel_order(cifar_dir):
    first, first_labels = write_cifar(cifar_dir / "cifar-10-batches-bin" / CIFAR_TRAIN[0], n=3)
    reader = Cifar10Reader(cifar_dir, "train")  # the parent of cifar-10-batches-bin works too
    assert len(reader) == 15 and len(Cifar10Reader(cifar_dir / "cifar-10-batches-bin")) == 17
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
    both = Cifar10Reader(cifar_dir)  # usage=None: every split present, train then test
    assert both.splits == ("train", "test")
    assert cifar_ids(both.read([14, 15, 16])[0]).tolist() == [42, 90, 91]


def test_cifar_dataset_shards_across_files(cifar_dir):
    seen = []
    for r in range(2):
        ds = Cifar10Dataset(cifar_dir, "train", num_shards=2, shard_id=r, shuffle=True, seed=1)
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
        MnistReader(mnist_dir, "train", num_samples=12)
    with pytest.raises(hvdkit.ShardingError, match=r"index 11 is outside"):
        MnistReader(mnist_dir, "train").read([11])
    with pytest.raises(hvdkit.ShardingError, match=r"index 15 is outside"):
        MnistReader(mnist_dir).read([15])
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
    got = mnist_ids(collect(MnistDataset(mnist_dir, shuffle=False))[0]).tolist()
    assert got == MNIST_IDS  # shuffle=False: stored order, train then test
    want = [10 * f + i for f in range(5) for i in range(3)] + [90, 91]
    assert cifar_ids(collect(Cifar10Dataset(cifar_dir, shuffle=False))[0]).tolist() == want
    assert sorted(cifar_ids(collect(Cifar10Dataset(cifar_dir))[0]).tolist()) == sorted(want)
    assert not [w for w in recwarn if issubclass(w.category, hvdkit.data.ShardingWarning)]


def test_num_shards_auto_follows_the_job(mnist_dir, local_runtime):
    # size 1 here: "auto" is shard 0 of 1; the 2-rank split is in tests/test_sharding_mp.py
    ds = MnistDataset(mnist_dir, num_shards="auto", shard_id="auto", shuffle=False)
    assert mnist_ids(collect(ds)[0]).tolist() == MNIST_IDS
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


# ------------------------------------------------------- MindSpore's defaults and passes
def perm(epoch: int, n: int = 15, seed: int = 0) -> np.ndarray:
    """The documented shuffled order of one epoch (docs/sharding.md)."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def test_default_reads_every_split_once_in_a_shuffled_order(mnist_dir):
    # (a) MnistDataset(dir) as MindSpore: both splits, every record once, shuffled
    ds = MnistDataset(mnist_dir)
    assert len(ds) == 15 and int(ds.cardinality()) == 15
    assert ds.element_spec == (tf.TensorSpec([28, 28, 1], tf.uint8), tf.TensorSpec([], tf.int32))
    got = ids_of(ds)
    assert sorted(got) == MNIST_IDS and got != MNIST_IDS
    assert got == mnist_id(perm(0)).tolist()  # epoch 0's order, as shuffle=True gave before
    images, labels = collect(MnistDataset(mnist_dir))
    assert images.shape == (15, 28, 28, 1) and images.dtype == np.uint8
    assert labels.dtype == np.int32 and labels.tolist() == [i * 7 % 10 for i in got]


def test_each_pass_reads_the_next_epochs_order(mnist_dir):
    # (b) every pass is a permutation of the same records; pass k has epoch + k's order
    ds = MnistDataset(mnist_dir, seed=3, epoch=2)
    passes = [ids_of(ds) for _ in range(3)]
    assert passes == [mnist_id(perm(2 + k, seed=3)).tolist() for k in range(3)]
    assert passes[0] != passes[1] != passes[2] != passes[0]
    assert all(sorted(p) == MNIST_IDS for p in passes)
    # shuffle=None and shuffle=True mean the same
    assert ids_of(MnistDataset(mnist_dir, shuffle=True, seed=3, epoch=2)) == passes[0]
    # a dataset built with epoch=e and read once gives epoch e's order (the old loop)
    for e in range(3):
        once = ids_of(MnistDataset(mnist_dir, seed=3, epoch=e))
        assert once == mnist_id(perm(e, seed=3)).tolist()
    # ds.repeat(): each repetition is a pass too
    fresh = MnistDataset(mnist_dir, seed=3, epoch=2)
    assert ids_of(fresh.repeat(2)) == passes[0] + passes[1]
    assert ids_of(fresh) == passes[2]


def test_shards_of_every_pass_are_disjoint_and_cover_everything(mnist_dir):
    # (c) the same pass on both ranks: shards disjoint, together every record
    for mode, sizes in (("pad", [8, 8]), ("drop", [7, 7]), ("uneven", [8, 7])):
        shards = [MnistDataset(mnist_dir, num_shards=2, shard_id=r, mode=mode) for r in range(2)]
        assert [len(s) for s in shards] == sizes
        for k in range(3):
            got = [ids_of(s) for s in shards]
            order = mnist_id(perm(k)).tolist()
            # positions r, r + 2, ...; pad wraps position 15 to 0, drop skips position 14
            assert got == [order[0::2][: sizes[0]], (order[1::2] + order[:1])[: sizes[1]]]
            if mode == "drop":
                assert not set(got[0]) & set(got[1])
                assert set(got[0]) | set(got[1]) == set(MNIST_IDS) - {order[-1]}
            else:
                assert set(got[0]).isdisjoint(got[1][:7])  # pad: rank 1's 8th is order[0]
                assert set(got[0]) | set(got[1]) == set(MNIST_IDS)


def test_num_samples_caps_each_shard_after_shuffling(mnist_dir):
    # (d) num_samples=3 with 2 shards: 3 records on each shard, the first 3 of its pass
    shards = [MnistDataset(mnist_dir, num_samples=3, num_shards=2, shard_id=r) for r in range(2)]
    assert [len(s) for s in shards] == [3, 3]
    for k in range(2):
        order = mnist_id(perm(k)).tolist()
        assert [ids_of(s) for s in shards] == [order[0::2][:3], order[1::2][:3]]
    # more than a shard holds: the whole shard (MindSpore: "maximum"); pad keeps equal sizes
    for cap in (8, 100):
        big = [MnistDataset(mnist_dir, num_samples=cap, num_shards=2, shard_id=r) for r in range(2)]
        assert [len(s) for s in big] == [8, 8]
        assert set(ids_of(big[0])) | set(ids_of(big[1])) == set(MNIST_IDS)
    uneven = [
        MnistDataset(mnist_dir, num_samples=100, num_shards=2, shard_id=r, mode="uneven")
        for r in range(2)
    ]
    assert [len(s) for s in uneven] == [8, 7]
    # without num_shards the cap applies to the whole order; unshuffled, its start
    assert ids_of(MnistDataset(mnist_dir, num_samples=4)) == mnist_id(perm(0)[:4]).tolist()
    assert ids_of(MnistDataset(mnist_dir, num_samples=4, shuffle=False)) == [0, 1, 2, 3]
    assert len(MnistDataset(mnist_dir, num_samples=100)) == 15
    for bad in (0, -1, True, 2.0, "3"):
        with pytest.raises(hvdkit.ConfigurationError, match=rf"num_samples={bad!r} is not an int"):
            MnistDataset(mnist_dir, num_samples=bad)


def test_shuffle_false_keeps_the_stored_order_in_every_pass(mnist_dir, cifar_dir):
    # (e) as before this change: shard() of the reader, the same list in every pass
    for r in range(2):
        ds = MnistDataset(mnist_dir, "train", num_shards=2, shard_id=r, shuffle=False)
        before = hvdkit.data.shard(MnistReader(mnist_dir, "train"), 2, r)
        want = [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 0]][r]
        assert ids_of(ds) == ids_of(ds) == ids_of(before) == want
    ds = MnistDataset(mnist_dir, shuffle=False)
    assert ids_of(ds) == ids_of(ds) == MNIST_IDS
    cifar = Cifar10Dataset(cifar_dir, "test", shuffle=False)
    assert cifar_ids(collect(cifar)[0]).tolist() == [90, 91]
    for bad in ("False", 0, 1, "none"):
        with pytest.raises(hvdkit.ConfigurationError, match=rf"shuffle={bad!r} is not True"):
            MnistDataset(mnist_dir, shuffle=bad)
    assert ids_of(MnistDataset(mnist_dir, shuffle=np.bool_(False))) == MNIST_IDS


def test_usage_none_reads_the_splits_present(tmp_path):
    # (f) a directory with the train files only (MindSpore's MNIST_Data/train): train only
    train_only = tmp_path / "train"
    write_mnist(train_only, "train", n=11)
    for usage in (None, "all"):  # MindSpore's 'all' also reads whatever splits are there
        assert MnistReader(train_only, usage).splits == ("train",)
        ds = MnistDataset(train_only, usage)
        assert len(ds) == 11 and sorted(ids_of(ds)) == list(range(11))
    with pytest.raises(hvdkit.DataFormatError, match=r"t10k-images-idx3-ubyte does not exist"):
        MnistDataset(train_only, "test")
    test_only = tmp_path / "test"
    write_mnist(test_only, "t10k", n=4, first_id=100)
    assert sorted(ids_of(MnistDataset(test_only))) == [100, 101, 102, 103]
    cifar = tmp_path / "cifar"
    write_cifar(cifar / CIFAR_TEST, n=2, first_id=90)
    assert Cifar10Reader(cifar).splits == ("test",)
    assert sorted(cifar_ids(collect(Cifar10Dataset(cifar))[0]).tolist()) == [90, 91]
    # a split is there when any of its files is: the others must be too
    write_cifar(cifar / CIFAR_TRAIN[0], n=3)
    with pytest.raises(hvdkit.DataFormatError, match=r"data_batch_2.bin does not exist"):
        Cifar10Reader(cifar)
    # a gzip-only split counts as there, so the error says to gunzip it
    gz = tmp_path / "gz"
    write_mnist(gz, "train", n=3)
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"):
        (gz / name).rename(gz / f"{name}.gz")
    with pytest.raises(hvdkit.DataFormatError, match=r"gunzip"):
        MnistDataset(gz)


def test_no_split_present_names_the_files_looked_for(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(hvdkit.DataFormatError) as info:
        MnistDataset(tmp_path / "empty")
    msg = str(info.value)
    assert "usage=None reads every MNIST split present" in msg and "holds none of them" in msg
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte"):
        assert name in msg
    with pytest.raises(hvdkit.DataFormatError, match=r"usage='all' .* is not a directory"):
        Cifar10Dataset(tmp_path / "missing", "all")
    with pytest.raises(hvdkit.DataFormatError, match=r"data_batch_1.bin, .* test_batch.bin"):
        Cifar10Reader(tmp_path / "empty")
    with pytest.raises(hvdkit.ConfigurationError, match=r"usage='valid' is not one of .* or None"):
        MnistDataset(tmp_path / "empty", "valid")


def test_keras_fit_reshuffles_every_epoch(mnist_dir):
    # Keras makes a new iterator per epoch: epoch k of fit reads pass k
    import keras

    seen = []

    def record(images, labels):
        def note(ids):
            seen.extend(ids.numpy().tolist())
            return ids

        pixels = tf.cast(images[:, 0, :2, 0], tf.int64)  # the first two pixels hold the id
        ids = tf.py_function(note, [pixels[:, 0] * 256 + pixels[:, 1]], tf.int64)
        return tf.cast(tf.reshape(ids, [-1, 1]), tf.float32), tf.cast(labels, tf.float32)

    data = MnistDataset(mnist_dir, seed=5).batch(4).map(record)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(data, epochs=3, verbose=0, shuffle=False)  # Keras's shuffle: n/a to datasets
    assert len(seen) == 45
    assert [seen[15 * k : 15 * (k + 1)] for k in range(3)] == [
        mnist_id(perm(k, seed=5)).tolist() for k in range(3)
    ]

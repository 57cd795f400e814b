"""Sharding index math, ShardSampler and shard(), in one process, looping over every rank."""

import collections
import json
import math
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from datafiles import record_id, write_tfrecords
from hypothesis import given, settings
from hypothesis import strategies as st

import hvdkit
from hvdkit.data import (
    ShardingWarning,
    ShardPositionCallback,
    ShardSampler,
    shard,
    shard_indices,
    shard_weights,
)

PROPS = settings(max_examples=150, deadline=None)
sizes = st.integers(1, 300)
shards = st.integers(1, 12)
seeds = st.integers(0, 2**32 - 1)
epochs = st.integers(0, 1000)


def all_shards(n, s, **kw):
    return [shard_indices(n, s, r, **kw) for r in range(s)]


def order(n, shuffle, seed, epoch):
    """The list shards read from: 0..n-1, or the (seed, epoch) permutation."""
    return shard_indices(n, 1, 0, shuffle=shuffle, seed=seed, epoch=epoch, mode="uneven")


# --------------------------------------------------------------------------- properties
@PROPS
@given(n=sizes, s=shards, seed=seeds, epoch=epochs, shuffle=st.booleans())
def test_pad_equal_sizes_covers_all_and_repeats_only_wrapped(n, s, seed, epoch, shuffle):
    parts = all_shards(n, s, shuffle=shuffle, seed=seed, epoch=epoch, mode="pad")
    per = math.ceil(n / s)
    assert [len(p) for p in parts] == [per] * s
    assert all(p.dtype == np.int64 for p in parts)
    assert all(len(set(p.tolist())) == len(p) for p in parts)  # no repeats inside a shard
    seen = collections.Counter(np.concatenate(parts).tolist())
    assert set(seen) == set(range(n))  # every index at least once
    lst = order(n, shuffle, seed, epoch)
    wrapped = lst[np.arange(n, per * s) % n]  # positions past the end of the list
    assert sum(seen.values()) - n == len(wrapped)
    assert {i for i, c in seen.items() if c > 1} <= set(wrapped.tolist())
    assert seen == collections.Counter(lst.tolist() + wrapped.tolist())


@PROPS
@given(n=sizes, s=shards, seed=seeds, epoch=epochs, shuffle=st.booleans())
def test_drop_equal_sizes_disjoint_and_drops_only_the_tail(n, s, seed, epoch, shuffle):
    if n < s:
        with pytest.raises(hvdkit.ShardingError):
            shard_indices(n, s, 0, mode="drop")
        return
    parts = all_shards(n, s, shuffle=shuffle, seed=seed, epoch=epoch, mode="drop")
    assert [len(p) for p in parts] == [n // s] * s
    union = np.concatenate(parts)
    assert len(set(union.tolist())) == len(union)  # disjoint
    lst = order(n, shuffle, seed, epoch)
    assert set(union.tolist()) == set(lst[: (n // s) * s].tolist())


@PROPS
@given(n=sizes, s=shards, seed=seeds, epoch=epochs, shuffle=st.booleans())
def test_uneven_is_an_exact_disjoint_cover_with_sizes_within_one(n, s, seed, epoch, shuffle):
    parts = all_shards(n, s, shuffle=shuffle, seed=seed, epoch=epoch, mode="uneven")
    lengths = [len(p) for p in parts]
    assert max(lengths) - min(lengths) <= 1 and sum(lengths) == n
    assert sorted(np.concatenate(parts).tolist()) == list(range(n))


@PROPS
@given(n=st.integers(20, 300), s=shards, seed=seeds, epoch=epochs)
def test_same_seed_and_epoch_same_permutation_other_epoch_differs(n, s, seed, epoch):
    perm = order(n, True, seed, epoch)
    assert sorted(perm.tolist()) == list(range(n))
    np.testing.assert_array_equal(perm, np.random.default_rng([seed, epoch]).permutation(n))
    for r in range(s):  # every rank, computing alone, agrees
        a = shard_indices(n, s, r, shuffle=True, seed=seed, epoch=epoch)
        np.testing.assert_array_equal(
            a, shard_indices(n, s, r, shuffle=True, seed=seed, epoch=epoch)
        )
        np.testing.assert_array_equal(a, perm[(r + s * np.arange(len(a))) % n])
    assert not np.array_equal(perm, order(n, True, seed, epoch + 1))
    assert not np.array_equal(perm, order(n, True, seed + 1, epoch))


@PROPS
@given(
    n=sizes, s=shards, seed=seeds, mode=st.sampled_from(["pad", "drop", "uneven"]), data=st.data()
)
def test_sampler_resume_neither_repeats_nor_skips(n, s, seed, mode, data):
    if mode == "drop" and n < s:
        return
    r = data.draw(st.integers(0, s - 1))
    a = ShardSampler(n, s, r, shuffle=True, seed=seed, mode=mode)
    a.set_epoch(data.draw(st.integers(0, 50)))
    full = a.indices()
    k = data.draw(st.integers(0, len(a)))
    a.advance(k)
    b = ShardSampler(n, s, r, shuffle=True, seed=seed, mode=mode)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert (b.epoch, b.position) == (a.epoch, k)
    np.testing.assert_array_equal(np.concatenate([full[:k], b.indices()]), full)


@PROPS
@given(n=sizes, s=shards, s2=shards, seed=seeds, data=st.data())
def test_masked_padding_trains_every_sample_once_through_a_change_of_size(n, s, s2, seed, data):
    """Pad mode with its repeats weighed 0: S ranks read k samples each, the job goes
    on with S' ranks from the saved state; the ids of weight 1 are the epoch's samples,
    each exactly once, and every rank of each world reads as many as the others."""
    epoch = data.draw(st.integers(0, 50))
    first = [ShardSampler(n, s, r, shuffle=True, seed=seed) for r in range(s)]
    k = data.draw(st.integers(0, len(first[0])))
    trained = collections.Counter()
    for sampler in first:
        sampler.set_epoch(epoch)
        ids, weights = sampler.indices()[:k], sampler.weights()[:k]
        trained.update(ids[weights == 1].tolist())
        sampler.advance(k)
    state = json.loads(json.dumps(first[0].state_dict()))
    second = [ShardSampler(n, s2, r, shuffle=True, seed=seed) for r in range(s2)]
    lengths = set()
    for sampler in second:
        sampler.load_state_dict(state)
        ids, weights = sampler.indices(), sampler.weights()
        assert ids.shape == weights.shape
        assert set(weights.tolist()) <= {0.0, 1.0}
        trained.update(ids[weights == 1].tolist())
        lengths.add(len(ids))
    assert trained == collections.Counter(range(n))
    assert len(lengths) == 1  # as many steps on every rank


@PROPS
@given(n=sizes, s=shards, s2=shards, seed=seeds, data=st.data())
def test_reshard_shares_out_the_rest_of_the_epoch_as_a_resume_on_new_shards_does(
    n, s, s2, seed, data
):
    """reshard(S', r') mid-epoch: the S' shards read the epoch's list from the cursor
    on, every position once (pad mode's repeats weighed 0), the same indices as a
    sampler of S' shards loading the saved state; on S' == S only the id changes."""
    epoch = data.draw(st.integers(0, 50))
    a = ShardSampler(n, s, 0, shuffle=True, seed=seed)
    a.set_epoch(epoch)
    k = data.draw(st.integers(0, len(a)))
    a.advance(k)
    cursor, state = a.cursor, json.loads(json.dumps(a.state_dict()))
    rest = collections.Counter()
    for r2 in range(s2):
        moved = ShardSampler(n, s, 0, shuffle=True, seed=seed)
        moved.load_state_dict(state)
        moved.reshard(s2, r2)
        loaded = ShardSampler(n, s2, r2, shuffle=True, seed=seed)
        loaded.load_state_dict(state)
        assert (moved.num_shards, moved.shard_id, moved.epoch) == (s2, r2, epoch)
        assert (moved.start, moved.position) == (loaded.start, loaded.position)
        np.testing.assert_array_equal(moved.indices(), loaded.indices())
        ids = moved.indices()
        rest.update(ids[moved.weights() == 1].tolist())
        if s2 != s:
            assert (moved.start, moved.position, moved.cursor) == (cursor, 0, cursor)
    if s2 != s:
        assert rest == collections.Counter(order(n, True, seed, epoch)[cursor:].tolist())


def test_reshard_defaults_to_the_job_and_names_a_bad_shard():
    s = ShardSampler(12, 2, 0)
    s.advance(3)
    s.reshard(3, 1)
    assert (s.start, s.position, len(s)) == (6, 0, 2)
    np.testing.assert_array_equal(s.indices(), [7, 10])
    with pytest.raises(
        hvdkit.errors.ShardingError, match=r"shard_id=3 is outside \[0, num_shards=3\)"
    ):
        s.reshard(3, 3)
    assert (s.num_shards, s.shard_id) == (3, 1)  # a refused reshard changes nothing
    with pytest.raises(hvdkit.errors.NotInitializedError, match=r"pass num_shards=1, shard_id=0"):
        s.reshard()  # the job's size and rank, but hvdkit.init() was not called
    s.reshard(1, 0)
    assert (s.num_shards, s.shard_id, s.start, s.position) == (1, 0, 6, 0)
    np.testing.assert_array_equal(s.indices(), np.arange(6, 12))


@given(n=sizes, s=shards, start=st.data(), mode=st.sampled_from(["drop", "uneven"]))
def test_only_pad_mode_has_weights_of_zero(n, s, start, mode):
    if mode == "drop" and n < s:
        return
    begin = start.draw(st.integers(0, n))
    for r in range(s):
        weights = shard_weights(n, s, r, mode=mode, start=begin)
        assert weights.dtype == np.float32
        assert weights.shape == shard_indices(n, s, r, mode=mode, start=begin).shape
        assert np.all(weights == 1.0)


def test_masked_dataset_gives_keras_a_sample_weight_and_refuses_other_elements():
    sampler = ShardSampler(10, 3, 2)  # reads 2, 5, 8 and the repeat 1
    x, y = np.arange(10, dtype="float32") * 10, np.arange(10)
    got = list(sampler.dataset((x, y), mask_padding=True).as_numpy_iterator())
    assert [(float(a), int(b), float(w)) for a, b, w in got] == [
        (20.0, 2, 1.0),
        (50.0, 5, 1.0),
        (80.0, 8, 1.0),
        (10.0, 1, 0.0),
    ]
    sampler.advance(3)
    assert [tuple(e) for e in sampler.dataset((x, y), mask_padding=True).as_numpy_iterator()] == [
        (10.0, 1, 0.0)
    ]
    with pytest.raises(hvdkit.errors.ShardingError, match=r"mask_padding=True .* \(x, y\) pairs"):
        sampler.dataset(x, mask_padding=True)


# --------------------------------------------------------------------------- hand cases
def test_ten_samples_three_shards_by_hand():
    assert [p.tolist() for p in all_shards(10, 3)] == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]
    drop = [p.tolist() for p in all_shards(10, 3, mode="drop")]
    assert drop == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    uneven = [p.tolist() for p in all_shards(10, 3, mode="uneven")]
    assert uneven == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    # more shards than samples: pad repeats the list; uneven leaves shards empty
    assert [p.tolist() for p in all_shards(2, 5)] == [[0], [1], [0], [1], [0]]
    assert [len(p) for p in all_shards(2, 5, mode="uneven")] == [1, 1, 0, 0, 0]


def test_shuffled_pad_wraps_to_the_start_of_the_permutation():
    perm = np.random.default_rng([7, 3]).permutation(10)
    parts = all_shards(10, 3, shuffle=True, seed=7, epoch=3)
    assert parts[0].tolist() == perm[[0, 3, 6, 9]].tolist()
    assert parts[1].tolist() == perm[[1, 4, 7, 0]].tolist()
    assert parts[2].tolist() == perm[[2, 5, 8, 1]].tolist()


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "args, kwargs, pattern",
    [
        ((10, 3, 3), {}, r"shard_id=3 is outside \[0, num_shards=3\).*between 0 and 2"),
        ((10, 3, -1), {}, r"shard_id=-1 is outside"),
        ((10, 0, 0), {}, r"num_shards=0 must be at least 1.*hvdkit\.size\(\)"),
        ((2, 3, 0), {"mode": "drop"}, r"num_samples=2 and num_shards=3.*use mode='pad'"),
        ((0, 2, 0), {}, r"num_samples=0: the dataset is empty"),
        ((10, 2, 0), {"mode": "even"}, r"mode='even' is not one of"),
        ((10, 2, 0), {"seed": -1}, r"seed=-1 must be at least 0"),
        ((10, 2.0, 0), {}, r"num_shards=2\.0 is not an integer"),
        ((10, 2, True), {}, r"shard_id=True is not an integer"),
    ],
)
def test_bad_arguments_name_the_value_and_the_fix(args, kwargs, pattern):
    with pytest.raises(hvdkit.ShardingError, match=pattern) as info:
        shard_indices(*args, **kwargs)
    assert isinstance(info.value, ValueError)


def test_defaults_need_init_and_explicit_values_must_come_in_pairs():
    hvdkit.shutdown()
    with pytest.raises(hvdkit.NotInitializedError, match=r"num_shards=1, shard_id=0"):
        ShardSampler(10)
    with pytest.raises(hvdkit.ShardingError, match=r"num_shards=2 and shard_id=None: give both"):
        ShardSampler(10, num_shards=2)


@pytest.fixture
def job_of_one():
    hvdkit.shutdown()
    hvdkit.init(backend="local")  # runtime state is global: shut down afterwards
    yield
    hvdkit.shutdown()


def test_defaults_follow_the_job_and_disagreement_warns(job_of_one):
    s = ShardSampler(10)
    assert (s.num_shards, s.shard_id, len(s)) == (1, 0, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardSampler(10, 1, 0)  # agrees with the job: silent
    with pytest.warns(
        ShardingWarning, match=r"num_shards=2, shard_id=1 differ .* size 1 and rank 0"
    ):
        s = ShardSampler(10, 2, 1)
    assert s.indices().tolist() == [1, 3, 5, 7, 9]  # still honoured
    with pytest.warns(ShardingWarning, match="num_shards=3, shard_id=0"):
        ds = shard(np.arange(4), 3, 0)
    assert list(ds.as_numpy_iterator()) == [0, 3]


# --------------------------------------------------------------------------- sampler
def test_sampler_epochs_positions_and_state():
    s = ShardSampler(10, 3, 1, shuffle=True, seed=5)
    assert (len(s), s.epoch, s.position) == (4, 0, 0)
    s.set_epoch(2)
    full = s.indices()
    assert full.tolist() == shard_indices(10, 3, 1, shuffle=True, seed=5, epoch=2).tolist()
    s.advance(3)
    s.set_epoch(2)  # same epoch: the position is kept (resume-friendly loops)
    assert s.position == 3 and s.indices().tolist() == full[3:].tolist()
    with pytest.raises(hvdkit.ShardingError, match=r"advance\(2\) at position 3 passes the end"):
        s.advance(2)
    state = s.state_dict()
    assert state == {
        "version": 2,
        "epoch": 2,
        "position": 3,
        "start": 0,
        "cursor": 9,  # 3 samples on each of 3 shards: list positions 0..8
        "num_samples": 10,
        "num_shards": 3,
        "shuffle": True,
        "seed": 5,
        "mode": "pad",
    }
    s.set_epoch(3)
    assert s.position == 0 and len(s.indices()) == 4
    other = ShardSampler(10, 3, 2, shuffle=True, seed=6)
    with pytest.raises(hvdkit.ShardingError, match=r"seed: saved 5, here 6"):
        other.load_state_dict(state)
    with pytest.raises(hvdkit.ShardingError, match=r"missing \['position'\]"):
        s.load_state_dict({k: v for k, v in state.items() if k != "position"})


def test_sampler_dataset_reads_the_rest_of_the_epoch_from_arrays_and_datasets():
    x = np.arange(10) * 10
    s = ShardSampler(10, 3, 1, shuffle=True, seed=5)
    s.set_epoch(1)
    want = (x[s.indices()]).tolist()
    s.advance(1)
    got = s.dataset(x)
    assert int(got.cardinality()) == 3
    assert list(got.as_numpy_iterator()) == want[1:]
    ra = tf.data.Dataset.range(10).map(lambda v: v * 10)  # random access: same order
    assert list(s.dataset(ra).as_numpy_iterator()) == want[1:]
    seq = tf.data.Dataset.from_generator(
        lambda: iter(range(0, 100, 10)), output_signature=tf.TensorSpec([], tf.int64)
    ).apply(tf.data.experimental.assert_cardinality(10))
    rest = list(s.dataset(seq).as_numpy_iterator())  # stored order, one element skipped
    assert len(rest) == 3 and set(rest) < set(want)
    with pytest.raises(hvdkit.ShardingError, match=r"source has 9 samples .* num_samples=10"):
        s.dataset(x[:9])


@pytest.mark.parametrize("steps_per_execution, want", [(1, [5, 8, 10]), (2, [8, 10])])
def test_position_callback_follows_fit_batch_by_batch(steps_per_execution, want):
    x = np.random.default_rng(0).normal(size=(10, 3)).astype("float32")
    y = np.arange(10) % 2
    sampler = ShardSampler(10, 1, 0, shuffle=True, seed=1)
    positions = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: positions.append(sampler.position)
    )
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(
        "sgd",
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=steps_per_execution,
    )
    sampler.advance(2)  # resumed after 2 samples: 8 left, batches of 3
    cb = ShardPositionCallback(sampler, 3)
    fit = dict(verbose=0, shuffle=False, callbacks=[cb, record])
    model.fit(sampler.dataset((x, y)).batch(3), epochs=1, **fit)
    assert positions == want
    sampler.set_epoch(1)
    with pytest.raises(hvdkit.ConfigurationError, match=r"second epoch \(1\)"):
        model.fit(sampler.dataset((x, y)).batch(3), epochs=2, **fit)


# --------------------------------------------------------------------------- shard()
def test_shard_arrays_by_index_in_reading_order():
    x = np.arange(20).reshape(10, 2)
    for r in range(3):
        idx = shard_indices(10, 3, r, shuffle=True, seed=2, epoch=4)
        ds = shard({"x": x, "y": x[:, 0] * 3}, 3, r, shuffle=True, seed=2, epoch=4)
        got = list(ds.as_numpy_iterator())
        assert [e["x"].tolist() for e in got] == x[idx].tolist()
        assert [int(e["y"]) for e in got] == (x[idx, 0] * 3).tolist()
    with pytest.raises(hvdkit.ShardingError, match="share their first dimension"):
        shard((np.zeros(3), np.zeros(4)), 2, 0)


def test_random_access_dataset_decodes_only_its_own_elements():
    decoded = []

    def decode(i):
        decoded.append(int(i))
        return i * 10

    ds = tf.data.Dataset.range(12).map(lambda i: tf.py_function(decode, [i], tf.int64))
    for r in range(2):
        decoded.clear()
        got = [int(v) for v in shard(ds, 2, r, shuffle=True, seed=9)]
        want = shard_indices(12, 2, r, shuffle=True, seed=9)
        assert got == (want * 10).tolist()
        # element 0 is decoded once more, to probe for random access
        assert sorted(decoded) == sorted([*want.tolist(), 0])


def test_sequential_and_unknown_length_datasets():
    def seq(n):
        return tf.data.Dataset.range(n).filter(lambda v: True)  # no random access

    for r in range(3):
        want = shard_indices(10, 3, r, shuffle=True, seed=1)
        ds = shard(
            seq(10).apply(tf.data.experimental.assert_cardinality(10)), 3, r, shuffle=True, seed=1
        )
        assert int(ds.cardinality()) == 4
        assert [int(v) for v in ds] == sorted(want.tolist())  # stored order
        unknown = shard(seq(10), 3, r, mode="uneven")
        assert [int(v) for v in unknown] == list(range(r, 10, 3))
    with pytest.raises(
        hvdkit.ShardingError, match=r"length is unknown, but mode='pad'.*assert_card"
    ):
        shard(seq(10), 3, 0)
    with pytest.raises(hvdkit.ShardingError, match=r"mode='uneven' with shuffle=True"):
        shard(seq(10), 3, 0, mode="uneven", shuffle=True)
    with pytest.raises(hvdkit.ShardingError, match="the dataset is empty"):
        shard(tf.data.Dataset.range(0), 2, 0)


def read_ids(ds):
    return [record_id(r) for r in ds.as_numpy_iterator()]


COUNTS = [4, 3, 5, 2, 6]  # 20 records in 5 files of different sizes


@pytest.mark.parametrize("shuffle", [False, True])
def test_file_list_pad_opens_own_files_and_equalises_counts(tmp_path, shuffle):
    files = write_tfrecords(tmp_path, COUNTS)
    starts = np.cumsum([0, *COUNTS])
    got = {}
    for r in range(2):
        own = shard_indices(5, 2, r, shuffle=shuffle, seed=3, epoch=1)
        stream = [i for f in own for i in range(starts[f], starts[f + 1])]
        ds = shard(files, 2, r, shuffle=shuffle, seed=3, epoch=1)
        got[r] = read_ids(ds)
        assert int(ds.cardinality()) == len(got[r])
        # own files in order, then wrapping round its own stream
        assert got[r] == (stream * len(got[r]))[: len(got[r])]
    assert (
        len(got[0])
        == len(got[1])
        == max(
            sum(COUNTS[f] for f in shard_indices(5, 2, r, shuffle=shuffle, seed=3, epoch=1))
            for r in range(2)
        )
    )
    assert set(got[0]) | set(got[1]) == set(range(20))


def test_file_list_drop_uneven_and_known_counts(tmp_path):
    files = write_tfrecords(tmp_path, COUNTS)
    # files: rank 0 -> 0, 2 (9 records); rank 1 -> 1, 3 (5 records); file 4 dropped
    drop = [read_ids(shard(files, 2, r, mode="drop")) for r in range(2)]
    assert drop == [[0, 1, 2, 3, 7, 8, 9, 10, 11][:5], [4, 5, 6, 12, 13]]
    uneven = [read_ids(shard(files, 2, r, mode="uneven")) for r in range(2)]
    assert sorted(uneven[0] + uneven[1]) == list(range(20)) and len(uneven[0]) == 15
    counted = [read_ids(shard(files, 2, r, records_per_file=COUNTS)) for r in range(2)]
    assert counted == [read_ids(shard(files, 2, r)) for r in range(2)]
    with pytest.raises(hvdkit.ShardingError, match=r"records_per_file has 2 entries for 5 files"):
        shard(files, 2, 0, records_per_file=[1, 2])
    with pytest.raises(hvdkit.ShardingError, match=r"pass records_per_file=<int or list>"):
        shard(files, 2, 0, reader=tf.data.TFRecordDataset)
    with pytest.raises(hvdkit.ConfigurationError, match="list of file paths only"):
        shard(np.arange(4), 2, 0, records_per_file=3)


def test_fewer_files_than_shards_falls_back_to_elements_with_a_warning(tmp_path):
    files = write_tfrecords(tmp_path, [7])
    got = []
    for r in range(3):
        with pytest.warns(ShardingWarning, match=r"1 files for 3 shards.*element sharding"):
            got.append(read_ids(shard(files, 3, r)))
    assert got == [[0, 3, 6], [0, 1, 4], [1, 2, 5]]  # shard_indices(7, 3, r), stored order
    assert collections.Counter(sum(got, [])) == collections.Counter([*range(7), 0, 1])


def test_truncated_or_missing_tfrecord_names_the_file(tmp_path):
    (path,) = write_tfrecords(tmp_path, [3])
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-5])
    with pytest.raises(hvdkit.DataFormatError, match=r"part-000.tfrecord is truncated: record 2"):
        shard([path, path], 2, 0)
    with pytest.raises(hvdkit.DataFormatError, match=r"nope.tfrecord does not exist"):
        shard([str(tmp_path / "nope.tfrecord"), path], 2, 0)
    with pytest.raises(hvdkit.ShardingError, match="one path"):
        shard(path, 2, 0)

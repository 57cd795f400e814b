"""hvdkit.data on 2 ranks: MNIST and TFRecord files read through the sharder.

argv: outdir, data directory prepared by tests/test_sharding_mp.py (MNIST
train files of 25 images and no test files, TFRecord files of 4, 3, 5, 2, 6 records, and a
single TFRecord file of 7). Every sample carries its id; the ranks allgather
the ids they read and check coverage, duplicates and batch counts.
"""

import collections
import json
import os
import sys
import warnings

import numpy as np
from datafiles import mnist_ids, record_id

import hvdkit as hvd
import hvdkit.data as hdata

from _harness import Checks

hvd.init()
r, n = hvd.rank(), hvd.size()
c = Checks(r, sys.argv[1])
DATA = sys.argv[2]
MNIST_N, COUNTS, BATCH = 25, [4, 3, 5, 2, 6], 4
files = [os.path.join(DATA, "files", f"part-{f:03d}.tfrecord") for f in range(len(COUNTS))]


def gather(ids):
    """Every rank's ids, as a list per rank, and the number of batches each read."""
    everyone = hvd.allgather_object(list(map(int, ids)))
    batches = hvd.allgather(np.array([-(-len(ids) // BATCH)], np.int64))
    return everyone, batches.tolist()


def mnist_read(ds):
    return [int(i) for images, _ in ds.batch(BATCH).as_numpy_iterator() for i in mnist_ids(images)]


def tfrecord_read(ds):
    return [record_id(x) for batch in ds.batch(BATCH).as_numpy_iterator() for x in batch]


with c.check("topology"):
    assert n == 2 and hvd.backend_name() == "horovod"

with c.check("mnist_pad_shuffled"):
    ds = hdata.MnistDataset(
        os.path.join(DATA, "mnist"), num_shards="auto", shuffle=True, seed=3, epoch=1
    )
    ids = mnist_read(ds)
    perm = np.random.default_rng([3, 1]).permutation(MNIST_N)
    assert ids == perm[np.arange(r, 26, 2) % MNIST_N].tolist(), ids
    everyone, batches = gather(ids)
    assert batches == [4, 4] and [len(e) for e in everyone] == [13, 13]
    counts = collections.Counter(everyone[0] + everyone[1])
    assert set(counts) == set(range(MNIST_N))  # exactly-once, plus the pad duplicate
    assert [i for i, k in counts.items() if k > 1] == [int(perm[0])]
    c.record("mnist_pad", everyone)

with c.check("mnist_drop_and_next_epoch"):
    ds = hdata.MnistDataset(
        os.path.join(DATA, "mnist"), num_shards="auto", shuffle=True, seed=3, epoch=2, mode="drop"
    )
    everyone, batches = gather(mnist_read(ds))
    perm = np.random.default_rng([3, 2]).permutation(MNIST_N)
    assert batches == [3, 3] and not set(everyone[0]) & set(everyone[1])
    assert set(everyone[0]) | set(everyone[1]) == set(range(MNIST_N)) - {int(perm[-1])}
    assert everyone[r] != c.values["mnist_pad"][r]  # epoch 2 reshuffled

with c.check("mnist_without_shards_reads_everything"):
    # MindSpore's meaning: no num_shards -> every rank reads every record, and
    # num_shards=1, shard_id=0 (the same, said explicitly) does not warn.
    # Shuffled by default, with one seed: the same order on both ranks.
    perm = np.random.default_rng([0, 0]).permutation(MNIST_N).tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for kwargs in ({}, {"num_shards": 1, "shard_id": 0}):
            ds = hdata.MnistDataset(os.path.join(DATA, "mnist"), **kwargs)
            everyone, batches = gather(mnist_read(ds))
            assert everyone == [perm, perm], everyone
            assert batches == [7, 7]
            ds = hdata.MnistDataset(os.path.join(DATA, "mnist"), shuffle=False, **kwargs)
            everyone, batches = gather(mnist_read(ds))
            assert everyone == [list(range(MNIST_N))] * 2, everyone
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hdata.MnistDataset(os.path.join(DATA, "mnist"), num_shards=1, shard_id=0, usage="train")
        hdata.MnistDataset(os.path.join(DATA, "mnist"), num_shards=3, shard_id=r)
    assert [w.category for w in caught] == [hdata.ShardingWarning], caught

with c.check("mnist_default_reshuffles_every_pass_in_step"):
    # MindSpore's defaults with num_shards: shuffled, and every pass over the one
    # dataset (here 3 reads) has the next epoch's order, the same on both ranks,
    # so each pass's shards are disjoint and cover the data (plus the pad repeat).
    ds = hdata.MnistDataset(os.path.join(DATA, "mnist"), num_shards="auto")
    passes = []
    for k in range(3):
        everyone, batches = gather(mnist_read(ds))
        perm = np.random.default_rng([0, k]).permutation(MNIST_N)
        assert everyone == [perm[np.arange(q, 26, 2) % MNIST_N].tolist() for q in range(2)]
        assert batches == [4, 4]
        assert not set(everyone[0]) & set(everyone[1][:12])  # rank 1's 13th is perm[0]
        assert set(everyone[0]) | set(everyone[1]) == set(range(MNIST_N))
        passes.append(everyone)
    assert passes[0] != passes[1] and passes[1] != passes[2] and passes[0] != passes[2]
    # num_samples caps each shard: the first 5 of its order, a new subset every pass
    capped = hdata.MnistDataset(os.path.join(DATA, "mnist"), num_shards="auto", num_samples=5)
    assert len(capped) == 5
    for k in range(2):
        everyone, batches = gather(mnist_read(capped))
        perm = np.random.default_rng([0, k]).permutation(MNIST_N)
        assert everyone == [perm[q::2][:5].tolist() for q in range(2)], everyone
        assert batches == [2, 2] and not set(everyone[0]) & set(everyone[1])
    c.record("passes", passes)

with c.check("tfrecord_files_pad"):
    for shuffle in (False, True):
        ds = hdata.shard(files, shuffle=shuffle, seed=7, epoch=2)  # counts exchanged
        everyone, batches = gather(tfrecord_read(ds))
        own = hdata.shard_indices(5, 2, r, shuffle=shuffle, seed=7, epoch=2)
        starts = np.cumsum([0, *COUNTS])
        stream = [i for f in own for i in range(starts[f], starts[f + 1])]
        totals = hvd.allgather_object(len(stream))
        assert len(everyone[r]) == max(totals) and everyone[r] == (stream * 9)[: max(totals)]
        assert batches[0] == batches[1] == -(-max(totals) // BATCH)
        assert set(everyone[0]) | set(everyone[1]) == set(range(sum(COUNTS)))
    c.record("files_pad", everyone)

with c.check("tfrecord_fewer_files_than_ranks_warns"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = hdata.shard([os.path.join(DATA, "single.tfrecord")])
    assert any(
        issubclass(w.category, hdata.ShardingWarning) and "1 files for 2 shards" in str(w.message)
        for w in caught
    ), [str(w.message) for w in caught]
    everyone, batches = gather(tfrecord_read(ds))
    assert everyone == [[0, 2, 4, 6], [0, 1, 3, 5]] and batches == [1, 1]

with c.check("explicit_shards_disagreeing_with_the_job_warn"):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hdata.ShardSampler(10, 2, r)
        assert not caught
        sampler = hdata.ShardSampler(10, 2, 1 - r)
    assert len(caught) == 1 and caught[0].category is hdata.ShardingWarning
    assert f"shard_id={1 - r} differ from this job's size 2 and rank {r}" in str(caught[0].message)
    assert sampler.indices().tolist() == list(range(1 - r, 10, 2))

with c.check("resume_mid_epoch"):
    reader = hdata.MnistReader(os.path.join(DATA, "mnist"))
    sampler = hdata.ShardSampler(len(reader), shuffle=True, seed=5)
    sampler.set_epoch(3)
    full = [int(i) for i in sampler.indices()]
    first = []
    for step, (images, _) in enumerate(sampler.dataset(reader).batch(BATCH)):
        first += mnist_ids(images.numpy()).tolist()
        sampler.advance(len(images))
        if step == 1:
            break  # "crash" after 2 batches
    state_file = os.path.join(sys.argv[1], "data_state.json")
    if r == 0:
        with open(state_file, "w") as f:
            json.dump(sampler.state_dict(), f)
    hvd.barrier()
    # a restarted job: new reader and sampler, state loaded from rank 0's file
    resumed = hdata.ShardSampler(
        len(hdata.MnistReader(os.path.join(DATA, "mnist"))), shuffle=True, seed=5
    )
    with open(state_file) as f:
        resumed.load_state_dict(json.load(f))
    assert (resumed.epoch, resumed.position) == (3, 8)
    resumed.set_epoch(3)  # the loop's set_epoch at the top of the epoch keeps the position
    rest = mnist_read(resumed.dataset(reader))
    assert first == full[:8] and rest == full[8:], (first, rest, full)
    everyone, batches = gather(first + rest)
    assert batches == [4, 4] and sorted(set(everyone[0]) | set(everyone[1])) == list(range(25))
    c.record("resume", {"first": first, "rest": rest})

c.finish()

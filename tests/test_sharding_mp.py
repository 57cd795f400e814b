"""hvdkit.data with 2 processes under horovodrun, over Gloo and MPI."""

import collections
import os

import pytest
from datafiles import write_mnist, write_tfrecords

from conftest import MULTIPROC, REPO, WorkerRun

EXPECTED = [
    "topology",
    "mnist_pad_shuffled",
    "mnist_drop_and_next_epoch",
    "mnist_without_shards_reads_everything",
    "mnist_default_reshuffles_every_pass_in_step",
    "tfrecord_files_pad",
    "tfrecord_fewer_files_than_ranks_warns",
    "explicit_shards_disagreeing_with_the_job_warn",
    "resume_mid_epoch",
]


def write_data(tmp_path):
    data = tmp_path / "data"
    write_mnist(data / "mnist", "train", n=25)
    write_tfrecords(data / "files", [4, 3, 5, 2, 6])
    (single,) = write_tfrecords(tmp_path / "one", [7])
    os.rename(single, data / "single.tfrecord")
    pythonpath = os.pathsep.join(map(str, [MULTIPROC, REPO, REPO / "tests"]))
    return {"args": (data,), "env_extra": {"PYTHONPATH": pythonpath}}


RUN = WorkerRun("sharding_worker.py", setup=write_data)


@pytest.mark.parametrize("check", EXPECTED)
def test_sharding(check, transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_check(check)


def test_sharding_reports_exactly_these_checks(transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_reported_exactly(EXPECTED)


def test_sharded_ids_cover_the_data_as_promised(transport, tmp_path_factory):
    res = RUN.result(transport, tmp_path_factory)
    # the allgathered ids agree across ranks and cover the data as promised
    pad = res.values(0)["mnist_pad"]
    assert pad == res.values(1)["mnist_pad"] and len(pad[0]) == len(pad[1]) == 13
    # 25 samples on 2 ranks, interleaved: rank 0 reads positions 0, 2, ..., 24 and
    # rank 1 reads 1, 3, ..., 23 and then wraps to position 0, rank 0's first sample
    assert pad[1][-1] == pad[0][0]
    assert collections.Counter(pad[0] + pad[1]) == collections.Counter([*range(25), pad[0][0]])
    assert pad[0] + pad[1] != sorted(pad[0] + pad[1])  # shuffled
    passes = res.values(0)["passes"]  # MnistDataset's default: a new order every pass
    assert passes == res.values(1)["passes"] and len(passes) == 3
    assert len({tuple(p[0] + p[1]) for p in passes}) == 3
    assert all(sorted(set(p[0] + p[1])) == list(range(25)) for p in passes)
    files = res.values(0)["files_pad"]
    assert len(files[0]) == len(files[1]) and set(files[0] + files[1]) == set(range(20))
    for r in (0, 1):
        resume = res.values(r)["resume"]
        assert len(resume["first"]) == 8 and len(resume["rest"]) == 5
        assert not set(resume["first"]) & set(resume["rest"])

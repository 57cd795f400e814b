"""hvdkit.data with 2 processes under horovodrun, over Gloo and MPI."""

import collections
import os

import numpy as np
from datafiles import write_mnist, write_tfrecords

from conftest import MULTIPROC, REPO, launch

EXPECTED = [
    "topology",
    "mnist_pad_shuffled",
    "mnist_drop_and_next_epoch",
    "tfrecord_files_pad",
    "tfrecord_fewer_files_than_ranks_warns",
    "explicit_shards_disagreeing_with_the_job_warn",
    "resume_mid_epoch",
    "barrier",
]


def test_sharding_two_ranks(tmp_path, transport):
    data = tmp_path / "data"
    write_mnist(data / "mnist", "train", n=25)
    write_tfrecords(data / "files", [4, 3, 5, 2, 6])
    (single,) = write_tfrecords(tmp_path / "one", [7])
    os.rename(single, data / "single.tfrecord")
    pythonpath = os.pathsep.join(map(str, [MULTIPROC, REPO, REPO / "tests"]))
    res = launch(
        "sharding_worker.py",
        tmp_path,
        transport,
        args=(data,),
        env_extra={"PYTHONPATH": pythonpath},
    )
    res.assert_all_passed(EXPECTED)
    # the allgathered ids agree across ranks and cover the data as promised
    pad = res.values(0)["mnist_pad"]
    assert pad == res.values(1)["mnist_pad"] and len(pad[0]) == len(pad[1]) == 13
    perm = np.random.default_rng([3, 1]).permutation(25)
    assert collections.Counter(pad[0] + pad[1]) == collections.Counter([*range(25), perm[0]])
    files = res.values(0)["files_pad"]
    assert len(files[0]) == len(files[1]) and set(files[0] + files[1]) == set(range(20))
    for r in (0, 1):
        resume = res.values(r)["resume"]
        assert len(resume["first"]) == 8 and len(resume["rest"]) == 5
        assert not set(resume["first"]) & set(resume["rest"])

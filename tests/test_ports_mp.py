"""The MindSpore and OneFlow tutorial ports in examples/, under the launch method each uses.

Each test runs a port as its tutorial runs the original and asserts the
outcome the tutorial describes: one job whose ranks end identical, shards
disjoint and complete, w = [2, 3], ...
"""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import sys

import numpy as np
import pytest
from datafiles import CIFAR_TEST, CIFAR_TRAIN, write_cifar, write_mnist

from conftest import REPO, horovodrun, launcher_env, run_bounded

PORTS = REPO / "examples" / "mindspore"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cpu_data_parallel_run_sh_trains_one_job(tmp_path):
    """The tutorial's run.sh: a scheduler and 2 workers, all `python3 train.py`, backgrounded.

    DATA_PATH is the whole cifar-10-batches-bin, as in the tutorial: with no
    usage, MindSpore (and the port) read the train and the test batches.
    """
    data = tmp_path / "cifar-10-batches-bin"
    for f, name in enumerate(CIFAR_TRAIN):
        write_cifar(data / name, n=32, first_id=32 * f)  # ids 0..159
    write_cifar(data / CIFAR_TEST, n=32, first_id=1000)  # ids 1000..1031
    reports = tmp_path / "reports"
    reports.mkdir()
    env = launcher_env()
    env.update(
        MS_WORKER_NUM="2",
        MS_SCHED_PORT=str(free_port()),
        PORT_REPORT_DIR=str(reports),
        HOME=str(tmp_path),  # the scheduler's token file goes to $HOME/.hvdkit
    )
    cmd = ["bash", str(PORTS / "cpu_data_parallel" / "run.sh"), str(data)]
    code, out, timed_out = run_bounded(cmd, 900, env=env, cwd=tmp_path)
    logs = {p.name: p.read_text() for p in tmp_path.glob("*.txt")}
    shown = "\n".join(f"== {k}\n{v[-2000:]}" for k, v in sorted(logs.items()))
    assert not timed_out and code == 0, f"{out}\n{shown}"
    assert sorted(logs) == ["scheduler.txt", "worker_0.txt", "worker_1.txt"]

    sched = logs["scheduler.txt"]
    assert "all 2 ranks finished successfully" in sched, shown
    assert "epoch:" not in sched and "weight sum" not in sched  # the scheduler never trains
    for name in ("worker_0.txt", "worker_1.txt"):
        epochs = re.findall(r"epoch: (\d+) step: (\d+), loss is ([\d.]+)", logs[name])
        # 192 images: 96 per worker, 3 batches of 32
        assert [(int(e), int(s)) for e, s, _ in epochs] == [(e, 3) for e in range(1, 11)], shown

    ranks = [json.loads((reports / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["size"]) for r in ranks] == [(0, 2), (1, 2)]
    ids = [set(r["ids"]) for r in ranks]
    assert len(ids[0]) == len(ids[1]) == 96 and not ids[0] & ids[1]  # disjoint shards
    assert ids[0] | ids[1] == set(range(160)) | set(range(1000, 1032))  # that cover both splits
    np.testing.assert_array_equal(ranks[0]["weights"], ranks[1]["weights"])  # one model


# ------------------------------------------------------------------ mpirun tutorials
MNIST_N = 320  # 10 global batches of 32


def mnist_dir(tmp_path):
    write_mnist(tmp_path / "mnist", "train", n=MNIST_N)
    return tmp_path / "mnist"


def run_port(port, how, tmp_path, extra_env=None, timeout=900):
    """Run examples/mindspore/<port> as ``how``: "1" (python), "mpirun" (run.sh), "gloo"."""
    data = mnist_dir(tmp_path)
    reports = tmp_path / f"reports-{how}"
    reports.mkdir()
    env = launcher_env()
    env.update(DATA_PATH=str(data), PORT_REPORT_DIR=str(reports), **(extra_env or {}))
    script = PORTS / port / "train.py"
    if how == "1":
        cmd = [sys.executable, str(script)]
    elif how == "mpirun":  # the tutorial's run.sh, 2 processes instead of 8
        env["RANK_SIZE"] = "2"
        cmd = ["bash", str(PORTS / port / "run.sh")]
    else:
        cmd = horovodrun(how, script)
    code, out, timed_out = run_bounded(cmd, timeout, env=env, cwd=tmp_path)
    assert not timed_out and code == 0, out[-4000:]
    n = 1 if how == "1" else 2
    return [json.loads((reports / f"rank{r}.json").read_text()) for r in range(n)], out


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """Each port's report from one process (whole batches, whole images), computed once."""
    cache = {}

    def get(port):
        if port not in cache:
            cache[port] = run_port(port, "1", tmp_path_factory.mktemp(port))[0][0]
        return cache[port]

    return get


@pytest.mark.parametrize("how", ["mpirun", "gloo"])
def test_manual_parallel_ranks_identical_and_equal_to_one_process(how, tmp_path, single_process):
    ranks, out = run_port("manual_parallel", how, tmp_path)
    one = single_process("manual_parallel")
    assert [r["size"] for r in ranks] == [2, 2] and one["size"] == 1
    np.testing.assert_array_equal(ranks[0]["weights"], ranks[1]["weights"])
    # The job computes one process's step, but sums in another order (two 16-row means,
    # averaged over ranks, for one 32-row mean). Over 100 steps on ReLUs those ~1e-8
    # differences grow in a way that depends on the batches: with the tutorial's order
    # (reshuffled every epoch) the first epoch agrees to 1e-7, the tenth to ~7e-4 in
    # the loss and ~1.2e-3 in the weights (measured). A wrong gradient scale or a
    # missing loss allreduce moves the losses by percents.
    np.testing.assert_allclose(ranks[0]["losses"][0], one["losses"][0], rtol=1e-5)
    np.testing.assert_allclose(ranks[0]["losses"], one["losses"], rtol=3e-3)
    np.testing.assert_allclose(ranks[0]["weights"], one["weights"], atol=5e-3)
    assert len(one["losses"]) == 10 and one["losses"][-1] < 0.7 * one["losses"][0]
    # LossMonitor(20): steps 20, 40, ..., 100, printed by both ranks
    steps = re.findall(r"epoch: \d+ step: (\d+), loss is", out)
    assert sorted(map(int, steps)) == sorted(2 * [20, 40, 60, 80, 100]), out[-3000:]


@pytest.mark.parametrize("how", ["mpirun", "gloo"])
def test_dataset_slice_strips_train_like_whole_images(how, tmp_path, single_process):
    ranks, _ = run_port("dataset_slice", how, tmp_path)
    one = single_process("dataset_slice")
    assert [r["strips"] for r in ranks] == [2, 2] and one["strips"] == 1
    assert ranks[0]["losses"] == ranks[1]["losses"]  # one job: the same loss on every rank
    np.testing.assert_array_equal(ranks[0]["replicated"], ranks[1]["replicated"])
    # the strips' job computes what one process computes on the whole images
    np.testing.assert_allclose(ranks[0]["losses"], one["losses"], rtol=1e-5)
    np.testing.assert_allclose(ranks[0]["replicated"], one["replicated"], atol=1e-5)
    assert len(one["losses"]) == 50 and one["losses"][-1] < one["losses"][0]


# ------------------------------------------------------------------ sink mode, one process
def test_sink_mode_tutorial(tmp_path):
    spec = importlib.util.spec_from_file_location("lenet_sink", REPO / "examples" / "lenet_sink.py")
    lenet_sink = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lenet_sink)
    # laid out as the tutorial's download: MNIST_Data/train and MNIST_Data/test
    data = tmp_path / "MNIST_Data"
    data.mkdir()
    lenet_sink.write_mnist_format(data, train=320, test=32)  # learnable digits-like patterns
    for split, prefix in (("train", "train"), ("test", "t10k")):
        (data / split).mkdir()
        for f in data.glob(f"{prefix}-*"):
            f.rename(data / split / f.name)
    env = launcher_env()
    # the tutorial's DATA_PATH: MnistDataset reads the train split, the one there
    env.update(DATA_PATH=str(data / "train"), SINK_SIZE="100")  # the tutorial's 1000, cut
    cmd = [sys.executable, str(PORTS / "sink_mode" / "train.py")]
    code, out, timed_out = run_bounded(cmd, 900, env=env, cwd=tmp_path)
    assert not timed_out and code == 0, out[-4000:]
    # Model.train: 10 epochs, each one sink of sink_size steps, one loss line per epoch
    epochs = re.findall(r"^epoch: (\d+) step: (\d+), loss is ([\d.]+)", out, re.M)
    assert [(int(e), int(s)) for e, s, _ in epochs] == [(e, 100) for e in range(1, 11)], out[-3000:]
    # LeNet-5 with the tutorial's TruncatedNormal(0.02) start leaves chance level slowly:
    # after 1000 steps the loss is below ln(10) = 2.3026 and below the first epoch's
    losses = [float(loss) for _, _, loss in epochs]
    assert losses[-1] < losses[0] and losses[-1] < np.log(10) - 0.01, losses
    # data_sink: 10 epochs of 10 batches in 100, 10 and 1 host calls
    assert len(re.findall(r"^step \d+, loss is", out, re.M)) == 100
    assert len(re.findall(r"^epoch \d+, loss is", out, re.M)) == 10
    assert re.findall(r"^sink (\d): (\d+) calls, (\d+) steps", out, re.M) == [
        ("1", "100", "100"),
        ("2", "10", "100"),
        ("3", "1", "100"),
    ]


# ------------------------------------------------------------------ OneFlow's DDP toy
def test_oneflow_ddp_toy_w_converges_to_2_3(transport):
    cmd = horovodrun(transport, REPO / "examples" / "oneflow_ddp_toy.py")
    code, out, timed_out = run_bounded(cmd, 600, env=launcher_env())
    assert not timed_out and code == 0, out[-3000:]
    # horovodrun prefixes lines "[0]<stdout>:" (Gloo) or "[1,0]<stdout>:" (MPI)
    ws = re.findall(r"\[(?:\d+,)?(\d)\]<stdout>:w:(\[\[.*?\]\])", out)
    assert sorted(r for r, _ in ws) == ["0", "1"], out[-3000:]
    w0, w1 = (np.array(json.loads(w)) for _, w in sorted(ws))
    np.testing.assert_array_equal(w0, w1)  # one model on both ranks
    np.testing.assert_allclose(w0, [[2.0], [3.0]], atol=1e-3)

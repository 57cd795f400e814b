"""The MindSpore and OneFlow tutorial ports in examples/, under the launch method each uses.

Each test runs a port as its tutorial runs the original and asserts the
outcome the tutorial describes: one job whose ranks end identical, shards
disjoint and complete, w = [2, 3], ...
"""

from __future__ import annotations

import json
import re
import socket

import numpy as np
from datafiles import CIFAR_TRAIN, write_cifar

from conftest import REPO, launcher_env, run_bounded

PORTS = REPO / "examples" / "mindspore"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cpu_data_parallel_run_sh_trains_one_job(tmp_path):
    """The tutorial's run.sh: a scheduler and 2 workers, all `python3 train.py`, backgrounded."""
    data = tmp_path / "cifar-10-batches-bin"
    for f, name in enumerate(CIFAR_TRAIN):
        write_cifar(data / name, n=32, first_id=32 * f)  # ids 0..159
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
        assert [(int(e), int(s)) for e, s, _ in epochs] == [(e, 2) for e in range(1, 11)], shown

    ranks = [json.loads((reports / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(r["rank"], r["size"]) for r in ranks] == [(0, 2), (1, 2)]
    ids = [set(r["ids"]) for r in ranks]
    assert len(ids[0]) == len(ids[1]) == 80 and not ids[0] & ids[1]  # disjoint shards
    assert ids[0] | ids[1] == set(range(160))  # that cover CIFAR-10 (the test's 160 images)
    np.testing.assert_array_equal(ranks[0]["weights"], ranks[1]["weights"])  # one model

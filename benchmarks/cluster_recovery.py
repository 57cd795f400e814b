"""Time to train again after a lost node, on the test clusters of Spark and Ray.

    python benchmarks/cluster_recovery.py            # both engines
    python benchmarks/cluster_recovery.py ray        # one

Starts the two-node cluster of tests/spark_cluster.py or tests/ray_cluster.py
(root: network namespaces), runs the suite's driver script of that engine
(tests/multiproc/{spark,ray}_driver.py: the main job uninterrupted, then with
the node of one rank lost at step 12 once its checkpoint is on disk) and
measures, in one run, side by side:

* ``recovery_s``: from the loss to the first training step of the attempt
  that resumed (what hvdkit's restart costs: detecting the loss, stopping the
  attempt, placing the ranks again, starting TensorFlow, Gloo and the restore);
* ``uninterrupted_s`` and ``with_loss_s``: the whole training call without
  and with the loss, and the steal time of the machine meanwhile.

Prints a table and writes bench_results/cluster_recovery.json.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from _common import REPO, write_results

sys.path.insert(0, str(REPO / "tests"))
MULTIPROC = REPO / "tests" / "multiproc"


def _steal() -> int:
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[8])


def _total() -> int:
    with open("/proc/stat") as f:
        return sum(int(x) for x in f.readline().split()[1:9])


def _watch(driver: subprocess.Popen, holding: Path, lose) -> float | None:
    """Run ``driver`` to its end; call ``lose()`` when ``holding`` appears; the loss's time."""
    lost_at = None
    while driver.poll() is None:
        if lost_at is None and holding.exists():
            lose()
            lost_at = time.time()
        time.sleep(0.1)
    return lost_at


def _measure(result: Path, lost_at: float | None) -> dict:
    got = json.loads(result.read_text())
    plain, killed = got["uninterrupted"], got["killed"]
    resumed = killed["value"]
    first = min(r["first_step_at"] for r in resumed)
    return {
        "recovery_s": round(first - lost_at, 2) if lost_at else None,
        "uninterrupted_s": round(plain["seconds"], 2),
        "with_loss_s": round(killed["seconds"], 2),
        "resumed_from_step": resumed[0]["resumed_from"],
        "same_weights": {r["fingerprint"] for r in resumed} == {plain["value"][0]["fingerprint"]},
    }


def spark() -> dict:
    import spark_cluster

    with spark_cluster.SparkCluster() as cluster:
        result = cluster.hosts.root / "result.json"
        driver = cluster.submit(
            str(MULTIPROC / "spark_driver.py"),
            [str(cluster.shared), str(result)],
            subprocess.DEVNULL,
        )
        lost_at = _watch(
            driver, cluster.shared / "killed" / "holding", lambda: cluster.kill_executor("n2")
        )
        return _measure(result, lost_at)


def ray() -> dict:
    import ray_cluster

    with ray_cluster.RayCluster() as cluster:
        result = cluster.hosts.root / "result.json"
        driver = cluster.driver(
            [str(MULTIPROC / "ray_driver.py"), str(cluster.shared), str(result)],
            "driver.log",
            {"HVDKIT_STALL_TIMEOUT": "8"},
        )
        frozen = cluster.shared / "frozen" / "holding"

        def lose():
            cluster.hosts.kill_host("n2")

        lost_at = None
        while driver.poll() is None:  # the driver's frozen case needs its SIGSTOP too
            if lost_at is None and (cluster.shared / "killed" / "holding").exists():
                lose()
                lost_at = time.time()
            if frozen.exists() and not (cluster.hosts.root / "stopped").exists():
                os.kill(int(frozen.read_text().split()[1]), signal.SIGSTOP)
                (cluster.hosts.root / "stopped").touch()
            time.sleep(0.1)
        return _measure(result, lost_at)


def main() -> int:
    engines = sys.argv[1:] or ["spark", "ray"]
    rows = {}
    for name in engines:
        steal0, total0 = _steal(), _total()
        rows[name] = {"spark": spark, "ray": ray}[name]()
        rows[name]["steal_share"] = round((_steal() - steal0) / max(1, _total() - total0), 4)
    print(f"{'engine':<8}{'recovery s':>12}{'uninterrupted s':>17}{'with loss s':>13}{'steal':>8}")
    for name, r in rows.items():
        print(
            f"{name:<8}{r['recovery_s']!s:>12}{r['uninterrupted_s']:>17}"
            f"{r['with_loss_s']:>13}{r['steal_share']:>8}  same weights: {r['same_weights']}"
        )
    print("wrote", write_results("cluster_recovery", {"date": time.ctime(), "engines": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

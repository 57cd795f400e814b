"""A real Spark standalone cluster on this machine: a master and two workers (n1, n2).

The master runs here, on the bridge's address; each worker runs on a host of
its own (:mod:`netns_hosts`: its own namespace, address and host name) with
one core, so a 2-rank barrier stage puts one rank on each node. Java 17 from
Debian and Spark from the pyspark wheel (``scripts/install.sh``). Everything
is stopped by pid. ``python tests/spark_cluster.py`` starts one by hand and
prints the master's URL (Ctrl-C or SIGTERM stops it).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import netns_hosts

NODES = ("n1", "n2")


def missing() -> str | None:
    """Why a Spark cluster cannot be started here, or None."""
    why = netns_hosts.missing()
    if why:
        return why
    if shutil.which("java") is None:
        return "java is not installed (Debian's openjdk-17-jre-headless; scripts/install.sh)"
    try:
        import pyspark  # noqa: F401
    except ImportError:
        return "pyspark is not installed (scripts/install.sh installs it)"
    return None


class SparkCluster(netns_hosts.Cluster):
    """Master + one worker per node; ``master_url`` for the driver."""

    def __init__(self, nodes: tuple[str, ...] = NODES, cores: int = 1):
        import pyspark

        self.hosts = netns_hosts.Hosts(nodes, "hvsp", 240)
        self.cores = cores
        self.spark_home = str(Path(pyspark.__file__).parent)
        self.port = netns_hosts.free_port()
        self.ui_port = netns_hosts.free_port()
        self.master_url = f"spark://{self.hosts.gateway}:{self.port}"
        self.shared = self.hosts.root / "shared"  # the cluster's shared folder
        self.workers: dict[str, subprocess.Popen] = {}

    def env(self, host: str | None) -> dict[str, str]:
        env = dict(os.environ, SPARK_HOME=self.spark_home, SPARK_DAEMON_MEMORY="256m")
        env["PYSPARK_PYTHON"] = sys.executable
        env["SPARK_LOCAL_IP"] = self.hosts.addresses[host] if host else self.hosts.gateway
        env["SPARK_LOG_DIR"] = str(self.hosts.root / "logs")
        env.pop("PYSPARK_GATEWAY_PORT", None)
        return env

    def start(self) -> None:
        self.hosts.start()
        self.shared.mkdir()
        self.shared.chmod(0o777)
        spark_class = os.path.join(self.spark_home, "bin", "spark-class")
        self.hosts.popen(
            None,
            [
                spark_class,
                "org.apache.spark.deploy.master.Master",
                "--host",
                self.hosts.gateway,
                "--port",
                str(self.port),
                "--webui-port",
                str(self.ui_port),
            ],
            self.env(None),
            "master.log",
        )
        for node in self.hosts.names:
            self.start_worker(node)
        self.wait_for(lambda: self.alive_workers() == len(self.hosts.names), "both workers")

    def start_worker(self, node: str) -> None:
        spark_class = os.path.join(self.spark_home, "bin", "spark-class")
        work = self.hosts.root / f"work-{node}"
        work.mkdir(exist_ok=True)
        self.workers[node] = self.hosts.popen(
            node,
            [
                spark_class,
                "org.apache.spark.deploy.worker.Worker",
                "--host",
                self.hosts.addresses[node],
                "--cores",
                str(self.cores),
                "--memory",
                "4g",
                "--work-dir",
                str(work),
                "--webui-port",
                "0",
                self.master_url,
            ],
            self.env(node),
            f"worker-{node}.log",
        )

    def submit(
        self, script: str, args: list[str], log, env: dict | None = None
    ) -> subprocess.Popen:
        """``spark-submit`` ``script`` to this cluster from this machine (the driver's host)."""
        gateway = self.hosts.gateway
        conf = {
            "spark.driver.host": gateway,
            "spark.driver.bindAddress": gateway,
            "spark.ui.enabled": "false",
            "spark.executor.memory": "2g",
        }
        cmd = [os.path.join(self.spark_home, "bin", "spark-submit"), "--master", self.master_url]
        for key, value in conf.items():
            cmd += ["--conf", f"{key}={value}"]
        return subprocess.Popen(
            [*cmd, script, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=os.path.dirname(script),
            env={**self.env(None), **(env or {})},
        )

    def alive_workers(self) -> int:
        url = f"http://{self.hosts.gateway}:{self.ui_port}/json/"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                state = json.load(r)
        except (OSError, ValueError):  # not up yet, or its HTML page while it starts
            return 0
        return sum(w.get("state") == "ALIVE" for w in state.get("workers", []))

    def wait_for(self, ready, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not up in {timeout} s:\n{self.report()}")
            time.sleep(0.5)

    def executor_pids(self, node: str) -> list[int]:
        """The executor JVMs (CoarseGrainedExecutorBackend) running on ``node``."""
        listed = subprocess.run(
            ["ip", "netns", "pids", self.hosts.netns[node]], capture_output=True, text=True
        ).stdout.split()
        found = []
        for pid in listed:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"CoarseGrainedExecutorBackend" in cmdline:
                found.append(int(pid))
        return found

    def kill_executor(self, node: str) -> list[int]:
        pids = self.executor_pids(node)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return pids

    def report(self) -> str:
        return "\n".join(
            f"--- {name}\n{self.hosts.log(name)[-3000:]}"
            for name in ("master.log", *(f"worker-{n}.log" for n in self.hosts.names))
        )

    def stop(self) -> None:
        self.hosts.stop()
        if os.environ.get("HVDKIT_KEEP_SPARK") != "1":
            shutil.rmtree(self.hosts.root, ignore_errors=True)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with SparkCluster() as cluster:
        print(cluster.master_url, "shared folder:", cluster.shared, flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass

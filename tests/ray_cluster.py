"""A real two-node Ray cluster on this machine: the head on n1, a worker node on n2.

Each node runs on a host of its own (:mod:`netns_hosts`), started with
``ray start --block`` from the ray wheel (``scripts/install.sh``) and its
own temporary folder. The head has 2 CPUs and the worker 1: a 2-rank
``SPREAD`` job puts a rank on each node, and after n2 is lost both ranks fit
on the head. A driver runs on the head node, as Ray's docs run one.
Everything is stopped by pid. ``python tests/ray_cluster.py`` starts one by hand.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

import netns_hosts

NODES = ("n1", "n2")
CPUS = {"n1": 2, "n2": 1}


def missing() -> str | None:
    """Why a Ray cluster cannot be started here, or None."""
    why = netns_hosts.missing()
    if why:
        return why
    try:
        import ray  # noqa: F401
    except ImportError:
        return "ray is not installed (scripts/install.sh installs it)"
    return None


class RayCluster(netns_hosts.Cluster):
    def __init__(self):
        self.hosts = netns_hosts.Hosts(NODES, "hvry", 230)
        self.port = netns_hosts.free_port()
        self.head = self.hosts.addresses["n1"]
        self.address = f"{self.head}:{self.port}"
        self.shared = self.hosts.root / "shared"
        self.ray = os.path.join(os.path.dirname(sys.executable), "ray")
        self.token = secrets.token_hex(32)  # Ray's token authentication, one token per cluster

    def env(self) -> dict[str, str]:
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="0")
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token)
        env.pop("RAY_ADDRESS", None)
        return env

    def _node(self, node: str, *args: str) -> None:
        temp = f"/tmp/hvr{self.hosts.tag}{node}"  # short: Ray's socket paths have a limit
        self.hosts.popen(
            node,
            [
                self.ray,
                "start",
                "--block",
                f"--node-ip-address={self.hosts.addresses[node]}",
                f"--num-cpus={CPUS[node]}",
                f"--temp-dir={temp}",
                *args,
            ],
            self.env(),
            f"ray-{node}.log",
        )

    def start(self) -> None:
        self.hosts.start()
        self.shared.mkdir()
        self.shared.chmod(0o777)
        self._node("n1", "--head", f"--port={self.port}", "--include-dashboard=false")
        self._node("n2", f"--address={self.address}")
        self.wait_for_nodes(2)

    def alive_nodes(self) -> int:
        code = (
            "import ray; ray.init(address='auto', logging_level='ERROR'); "
            "print(sum(n['Alive'] for n in ray.nodes()))"
        )
        proc = self.hosts.popen("n1", [sys.executable, "-c", code], self.env(), "probe.log")
        proc.wait()
        text = self.hosts.log("probe.log").strip().splitlines()
        (self.hosts.root / "probe.log").unlink(missing_ok=True)
        return int(text[-1]) if text and text[-1].isdigit() else 0

    def wait_for_nodes(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while self.alive_nodes() < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{n} Ray nodes not up in {timeout} s:\n{self.report()}")
            time.sleep(1)

    def driver(self, argv: list[str], log: str, env: dict | None = None) -> subprocess.Popen:
        env = dict(self.env(), RAY_ADDRESS=self.address, **(env or {}))
        return self.hosts.popen("n1", [sys.executable, *argv], env, log)

    def report(self) -> str:
        return "\n".join(f"--- {n}\n{self.hosts.log(f'ray-{n}.log')[-3000:]}" for n in NODES)

    def stop(self) -> None:
        self.hosts.stop()
        for node in NODES:
            shutil.rmtree(f"/tmp/hvr{self.hosts.tag}{node}", ignore_errors=True)
        if os.environ.get("HVDKIT_KEEP_RAY") != "1":
            shutil.rmtree(self.hosts.root, ignore_errors=True)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with RayCluster() as cluster:
        print("head at", cluster.address, "shared folder:", cluster.shared, flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass

"""Simulated machines for the cluster tests: one network namespace per host, on one bridge.

Each host has its own address, its own host name (a UTS namespace) and an
``/etc/hosts`` that names every host (a mount namespace), as machines on a
switch would; the file system is the machine's, as a shared file system
would be. This machine keeps the bridge's address (``gateway``): a driver or
a head started here reaches every host. Everything is started in a process
group of its own and stopped by pid (and every process left in a host's
namespace is killed with it): ``tests/spark_cluster.py`` and
``tests/ray_cluster.py`` use it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

from conftest import remove_netns


def missing() -> str | None:
    """Why hosts cannot be simulated here, or None."""
    if os.geteuid() != 0:
        return "it needs root (network namespaces)"
    for tool in ("ip", "nsenter", "unshare"):
        if subprocess.run(["which", tool], capture_output=True).returncode:
            return f"{tool} is not installed (Debian's iproute2, util-linux)"
    return None


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Hosts:
    """``names`` as hosts on a bridge; ``prefix`` keeps two clusters' links apart.

    Attributes:
        addresses: host name -> its address; ``gateway`` this machine's on the bridge.
        root: a folder for the hosts' files (``hosts``, logs); removed at ``stop``.
    """

    def __init__(self, names: tuple[str, ...], prefix: str, subnet_base: int):
        tag = os.getpid() % 10000
        self.names = names
        self.tag = f"{prefix}{tag}"
        self.subnet = f"10.{subnet_base + tag % 10}.{tag % 250}"
        self.gateway = f"{self.subnet}.1"
        self.addresses = {n: f"{self.subnet}.{11 + i}" for i, n in enumerate(names)}
        self.bridge = f"{self.tag}br"
        self.netns = {n: f"{self.tag}{n}" for n in names}
        self.root = Path(tempfile.mkdtemp(prefix=f"hvdkit-{prefix}-", dir="/var/tmp"))
        self.root.chmod(0o755)
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, name in enumerate(self.names):
            ns, outside = self.netns[name], f"{self.tag}v{i}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", outside, "master", self.bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.addresses[name]}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        lines = ["127.0.0.1 localhost", f"{self.gateway} {socket.gethostname()}"]
        lines += [f"{a} {n}" for n, a in self.addresses.items()]
        (self.root / "hosts").write_text("\n".join(lines) + "\n")

    def popen(self, host: str | None, cmd: list[str], env: dict, log: str) -> subprocess.Popen:
        """Start ``cmd`` on ``host`` (None: this machine) in its own process group."""
        out = open(self.root / log, "ab")
        if host is not None:
            inside = (
                f'hostname {host} && mount --bind {self.root / "hosts"} /etc/hosts && exec "$@"'
            )
            cmd = [
                "nsenter",
                f"--net=/var/run/netns/{self.netns[host]}",
                "unshare",
                "--uts",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                inside,
                "sh",
                *cmd,
            ]
        proc = subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        out.close()
        self.procs.append(proc)
        return proc

    def kill_host(self, host: str) -> None:
        """The host is lost: every process in its namespace is killed at once."""
        listed = subprocess.run(
            ["ip", "netns", "pids", self.netns[host]], capture_output=True, text=True
        )
        for pid in listed.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for ns in self.netns.values():
            remove_netns(ns)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def log(self, name: str) -> str:
        path = self.root / name
        return path.read_text(errors="replace") if path.exists() else ""


class Cluster:
    """A cluster on :class:`Hosts`: ``with`` starts it, and stops it even when the start fails."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

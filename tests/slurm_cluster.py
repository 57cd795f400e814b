"""A real Slurm cluster on this machine: munged, slurmctld and two slurmd nodes (n1, n2).

Each node runs in its own network namespace (its own address on a bridge, as a machine
on a switch), its own UTS namespace (its host name is the node's name) and its own mount
namespace, where its own ``TmpFS`` folder (two nodes sharing one collide in PMIx's
folder) and an ``/etc/hosts`` that names every node are mounted. ``/tmp`` itself stays
the machine's: a repository cloned there (as CI does) must be visible on every node, as
a shared file system would be. The controller and munged run in this machine's
namespaces; everything is started from Debian's ``slurm-wlm`` and ``munge``
(``scripts/install.sh``) with a generated ``slurm.conf`` in one folder, which is also
the cluster's shared file system (jobs' scripts, outputs, checkpoints).

Pitfalls met on the way (issue 39): ``ip netns exec`` remounts ``/sys`` and
Slurm 22.05's ``slurmd`` then fails ("Unable to initialize cgroup plugin"), so
a node enters its network namespace with ``nsenter --net`` and makes its other
namespaces with ``unshare``; a requeued job waits ``cred_expire`` (120 s by
default) before it starts again, so the config takes Slurm's minimum (5 s);
job ids start at 1 on every fresh cluster.

Usage (root only; everything started is stopped by pid)::

    with SlurmCluster() as cluster:
        job = cluster.sbatch(["--wrap", "hostname"], "-N", "2")
        cluster.wait(job)

Run ``python tests/slurm_cluster.py`` to start one by hand (Ctrl-C or SIGTERM stops it).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import netns_hosts

from conftest import remove_netns

NODES = ("n1", "n2")
CPUS_PER_NODE = 2
SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "squeue")
# Fast enough for tests: a requeued job starts again after cred_expire (Slurm's
# minimum, 5 s), a stopped task is killed KillWait after its SIGTERM.
TIMINGS = {
    "MessageTimeout": 5,
    "KillWait": 5,
    "MinJobAge": 300,  # finished jobs stay visible to scontrol for the test's checks
    "SlurmdTimeout": 60,
    "SlurmctldTimeout": 60,
    "InactiveLimit": 0,
    "BatchStartTimeout": 20,
    # the main scheduling loop runs every 60 s by default, and a requeued job waits for it
    "SchedulerParameters": "sched_interval=2",
}
FINISHED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}


def missing() -> str | None:
    """Why a Slurm cluster cannot be started here, or None."""
    if os.geteuid() != 0:
        return "it needs root (network namespaces, munged and slurmd as root)"
    absent = [b for b in (*SLURM_BINARIES, "ip", "nsenter", "unshare") if not shutil.which(b)]
    if absent:
        return (
            f"{', '.join(absent)} not installed (Debian's slurm-wlm, munge, iproute2 and "
            "util-linux; scripts/install.sh installs them)"
        )
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _run(*cmd: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


class SlurmCluster(netns_hosts.Cluster):
    """munged + slurmctld + one slurmd per node, each node in its own namespaces.

    Attributes:
        root: the cluster's folder (config, logs, state; also the jobs' shared
            file system; each node mounts its own ``node-tmp``, Slurm's ``TmpFS``).
        addresses: node name -> its address; ``controller_addr`` the controller's.
        env: the environment for Slurm's commands (``SLURM_CONF``), also passed to jobs.
    """

    def __init__(self, mpi_default: str = "pmix", nodes: tuple[str, ...] = NODES):
        self.nodes = nodes
        self.mpi_default = mpi_default
        tag = os.getpid() % 10000
        self.tag = tag
        self.subnet = f"10.{215 + tag % 20}.{tag % 250}"
        self.controller_addr = f"{self.subnet}.1"
        self.addresses = {n: f"{self.subnet}.{11 + i}" for i, n in enumerate(nodes)}
        self.bridge = f"hvsbr{tag}"
        self.netns = {n: f"hvs{n}{tag}" for n in nodes}
        self.root = Path(tempfile.mkdtemp(prefix="hvdkit-slurm-", dir="/var/tmp"))
        self.root.chmod(0o755)
        self.conf = self.root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self._procs: list[subprocess.Popen] = []
        self._links: list[str] = []

    # ---------------------------------------------------------------- start / stop
    def start(self) -> None:
        self._network()
        self._write_files()
        self._start(["munged", "-F", "-f", *self._munge_args()], "munged")
        self._wait_for(lambda: (self.root / "munge.sock").exists(), "munged's socket")
        self._start(["slurmctld", "-D", "-i", "-f", str(self.conf)], "slurmctld")
        for node in self.nodes:
            self._start_node(node)
        self._wait_for(self._nodes_idle, "both nodes idle", timeout=60)

    def stop(self) -> None:
        for proc in reversed(self._procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for ns in self.netns.values():
            remove_netns(ns)  # what still runs in a node is this cluster's (a job's leftovers)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        if os.environ.get("HVDKIT_KEEP_SLURM") != "1":
            shutil.rmtree(self.root, ignore_errors=True)

    def _network(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.controller_addr}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, node in enumerate(self.nodes):
            ns, host_side = self.netns[node], f"hvs{i}v{self.tag}"
            _run("ip", "netns", "add", ns)
            _run(
                "ip", "link", "add", host_side, "type", "veth", "peer", "name", "eth0", "netns", ns
            )
            _run("ip", "link", "set", host_side, "master", self.bridge, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.addresses[node]}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")

    def _munge_args(self) -> list[str]:
        r = self.root
        return [
            f"--socket={r / 'munge.sock'}",
            f"--key-file={r / 'munge.key'}",
            f"--pid-file={r / 'munged.pid'}",
            f"--log-file={r / 'munged.log'}",
            f"--seed-file={r / 'munged.seed'}",
        ]

    def _write_files(self) -> None:
        r = self.root
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for sub in (
            "state",
            "spool",
            "log",
            "shared",
            "node-tmp",
            *(f"{n}-tmp" for n in self.nodes),
        ):
            (r / sub).mkdir()
        for n in self.nodes:
            (r / f"{n}-tmp").chmod(0o1777)
        (r / "shared").chmod(0o777)
        hosts = ["127.0.0.1 localhost", f"{self.controller_addr} {socket.gethostname()}"]
        hosts += [f"{addr} {node}" for node, addr in self.addresses.items()]
        (r / "hosts").write_text("\n".join(hosts) + "\n")
        lines = [
            "ClusterName=hvdkit",
            f"SlurmctldHost={socket.gethostname()}({self.controller_addr})",
            f"SlurmctldPort={_free_port()}",
            "SlurmdPort=6818",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r / 'munge.sock'},cred_expire=5",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin",
            f"MpiDefault={self.mpi_default}",
            "ReturnToService=2",
            f"TmpFS={r / 'node-tmp'}",  # each node mounts its own folder here
            "JobRequeue=0",
            *(f"{k}={v}" for k, v in TIMINGS.items()),
            *(
                f"NodeName={n} NodeAddr={a} CPUs={CPUS_PER_NODE} State=UNKNOWN"
                for n, a in self.addresses.items()
            ),
            f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES "
            "MaxTime=INFINITE State=UP OverSubscribe=NO",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        (r / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")

    def _start_node(self, node: str) -> None:
        r = self.root
        inside = (
            f"hostname {node} && mount --bind {r / (node + '-tmp')} {r / 'node-tmp'} && "
            f"mount --bind {r / 'hosts'} /etc/hosts && "
            f"exec slurmd -D -N {node} -f {self.conf}"
        )
        cmd = [
            "nsenter",
            f"--net=/run/netns/{self.netns[node]}",
            "unshare",
            "--mount",
            "--uts",
            "--propagation",
            "private",
            "sh",
            "-c",
            inside,
        ]
        self._start(cmd, f"slurmd-{node}")

    def _start(self, cmd: list[str], name: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        with log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        self._procs.append(proc)

    def _wait_for(self, ready, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [p.args for p in self._procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"Slurm test cluster: no {what} within {timeout:g} s"
                    + (f"; exited: {dead}" if dead else "")
                    + f"; logs in {self.root / 'log'}:\n{self.logs()}"
                )
            time.sleep(0.2)

    def _nodes_idle(self) -> bool:
        proc = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=self.env
        )
        states = dict(line.split() for line in proc.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in self.nodes)

    def logs(self, tail: int = 30) -> str:
        out = []
        for path in sorted((self.root / "log").iterdir()):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            out.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(out)

    # ---------------------------------------------------------------- jobs
    def sbatch(self, *args: str, env: dict | None = None) -> int:
        """Submit a batch job (``sbatch --parsable args``); its job id."""
        proc = subprocess.run(
            ["sbatch", "--parsable", *args],
            capture_output=True,
            text=True,
            env={**self.env, **(env or {})},
            cwd=self.root / "shared",
        )
        if proc.returncode:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {proc.stderr.strip()}")
        return int(proc.stdout.strip().split(";")[0])

    def run(self, *cmd: str) -> str:
        """A Slurm command (``scontrol requeue 3``, ``scancel ...``) against this cluster."""
        return _run_env(self.env, *cmd)

    def scontrol(self, *args: str) -> str:
        return self.run("scontrol", *args)

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, Restarts, NodeList, ...)."""
        text = self.scontrol("show", "job", "-o", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def report(self, job_id: int) -> str:
        """What to read when a job did not do what a test waited for: its fields, the
        nodes' states, the queue and the daemons' last log lines."""
        parts = [f"scontrol show job {job_id}:\n{self.job(job_id)}"]
        for cmd in (["sinfo", "-N", "-o", "%N %T %E"], ["squeue", "-o", "%i %T %r %N"]):
            proc = subprocess.run(cmd, capture_output=True, text=True, env=self.env)
            parts.append(f"{' '.join(cmd)}:\n{proc.stdout}{proc.stderr}")
        parts.append(self.logs())
        return "\n".join(parts)

    def wait(self, job_id: int, timeout: float = 600.0, states=FINISHED) -> dict[str, str]:
        """Poll until the job is in one of ``states``; its fields then.

        Raises:
            TimeoutError: not there within ``timeout`` s (the job is cancelled).
        """
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                why = f"job {job_id} still {info.get('JobState')} after {timeout} s"
                report = self.report(job_id)
                subprocess.run(["scancel", str(job_id)], env=self.env, capture_output=True)
                raise TimeoutError(f"{why}\n{report}")
            time.sleep(0.5)


def _run_env(env: dict, *cmd: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _stop_on(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    # Ctrl-C or `kill <pid>` stops the cluster (a shell's background job ignores SIGINT)
    signal.signal(signal.SIGINT, _stop_on)
    signal.signal(signal.SIGTERM, _stop_on)
    with SlurmCluster() as c:
        print(
            f"SLURM_CONF={c.conf}  shared folder: {c.root / 'shared'}  "
            f"(Ctrl-C or kill {os.getpid()} stops it)",
            flush=True,
        )
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass

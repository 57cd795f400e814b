"""Gradient allreduce across simulated hosts (network namespaces), and a ring-allreduce model.

    sudo .venv/bin/python benchmarks/multihost.py                     # full run, ~5 min
    sudo .venv/bin/python benchmarks/multihost.py --hosts 2 --links 1gbit --sizes 1M,4M --repeats 2

Needs root, ``ip`` and ``tc`` (iproute2); refuses with exit status 2 otherwise.

Set-up: each simulated host is a network namespace with one veth (``eth0``,
10.213.9.<i+1>/24); the other ends meet on a bridge in a hub namespace. A
link setting is applied to every host's ``eth0`` egress: ``veth`` (unshaped),
``10gbit`` or ``1gbit`` (``tc`` token bucket filter). Each host's
``/etc/netns/<ns>/hosts`` maps this machine's name to the host's own address, as
on real machines. The namespaces and those files are removed at the end, also on
Ctrl-C/SIGTERM (processes still in the namespaces are stopped first); a later
run removes what a SIGKILLed run left behind. Latency cannot be injected here
(no ``netem`` in this kernel): the per-message cost of the veth is measured and
larger round-trip times enter only the model below, labelled as modelled.

Per host count and link setting:

* probe: a TCP ping-pong of 1 byte between host 0 and host 1 (median round trip)
  and a bulk TCP transfer (achieved rate: checks the shaping);
* jobs, one rank per host: Gloo through hvdkit's scheduler/worker launch
  (``examples/cluster/run_scheduler.sh`` in host 0, ``run_workers.sh 1`` in every
  host); and, with ``--transports gloo,mpi`` (the default) where hosts <= cores,
  MPI through ``mpirun`` in host 0 with a launch agent in ssh's place that runs
  Open MPI's daemon in each host's namespace (Open MPI's TCP transport). Each
  rank times ``hvdkit.reduce_gradients`` inside a ``tf.function`` (the gradient
  path of ``DistributedOptimizer``: one grouped allreduce of a gradient list,
  with the step marker) for gradient lists of ``--sizes`` bytes of float32
  split in 8 tensors, without and with ``hvdkit.Compression.fp16``, interleaved
  call by call; the median of ``--repeats`` calls after 2 warm-up calls, slowest rank.

Model (pure functions below, checked by tests/unit/test_multihost_model.py): a
ring allreduce of S bytes on n hosts of bandwidth B and per-message latency
alpha takes ``2(n-1)/n * S/B + 2(n-1) * alpha`` (Gloo's allreduce is a ring).
One gradient step costs ``c + ring(S) + ring(0)``: ``c`` is the per-call cost in
the processes (TensorFlow, Horovod's fusion copy and cycle), and ``ring(0)`` is
Horovod's negotiation, itself a small Gloo allreduce every cycle. ``B`` and ``c``
are fitted by least squares to the 2-host figures of each link setting (Gloo's,
and separately MPI's, whose allreduce is taken to scale as a ring too); ``alpha``
is half the probe's round trip, plus half the modelled RTT. The Gloo fit is
checked against the measured 4-host figures. MPI's time over Gloo's is printed
per link, size and compression. Scaling efficiency of a step of compute
time ``t`` is ``t / (t + exposed)``; without overlap ``exposed`` is the whole
allreduce (hvdkit's case: the grouped allreduce starts after the backward pass),
with overlap it is what exceeds the backward pass (2/3 of ``t``), an upper bound.

Prints tables, writes bench_results/multihost.json and docs/multihost_bench.svg.
A benchmark, not a test: nothing here fails on a slow machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _svg import Series, document, legend, line_chart
from allreduce import GROUP_PIECES, parse_size

from hvdkit.launch.transport import MPI_ENV

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SUBNET = "10.213.9"
NS_PREFIX = "hvdmh-"
# link name -> tbf rate in bit/s (None: the veth unshaped)
LINKS = {"veth": None, "10gbit": 10e9, "1gbit": 1e9}
COMPRESSIONS = ("none", "fp16")
TRANSPORTS = ("gloo", "mpi")
WARMUP_CALLS = 2
PROBE_PORT = 29780
SCHED_PORT = 29790
JOB_TIMEOUT_S = 1500  # a guard against a hang, not a measure of speed

# The modelled cluster (stated in docs/performance.md).
MODEL_PARAMS = 25_000_000  # ResNet-50-sized: 25M float32 parameters = 100 MB of gradients
MODEL_HOSTS = (8, 32, 128)
MODEL_RTTS_S = (0.2e-3, 2e-3)
MODEL_LINKS = ("1gbit", "10gbit")
STEP_TIME_S = 0.25  # compute time of one training step on one host
BACKWARD_SHARE = 2 / 3  # the backward pass's share of a step (forward:backward ~ 1:2)
# DistributedOptimizer(backward_passes_per_step=k): one allreduce per k steps of compute
ACCUMULATION = (1, 2, 4)


# ----------------------------------------------------------------- the model (pure)
def ring_allreduce_seconds(nbytes: float, hosts: int, bandwidth: float, alpha: float) -> float:
    """Time of a ring allreduce: ``2(n-1)/n * S/B + 2(n-1) * alpha``.

    Args:
        nbytes: bytes reduced (S).
        hosts: ranks in the ring (n); 1 costs nothing.
        bandwidth: bytes per second each host sends (and receives) (B).
        alpha: seconds per message, one ring step (alpha).

    Example: 100 MB on 8 hosts at 1.25e9 B/s (10 Gbit/s) with alpha = 0.1 ms:
    ``2*7/8 * 0.08 s + 14 * 0.0001 s = 0.1414 s``.
    """
    if hosts < 1 or bandwidth <= 0 or alpha < 0 or nbytes < 0:
        raise ValueError(
            f"ring_allreduce_seconds: hosts={hosts}, bandwidth={bandwidth}, alpha={alpha}, "
            f"nbytes={nbytes}; need hosts >= 1, bandwidth > 0, alpha >= 0, nbytes >= 0"
        )
    if hosts == 1:
        return 0.0
    return 2 * (hosts - 1) / hosts * nbytes / bandwidth + 2 * (hosts - 1) * alpha


def step_allreduce_seconds(
    nbytes: float, hosts: int, bandwidth: float, alpha: float, per_call: float
) -> float:
    """One gradient step's allreduce in Horovod: ``c + ring(S) + ring(0)`` (Gloo's ring; MPI's
    rows take its allreduce to scale the same way).

    ``per_call`` (c) is the cost inside the processes; ``ring(0)`` is Horovod's
    negotiation (a Gloo allreduce of a small bit vector every cycle).
    """
    if hosts == 1:
        return 0.0
    data = ring_allreduce_seconds(nbytes, hosts, bandwidth, alpha)
    return per_call + data + ring_allreduce_seconds(0, hosts, bandwidth, alpha)


def scaling_efficiency(compute_s: float, comm_s: float, overlap_s: float = 0.0) -> float:
    """``compute / (compute + exposed)``, exposed = communication beyond ``overlap_s``."""
    if compute_s <= 0:
        raise ValueError(f"scaling_efficiency: compute_s={compute_s}; need a time > 0")
    return compute_s / (compute_s + max(0.0, comm_s - overlap_s))


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``; returns ``(a, b)``."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"fit_line: need >= 2 distinct x with one y each, got {xs!r}, {ys!r}")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return my - b * mx, b


def fit_alpha_beta(
    nbytes: Sequence[float], seconds: Sequence[float], hosts: int, alpha: float
) -> dict:
    """Bandwidth and per-call cost from measured step times of ``hosts`` ranks.

    The slope of seconds against bytes is ``2(n-1)/n / B``; the intercept is
    ``c + 2 * 2(n-1) * alpha`` (data ring and negotiation ring), ``alpha`` measured apart.
    """
    a, b = fit_line(nbytes, seconds)
    if b <= 0:
        raise ValueError(f"fit_alpha_beta: time does not grow with size (slope {b}); re-run")
    return {
        "bandwidth": 2 * (hosts - 1) / hosts / b,
        "per_call": a - 2 * 2 * (hosts - 1) * alpha,
        "intercept": a,
        "alpha": alpha,
    }


def hosts_at_efficiency(
    target: float,
    compute_s: float,
    nbytes: float,
    bandwidth: float,
    alpha: float,
    per_call: float,
    overlap_s: float = 0.0,
    limit: int = 4096,
) -> int:
    """Largest power-of-two host count whose efficiency is >= ``target`` (1 if none above 1)."""
    best, n = 1, 2
    while n <= limit:
        t = step_allreduce_seconds(nbytes, n, bandwidth, alpha, per_call)
        if scaling_efficiency(compute_s, t, overlap_s) < target:
            break
        best, n = n, n * 2
    return best


# ----------------------------------------------------------------- the lab (root)
def refuse(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


def preflight(transports: Sequence[str]) -> None:
    missing = []
    if os.geteuid() != 0:
        missing.append("root (it creates network namespaces): run it as root, e.g. sudo")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            missing.append(f"the '{tool}' command (Debian package iproute2)")
    if "mpi" in transports and shutil.which("mpirun") is None:
        missing.append(
            "Open MPI's mpirun for the MPI runs (Debian package openmpi-bin), "
            "or pass --transports gloo"
        )
    if not (BIN / "hvdkitrun").exists():
        missing.append(f"hvdkitrun next to {sys.executable} (run scripts/install.sh)")
    if missing:
        refuse("benchmarks/multihost.py needs " + "; and ".join(missing))


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _remove_namespace(ns: str) -> None:
    """Stop what still runs in ``ns`` (only this script's processes run there), then delete it."""
    pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(int(pid), sig)
            except (ProcessLookupError, ValueError):
                pass
        if sig == signal.SIGTERM and pids:
            time.sleep(1)
            pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
    sh("ip", "netns", "del", ns, check=False)
    shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


def remove_stale_namespaces() -> None:
    """Namespaces of earlier runs of this script whose process is gone (e.g. SIGKILLed)."""
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.strip() else ""
        if not ns.startswith(NS_PREFIX):
            continue
        pid = ns[len(NS_PREFIX) :].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            print(f"removing namespace {ns} left by an earlier run (pid {pid})", flush=True)
            _remove_namespace(ns)


class Lab:
    """``hosts`` namespaces on one bridge; ``shape`` applies a link setting to all of them."""

    def __init__(self, hosts: int):
        tag = f"{NS_PREFIX}{os.getpid()}"
        self.hub = f"{tag}-hub"
        self.names = [f"{tag}-h{i}" for i in range(hosts)]
        self.addrs = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self.procs: list[subprocess.Popen] = []
        self.created: list[str] = []

    def __enter__(self) -> Lab:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        sh("ip", "netns", "add", self.hub)
        self.created.append(self.hub)
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.names, self.addrs, strict=True)):
            sh("ip", "netns", "add", ns)
            self.created.append(ns)
            port = f"p{i}"
            sh(
                "ip",
                "link",
                "add",
                "eth0",
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                self.hub,
            )
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", self.hub, "link", "set", port, "master", "br0")
            sh("ip", "-n", self.hub, "link", "set", port, "up")
            hosts = Path("/etc/netns") / ns / "hosts"
            hosts.parent.mkdir(parents=True, exist_ok=True)
            hosts.write_text(f"127.0.0.1 localhost\n{addr} {socket.gethostname()}\n")

    def shape(self, link: str) -> None:
        rate = LINKS[link]
        for ns in self.names:
            sh("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
            if rate is not None:
                burst = max(16_000, int(rate / 8 * 1e-3))  # 1 ms at the rate
                sh(
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    "eth0",
                    "root",
                    "tbf",
                    "rate",
                    f"{int(rate)}bit",
                    "burst",
                    str(burst),
                    "latency",
                    "50ms",
                )

    def start(self, ns: str, cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
        with open(log, "w") as fh:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, *cmd],
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs.clear()
        for ns in reversed(self.created):
            _remove_namespace(ns)
        self.created.clear()


# ----------------------------------------------------------------- probes
def probe_server(port: int) -> None:
    srv = socket.create_server(("0.0.0.0", port))
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    f = conn.makefile("rb")
    while True:
        op = f.read(1)
        if op in (b"", b"q"):
            break
        if op == b"p":
            conn.sendall(b"p")
        elif op == b"b":
            left = int.from_bytes(f.read(8), "big")
            while left:
                left -= len(f.read1(min(left, 1 << 20)))
            conn.sendall(b"k")


def probe_client(host: str, port: int, out: str) -> None:
    for _ in range(300):
        try:
            conn = socket.create_connection((host, port), timeout=30)
            break
        except OSError:
            time.sleep(0.1)
    else:
        raise RuntimeError(f"probe server {host}:{port} did not answer")
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(2000):
        t0 = time.perf_counter()
        conn.sendall(b"p")
        conn.recv(1)
        rtts.append(time.perf_counter() - t0)
    chunk = bytes(1 << 20)
    rates = []
    for nbytes in (32 << 20,) * 3:
        t0 = time.perf_counter()
        conn.sendall(b"b" + nbytes.to_bytes(8, "big"))
        for _ in range(nbytes // len(chunk)):
            conn.sendall(chunk)
        conn.recv(1)
        rates.append(nbytes * 8 / (time.perf_counter() - t0))
    conn.sendall(b"q")
    rtt = statistics.median(rtts[100:])
    Path(out).write_text(json.dumps({"rtt_s": rtt, "gbit_s": statistics.median(rates) / 1e9}))


def probe(lab: Lab, tmp: Path) -> dict:
    out = tmp / "probe.json"
    out.unlink(missing_ok=True)
    me = [sys.executable, __file__]
    server = lab.start(
        lab.names[1],
        [*me, "--probe-server", str(PROBE_PORT)],
        dict(os.environ),
        tmp / "probe-server.log",
    )
    client = lab.start(
        lab.names[0],
        [*me, "--probe-client", lab.addrs[1], str(PROBE_PORT), "--out", str(out)],
        dict(os.environ),
        tmp / "probe-client.log",
    )
    for proc in (client, server):
        if proc.wait(timeout=300) != 0:
            log = (tmp / ("probe-client.log" if proc is client else "probe-server.log")).read_text()
            raise RuntimeError(f"link probe failed: {log[-2000:]}")
    return json.loads(out.read_text())


# ----------------------------------------------------------------- the job
def worker(sizes: list[str], repeats: int, out: str) -> None:
    """One rank: time hvdkit's gradient allreduce for every size, both compressions."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    import hvdkit as hvd

    hvd.init(intra_op_threads=1)
    step = tf.Variable(0, dtype=tf.int64)

    def make(compression):
        @tf.function
        def reduce(grads):
            # the DistributedOptimizer's path: one grouped allreduce with the step marker
            reduced = hvd.reduce_gradients(grads, compression=compression, step=step)
            step.assign_add(1)
            return tf.stack([r[0] for r in reduced])

        return reduce

    fns = {"none": make(hvd.Compression.none), "fp16": make(hvd.Compression.fp16)}
    results: dict[str, dict[str, float]] = {c: {} for c in COMPRESSIONS}
    for label in sizes:
        piece = parse_size(label) // 4 // GROUP_PIECES
        grads = [tf.random.uniform([piece]) for _ in range(GROUP_PIECES)]
        for fn in fns.values():
            for _ in range(WARMUP_CALLS):
                fn(grads).numpy()
        times: dict[str, list[float]] = {c: [] for c in COMPRESSIONS}
        for _ in range(repeats):
            for name, fn in fns.items():  # interleaved: both see the same machine noise
                t0 = time.perf_counter()
                fn(grads).numpy()
                times[name].append(time.perf_counter() - t0)
        for name in COMPRESSIONS:
            mine = tf.constant([statistics.median(times[name])], tf.float64)
            results[name][label] = float(hvd.allreduce(mine, op=hvd.Max)[0])
        if hvd.rank() == 0:
            shown = " ".join(f"{c}={results[c][label] * 1e3:.1f}ms" for c in COMPRESSIONS)
            print(f"  {label}: {shown}", flush=True)
    if hvd.rank() == 0:
        info = {
            "size": hvd.size(),
            "gloo_iface": os.environ.get("HOROVOD_GLOO_IFACE"),
            "transport": "gloo" if "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ else "mpi",
            "seconds": results,
        }
        Path(out).write_text(json.dumps(info))


def _job_env() -> dict:
    return dict(
        os.environ,
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONPATH=str(REPO),
        TF_CPP_MIN_LOG_LEVEL="2",
    )


def _worker_argv(sizes: list[str], repeats: int, out: Path) -> list[str]:
    return [
        sys.executable,
        __file__,
        "--worker",
        "--sizes",
        ",".join(sizes),
        "--repeats",
        str(repeats),
        "--out",
        str(out),
    ]


def _finish(procs: list[subprocess.Popen], out: Path, logs: list[Path], what: str) -> dict:
    """Wait for the job's processes (bounded); its result, or an error with its logs' tails."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    for proc in procs:
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    codes = [p.returncode for p in procs]
    if any(codes) or not out.exists():
        tails = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in logs)
        raise RuntimeError(f"the {what} allreduce job failed (exit codes {codes}):\n{tails}")
    return json.loads(out.read_text())


def run_job(lab: Lab, argv: list[str], out: Path, tmp: Path, port: int) -> dict:
    """Gloo: hvdkit's scheduler/worker launch, the scheduler in host 0, a worker in every host.

    Every worker runs ``argv``; rank 0 writes its result to ``out`` (JSON).
    """
    out.unlink(missing_ok=True)
    env = dict(
        _job_env(),
        HVDKIT_SCHED_HOST=lab.addrs[0],
        HVDKIT_SCHED_PORT=str(port),
        HVDKIT_JOB_TOKEN=secrets.token_hex(16),
        HVDKIT_WORKER_NUM=str(len(lab.names)),
        HVDKIT_SCHED_TIMEOUT="300",
    )
    cluster = REPO / "examples" / "cluster"
    logs = [tmp / "sched.log", *(tmp / f"worker{i}.log" for i in range(len(lab.names)))]
    sched = lab.start(lab.names[0], [str(cluster / "run_scheduler.sh")], env, logs[0])
    workers = [
        lab.start(ns, [str(cluster / "run_workers.sh"), "1", *argv], env, log)
        for ns, log in zip(lab.names, logs[1:], strict=True)
    ]
    return _finish([*workers, sched], out, logs, "Gloo")


def write_launch_agent(lab: Lab, path: Path) -> Path:
    """Open MPI's launch agent for the simulated hosts (``plm_rsh_agent``, ssh's place).

    ``mpirun`` calls it as ``agent <host> <command words>`` for every host but its
    own; it runs the command in that host's namespace, as ssh would run it there.
    """
    cases = "".join(
        f"  {addr}) ns={ns} ;;\n" for addr, ns in zip(lab.addrs, lab.names, strict=True)
    )
    path.write_text(
        "#!/bin/sh\n"
        "# written by benchmarks/multihost.py: mpirun's launch agent for its simulated hosts\n"
        'host="$1"; shift\n'
        'case "$host" in\n'
        f"{cases}"
        '  *) echo "launch agent: $host is not a simulated host" >&2; exit 2 ;;\n'
        "esac\n"
        'exec ip netns exec "$ns" sh -c "$*"\n'
    )
    path.chmod(0o755)
    return path


def run_job_mpi(lab: Lab, argv: list[str], out: Path, tmp: Path) -> dict:
    """MPI: ``mpirun`` in host 0 starts one rank per host (``argv``) through the namespace agent.

    Open MPI's TCP transport between the hosts (``btl tcp,self``): all the
    namespaces share this machine's name and /dev/shm, so Open MPI would
    otherwise take them for one node and pass messages through shared memory,
    which separate hosts cannot. ``MPI_ENV`` in the environment (ranks yield while
    waiting), as hvdkitrun gives it. ``--bind-to none``, as horovodrun passes: each
    simulated host's daemon would otherwise bind its one rank to core 0, all
    of them to the same core (measured: 24 ms for a 400 KB allreduce of Open
    MPI alone instead of 0.26 ms).
    """
    out.unlink(missing_ok=True)
    agent = write_launch_agent(lab, tmp / "netns_agent.sh")
    mpirun = [
        shutil.which("mpirun") or "mpirun",
        "--allow-run-as-root",
        "-np",
        str(len(lab.names)),
        "-H",
        ",".join(f"{addr}:1" for addr in lab.addrs),
        "--bind-to",
        "none",
        "--map-by",
        "slot",
        *("--mca", "plm_rsh_agent", str(agent)),
        *("--mca", "btl", "tcp,self"),
        *("--mca", "btl_tcp_if_include", "eth0"),
        *("--mca", "oob_tcp_if_include", "eth0"),
        *("-x", "PATH", "-x", "PYTHONPATH", "-x", "TF_CPP_MIN_LOG_LEVEL"),
    ]
    env = _job_env()
    for key, value in MPI_ENV.items():  # as hvdkitrun gives every MPI job (yours wins)
        env.setdefault(key, value)
    log = tmp / "mpirun.log"
    job = lab.start(lab.names[0], [*mpirun, *argv], env, log)
    return _finish([job], out, [log], "MPI")


# ----------------------------------------------------------------- analysis
def transport_of(run: dict) -> str:
    return run.get("transport", "gloo")  # JSON older than the worker's "transport" key: Gloo


def mpi_over_gloo(runs: list[dict], sizes: list[str]) -> dict[str, dict[str, float]]:
    """MPI's time over Gloo's per ``hosts/link/compression`` measured on both (< 1: MPI faster)."""
    gloo = {(r["hosts"], r["link"]): r for r in runs if transport_of(r) == "gloo"}
    out = {}
    for run in runs:
        other = gloo.get((run["hosts"], run["link"]))
        if transport_of(run) != "mpi" or other is None:
            continue
        for comp in COMPRESSIONS:
            out[f"{run['hosts']}/{run['link']}/{comp}"] = {
                s: run["seconds"][comp][s] / other["seconds"][comp][s] for s in sizes
            }
    return out


def analyse(runs: list[dict], sizes: list[str]) -> dict:
    """Fits per (hosts, link, compression) of the Gloo runs, the 4-host check, the
    predictions, MPI's time against Gloo's, and the MPI runs' fits and predictions."""
    compared = mpi_over_gloo(runs, sizes)
    mpi_runs = [r for r in runs if transport_of(r) == "mpi"]
    runs = [r for r in runs if transport_of(r) == "gloo"]  # the model is Gloo's ring
    fits = fit_runs(runs, sizes)
    mpi_fits = fit_runs(mpi_runs, sizes)
    mpi_predictions = [
        predict("measured", link, rtt, comp, False, fit["bandwidth"], fit)
        for link in MODEL_LINKS
        for rtt in MODEL_RTTS_S
        for comp in COMPRESSIONS
        if (fit := mpi_fits.get(f"2/{link}/{comp}")) is not None
    ]
    checks = {}
    for run in runs:
        n, link = run["hosts"], run["link"]
        for comp in COMPRESSIONS:
            base = fits.get(f"2/{link}/{comp}")
            if n == 2 or base is None:
                continue
            alpha = run["probe"]["rtt_s"] / 2
            ratios = {}
            for s in sizes:
                pred = step_allreduce_seconds(
                    parse_size(s), n, base["bandwidth"], alpha, max(0.0, base["per_call"])
                )
                ratios[s] = run["seconds"][comp][s] / pred
            checks[f"{n}/{link}/{comp}"] = ratios
    predictions = []
    for basis in ("measured", "line"):
        for link in MODEL_LINKS:
            for rtt in MODEL_RTTS_S:
                for comp in COMPRESSIONS:
                    fit = fits.get(f"2/{link}/{comp}")
                    if fit is None:
                        continue
                    # measured: B as hvdkit reached it here (CPU costs included);
                    # line: the nominal rate, fp16 sending half the bytes, CPU costs ignored
                    bandwidth = fit["bandwidth"]
                    if basis == "line":
                        bandwidth = LINKS[link] / 8 * (2 if comp == "fp16" else 1)
                    predictions += [
                        predict(basis, link, rtt, comp, overlap, bandwidth, fit)
                        for overlap in (False, True)
                    ]
    accumulation = []
    for basis in ("measured", "line"):
        fit = fits.get("2/10gbit/none")
        if fit is None:
            continue
        bandwidth = fit["bandwidth"] if basis == "measured" else LINKS["10gbit"] / 8
        for rtt in MODEL_RTTS_S:
            alpha, per_call = fit["alpha"] + rtt / 2, max(0.0, fit["per_call"])
            for k in ACCUMULATION:
                eff = {
                    n: scaling_efficiency(
                        k * STEP_TIME_S,
                        step_allreduce_seconds(4 * MODEL_PARAMS, n, bandwidth, alpha, per_call),
                    )
                    for n in MODEL_HOSTS
                }
                accumulation.append(
                    {"basis": basis, "rtt_ms": round(rtt * 1e3, 3), "passes": k, "efficiency": eff}
                )
    return {
        "fits": fits,
        "check_4_hosts": checks,
        "predictions": predictions,
        "accumulation": accumulation,
        "mpi_over_gloo": compared,
        "mpi_fits": mpi_fits,
        "mpi_predictions": mpi_predictions,
    }


def fit_runs(runs: list[dict], sizes: list[str]) -> dict[str, dict]:
    """``fit_alpha_beta`` of every run, keyed ``hosts/link/compression``."""
    fits: dict[str, dict] = {}
    for run in runs:
        n, link = run["hosts"], run["link"]
        alpha = run["probe"]["rtt_s"] / 2
        for comp in COMPRESSIONS:
            xs = [float(parse_size(s)) for s in sizes]
            ys = [run["seconds"][comp][s] for s in sizes]
            fits[f"{n}/{link}/{comp}"] = fit_alpha_beta(xs, ys, n, alpha)
    return fits


def predict(
    basis: str, link: str, rtt: float, comp: str, overlap: bool, bandwidth: float, fit: dict
) -> dict:
    """Efficiency of the modelled step at ``MODEL_HOSTS`` for one setting."""
    alpha = fit["alpha"] + rtt / 2
    per_call = max(0.0, fit["per_call"])
    hidden = BACKWARD_SHARE * STEP_TIME_S if overlap else 0.0
    nbytes = 4 * MODEL_PARAMS
    row = {
        "basis": basis,
        "link": link,
        "rtt_ms": round(rtt * 1e3, 3),
        "compression": comp,
        "overlap": overlap,
        "bandwidth_gbit_s": bandwidth * 8 / 1e9,
        "efficiency": {},
        "allreduce_s": {},
    }
    for n in MODEL_HOSTS:
        t = step_allreduce_seconds(nbytes, n, bandwidth, alpha, per_call)
        row["allreduce_s"][n] = t
        row["efficiency"][n] = scaling_efficiency(STEP_TIME_S, t, hidden)
    row["hosts_at_90pct"] = hosts_at_efficiency(
        0.9, STEP_TIME_S, nbytes, bandwidth, alpha, per_call, hidden
    )
    return row


def print_report(runs: list[dict], sizes: list[str], analysis: dict) -> None:
    print("\nms per gradient allreduce (hvdkit.reduce_gradients in a tf.function;")
    print("median of the calls, slowest rank); probe = TCP ping-pong RTT and bulk rate")
    print(f"{'hosts link  via':19s}{'probe':>20s} {'comp':6s}" + "".join(f"{s:>9s}" for s in sizes))
    for run in runs:
        p = run["probe"]
        head = f"{run['hosts']:<2d}   {run['link']:7s}{transport_of(run):5s}"
        pr = f"{p['rtt_s'] * 1e6:6.0f}us {p['gbit_s']:5.2f}Gb/s"
        for comp in COMPRESSIONS:
            cells = "".join(f"{run['seconds'][comp][s] * 1e3:9.1f}" for s in sizes)
            print(f"{head:19s}{pr:>20s} {comp:6s}{cells}")
            head, pr = "", ""
        gains = "".join(
            f"{run['seconds']['none'][s] / run['seconds']['fp16'][s]:8.2f}x" for s in sizes
        )
        print(f"{'':19s}{'':>20s} {'gain':6s}{gains}")
    if analysis["mpi_over_gloo"]:
        print("\nMPI time / Gloo time, same hosts and link (< 1: MPI faster)")
        for key, ratios in analysis["mpi_over_gloo"].items():
            print(f"{key:22s}" + "".join(f"{r:9.2f}" for r in ratios.values()))
    print("\nfit of c + 2(n-1)/n*S/B + 2*2(n-1)*alpha (alpha = probe RTT/2), Gloo runs")
    print(f"{'hosts/link/comp':22s}{'B Gbit/s':>10s}{'c ms':>9s}{'alpha us':>10s}")
    for key, f in analysis["fits"].items():
        print(
            f"{key:22s}{f['bandwidth'] * 8 / 1e9:10.2f}{f['per_call'] * 1e3:9.2f}"
            f"{f['alpha'] * 1e6:10.1f}"
        )
    if analysis["check_4_hosts"]:
        print("\nmeasured / predicted from the 2-host fit")
        for key, ratios in analysis["check_4_hosts"].items():
            print(f"{key:22s}" + "".join(f"{r:9.2f}" for r in ratios.values()))
    print(
        f"\nmodelled: {MODEL_PARAMS / 1e6:g}M parameters ({4 * MODEL_PARAMS / 1e6:g} MB fp32), "
        f"{STEP_TIME_S} s compute per step; scaling efficiency at {MODEL_HOSTS} hosts"
    )
    print(
        f"{'B from':9s}{'link':8s}{'RTT ms':>7s} {'comp':5s}{'overlap':>8s}"
        + "".join(f"{n:>8d}" for n in MODEL_HOSTS)
        + "   hosts>=90%"
    )
    for row in analysis["predictions"]:
        print_prediction(row)
    if analysis.get("mpi_predictions"):
        print("\nthe same model with B and c fitted to the 2-host MPI runs")
        print("(Open MPI's allreduce taken to scale as a ring: not measured beyond 2 hosts)")
        print(f"{'hosts/link/comp':22s}{'B Gbit/s':>10s}{'c ms':>9s}")
        for key, f in analysis["mpi_fits"].items():
            print(f"{key:22s}{f['bandwidth'] * 8 / 1e9:10.2f}{f['per_call'] * 1e3:9.2f}")
        for row in analysis["mpi_predictions"]:
            print_prediction(row)


def print_prediction(row: dict) -> None:
    cells = "".join(f"{row['efficiency'][n] * 100:7.0f}%" for n in MODEL_HOSTS)
    at90 = row["hosts_at_90pct"]
    print(
        f"{row['basis']:9s}{row['link']:8s}{row['rtt_ms']:7.1f} {row['compression']:5s}"
        f"{'yes' if row['overlap'] else 'no':>8s}{cells}   {at90 if at90 > 1 else '<2'}"
    )


def print_accumulation(analysis: dict) -> None:
    if not analysis["accumulation"]:
        return
    print("\nbackward_passes_per_step k (one fp32 allreduce per k steps), 10gbit, no overlap")
    print(f"{'B from':9s}{'RTT ms':>7s}{'k':>3s}" + "".join(f"{n:>8d}" for n in MODEL_HOSTS))
    for row in analysis["accumulation"]:
        cells = "".join(f"{row['efficiency'][n] * 100:7.0f}%" for n in MODEL_HOSTS)
        print(f"{row['basis']:9s}{row['rtt_ms']:7.1f}{row['passes']:3d}{cells}")


COLORS = {"veth": "#2ca02c", "10gbit": "#1f77b4", "1gbit": "#d62728"}
RTT_COLORS = {
    ("1gbit", 0.2): "#d62728",
    ("1gbit", 2.0): "#ff9896",
    ("10gbit", 0.2): "#1f77b4",
    ("10gbit", 2.0): "#aec7e8",
}


def svg_plot(runs: list[dict], sizes: list[str], analysis: dict, path: Path) -> None:
    """Left: measured ms against size on 2 hosts (Gloo); middle: modelled efficiency (no
    overlap); right, where MPI was measured: MPI's time over Gloo's on 2 hosts."""
    measured = [
        Series(
            f"{r['link']}{' fp16' if c == 'fp16' else ''}",
            COLORS[r["link"]],
            [r["seconds"][c][s] * 1e3 for s in sizes],
            dash=c == "fp16",
        )
        for r in runs
        if r["hosts"] == 2 and transport_of(r) == "gloo"
        for c in COMPRESSIONS
    ]
    modelled = [
        Series(
            f"{row['link']} {row['rtt_ms']:g}ms{' fp16' if row['compression'] == 'fp16' else ''}",
            RTT_COLORS[(row["link"], row["rtt_ms"])],
            [row["efficiency"][n] * 100 for n in MODEL_HOSTS],
            dash=row["compression"] == "fp16",
        )
        for row in analysis["predictions"]
        if not row["overlap"] and row["basis"] == "measured"
    ]
    parts = line_chart(
        0,
        0,
        430,
        300,
        title="measured: 2 hosts, Gloo; x: bytes of fp32 gradients",
        x_labels=sizes,
        x_values=[float(parse_size(s)) for s in sizes],
        y_label="ms per gradient allreduce",
        series=measured,
    )
    parts += legend(70, 320, measured, 2, 170)
    parts += line_chart(
        440,
        0,
        430,
        300,
        title="modelled: 100 MB gradients, 0.25 s step, B as measured",
        x_labels=[f"{n} hosts" for n in MODEL_HOSTS],
        x_values=[float(n) for n in MODEL_HOSTS],
        y_label="scaling efficiency % (no overlap, as hvdkit)",
        series=modelled,
        log_y=False,
        y_range=(0.0, 100.0),
    )
    parts += legend(510, 320, modelled, 2, 170)
    width = 880
    ratios = [
        Series(
            f"{key.split('/')[1]}{' fp16' if key.endswith('fp16') else ''}",
            COLORS[key.split("/")[1]],
            [by_size[s] for s in sizes],
            dash=key.endswith("fp16"),
        )
        for key, by_size in analysis.get("mpi_over_gloo", {}).items()
        if key.startswith("2/")
    ]
    if ratios:
        top = max(2.0, math.ceil(max(v for r in ratios for v in r.values) * 2) / 2)
        parts += line_chart(
            880,
            0,
            430,
            300,
            title="measured: 2 hosts, MPI time / Gloo time",
            x_labels=sizes,
            x_values=[float(parse_size(s)) for s in sizes],
            y_label="< 1: MPI faster",
            series=ratios,
            log_y=False,
            y_range=(0.0, top),
        )
        parts += legend(950, 320, ratios, 2, 170)
        width = 1320
    foot = (
        "dashed: hvdkit.Compression.fp16; 2-core shared machine, tc tbf shaping; "
        "RTT added in the model only (benchmarks/multihost.py)"
    )
    path.write_text(document(width, 410, parts, foot))


# ----------------------------------------------------------------- main
def _interrupted(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--probe-server", type=int)
    p.add_argument("--probe-client", nargs=2, metavar=("HOST", "PORT"))
    p.add_argument("--out")
    p.add_argument("--hosts", default="2,4", help="host counts, e.g. 2,4")
    p.add_argument("--links", default="veth,10gbit,1gbit", help=f"of {', '.join(LINKS)}")
    p.add_argument(
        "--transports",
        default="gloo,mpi",
        help="of gloo, mpi; MPI runs only where hosts <= cores (one rank per core)",
    )
    p.add_argument("--sizes", default="1M,4M,16M,64M,100M", help="bytes of float32 gradients")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=str(REPO / "bench_results" / "multihost.json"))
    p.add_argument("--plot", default=str(REPO / "docs" / "multihost_bench.svg"))
    p.add_argument("--from-json", help="re-analyse the runs of an earlier JSON (no namespaces)")
    args = p.parse_args()
    sizes = [s.strip().upper() for s in args.sizes.split(",")]
    if args.worker:
        worker(sizes, args.repeats, args.out)
        return
    if args.probe_server:
        probe_server(args.probe_server)
        return
    if args.probe_client:
        probe_client(args.probe_client[0], int(args.probe_client[1]), args.out)
        return

    if args.from_json:
        old = json.loads(Path(args.from_json).read_text())
        config, runs = old["config"], old["runs"]
    else:
        config, runs = measure(args, sizes)
        # the measurements first, so that a failing analysis does not lose them
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"config": config, "runs": runs}, indent=2))
    analysis = analyse(runs, config["sizes"])
    print_report(runs, config["sizes"], analysis)
    print_accumulation(analysis)
    config["model"] = {
        "params": MODEL_PARAMS,
        "step_time_s": STEP_TIME_S,
        "backward_share": BACKWARD_SHARE,
        "hosts": MODEL_HOSTS,
        "rtt_s": MODEL_RTTS_S,
        "accumulation": ACCUMULATION,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"config": config, "runs": runs, **analysis}, indent=2))
    print(f"\nwrote {args.json}")
    if args.plot:
        svg_plot(runs, config["sizes"], analysis, Path(args.plot))
        print(f"wrote {args.plot}")


def measure(args: argparse.Namespace, sizes: list[str]) -> tuple[dict, list[dict]]:
    """Every host count and link setting in turn; returns the run's config and its runs."""
    links = [s.strip() for s in args.links.split(",")]
    hosts = [int(h) for h in args.hosts.split(",")]
    transports = [t.strip() for t in args.transports.split(",")]
    bad = [x for x in links if x not in LINKS] + [str(h) for h in hosts if h < 2]
    bad += [t for t in transports if t not in TRANSPORTS]
    if bad:
        refuse(
            f"multihost.py: bad --links/--hosts/--transports value(s) {bad}; links are "
            f"{', '.join(LINKS)}, hosts >= 2, transports {', '.join(TRANSPORTS)}"
        )
    if len(sizes) < 2:
        refuse(f"multihost.py: --sizes {','.join(sizes)} has fewer than 2 sizes (the fit needs 2)")
    if "gloo" not in transports:
        refuse(
            f"multihost.py: --transports {','.join(transports)} lacks gloo, the model's basis "
            "and the reference of MPI's ratios; add it"
        )
    preflight(transports)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupted)
    remove_stale_namespaces()
    tmp = REPO / "bench_results" / f"multihost-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    runs = []
    try:
        for n in hosts:
            with Lab(n) as lab:  # removed on the way out, whatever happens
                for link in links:
                    lab.shape(link)
                    pr = probe(lab, tmp)
                    print(
                        f"{n} hosts, {link}: probe RTT {pr['rtt_s'] * 1e6:.0f} us, "
                        f"{pr['gbit_s']:.2f} Gbit/s",
                        flush=True,
                    )
                    out = tmp / "job.json"
                    me = _worker_argv(sizes, args.repeats, out)
                    got = run_job(lab, me, out, tmp, SCHED_PORT + len(runs))
                    runs.append({"hosts": n, "link": link, "probe": pr, **got})
                    if "mpi" not in transports:
                        continue
                    if n > (os.cpu_count() or 1):
                        print(f"  MPI skipped: {n} ranks on {os.cpu_count()} cores", flush=True)
                        continue
                    got = run_job_mpi(lab, me, out, tmp)
                    runs.append({"hosts": n, "link": link, "probe": pr, **got})
    except KeyboardInterrupt as exc:
        sys.exit(f"multihost.py: interrupted ({exc}); namespaces and /etc/netns files removed")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    config = {
        "hosts": hosts,
        "links": links,
        "transports": transports,
        "sizes": sizes,
        "repeats": args.repeats,
        "pieces": GROUP_PIECES,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    return config, runs


if __name__ == "__main__":
    main()

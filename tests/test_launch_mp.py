"""Launching: horovodrun, mpirun, hvdkitrun and the scheduler/worker scripts.

The same small training (tests/multiproc/launch_train.py) must end with the
same weights whichever way it is started, and every failure mode must end
the job non-zero, naming the rank, within a bounded time.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from hvdkit.launch.transport import choose_transport, ranks_yield

from conftest import (
    MULTIPROC,
    NETNS_MISSING,
    REPO,
    VENV_BIN,
    launcher_env,
    needs_netns,
    remove_netns,
    run_bounded,
)

TRAIN = str(MULTIPROC / "launch_train.py")
SCHEDULER_SH = str(REPO / "examples" / "cluster" / "run_scheduler.sh")
WORKERS_SH = str(REPO / "examples" / "cluster" / "run_workers.sh")
PY = sys.executable
# A guard against a hang on a loaded machine, never a measure of speed.
HANG_S = 600


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports (held open together, so none is returned twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def weights(outdir: Path) -> list[np.ndarray]:
    return [np.load(outdir / f"weights.rank{r}.npy") for r in (0, 1)]


def pids(outdir: Path) -> list[int]:
    return [int((outdir / f"pid.rank{r}").read_text()) for r in (0, 1)]


def assert_gone(pid_list):
    for pid in pid_list:
        alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        assert not alive, f"process {pid} is still running"


def run(cmd, tmp_path, timeout=HANG_S, env_extra=None):
    env = launcher_env()
    env.update(env_extra or {})
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path
    )
    proc.output = proc.stdout + proc.stderr
    return proc


def sched_env(port, token="test-token", worker_num=2, **extra):
    env = {
        "HVDKIT_SCHED_PORT": str(port),
        "HVDKIT_JOB_TOKEN": token,
        "HVDKIT_WORKER_NUM": str(worker_num),
        "HVDKIT_SCHED_TIMEOUT": "60",
    }
    env.update({k: str(v) for k, v in extra.items()})
    return env


def start(cmd, env_extra, cwd, netns=None):
    env = launcher_env()
    env.update(env_extra)
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd
    )


def finish(proc, timeout=HANG_S):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def scheduler_job(
    tmp_path,
    outdir,
    port,
    *train_args,
    token="test-token",
    netns=(None, None, None),
    sched_host="127.0.0.1",
    **env_extra,
):
    """run_scheduler.sh + one run_workers.sh per worker; returns (codes, outputs)."""
    env = sched_env(port, token, HVDKIT_SCHED_HOST=sched_host, **env_extra)
    sched = start([SCHEDULER_SH], env, tmp_path, netns[0])
    workers = [
        start(
            [WORKERS_SH, "1", PY, TRAIN, str(outdir), *train_args],
            env,
            tmp_path,
            ns,
        )
        for ns in netns[1:]
    ]
    results = [finish(p) for p in [sched, *workers]]
    return [c for c, _ in results], [o for _, o in results]


# ------------------------------------------------------------------ success paths
def test_same_weights_under_every_launcher(tmp_path):
    results = {}
    launchers = {
        "horovodrun-gloo": [str(VENV_BIN / "horovodrun"), "-np", "2", "--gloo", PY, TRAIN],
        "horovodrun-mpi": [str(VENV_BIN / "horovodrun"), "-np", "2", "--mpi", PY, TRAIN],
        "mpirun": ["mpirun", "-np", "2", "--bind-to", "none"]
        + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
        + [PY, TRAIN],
        # no transport flag: the default rule picks one and says which
        # --check-weights: the ranks' weights are compared at the end (equal: exit 0)
        "hvdkitrun-default": [str(VENV_BIN / "hvdkitrun"), "-np", "2", "--log-dir", "logs"]
        + ["--check-weights", PY, TRAIN],
        "hvdkitrun-mpi": [str(VENV_BIN / "hvdkitrun"), "-np", "2", "--mpi", "--check-weights"]
        + [PY, TRAIN],
    }
    for name, cmd in launchers.items():
        outdir = tmp_path / name
        outdir.mkdir()
        proc = run([*cmd, str(outdir)], tmp_path)
        assert proc.returncode == 0, (name, proc.output[-3000:])
        results[name] = weights(outdir)
        announced = r"hvdkitrun: transport (\w+) \(2 processes, (\d+) cores here, ([^;]+); "
        said = re.findall(announced, proc.stderr)
        if name == "hvdkitrun-default":
            assert len(said) == 1 and said[0][0] in ("gloo", "mpi"), proc.stderr[-3000:]
            other = "--gloo" if said[0][0] == "mpi" else "--mpi"
            assert f"docs/performance.md); {other} to override." in proc.stderr
            assert int(said[0][1]) == os.cpu_count()
            # the pick is the documented rule applied to what it announced: the busy
            # cores, measured only when MPI's ranks spin (else they cannot matter)
            yields = ranks_yield(launcher_env())
            if yields:
                assert said[0][2] == "MPI's ranks yield", said
            else:
                assert said[0][2].endswith(" busy"), said
            rule = choose_transport(
                [("localhost", 2)],
                cores=os.cpu_count(),
                load=0.0 if yields else float(said[0][2].removesuffix(" busy")),
                mpi_available=True,
                is_local=lambda host: True,
                ranks_yield=yields,
            )
            assert said[0][0] == rule, said
        else:
            assert said == [], (name, said)  # a transport given is not announced
    outdir = tmp_path / "scheduler"
    outdir.mkdir()
    weights_dir = tmp_path / "fingerprints"
    check = {"HVDKIT_CHECK_WEIGHTS": "1", "HVDKIT_WEIGHTS_DIR": weights_dir}
    codes, outs = scheduler_job(tmp_path, outdir, free_port(), **check)
    assert codes == [0, 0, 0], outs
    assert "all 2 ranks finished successfully" in outs[0]
    assert sorted(p.name for p in weights_dir.iterdir()) == ["rank.0.json", "rank.1.json"]
    results["scheduler/worker"] = weights(outdir)

    ref = results["horovodrun-gloo"][0]
    assert ref.shape == (19,)  # 4*3 + 3 + 3*1 + 1 parameters
    for name, (w0, w1) in results.items():
        np.testing.assert_array_equal(w0, w1, err_msg=f"{name}: ranks differ")
        np.testing.assert_allclose(w0, ref, rtol=1e-6, atol=1e-7, err_msg=name)

    # hvdkitrun: rank-prefixed console, per-rank log files
    log0 = (tmp_path / "logs" / "rank.0" / "stdout").read_text()
    log1 = (tmp_path / "logs" / "rank.1" / "stdout").read_text()
    assert log0.startswith("rank 0 of 2 (local 0/2)") and "rank 0 final loss" in log0
    assert log1.startswith("rank 1 of 2 (local 1/2)") and "[rank" not in log1


def test_hvdkitrun_log_files_hold_each_ranks_lines_exactly(transport, tmp_path):
    # Unbuffered ranks write a line's text and its newline separately; mpirun
    # then glues one rank's text to another's on one line of its output.
    lines = 2000
    code = (
        "import os; e = os.environ\n"
        "r = int(e.get('OMPI_COMM_WORLD_RANK') or e['HOROVOD_RANK'])\n"
        f"for i in range({lines}): print(f'rank {{r}} line {{i}}', 'x' * 40)"
    )
    cmd = [str(VENV_BIN / "hvdkitrun"), "-np", "2", f"--{transport}", "--log-dir", "logs"]
    proc = run([*cmd, PY, "-c", code], tmp_path, env_extra={"PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.output[-3000:]
    for r in (0, 1):
        got = (tmp_path / "logs" / f"rank.{r}" / "stdout").read_text().splitlines()
        want = [f"rank {r} line {i} " + "x" * 40 for i in range(lines)]
        wrong = [(i, g) for i, (g, w) in enumerate(zip(got, want, strict=False)) if g != w]
        assert len(got) == lines and not wrong, (r, len(got), wrong[:3])
    console = [ln for ln in proc.stdout.splitlines() if ln.startswith("[rank ")]
    assert len(console) == 2 * lines
    assert all(ln.startswith(f"[rank {ln[6]}] rank {ln[6]} line ") for ln in console)


def test_hvdkitrun_prefixes_lines(tmp_path):
    """...and a rank's layout left in the launching shell does not reach the ranks (under
    horovodrun it overrides each rank's own: both ranks were rank 0, and Horovod's start
    waited out its timeout). In this test because it is the quick tier's one 2-rank job."""
    code = (
        "import hvdkit, os; hvdkit.init(); "
        "print('hi', hvdkit.rank(), os.environ['HOROVOD_CONTROLLER'], os.environ['HOROVOD_RANK'])"
    )
    # --gloo: the default transport depends on the machine's load (launch/transport.py)
    proc = run(
        [str(VENV_BIN / "hvdkitrun"), "-np", "2", "--gloo", PY, "-c", code],
        tmp_path,
        env_extra={"HOROVOD_RANK": "0", "HOROVOD_LOCAL_RANK": "0"},
    )
    assert proc.returncode == 0, proc.output
    assert "[rank 0] hi 0 gloo 0" in proc.stdout and "[rank 1] hi 1 gloo 1" in proc.stdout
    assert "not passing HOROVOD_RANK=0, HOROVOD_LOCAL_RANK=0 from this environment" in proc.stderr


YIELD = "OMPI_MCA_mpi_yield_when_idle"  # spelled out: these tests do not trust MPI_ENV
BTL = "OMPI_MCA_btl"  # mpirun hands its `-mca btl` value to the ranks in this variable


def hvdkitrun_with_mpi_vars(given: str | None, argv: list[str], tmp_path, btl: str | None = None):
    """``hvdkitrun *argv`` with ``YIELD`` set to ``given``, or unset (the suite sets it),
    and ``BTL`` set to ``btl`` or unset."""
    env = launcher_env()
    env.pop(YIELD, None)
    env.pop(BTL, None)
    if given is not None:
        env[YIELD] = given
    if btl is not None:
        env[BTL] = btl
    proc = subprocess.run(
        ["hvdkitrun", *argv], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=HANG_S
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.parametrize(
    "transport, given, btl, seen",
    [
        ("mpi", None, None, "1 ^openib,ofi"),
        ("mpi", "0", "self,vader,tcp", "0 self,vader,tcp"),
        ("gloo", None, None, "None None"),
    ],
)
def test_hvdkitrun_open_mpi_settings(tmp_path, transport, given, btl, seen):
    """MPI jobs get OMPI_MCA_mpi_yield_when_idle=1 (transport.MPI_ENV) and, on one
    machine, Open MPI's ofi layer left out (transport.mpirun_btl), unless the user
    set these variables: then theirs reach the ranks (horovodrun's own `-mca btl`
    flag would override OMPI_MCA_btl)."""
    show = f"import os; print('yield', os.environ.get({YIELD!r}), os.environ.get({BTL!r}))"
    argv = ["-np", "2", f"--{transport}", PY, "-c", show]
    proc = hvdkitrun_with_mpi_vars(given, argv, tmp_path, btl=btl)
    lines = sorted(line for line in proc.stdout.splitlines() if "] yield " in line)
    assert lines == [f"[rank 0] yield {seen}", f"[rank 1] yield {seen}"], proc.stdout


@pytest.mark.parametrize("given, expected", [(None, "mpi"), ("0", "gloo")])
def test_hvdkitrun_default_with_more_processes_than_cores(tmp_path, given, expected):
    """Oversubscribed: MPI while its ranks yield (hvdkitrun's default), Gloo if they spin."""
    np_ = (os.cpu_count() or 1) + 2
    proc = hvdkitrun_with_mpi_vars(given, ["-np", str(np_), PY, "-c", "pass"], tmp_path)
    said = re.findall(rf"hvdkitrun: transport (\w+) \({np_} processes, ", proc.stderr)
    assert said == [expected], proc.stderr


def test_hvdkitrun_argument_errors(tmp_path):
    hv = str(VENV_BIN / "hvdkitrun")
    for args, fragment in [
        ([PY, "x.py"], "say how many processes"),
        (["-np", "2"], "no program given"),
        (["-np", "3", "-H", "localhost:2", PY], "more than the 2 slots"),
        (["-np", "4", "--nproc-per-node", "2", PY], "conflicts with --nproc-per-node"),
        (["-H", "a", PY], "needs a slot count"),
        (["-np", "2", "--stall-timeout", "0", PY], "must be positive"),
    ]:
        proc = run([hv, *args], tmp_path, timeout=HANG_S)
        assert proc.returncode == 2, (args, proc.output)
        assert fragment in proc.stderr, (args, proc.stderr)


# ------------------------------------------------------------------ failures
def hvdkitrun_with_fault(tmp_path, transport, fault, timeout, env_extra=None):
    cmd = [
        str(VENV_BIN / "hvdkitrun"),
        "-np",
        "2",
        f"--{transport}",
        PY,
        TRAIN,
        str(tmp_path),
        "--fault",
        fault,
        "--fault-rank",
        "1",
    ]
    return run(cmd, tmp_path, timeout=timeout, env_extra=env_extra)


@pytest.mark.parametrize("transport", ["gloo", "mpi"])
def test_hvdkitrun_failing_rank_is_named_and_job_stops(tmp_path, transport):
    # the timeout only guards against a hang; how fast the job ends is not asserted
    proc = hvdkitrun_with_fault(tmp_path, transport, "kill", timeout=HANG_S)
    assert proc.returncode != 0
    assert "hvdkitrun: rank 1 failed" in proc.stderr, proc.output[-3000:]
    assert "injecting fault 'kill'" in proc.stderr.split("hvdkitrun: rank 1 failed")[-1]
    assert not (tmp_path / "weights.rank0.npy").exists()  # rank 0 was stopped, not finished
    assert_gone(pids(tmp_path))


@pytest.mark.parametrize("transport", ["gloo", "mpi"])
def test_hvdkitrun_stall_timeout_ends_a_frozen_job(tmp_path, transport):
    proc = hvdkitrun_with_fault(
        tmp_path, transport, "stop", timeout=HANG_S, env_extra={"HVDKIT_STALL_TIMEOUT": "10"}
    )
    assert proc.returncode == 124, proc.output[-3000:]
    silent = re.search(r"hvdkitrun: rank 1 stalled: no heartbeat for (\d+) s", proc.stderr)
    assert silent, proc.output[-3000:]
    assert int(silent.group(1)) >= 10  # ended by the stall timeout, not before it
    assert_gone(pids(tmp_path))  # the SIGSTOPped rank was cleaned up too


def test_scheduler_kill_one_worker_mid_training(tmp_path):
    codes, outs = scheduler_job(
        tmp_path, tmp_path, free_port(), "--fault", "kill", "--fault-rank", "1"
    )
    assert all(c != 0 for c in codes), (codes, outs)
    assert "job failed: rank 1 killed by signal 9 (SIGKILL)" in outs[0], outs[0]
    assert_gone(pids(tmp_path))


def test_hvdkitrun_rank_finishing_early_is_not_a_stall(tmp_path):
    code = (
        "import hvdkit, time; hvdkit.init(); "
        "time.sleep(8 if hvdkit.rank() == 0 else 0); print('done', hvdkit.rank())"
    )
    proc = run(
        [str(VENV_BIN / "hvdkitrun"), "-np", "2", PY, "-c", code],
        tmp_path,
        env_extra={"HVDKIT_STALL_TIMEOUT": "3"},
    )
    assert proc.returncode == 0, proc.output[-3000:]
    assert "[rank 0] done 0" in proc.stdout and "stalled" not in proc.output


def test_scheduler_names_a_worker_that_was_killed(tmp_path):
    port = free_port()
    env = sched_env(port, HVDKIT_SCHED_HOST="127.0.0.1")
    sched = start([SCHEDULER_SH], env, tmp_path)
    train = [PY, TRAIN, str(tmp_path), "--steps", "400"]
    workers = [start([WORKERS_SH, "1", *train], env, tmp_path) for _ in range(2)]
    deadline = time.monotonic() + HANG_S
    # both ranks are training (each wrote its marker after its third step) before the kill
    while not all((tmp_path / f"trained.rank{r}").exists() for r in (0, 1)):
        assert time.monotonic() < deadline, "ranks did not start training"
        time.sleep(0.2)
    supervisor = psutil.Process(pids(tmp_path)[1]).parent()  # rank 1's worker process
    supervisor.kill()
    results = [finish(p) for p in [sched, *workers]]
    assert all(c != 0 for c, _ in results), results
    assert "job failed: rank 1 lost its worker" in results[0][1], results[0][1]
    assert_gone(pids(tmp_path))  # rank 1's program died with its worker


def test_scheduler_stops_a_job_with_a_frozen_worker(tmp_path):
    port = free_port()
    env = sched_env(port, HVDKIT_SCHED_HOST="127.0.0.1", HVDKIT_STALL_TIMEOUT=10)
    sched = start([SCHEDULER_SH], env, tmp_path)
    workers = [
        start(
            [
                WORKERS_SH,
                "1",
                PY,
                TRAIN,
                str(tmp_path),
                "--fault",
                "stop",
                "--fault-rank",
                "1",
            ],
            env,
            tmp_path,
        )
        for _ in range(2)
    ]
    results = [finish(p) for p in [sched, *workers]]
    assert all(c != 0 for c, _ in results), results
    assert "job failed: rank 1 stalled: no heartbeat for" in results[0][1], results[0][1]
    assert_gone(pids(tmp_path))


def test_scheduler_times_out_when_a_worker_never_arrives(tmp_path):
    port = free_port()
    env = sched_env(port, HVDKIT_SCHED_TIMEOUT=5)
    sched = start([SCHEDULER_SH], env, tmp_path)
    worker = start([WORKERS_SH, "1", PY, "-c", "pass"], env, tmp_path)
    (sc, sout), (wc, wout) = finish(sched), finish(worker)
    assert sc == 2 and wc != 0
    assert "only 1 of 2 workers registered within 5 s (arrived: " in sout, sout
    assert "the scheduler stopped the job before it started" in wout, wout


def test_scheduler_refuses_a_wrong_token_and_jobs_do_not_mix(tmp_path):
    port_a, port_b = free_ports(2)
    env_a, env_b = sched_env(port_a, "token-a"), sched_env(port_b, "token-b")
    show = [
        PY,
        "-c",
        "import os; print('job', os.environ['HOROVOD_RANK'], "
        "os.environ['HOROVOD_SIZE'], os.environ['HOROVOD_GLOO_RENDEZVOUS_PORT'])",
    ]
    sched_a = start([SCHEDULER_SH], env_a, tmp_path)
    sched_b = start([SCHEDULER_SH], env_b, tmp_path)
    intruder = start(
        [WORKERS_SH, "1", *show],
        {**env_b, "HVDKIT_SCHED_PORT": str(port_a)},
        tmp_path,
    )
    ic, iout = finish(intruder)
    assert ic != 0 and "refused this worker: bad job token" in iout, iout
    wa = start([WORKERS_SH, "2", *show], env_a, tmp_path)
    wb = start([WORKERS_SH, "2", *show], env_b, tmp_path)
    results = [finish(p) for p in (wa, wb, sched_a, sched_b)]
    assert [c for c, _ in results] == [0, 0, 0, 0], results
    assert "refused a worker from 127.0.0.1" in results[2][1]
    for _, out in results[:2]:
        lines = [ln.split("] ", 1)[1] for ln in out.splitlines() if "] job " in ln]
        assert sorted(ln.split()[1:3] for ln in lines) == [["0", "2"], ["1", "2"]], out
        assert len({ln.split()[3] for ln in lines}) == 1  # one rendezvous per job
    ports = {out.split("] job ")[1].split()[2] for _, out in results[:2]}
    assert len(ports) == 2  # the two jobs used different rendezvous servers


def test_scheduler_port_in_use_is_a_clear_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = run([SCHEDULER_SH], tmp_path, env_extra=sched_env(port))
    assert proc.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in proc.stderr


# ------------------------------------------------------------------ two hosts on one machine


@contextlib.contextmanager
def namespace_pair(if_a: str, if_b: str):
    """Namespaces A (10.213.7.1 on ``if_a``) and B (10.213.7.2 on ``if_b``), a veth pair apart."""
    tag = str(os.getpid() % 100000)
    a, b = f"hvdka{tag}", f"hvdkb{tag}"
    cmds = [
        f"ip netns add {a}",
        f"ip netns add {b}",
        f"ip link add {if_a} netns {a} type veth peer name {if_b} netns {b}",
        f"ip -n {a} addr add 10.213.7.1/24 dev {if_a}",
        f"ip -n {b} addr add 10.213.7.2/24 dev {if_b}",
        f"ip -n {a} link set {if_a} up",
        f"ip -n {b} link set {if_b} up",
        f"ip -n {a} link set lo up",
        f"ip -n {b} link set lo up",
    ]
    # As on real machines, each host's name resolves to its own address
    # (`ip netns exec` mounts /etc/netns/<ns>/hosts over /etc/hosts).
    hosts_files = []
    try:
        for c in cmds:
            subprocess.run(c.split(), check=True, capture_output=True, text=True)
        for ns, ip in ((a, "10.213.7.1"), (b, "10.213.7.2")):
            path = Path("/etc/netns") / ns / "hosts"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"127.0.0.1 localhost\n{ip} {socket.gethostname()}\n")
            hosts_files.append(path)
        yield a, b
    finally:
        for ns in (a, b):
            remove_netns(ns)  # what still runs there is this test's (ranks an sshd session left)
        for path in hosts_files:
            shutil.rmtree(path.parent, ignore_errors=True)


@pytest.fixture
def two_hosts():
    """A pair whose interfaces have different names (va<tag>, vb<tag>): tests name the side."""
    tag = str(os.getpid() % 100000)
    with namespace_pair(f"va{tag}", f"vb{tag}") as hosts:
        yield hosts


@needs_netns("scheduler and workers on two hosts (namespaces)")
def test_scheduler_and_workers_across_two_network_namespaces(tmp_path, two_hosts):
    a, b = two_hosts
    codes, outs = scheduler_job(tmp_path, tmp_path, 29713, netns=(a, a, b), sched_host="10.213.7.1")
    assert codes == [0, 0, 0], outs
    assert "assigned 2 ranks on 2 host(s)" in outs[0], outs[0]
    w0, w1 = weights(tmp_path)
    np.testing.assert_array_equal(w0, w1)
    # each worker ran on its own host: one local rank per host, Gloo over the veth
    assert "(local 0/1)" in outs[1] and "(local 0/1)" in outs[2]
    assert "on va" in outs[1] and "on vb" in outs[2]


@needs_netns("a worker refusing a host name that resolves to loopback")
def test_worker_refuses_a_host_name_that_resolves_to_loopback(tmp_path, two_hosts):
    """Horovod 0.28.1 would abort such a cross-host job deep in Gloo; we say why first."""
    a, _ = two_hosts
    (Path("/etc/netns") / a / "hosts").write_text(f"127.0.0.1 localhost {socket.gethostname()}\n")
    env = sched_env(29714, HVDKIT_SCHED_HOST="10.213.7.2", HVDKIT_SCHED_TIMEOUT=5)
    worker = start([WORKERS_SH, "1", PY, "-c", "pass"], env, tmp_path, a)
    code, out = finish(worker)
    assert code != 0
    assert f"host name '{socket.gethostname()}' resolves to 127.0.0.1" in out, out


SSHD = Path("/usr/sbin/sshd")
SSH_TOOLS = ("ssh", "ssh-keygen", "mpirun")
SSH_MISSING = NETNS_MISSING or (
    None
    if SSHD.exists() and all(shutil.which(t) for t in SSH_TOOLS)
    else f"it needs OpenSSH's sshd, and {', '.join(SSH_TOOLS)} on PATH"
)


@pytest.fixture
def ssh_hosts(tmp_path):
    """Two namespaces with an sshd in each, and a ``bin`` folder whose ``ssh`` reaches them.

    Both interfaces are named eth0, as horovodrun requires across machines (it
    looks for an interface name that every host has).

    The key, host key and configs live in tmp_path; put ``<tmp_path>/ssh/bin``
    first on PATH and ``ssh 10.213.7.2 cmd`` runs ``cmd`` in namespace B, as
    horovodrun and mpirun reach another machine.
    """
    d = tmp_path / "ssh"
    (d / "bin").mkdir(parents=True)
    for name in ("key", "hostkey"):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True
        )
    (d / "authorized_keys").write_text((d / "key.pub").read_text())
    (d / "ssh_config").write_text(
        f"Host *\n  IdentityFile {d / 'key'}\n  IdentitiesOnly yes\n  BatchMode yes\n"
        "  UserKnownHostsFile /dev/null\n  StrictHostKeyChecking no\n  LogLevel ERROR\n"
        "  ConnectTimeout 10\n"
    )
    ssh = d / "bin" / "ssh"
    ssh.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {d / "ssh_config"} "$@"\n')
    ssh.chmod(0o755)
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation folder
    daemons, logs = [], []
    with contextlib.ExitStack() as stack:
        two_hosts = stack.enter_context(namespace_pair("eth0", "eth0"))
        stack.callback(_stop_daemons, daemons, logs)
        for ns, ip in zip(two_hosts, ("10.213.7.1", "10.213.7.2"), strict=True):
            conf = d / f"sshd_{ns}.conf"
            conf.write_text(
                f"ListenAddress {ip}\nHostKey {d / 'hostkey'}\n"
                f"AuthorizedKeysFile {d / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
                f"PasswordAuthentication no\nStrictModes no\nUsePAM no\nPidFile none\n"
            )
            logs.append(open(d / f"sshd_{ns}.log", "w"))
            daemons.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", ns, str(SSHD), "-D", "-e", "-f", str(conf)],
                    stdout=subprocess.DEVNULL,
                    stderr=logs[-1],
                )
            )
        a, b = two_hosts
        pairs = ((a, b, "10.213.7.2", daemons[1]), (b, a, "10.213.7.1", daemons[0]))
        for client, server, ip, daemon in pairs:
            # each daemon answers before the test starts (an ordering fact, not a sleep)
            for _ in range(600):  # up to a minute for sshd to listen
                probe = subprocess.run(
                    ["ip", "netns", "exec", client, str(ssh), ip, "ip -o -4 addr show"],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                if probe.returncode == 0 or daemon.poll() is not None:
                    break
                time.sleep(0.1)
            sshd_log = (d / f"sshd_{server}.log").read_text()
            assert ip in probe.stdout, (client, ip, probe.stdout, probe.stderr, sshd_log)
        yield two_hosts, d / "bin"


def _stop_daemons(daemons: list[subprocess.Popen], logs: list) -> None:
    try:
        for proc in daemons:
            proc.terminate()
        for proc in daemons:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    finally:
        for log in logs:
            log.close()


@pytest.mark.skipif(
    SSH_MISSING is not None,
    reason=f"NOT TESTED: hvdkitrun -H across two hosts over SSH: {SSH_MISSING}; run "
    "scripts/test.sh as root (scripts/install.sh installs openssh-server and iproute2)",
)
def test_hvdkitrun_across_two_hosts_over_ssh_default_and_gloo(tmp_path, ssh_hosts):
    """hvdkitrun -H over SSH, as on two machines: the default (MPI across hosts) and --gloo.

    Each host runs one rank (Horovod sees local size 1 on both), and both
    transports end with the weights of the same job on one machine.
    """
    (a, _), ssh_bin = ssh_hosts
    hosts = "10.213.7.1:1,10.213.7.2:1"
    results = {}
    for name, flags in {"default": [], "gloo": ["--gloo"]}.items():
        outdir = tmp_path / name
        outdir.mkdir()
        cmd = ["hvdkitrun", "-np", "2", "-H", hosts, *flags, PY, TRAIN, str(outdir)]
        env = launcher_env()
        env["PATH"] = f"{ssh_bin}{os.pathsep}{env['PATH']}"
        code, out, timed_out = run_bounded(
            ["ip", "netns", "exec", a, *cmd], HANG_S, env=env, cwd=tmp_path
        )
        assert code == 0 and not timed_out, (name, out[-3000:])
        assert "rank 0 of 2 (local 0/1)" in out and "rank 1 of 2 (local 0/1)" in out, out[-3000:]
        announced = re.findall(r"hvdkitrun: transport (\w+) \(2 processes", out)
        assert announced == ([] if flags else ["mpi"]), (name, announced)
        results[name] = weights(outdir)
    local = tmp_path / "one-machine"
    local.mkdir()
    proc = run(["hvdkitrun", "-np", "2", "--gloo", PY, TRAIN, str(local)], tmp_path)
    assert proc.returncode == 0, proc.output[-3000:]
    ref = weights(local)[0]
    for name, (w0, w1) in results.items():
        np.testing.assert_array_equal(w0, w1, err_msg=f"{name}: ranks differ")
        np.testing.assert_allclose(w0, ref, rtol=1e-6, err_msg=f"{name}: differs from one machine")

"""Test helpers: running a worker script under the real launcher with 2 ranks."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvdkit._compat import HOROVODRUN_LAYOUT_VARIABLES
from hvdkit.launch.transport import MPI_ENV, mpi_root_env

REPO = Path(__file__).resolve().parents[1]
MULTIPROC = Path(__file__).resolve().parent / "multiproc"
VENV_BIN = Path(sys.executable).parent
TRANSPORTS = ["gloo", "mpi"]


# Horovod's negotiation cycle in the suite's jobs (its default: 1 ms). Between
# cycles a waiting rank polls: an idle 2-rank job used 0.5 of a core per rank
# over MPI (yielding) and 0.07 over Gloo at 1 ms, 0.1 and 0.02 at 20 ms. The
# suite runs 3 test files on 2 cores, so that polling takes CPU from the other
# files' ranks: three MPI+Gloo test files used 16 % less CPU at 10 ms (322
# CPU-s against 385; 20 ms: 325, and 9 % longer, one cycle more per collective).
# Results do not depend on it (a sum is a sum whichever cycle carries it);
# the Keras guides' test runs at Horovod's default, and so does every user's job.
SUITE_CYCLE_MS = "10"


def launcher_env(sklearn: bool = False, horovod_cycle: bool = True) -> dict:
    """The environment of the jobs the suite launches.

    ``sklearn``: the processes may import scikit-learn (the examples' data);
    otherwise they start without it (tests/multiproc/sitecustomize.py). Without
    horovodrun's layout variables (a ``HOROVOD_RANK`` of pytest's own environment
    would override each rank's under plain horovodrun: hvdkit/_compat.py).
    ``horovod_cycle``: Horovod's cycle is :data:`SUITE_CYCLE_MS` unless pytest's
    environment sets one; ``False``: Horovod's own default, as users run.
    """
    env = {k: v for k, v in os.environ.items() if k not in HOROVODRUN_LAYOUT_VARIABLES}
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(MULTIPROC), str(REPO)])
    env["HVDKIT_TEST_SKLEARN"] = "1" if sklearn else "0"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if horovod_cycle:
        env.setdefault("HOROVOD_CYCLE_TIME", SUITE_CYCLE_MS)
    else:
        env.pop("HOROVOD_CYCLE_TIME", None)
    # The suite runs two test files side by side (pytest-xdist), so up to 4
    # ranks share 2 cores; Open MPI's ranks busy-poll by default and starve
    # their peers when oversubscribed. Yielding keeps MPI jobs from collapsing
    # (hvdkitrun sets it too; plain mpirun/horovodrun jobs of the tests need it).
    for key, value in MPI_ENV.items():
        env.setdefault(key, value)
    env.update(mpi_root_env())
    return env


class LaunchResult:
    """What a 2-rank worker script reported: its exit status, output and per-rank checks."""

    def __init__(self, returncode: int, output: str, outdir: Path, np_: int, timed_out=False):
        self.returncode = returncode
        self.output = output
        self.outdir = outdir
        self.timed_out = timed_out
        self.ranks = []
        for r in range(np_):
            path = outdir / f"rank{r}.json"
            self.ranks.append(json.loads(path.read_text()) if path.exists() else None)

    def _how_it_ended(self) -> str:
        if self.timed_out:
            return "the job was stopped after its time limit (a hang)"
        return f"the job exited with status {self.returncode}"

    def assert_check(self, name: str) -> None:
        """Check ``name`` passed on every rank; otherwise fail with that rank's traceback."""
        for rank, report in enumerate(self.ranks):
            result = (report or {}).get("results", {}).get(name)
            if result is None:
                raise AssertionError(
                    f"check {name!r} was not reached on rank {rank}; {self._how_it_ended()}.\n"
                    f"last output:\n{self.output[-3000:]}"
                )
            if not result["ok"]:
                raise AssertionError(f"check {name!r} failed on rank {rank}:\n{result['error']}")

    def assert_reported_exactly(self, expected: list[str]) -> None:
        """Every rank ran exactly the ``expected`` checks, in order, and the job exited 0."""
        for rank, report in enumerate(self.ranks):
            got = list((report or {}).get("results", {}))
            assert got == expected, f"rank {rank} reported checks {got}, expected {expected}"
        assert self.returncode == 0, f"{self._how_it_ended()}\n{self.output[-3000:]}"

    def assert_all_passed(self, expected: list[str]) -> None:
        """Each of ``expected`` passed on every rank, and nothing else was reported."""
        for name in expected:
            self.assert_check(name)
        self.assert_reported_exactly(expected)

    def passed(self, rank: int) -> list[str]:
        return self.ranks[rank]["passed"]

    def values(self, rank: int) -> dict:
        return self.ranks[rank]["values"]


def horovodrun(transport: str, *argv, np_: int = 2) -> list[str]:
    """``horovodrun -np N --<transport> python argv...`` with this venv's launcher and Python."""
    return [
        str(VENV_BIN / "horovodrun"),
        "-np",
        str(np_),
        f"--{transport}",
        sys.executable,
        *map(str, argv),
    ]


def horovodrun_as_hvdkitrun_runs_it(transport: str, *argv, np_: int = 2) -> list[str]:
    """``horovodrun -np N --<transport> python argv...`` as hvdkitrun builds it
    (``hvdkit.launch.cli._horovodrun_command``: Horovod's horovodrun in hvdkitrun's
    wrapper, hvdkit/launch/guarded_horovodrun.py).

    The same launch by Horovod's own code, without what each start costs there:
    its build check imports TensorFlow in a forked child (performance-record.md,
    "A process's end"), and under MPI Open MPI's ofi layer sleeps 1 s as the job
    ends. For the worker scripts, whose subject is hvdkit's API; horovodrun as
    users type it is launched by test_launch_mp.py and the examples' and ports' tests.
    """
    from hvdkit.launch import cli

    command = [sys.executable, *map(str, argv)]
    return cli._horovodrun_command(transport, np_, [("localhost", np_)], 30, command)


def start_in_session(cmd: list[str], **kwargs) -> subprocess.Popen:
    """Start ``cmd`` in its own session, stdout and stderr merged into one text pipe.

    Its own session lets a test stop exactly this job (``os.killpg(proc.pid, ...)``)
    and nothing else on the machine.
    """
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        **kwargs,
    )


def hvdkitrun(transport: str, *argv, options: tuple = (), np_: int = 2) -> list[str]:
    """``hvdkitrun -np N --<transport> [options] python argv...`` with this venv's launcher."""
    return [
        str(VENV_BIN / "hvdkitrun"),
        "-np",
        str(np_),
        f"--{transport}",
        *map(str, options),
        sys.executable,
        *map(str, argv),
    ]


def shared_folder(tmp_path_factory, name: str, make) -> Path:
    """A folder that ``make(folder)`` fills once per test run, whichever pytest-xdist
    worker asks first; the others wait for it (a lock file).

    For a fault-free reference job that several test files compare with: one run
    of the suite runs it once. A ``make`` that raises leaves no mark of being
    done, so the next test that asks runs it again in an emptied folder (and
    fails the same way).
    """
    import fcntl

    base = tmp_path_factory.getbasetemp()
    # under xdist each worker's base is popen-gw<N> in the run's own folder
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared"
    root.mkdir(exist_ok=True)
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            done.touch()
    return folder


def uninterrupted_fit(tmp_path_factory) -> Path:
    """The output folder of ``hvdkitrun -np 2 --gloo ft_train.py --mode fit`` without
    faults (attempt 0, no step sleep): the reference of test_restart_mp,
    test_preemption_mp and test_checkpoint_mp, over either transport.

    One job serves both: with 2 ranks every averaged gradient is one addition of two
    numbers, the same bits over Gloo and MPI (both runs' result files were byte-equal;
    their ids files differed only in the time stamps, which no test compares).
    """

    def make(out: Path) -> None:
        cmd = hvdkitrun("gloo", MULTIPROC / "ft_train.py", out, "--mode", "fit")
        cmd += ["--attempt", "0", "--step-sleep", "0"]
        code, output, timed_out = run_bounded(cmd, 600, env=launcher_env(), cwd=out)
        assert code == 0 and not timed_out, output[-4000:]

    return shared_folder(tmp_path_factory, "uninterrupted-fit", make)


def run_bounded(cmd: list[str], timeout: float, **kwargs) -> tuple[int, str, bool]:
    """Run ``cmd`` in its own session; on timeout stop that session (only our own processes).

    Returns ``(exit status, stdout + stderr, timed out)``.
    """
    proc = start_in_session(cmd, **kwargs)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out, False
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                out, _ = proc.communicate(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            out = ""
        return proc.returncode, out or "", True


def launch(
    script: str,
    tmp_path: Path,
    transport: str = "gloo",
    np_: int = 2,
    args: tuple = (),
    timeout: float = 300,
    env_extra: dict | None = None,
) -> LaunchResult:
    """Run tests/multiproc/<script> with ``horovodrun -np N --<transport>`` (in hvdkitrun's
    wrapper: :func:`horovodrun_as_hvdkitrun_runs_it`)."""
    outdir = tmp_path / f"out-{transport}"
    outdir.mkdir(exist_ok=True)
    env = launcher_env()
    env.update(env_extra or {})
    script_argv = (MULTIPROC / script, outdir, *args)
    cmd = horovodrun_as_hvdkitrun_runs_it(transport, *script_argv, np_=np_)
    code, out, timed_out = run_bounded(cmd, timeout, env=env, cwd=tmp_path)
    return LaunchResult(code, out, outdir, np_, timed_out)


class WorkerRun:
    """One run of a worker script per transport, shared by the tests of every check.

    A test module declares its checks and reports each as its own pytest item::

        RUN = WorkerRun("training_worker.py", timeout=600)
        CHECKS = ["fit_sgd_equals_single_process", ...]

        @pytest.mark.parametrize("check", CHECKS)
        def test_check(check, transport, tmp_path_factory):
            RUN.result(transport, tmp_path_factory).assert_check(check)

        def test_reports_exactly_these_checks(transport, tmp_path_factory):
            RUN.result(transport, tmp_path_factory).assert_reported_exactly(CHECKS)


    ``setup(tmp_path)``, if given, prepares the run's folder (e.g. writes data
    files) and returns extra keyword arguments for :func:`launch`.
    """

    def __init__(self, script: str, *, setup=None, **launch_kwargs):
        self.script, self.setup, self.launch_kwargs = script, setup, launch_kwargs
        self._results: dict[str, LaunchResult] = {}

    def result(self, transport: str, tmp_path_factory) -> LaunchResult:
        if transport not in self._results:
            tmp = tmp_path_factory.mktemp(f"{Path(self.script).stem}-{transport}")
            kwargs = {**self.launch_kwargs, **(self.setup(tmp) if self.setup else {})}
            self._results[transport] = launch(self.script, tmp, transport, **kwargs)
        return self._results[transport]


# What the jobs a test launches read from the environment it passes on: Horovod's,
# hvdkit's (and MindSpore's names for them), Open MPI's, PMI's and Slurm's variables.
# (Imports set others on their first run, whichever test that is: TensorFlow sets
# TF2_BEHAVIOR, KMP_*, TPU_ML_PLATFORM, h5py HDF5_PLUGIN_PATH; those are not checked.)
LAUNCH_PREFIXES = ("HOROVOD_", "HVDKIT_", "MS_", "OMPI_", "PMI_", "PMIX_", "SLURM_")


@pytest.fixture(autouse=True)
def environment_left_as_found():
    """Every test leaves the launch variables of ``os.environ`` (:data:`LAUNCH_PREFIXES`)
    as it found them, or fails naming what it changed.

    A variable left behind reaches every job the same pytest worker launches
    later: a unit test's leaked ``HOROVOD_RANK=0`` once gave both ranks of the
    next ``hvdkitrun`` job rank 0 (horovodrun hands the launching environment to
    the ranks after their own layout). They are put back either way.
    """

    def launch_vars() -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k.startswith(LAUNCH_PREFIXES)}

    before = launch_vars()
    yield
    after = launch_vars()
    if after != before:
        for key in after.keys() - before.keys():
            del os.environ[key]
        os.environ.update(before)
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        pytest.fail(
            f"the test left os.environ changed: {changed}; set variables with monkeypatch",
            pytrace=False,
        )


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    return request.param


@pytest.fixture
def local_runtime(monkeypatch):
    """A size-1 hvdkit runtime, shut down after the test (runtime state is global)."""
    import hvdkit
    from hvdkit import config

    for var in (*config.LAUNCHER_SIZE_VARS, config.BACKEND):
        monkeypatch.delenv(var, raising=False)
    hvdkit.shutdown()
    hvdkit.init()
    yield
    hvdkit.shutdown()


def _netns_missing() -> str | None:
    """Why this machine cannot run the network-namespace tests, or None."""
    if os.geteuid() != 0:
        return "they need root to create network namespaces"
    if shutil.which("ip") is None:
        return "they need the 'ip' command (Debian package iproute2)"
    return None


NETNS_MISSING = _netns_missing()


def remove_netns(ns: str) -> None:
    """Kill what still runs in network namespace ``ns`` (the test's own processes), delete it."""
    listed = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    for pid in listed.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def needs_netns(what: str):
    """Skip ``what`` (a multi-host test on namespaces) here, saying what was not tested and how."""
    return pytest.mark.skipif(
        NETNS_MISSING is not None,
        reason=f"NOT TESTED: {what}: {NETNS_MISSING}; run scripts/test.sh as root "
        "(it installs iproute2) to test it",
    )


# ------------------------------------------------------------ where the suite's time goes
# The longest test files, longest first (their seconds of test time in a
# 3-worker run of db2565f, performance-record.md). scripts/test.sh hands files to its pytest
# workers in collection order (--no-loadscope-reorder: xdist's default order,
# by number of tests, put these files, which have few tests, last, and the run
# ended with test_phases_mp.py's 10 minutes alone), so they start first and
# their waits (stall timeouts, restarts) overlap the other files' work. A file
# not listed keeps its place after them; the list only orders, it skips nothing.
SLOW_FILES_FIRST = (
    "test_launch_mp.py",  # 384 s
    "test_restart_mp.py",  # 383 s
    "test_checkpoint_mp.py",  # 376 s
    "test_divergence_mp.py",  # 328 s
    "test_phases_mp.py",  # 272 s, one test
    "test_examples_mp.py",  # 221 s
    "test_ray.py",  # 160-190 s: a Ray cluster and one driver script (this session's runs)
    "test_spark.py",  # 130-160 s: a Spark cluster and one spark-submit
    "test_slurm.py",  # 189 s
    "test_keras_workflows_mp.py",  # 184 s
    "test_sink_mp.py",  # 167 s
    "test_preemption_mp.py",  # 145 s
    "test_ports_mp.py",  # 145 s
    "test_overlap_mp.py",  # 137 s
    "test_training_mp.py",  # 124 s
    "test_elastic_faults_mp.py",  # 120 s
    "test_chaos_three_faults_mp.py",  # 112 s
)


def pytest_collection_modifyitems(items):
    """Put the files of :data:`SLOW_FILES_FIRST` first, in its order (a stable sort)."""
    place = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: place.get(item.path.name, len(place)))


_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Sum each test file's setup, call and teardown seconds (on xdist's controller too)."""
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The slowest files: with ``--dist loadfile`` a file's tests run one after another."""
    if len(_FILE_SECONDS) < 2:
        return
    slowest = sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1])[:15]
    total = sum(_FILE_SECONDS.values())
    terminalreporter.write_sep("=", f"slowest files ({total:.0f} s of test time in all)")
    for path, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f}s  {path}")


# HVDKIT_TEST_CGROUP_LOG=<file> (root, cgroup v1's cpuacct): each pytest worker
# moves itself into a cgroup of its own, and every test's CPU, with that of every
# process it started (killed ones and their children too), is appended as a JSON
# line with the test's wall time, its start (epoch seconds) and its xdist worker.
# A test whose CPU is well below its wall time waits (for a timeout, a restart):
# with the cores busy, the other tests fill that.
# Processes started by daemons (sshd, slurmd) are not counted.
_CPUACCT = Path("/sys/fs/cgroup/cpuacct")


def _cgroup_usage() -> int | None:
    group = os.environ.get("_HVDKIT_TEST_CGROUP")
    return int((Path(group) / "cpuacct.usage").read_text()) if group else None


def pytest_configure(config):
    if not os.environ.get("HVDKIT_TEST_CGROUP_LOG") or not _CPUACCT.is_dir():
        return
    for old in _CPUACCT.glob("hvdkit-test-*"):  # left by an earlier run's workers
        with contextlib.suppress(OSError):
            old.rmdir()  # refused while a process is in it
    if getattr(config.option, "numprocesses", None) and "PYTEST_XDIST_WORKER" not in os.environ:
        return  # xdist's controller: its workers measure
    group = _CPUACCT / f"hvdkit-test-{os.getpid()}"
    group.mkdir(exist_ok=True)
    (group / "cgroup.procs").write_text(str(os.getpid()))
    os.environ["_HVDKIT_TEST_CGROUP"] = str(group)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, began, started = _cgroup_usage(), time.time(), time.monotonic()
    yield
    if before is not None:
        with open(os.environ["HVDKIT_TEST_CGROUP_LOG"], "a") as f:
            cpu = (_cgroup_usage() - before) / 1e9
            wall = time.monotonic() - started  # setup and teardown included, like the CPU
            line = {"test": item.nodeid, "cpu": round(cpu, 2), "wall": round(wall, 2)}
            # when and where: how the workers' runs line up (which one ends alone)
            line["began"] = round(began, 2)
            line["worker"] = os.environ.get("PYTEST_XDIST_WORKER", "")
            f.write(json.dumps(line) + "\n")

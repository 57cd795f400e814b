"""Spark: ``hvdkit.spark.run(fn, num_proc=N)`` trains on a Spark cluster's executors.

Everything hvdkit knows about Spark is here. One call is one Spark job of
one barrier stage (``RDD.barrier()``) of ``num_proc`` tasks, all started
together or none. Each task learns every task's executor address from
``BarrierTaskContext.getTaskInfos()``; the task of partition 0 serves Gloo's
rendezvous (:mod:`hvdkit.clusters._world`) and sends its port to the others
with ``allGather``. No SSH, no ``mpirun``: Gloo only (Spark starts no MPI
launcher). Each task then runs ``fn`` as one rank in a process of its own
(:mod:`hvdkit.clusters._call`): a fresh Horovod world on every call, even
though Spark reuses its Python workers, and the rank ends with its task.

Faults: Spark aborts the whole job when a task of a barrier *result* stage
fails ("Could not recover from a failed barrier ResultStage", checked with
pyspark 4.3.0); only a barrier shuffle-map stage is resubmitted. So hvdkit
retries itself: when an executor is lost (or a rank's collective failed
because a peer was), it waits for ``num_proc`` task slots again (up to
``start_timeout``, for Spark to replace the lost executor) and runs the
stage anew, up to ``max_restarts`` times (by default Spark's own
``spark.stage.maxConsecutiveAttempts`` - 1 = 3). ``fn`` resumes from its own
``hvdkit.Checkpointer`` on a shared folder. An error that ``fn`` itself
raised is not retried: it is raised on the driver with the rank's traceback.

Example (a driver script; ``spark-submit driver.py`` or ``python driver.py``)::

    from pyspark.sql import SparkSession
    import hvdkit.spark

    def train(epochs):
        import hvdkit
        hvdkit.init()
        ...
        return hvdkit.rank()

    spark = SparkSession.builder.getOrCreate()
    print(hvdkit.spark.run(train, args=(3,), num_proc=2))   # [0, 1]
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from .. import config
from .._validate import is_int, is_number
from ..errors import ConfigurationError, LaunchError, NotSupportedError
from . import _call, _world

__all__ = ["run"]
log = logging.getLogger("hvdkit.spark")

SLOT_POLL_S = 0.5
# num_proc above the slots fails once the registered slots have not changed for this
# long (executors that are still starting register within seconds of each other). Not
# on a retry: the previous attempt had the slots, and the replacement of a lost executor
# (the standalone master schedules one after every executor exit) can take longer.
SLOTS_SETTLED_S = 10.0
# The slot waits' clock, module attributes so that a test scripts time instead of sleeping.
_monotonic = time.monotonic
_sleep = time.sleep
RANK_ERROR = "hvdkit-rank-error"  # marks a task failure whose cause is fn's own error


def run(
    fn: Callable,
    args: Sequence = (),
    kwargs: Mapping | None = None,
    num_proc: int | None = None,
    start_timeout: float | None = None,
    use_mpi: bool | None = None,
    use_gloo: bool | None = None,
    extra_mpi_args: str | None = None,
    env: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    verbose: int = 1,
    nics: set | None = None,
    prefix_output_with_timestamp: bool = False,
    executable: str | None = None,
    max_restarts: int | None = None,
) -> list:
    """Run ``fn(*args, **kwargs)`` as ``num_proc`` ranks on the Spark cluster; results by rank.

    ``horovod.spark.run``'s arguments, with its meanings. Inside ``fn``,
    ``hvdkit.init()`` gives ``size() == num_proc``, ``rank()`` = the task's
    partition, and ``local_rank()``/``local_size()`` per executor host.

    Args:
        fn: the training function; pickled with cloudpickle (a closure is fine),
            run once per rank. Its return value must be picklable.
        args, kwargs: passed to ``fn``.
        num_proc: ranks (barrier tasks). ``None``: the cluster's default
            parallelism (``spark.default.parallelism``, else its cores), read
            once executors have registered.
        start_timeout: seconds to wait for ``num_proc`` task slots (a driver
            that calls ``run`` right after building its session waits for the
            executors; a retry waits for a lost executor's replacement) and for
            the ranks to meet. ``None``: ``HOROVOD_SPARK_START_TIMEOUT``, else 600.
        use_mpi, extra_mpi_args, nics: Horovod's; only ``None``/``False``
            (Spark starts no MPI launcher; hvdkit picks each host's interface
            towards rank 0 itself).
        use_gloo: ``None`` or ``True``: the ranks use Gloo.
        env: variables set for every rank, on top of the executor's environment
            (Horovod replaces the whole environment, by default with the driver's).
        stdout, stderr: where the ranks' output goes, each line as
            ``[rank N] text`` (default: the driver's ``sys.stdout``/``sys.stderr``).
        verbose: 0 prints nothing of hvdkit's own; 1 (default) its retries; 2 more.
        prefix_output_with_timestamp: put the time before each rank line.
        executable: the Python of the ranks (default: the executor's Python).
        max_restarts: times the stage is run again after a lost executor or
            rank; ``None``: ``spark.stage.maxConsecutiveAttempts`` - 1 (3).

    Returns:
        ``fn``'s return values, ``[rank 0's, rank 1's, ...]``.

    Raises:
        ConfigurationError: no active SparkContext, called inside a Spark task,
            ``fn`` not picklable, ``num_proc`` above the cluster's task slots,
            the slots did not come within ``start_timeout``, or the ranks
            cannot reach rank 0.
        NotSupportedError: MPI asked for.
        LaunchError: ``fn`` raised on a rank (its traceback), the stage
            failed ``max_restarts + 1`` times, or a retry's task slots did not
            come back within ``start_timeout``.

    Example:
        >>> hvdkit.spark.run(lambda: __import__("hvdkit").size(), num_proc=2)  # doctest: +SKIP
        [2, 2]
    """
    sc = _spark_context()
    if use_mpi or extra_mpi_args:
        raise NotSupportedError(
            f"hvdkit.spark.run(use_mpi={use_mpi!r}, extra_mpi_args={extra_mpi_args!r}): Spark "
            "starts no MPI launcher, so the ranks meet over Gloo. Drop use_mpi/extra_mpi_args."
        )
    if use_gloo is False:
        raise NotSupportedError(
            "hvdkit.spark.run(use_gloo=False): Gloo is the only transport on Spark; drop it."
        )
    if nics is not None:
        raise NotSupportedError(
            f"hvdkit.spark.run(nics={nics!r}): each rank uses its host's interface towards "
            "rank 0 (the executor's address); drop nics."
        )
    _check_count("num_proc", num_proc, minimum=1, allow_none=True)
    _check_count("max_restarts", max_restarts, minimum=0, allow_none=True)
    timeout = _start_timeout(start_timeout)
    call = _pickled_call(fn, args, kwargs)
    if max_restarts is None:
        max_restarts = int(sc.getConf().get("spark.stage.maxConsecutiveAttempts", "4")) - 1
    if num_proc is None:
        _wait_for_slots(sc, 1, timeout)
        num_proc = sc.defaultParallelism
    relay = _Relay(
        _driver_host(sc),
        stdout or sys.stdout,
        stderr or sys.stderr,
        prefix_output_with_timestamp,
    )
    spec = _TaskSpec(
        call=call,
        env=dict(env or {}),
        relay=(relay.host, relay.port, relay.token),
        timeout_s=timeout,
        executable=executable,
        verbose=verbose,
    )
    try:
        for attempt in range(max_restarts + 1):
            slots = _wait_for_slots(sc, num_proc, timeout, retry=attempt > 0)
            if verbose >= 2:
                print(f"hvdkit.spark: {num_proc} ranks on {slots} task slots", file=sys.stderr)
            try:
                return _one_stage(sc, spec, num_proc, relay)
            except _StageLost as lost:
                if attempt == max_restarts:
                    raise LaunchError(
                        f"hvdkit.spark.run: the barrier stage of {num_proc} ranks failed "
                        f"{attempt + 1} times; the last time: {lost}. Raise max_restarts, or "
                        "see the executors' logs for why they were lost."
                    ) from None
                if verbose >= 1:
                    print(
                        f"hvdkit.spark: attempt {attempt + 1} lost a rank ({lost}); running "
                        f"the stage again once {num_proc} task slots are back, within "
                        f"{timeout:g} s ({max_restarts - attempt} more attempts allowed)",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        relay.close()
    raise AssertionError("unreachable")  # the loop returns or raises


# ------------------------------------------------------------------ the driver's checks
def _spark_context():
    try:
        from pyspark import SparkContext, TaskContext
    except ImportError:
        raise NotSupportedError(
            "hvdkit.spark needs pyspark: pip install pyspark (the version of your cluster)."
        ) from None
    if TaskContext.get() is not None:
        raise ConfigurationError(
            "hvdkit.spark.run was called inside a Spark task; call it on the driver (the "
            "script that builds the SparkSession), not in a map, UDF or foreach."
        )
    sc = SparkContext._active_spark_context
    if sc is None:
        raise ConfigurationError(
            "hvdkit.spark.run found no active SparkContext; build one first: "
            "spark = SparkSession.builder.getOrCreate()."
        )
    if sc.getConf().get("spark.dynamicAllocation.enabled", "false").lower() == "true":
        raise ConfigurationError(
            "spark.dynamicAllocation.enabled=true: Spark's barrier stages refuse dynamic "
            "allocation. Set spark.dynamicAllocation.enabled=false for this application."
        )
    return sc


def _check_count(name: str, value, *, minimum: int, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if not is_int(value) or value < minimum:
        raise ConfigurationError(
            f"hvdkit.spark.run({name}={value!r}): expected a whole number >= {minimum}"
            + (" or None" if allow_none else "")
            + "."
        )


def _start_timeout(given: float | None) -> float:
    if given is None:
        return config.get_float(
            config.SPARK_START_TIMEOUT,
            config.DEFAULT_START_TIMEOUT_S,
            positive=True,
            what="seconds",
            fix="e.g. 600",
        )
    if not is_number(given) or not given > 0:
        raise ConfigurationError(
            f"hvdkit.spark.run(start_timeout={given!r}): expected seconds > 0, e.g. 600."
        )
    return float(given)


def _pickled_call(fn, args, kwargs) -> bytes:
    if not callable(fn):
        raise ConfigurationError(f"hvdkit.spark.run(fn={fn!r}): fn must be a function.")
    from pyspark import cloudpickle

    try:
        return cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    except Exception as exc:
        name = getattr(fn, "__qualname__", repr(fn))
        raise ConfigurationError(
            f"hvdkit.spark.run cannot send {name} and its arguments to the executors: "
            f"{type(exc).__name__}: {exc}. Build such objects (sessions, locks, open files, "
            "models) inside fn, and pass only plain data as args."
        ) from None


def task_slots(sc) -> int:
    """Tasks the registered executors can run at once (what a barrier stage needs)."""
    jsc = sc._jsc.sc()
    return int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))


def _wait_for_slots(sc, needed: int, timeout_s: float, *, retry: bool = False) -> int:
    """Wait until the executors offer ``needed`` task slots; their number.

    A first attempt gives up early when the slots stop growing short of
    ``needed``: the cluster is too small. A ``retry`` (after an attempt lost an
    executor) had the slots a moment ago, so it waits the whole ``timeout_s`` for
    the lost executor's replacement, however long the slots stay short.

    Raises:
        ConfigurationError: a first attempt's slots stopped growing short of
            ``needed`` (for :data:`SLOTS_SETTLED_S`), or ``timeout_s`` passed.
        LaunchError: a retry's slots did not come back within ``timeout_s``.
    """
    start = _monotonic()
    slots, since = task_slots(sc), start
    while slots < needed:
        _sleep(SLOT_POLL_S)
        now, seen = _monotonic(), task_slots(sc)
        if seen != slots:
            slots, since = seen, now
        timed_out = now - start >= timeout_s
        if retry and timed_out:
            raise LaunchError(
                f"hvdkit.spark.run: an executor was lost, and the stage's next attempt needs "
                f"{needed} task slots again, but the cluster has {slots} after "
                f"start_timeout={timeout_s:g} s. If the executors take longer to come back, "
                "raise start_timeout; else see the Spark master's and workers' logs for why "
                "the lost executor was not relaunched (a worker that is gone is not replaced; "
                "spark.deploy.maxExecutorRetries)."
            )
        settled = not retry and slots > 0 and now - since >= SLOTS_SETTLED_S
        if settled or timed_out:
            cpus = sc.getConf().get("spark.task.cpus", "1")
            raise ConfigurationError(
                f"hvdkit.spark.run(num_proc={needed}) needs {needed} task slots at once (a "
                f"barrier stage starts all its tasks together), but the cluster has {slots} "
                f"(its executors' cores / spark.task.cpus={cpus})"
                + (
                    f", after {timeout_s:g} s (start_timeout)"
                    if not settled
                    else f", unchanged for {SLOTS_SETTLED_S:g} s"
                )
                + f". Use num_proc <= {max(slots, 1)}, or give the application more executors "
                "or cores (spark.executor.instances, spark.cores.max, spark.executor.cores)."
            )
    return slots


def _driver_host(sc) -> str:
    return sc.getConf().get("spark.driver.host") or socket.gethostbyname(socket.gethostname())


# ------------------------------------------------------------------ one stage
@dataclass
class _TaskSpec:
    """What every task of the stage gets (pickled with the task)."""

    call: bytes
    env: dict[str, str]
    relay: tuple[str, int, str]
    timeout_s: float
    executable: str | None
    verbose: int
    job: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    watch_env: dict[str, str] = field(default_factory=dict)  # the attempt's heartbeat receiver


class _StageLost(Exception):
    """The stage failed because a rank or its executor was lost: worth running again."""


def _one_stage(sc, spec: _TaskSpec, num_proc: int, relay: _Relay) -> list:
    """One barrier job; ``fn``'s values by rank. A rank silent past the stall timeout ends it.

    Raises:
        _StageLost: an executor or rank was lost, or a rank fell silent: run it again.
        LaunchError: ``fn`` (or a rank's set-up) raised: no retry would help.
    """
    spec.job = uuid.uuid4().hex[:12]
    relay.errors.clear()
    watch = _world.StallWatch(relay.host)
    spec.watch_env = watch.env()
    group = f"hvdkit-{spec.job}"
    rdd = sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(_TaskRunner(spec))
    done: dict[str, Any] = {}

    def collect() -> None:
        sc.setJobGroup(group, "hvdkit.spark.run", interruptOnCancel=True)
        try:
            done["pairs"] = rdd.collect()
        except Exception as exc:  # py4j's Py4JJavaError: the stage's first failure
            done["error"] = exc

    job = threading.Thread(target=collect, name="hvdkit-spark-job", daemon=True)
    job.start()
    silent = None
    try:
        while job.is_alive():
            job.join(SLOT_POLL_S)
            silent = silent or watch.silent()
            if silent and job.is_alive():
                sc.cancelJobGroup(group)
                job.join()
    finally:
        watch.close()
    if silent:
        raise _StageLost(silent)
    if "error" in done:
        raise _failure(str(done["error"]), relay.errors)
    return [value for _, value in sorted(done["pairs"], key=lambda p: p[0])]


# Spark names the barrier task whose failure aborted the stage ResultTask(stage, partition);
# the partition is the rank.
_FAILED_TASK = re.compile(r"barrier task ResultTask\(\d+, (\d+)\)")


def _failure(text: str, reported: Mapping[int, tuple[str, str]]) -> Exception:
    """What a failed stage means, from Spark's job-abort ``text`` and the ranks' own reports.

    ``fn``'s own error (a rank reported it, or its task's error carries
    :data:`RANK_ERROR`) is a ``LaunchError`` naming the rank, with its
    traceback; anything else lost a rank: a :class:`_StageLost` naming the
    rank and why (an executor that exited, a peer lost), for the retry's line.
    """
    fn_errors = {r: t for r, (kind, t) in sorted(reported.items()) if kind == _call.FN_ERROR}
    if fn_errors or RANK_ERROR in text:
        marked = re.search(rf"rank (\d+): {RANK_ERROR}", text)
        rank, trace = next(
            iter(fn_errors.items()),
            (marked.group(1) if marked else "?", _between(text, RANK_ERROR)),
        )
        if trace.startswith((_call.CANNOT_LOAD, _call.CANNOT_RETURN)):  # not fn's own error
            return LaunchError(f"hvdkit.spark.run: rank {rank}: {trace}")
        return LaunchError(f"hvdkit.spark.run: fn raised on rank {rank}:\n{trace}")
    lines = [line.strip() for line in text.splitlines()]
    peer = next((line for line in lines if re.search(r"rank \d+ lost a peer: ", line)), None)
    if peer is not None:  # the task's RuntimeError names its rank
        return _StageLost(peer[peer.index("rank ") :][:400])
    task = _FAILED_TASK.search(text)
    lost = next((line for line in lines if line.startswith("ExecutorLostFailure")), None)
    if lost is not None:
        return _StageLost((f"rank {task.group(1)}: " if task else "") + lost[:400])
    return _StageLost(_first_line(text))


def _between(text: str, marker: str) -> str:
    parts = text.split(marker)
    return parts[1].strip() if len(parts) >= 3 else _first_line(text)


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if "Exception" in line or "Failure" in line or "failed" in line:
            return line.strip().lstrip(": ")[:400]
    return text.strip().splitlines()[0][:400] if text.strip() else "unknown"


class _TaskRunner:
    """The barrier task: meet, run the rank's process, forward its output, return its value."""

    def __init__(self, spec: _TaskSpec):
        self.spec = spec

    def __call__(self, _partition):
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        try:
            kind, value = self._rank(ctx, rank)
        except Exception as exc:  # the task's own set-up failed: the same again on a retry
            kind, value = _call.FN_ERROR, f"{type(exc).__name__}: {exc}"
            _RelaySender(self.spec.relay, rank).status(kind, value)
        if kind == _call.FN_ERROR:
            raise RuntimeError(f"rank {rank}: {RANK_ERROR}\n{value}\n{RANK_ERROR}")
        if kind != _call.OK:
            raise RuntimeError(f"rank {rank} lost a peer: {_call.summary(value)}")
        return [(rank, value)]

    def _rank(self, ctx, rank: int) -> tuple[str, Any]:
        spec = self.spec
        hosts = [info.address.rsplit(":", 1)[0] for info in ctx.getTaskInfos()]
        world = _world.places(hosts)
        fix = (
            "Each executor must be reachable from the others at the address it registered "
            "with (set SPARK_LOCAL_IP on the workers, or spark.driver.host for local mode)."
        )
        addresses = [_world.resolve(h, f"executor host {h}", fix) for h in hosts]
        _world.check_reachable(hosts, addresses, fix)
        server, port = None, 0
        if rank == 0:
            try:
                server, port = _world.serve(addresses[0], 0, set(addresses), world)
            except OSError as exc:
                raise ConfigurationError(
                    f"rank 0 cannot serve Gloo's rendezvous on {addresses[0]} ({exc}). {fix}"
                ) from None
        port = int(ctx.allGather(str(port))[0])
        try:
            mine = _world.local_address_towards(
                addresses[0],
                port,
                min(spec.timeout_s, _world.REACH_TIMEOUT_S),
                f"It runs in the executor on {hosts[0]}. {fix}",
            )
            env = dict(os.environ)
            hvd = _world.horovod_env(world[rank], addresses[0], port, mine, hosts=len(set(hosts)))
            env.update(hvd)
            env.update(spec.watch_env)
            env.update(spec.env)
            out = _run_rank(spec, rank, env)
            ctx.barrier()  # rank 0's rendezvous serves until every rank is done
            return out
        finally:
            if server is not None:
                server.stop()


def _run_rank(spec: _TaskSpec, rank: int, env: dict[str, str]) -> tuple[str, Any]:
    """Run fn in a process of its own; ``("ok", value)`` or ``(kind, traceback)``."""
    with tempfile.TemporaryDirectory(prefix=f"hvdkit-spark-{spec.job}-{rank}-") as tmp:
        call, result = os.path.join(tmp, "call"), os.path.join(tmp, "result")
        with open(call, "wb") as f:
            f.write(spec.call)
        cmd = [spec.executable or sys.executable, "-m", _call.__name__, call, result]
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        sender = _RelaySender(spec.relay, rank)
        pumps = [
            threading.Thread(target=sender.pump, args=(proc.stdout, "stdout"), daemon=True),
            threading.Thread(target=sender.pump, args=(proc.stderr, "stderr"), daemon=True),
        ]
        for t in pumps:
            t.start()
        code = proc.wait()
        for t in pumps:
            t.join()
        if os.path.exists(result) and os.path.getsize(result):
            with open(result, "rb") as f:
                out = pickle.load(f)
            if out[0] == _call.OK:
                sender.close()
                return _call.OK, out[1]
            kind, text = out[1], out[2]
        else:
            kind = _call.LOST_PEER
            text = f"rank {rank}'s process ended with {_exit_text(code)} before fn returned"
        sender.status(kind, text)
        sender.close()
        return kind, text


def _exit_text(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit code {code}"


# ------------------------------------------------------------------ output to the driver
class _Relay:
    """The driver's end: takes the ranks' lines over TCP (with the run's token) and prints them."""

    def __init__(self, host: str, out: TextIO, err: TextIO, timestamps: bool):
        self.token = secrets.token_hex(16)
        self.streams = {"stdout": out, "stderr": err}
        self.timestamps = timestamps
        self.errors: dict[int, tuple[str, str]] = {}  # rank -> (kind, traceback) it reported
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, 0))
        self.host, self.port = host, self._sock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name="hvdkit-spark-relay", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("r", encoding="utf-8", errors="replace") as f:
            if f.readline().strip() != self.token:
                return  # not one of this run's tasks
            for line in f:
                rank, stream, text = line.rstrip("\n").split("\t", 2)
                if stream == "status":
                    kind, _, trace = text.partition("\t")
                    self.errors[int(rank)] = (kind, trace.replace("\x00", "\n"))
                else:
                    self._write(int(rank), stream, text)

    def _write(self, rank: int, stream: str, text: str) -> None:
        stamp = time.strftime("%a %b %d %H:%M:%S %Y ") if self.timestamps else ""
        out = self.streams.get(stream, self.streams["stdout"])
        with self._lock:
            out.write(f"{stamp}[rank {rank}] {text}\n")
            out.flush()

    def close(self) -> None:
        self._closed = True
        self._sock.close()


class _RelaySender:
    """A task's end: the rank's lines to the driver (dropped if the driver cannot be reached)."""

    def __init__(self, relay: tuple[str, int, str], rank: int):
        host, port, token = relay
        self.rank = rank
        self._lock = threading.Lock()
        try:
            self._sock = socket.create_connection((host, port), timeout=10)
            self._sock.settimeout(None)
            self._sock.sendall(f"{token}\n".encode())
        except OSError:
            self._sock = None

    def _send(self, stream: str, text: str) -> None:
        if self._sock is None:
            return
        data = f"{self.rank}\t{stream}\t{text}\n".encode("utf-8", "replace")
        with self._lock:
            try:
                self._sock.sendall(data)
            except OSError:
                self._sock = None

    def pump(self, pipe, stream: str) -> None:
        for raw in io.TextIOWrapper(pipe, encoding="utf-8", errors="replace"):
            self._send(stream, raw.rstrip("\r\n").replace("\t", "    "))

    def status(self, kind: str, text: str) -> None:
        self._send("status", f"{kind}\t{text.replace(chr(10), chr(0))}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()

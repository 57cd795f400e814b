"""Which transport ``hvdkitrun`` uses when neither ``--gloo`` nor ``--mpi`` is given.

The rule is described once, with the measurements behind it, in
docs/performance.md ("The default transport"); :func:`choose_transport` is its
code (its docstring gives the inputs and examples), :data:`MPI_ENV` the
setting that makes MPI's ranks yield, :func:`busy_cores` the measure of other
work on this machine.

Pure logic (no processes, no TensorFlow), so tests/unit checks it directly.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence

GLOO, MPI = "gloo", "mpi"
# Set for every MPI job hvdkitrun starts, unless the user's environment sets it:
# a rank waiting in an MPI call gives its core away instead of spinning on it.
# Horovod's background thread of the rank that is not the coordinator waits in
# MPI for the next negotiation cycle, so with Open MPI's default it spins a
# whole core (measured: 0.99 of a core in an idle 2-rank job) that the rank's
# own TensorFlow compute needs; yielding made the 2-process training step
# ~1.4x faster (docs/performance.md, "Open MPI's waiting ranks").
YIELD_VAR = "OMPI_MCA_mpi_yield_when_idle"
MPI_ENV = {YIELD_VAR: "1"}
# Open MPI's byte transfer layers: horovodrun passes `-mca btl ^openib`, which
# overrides the user's own OMPI_MCA_btl and leaves Open MPI 4.1's ofi (libfabric)
# layer in, whose close sleeps 1 s in every rank at the end of every job
# (performance-record.md, "A process's end"). On one machine shared memory
# carries the whole job, so hvdkitrun leaves ofi out there; between machines
# Horovod's choice stands (a fabric may be reachable only through libfabric).
BTL_VAR = "OMPI_MCA_btl"
ONE_HOST_BTL = "^openib,ofi"
# Open MPI refuses to start as root without both (containers, CI runners).
MPI_AS_ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def mpi_root_env() -> dict[str, str]:
    """:data:`MPI_AS_ROOT_ENV` when this process runs as root, else nothing.

    The shell scripts (``scripts/_env.sh``, ``examples/cluster/_find_hvdkitrun.sh``)
    take the same variables from ``python -m hvdkit.launch.transport --root-env``.
    """
    return dict(MPI_AS_ROOT_ENV) if os.geteuid() == 0 else {}


def mpirun_btl(one_host: bool, environ: Mapping[str, str]) -> str | None:
    """The ``-mca btl`` value horovodrun should pass: ``None`` keeps Horovod's, ``""`` none.

    The user's :data:`BTL_VAR` wins (then no flag overrides it); a job on this
    machine alone gets :data:`ONE_HOST_BTL`; a job across machines Horovod's own.

    Example:
        >>> mpirun_btl(True, {}), mpirun_btl(False, {}), mpirun_btl(True, {BTL_VAR: "self,tcp"})
        ('^openib,ofi', None, '')
    """
    if environ.get(BTL_VAR):
        return ""
    return ONE_HOST_BTL if one_host else None


def root_env_exports() -> str:
    """:func:`mpi_root_env` as one shell ``export`` line, or ``""`` when not root."""
    env = mpi_root_env()
    return "export " + " ".join(f"{k}={v}" for k, v in env.items()) if env else ""


# Cores' worth of other load tolerated before MPI's busy-polling is avoided: an
# idle desktop or a CI runner shows a load of 0.1-1 without being busy.
BUSY_SLACK = 1.0


def choose_transport(
    hosts: Sequence[tuple[str, int]],
    *,
    cores: int | None,
    load: float = 0.0,
    mpi_available: bool,
    is_local: Callable[[str], bool],
    ranks_yield: bool = False,
) -> str:
    """The default transport for a job laid out as ``hosts``.

    The rule of docs/performance.md ("The default transport"), in code; a
    busy machine means more than ``cores`` + :data:`BUSY_SLACK` of this job's
    processes here and ``load``.

    Args:
        hosts: ``(host, processes on it)`` pairs, as ``cli.plan`` returns them,
            e.g. ``[("localhost", 2)]`` or ``[("a", 2), ("b", 2)]``.
        cores: CPU cores of this machine (``os.cpu_count()``), taken as every
            host's; ``None`` if unknown, then neither the process counts nor
            the load are held against MPI.
        load: cores' worth of other work competing for this machine's cores as
            the job starts (:func:`busy_cores`); counts only if the job runs
            processes here.
        mpi_available: whether Open MPI's ``mpirun`` can be found.
        is_local: whether a host name means this machine.
        ranks_yield: whether MPI's ranks will yield their core while waiting
            (:func:`ranks_yield`).

    Returns:
        ``"mpi"`` or ``"gloo"``.

    Example:
        >>> choose_transport([("localhost", 2)], cores=2, mpi_available=True,
        ...                  is_local=lambda h: h == "localhost")
        'mpi'
        >>> choose_transport([("localhost", 2)], cores=2, load=5.0, mpi_available=True,
        ...                  is_local=lambda h: h == "localhost")
        'gloo'
        >>> choose_transport([("localhost", 4)], cores=2, mpi_available=True,
        ...                  is_local=lambda h: h == "localhost")
        'gloo'
        >>> choose_transport([("localhost", 4)], cores=2, load=5.0, mpi_available=True,
        ...                  is_local=lambda h: h == "localhost", ranks_yield=True)
        'mpi'
        >>> choose_transport([("a", 2), ("b", 2)], cores=2, mpi_available=True,
        ...                  is_local=lambda h: h == "localhost")
        'mpi'
    """
    if not mpi_available:
        return GLOO
    if ranks_yield:
        return MPI
    per_host: dict[str, int] = {}
    for host, slots in hosts:  # every name of this machine counts as one host
        key = "" if is_local(host) else host
        per_host[key] = per_host.get(key, 0) + slots
    here = per_host.get("", 0)
    if cores is not None:
        if max(per_host.values(), default=0) > cores:
            return GLOO  # some host oversubscribed (others are taken to have as many cores)
        if here and here + load > cores + BUSY_SLACK:
            return GLOO  # this machine busy with other work
    return MPI


def ranks_yield(environ: Mapping[str, str]) -> bool:
    """Whether an MPI job started by hvdkitrun with ``environ`` yields (``MPI_ENV`` unless set).

    Example:
        >>> ranks_yield({}), ranks_yield({YIELD_VAR: "0"}), ranks_yield({YIELD_VAR: "true"})
        (True, False, True)
    """
    value = environ.get(YIELD_VAR, MPI_ENV[YIELD_VAR]).strip().lower()
    return value not in ("0", "false", "no", "f", "n")


def cpu_ticks() -> list[int] | None:
    """All cores' ticks from ``/proc/stat``; ``None`` where there is none (not Linux).

    In order: user nice system idle iowait irq softirq steal (guest time is
    inside user).
    """
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    return [int(v) for v in fields[1:9]] if fields[:1] == ["cpu"] else None


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) ticks of all cores; ``None`` where ``/proc/stat`` is missing."""
    ticks = cpu_ticks()
    if ticks is None:
        return None
    idle = ticks[3] + ticks[4]
    return sum(ticks) - idle, sum(ticks)


def busy_cores(
    cores: int | None,
    seconds: float = 0.5,
    *,
    read: Callable[[], tuple[int, int] | None] = _cpu_times,
    sleep: Callable[[float], None] = time.sleep,
) -> float | None:
    """Cores' worth of CPU in use on this machine over the next ``seconds``.

    The rule's measure of other work. Not the 1-minute load average: that
    still counts work which ended up to a minute ago (right after one job,
    the next saw a load of 1.3-3.4 on idle cores, picked Gloo, and ran 2.4x
    slower than over MPI; docs/performance.md). ``None`` without
    ``/proc/stat`` (not Linux) or without a core count.

    Example:
        >>> samples = iter([(100, 1000), (150, 1200)])   # 50 of 200 ticks busy
        >>> busy_cores(2, read=lambda: next(samples), sleep=lambda s: None)
        0.5
    """
    first = read()
    if first is None or not cores:
        return None
    sleep(seconds)
    second = read()
    if second is None or second[1] <= first[1]:
        return None
    return cores * (second[0] - first[0]) / (second[1] - first[1])


if __name__ == "__main__":  # the shell scripts' one way to the variables above
    import sys

    if sys.argv[1:] != ["--root-env"]:
        sys.exit("usage: python -m hvdkit.launch.transport --root-env")
    print(root_env_exports())

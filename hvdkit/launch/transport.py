"""Which transport ``hvdkitrun`` uses when neither ``--gloo`` nor ``--mpi`` is given.

The rule and the measurements behind it are in docs/performance.md; in short:

- every process on this machine, free cores for them (see below), and Open MPI's
  ``mpirun`` installed: **MPI** (shared-memory transport; the raw Horovod
  training loop ran 1.36x faster than over Gloo, and a 400 KB allreduce ~4x
  faster, on an otherwise quiet 2-core machine);
- one machine without free cores for the job, that is more processes than
  cores, or the job's processes plus the cores busy with other work (measured
  over half a second as the job starts, :func:`busy_cores`) exceeding the
  cores by more than one: **Gloo**. Open MPI's shared-memory progress
  busy-polls; on an oversubscribed CPU a peer that is not running makes the
  others spin through their time slices, and allreduces over MPI (even Open
  MPI's own, without Horovod) were measured 10-1000x slower than on a quiet
  machine, while Gloo's blocking sockets degrade gracefully;
- processes on more than one machine: **MPI** as well, unless a host would
  run more processes than this machine has cores (the other hosts are taken
  to be like this one), or this machine runs some of them and is busy as
  above. Between simulated hosts (network namespaces, Open MPI's TCP
  transport against Gloo's) Horovod over MPI was faster in most gradient
  sizes and link speeds, and several times faster with fp16 compression on
  fast links (Gloo sums float16 slowly); the figures, and where Gloo was
  faster, are in docs/performance.md. It needs what ``horovodrun --mpi`` needs:
  password-less ssh (as Gloo across machines does) and Open MPI at the same
  path on every host; ``--gloo`` otherwise;
- no ``mpirun``: **Gloo**, the only one that can run.

Pure logic (no processes, no TensorFlow), so tests/unit checks it directly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

GLOO, MPI = "gloo", "mpi"
# Set for every MPI job hvdkitrun starts, unless the user's environment sets it:
# a rank waiting in an MPI call gives its core away instead of spinning on it.
# Horovod's background thread of the rank that is not the coordinator waits in
# MPI for the next negotiation cycle, so with Open MPI's default it spins a
# whole core (measured: 0.99 of a core in an idle 2-rank job) that the rank's
# own TensorFlow compute needs; yielding made the 2-process training step
# ~1.4x faster (docs/performance.md, "Open MPI's waiting ranks").
MPI_ENV = {"OMPI_MCA_mpi_yield_when_idle": "1"}
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
) -> str:
    """The default transport for a job laid out as ``hosts``.

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
        >>> choose_transport([("a", 2), ("b", 2)], cores=2, mpi_available=True,
        ...                  is_local=lambda h: h == "localhost")
        'mpi'
    """
    if not mpi_available:
        return GLOO
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


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of all cores from ``/proc/stat``; ``None`` where there is none."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is inside user)
    ticks = [int(v) for v in fields[1:9]]
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

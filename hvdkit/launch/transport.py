"""Which transport ``hvdkitrun`` uses when neither ``--gloo`` nor ``--mpi`` is given.

The rule and the measurements behind it are in docs/performance.md; in short:

- every process on this machine, free cores for them (see below), and Open MPI's
  ``mpirun`` installed: **MPI** (shared-memory transport; the raw Horovod
  training loop ran 1.36x faster than over Gloo, and a 400 KB allreduce ~4x
  faster, on an otherwise quiet 2-core machine);
- one machine without free cores for the job, that is more processes than
  cores, or the job's processes plus the 1-minute load average exceeding the
  cores by more than one: **Gloo**. Open MPI's shared-memory progress
  busy-polls; on an oversubscribed CPU a peer that is not running makes the
  others spin through their time slices, and allreduces over MPI (even Open
  MPI's own, without Horovod) were measured 10-1000x slower than on a quiet
  machine, while Gloo's blocking sockets degrade gracefully;
- processes on more than one machine: **Gloo**, a documented choice, not a
  measurement: ``hvdkitrun`` serves Gloo's rendezvous through its guard (only
  the job's machines are answered), while MPI across machines needs
  password-less ssh and the same Open MPI on every host;
- no ``mpirun``: **Gloo**, the only one that can run.

Pure logic (no processes, no TensorFlow), so tests/unit checks it directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

GLOO, MPI = "gloo", "mpi"
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
        cores: CPU cores of this machine (``os.cpu_count()``); ``None`` if unknown,
            then neither the process count nor the load is held against MPI.
        load: the machine's 1-minute load average before the job starts
            (``os.getloadavg()[0]``): other work competing for the cores.
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
    """
    if not mpi_available:
        return GLOO
    if not all(is_local(host) for host, _ in hosts):
        return GLOO
    processes = sum(slots for _, slots in hosts)
    if cores is not None and (processes > cores or processes + load > cores + BUSY_SLACK):
        return GLOO
    return MPI

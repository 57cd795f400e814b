"""Inside a Slurm allocation: ``srun``'s tasks meet over Gloo, ``hvdkitrun`` takes the allocation.

``srun python train.py`` starts every rank itself. Over MPI (``srun
--mpi=pmix``) Open MPI finds the other ranks through PMIx and there is
nothing to do. Over Gloo hvdkit does what ``horovodrun`` would: rank 0 starts
Horovod's rendezvous server (:class:`~hvdkit.launch.guard.GuardedRendezvous`,
bound to the address of the step's first node and answering only the
step's nodes) on a port every task derives from the job and step ids, and
each task gets Horovod's Gloo settings (:func:`~hvdkit.launch.worker.horovod_env`)
from ``SLURM_*`` (:class:`~hvdkit.environments.SlurmEnvironment`).
:func:`hvdkit.init` calls :func:`join_srun_step` before it starts Horovod.
"""

from __future__ import annotations

import logging
import os
import socket
import time

from .. import _compat, config
from ..environments import GLOO, SlurmEnvironment
from ..errors import ConfigurationError

log = logging.getLogger("hvdkit.slurm")
_server = None  # rank 0's rendezvous server: serves until the process ends
POLL_S = 0.2


def join_srun_step() -> str | None:
    """Prepare this ``srun`` task to start Horovod; its transport, or None outside ``srun``.

    Raises:
        ConfigurationError: ``HVDKIT_WORKER_NUM`` disagrees with the task
            count, MPI was asked for without PMIx, or (Gloo) the rendezvous
            host cannot be resolved or reached within ``HVDKIT_SCHED_TIMEOUT``.
    """
    slurm = SlurmEnvironment.detect()
    if slurm is None:
        return None
    slurm.check_worker_num()
    transport = slurm.transport()
    if transport == GLOO and slurm.size > 1:
        os.environ.update(gloo_env(slurm, config.sched_timeout(ConfigurationError)))
    return transport


def gloo_env(slurm: SlurmEnvironment, timeout_s: float) -> dict[str, str]:
    """Horovod's Gloo settings for this task; rank 0 starts the rendezvous server first."""
    from .worker import horovod_env, interface_for

    host, port = slurm.rendezvous_host, slurm.rendezvous_port()
    address = _resolve(host, f"the first node of the step ({host}, where rank 0 runs)")
    if slurm.rank == 0:
        _serve(slurm, address, port)
    mine = _local_address_towards(address, port, timeout_s, host)
    _compat.check_gloo_hostname(address)
    assign = dict(
        rendezvous_port=port,
        hostname=slurm.node or socket.gethostname(),
        rank=slurm.rank,
        size=slurm.size,
        local_rank=slurm.local_rank,
        local_size=slurm.local_size,
        cross_rank=slurm.cross_rank,
        cross_size=slurm.cross_size,
    )
    return horovod_env(assign, address, interface_for(mine))


def _resolve(host: str, what: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot resolve {what} to an address ({exc}). Gloo's ranks meet there; make the "
            "node names resolve on every node, or use MPI: '#SBATCH --mpi=pmix' / srun --mpi=pmix."
        ) from None


def _serve(slurm: SlurmEnvironment, address: str, port: int) -> None:
    """Rank 0: Horovod's rendezvous server on ``address:port`` for the step's nodes."""
    global _server
    from .guard import GuardedRendezvous

    slot_info = _compat.horovod_slot_info()

    allowed = {_resolve(n, f"node {n} of the step") for n in slurm.nodes}
    server = GuardedRendezvous(address, allowed | {address})
    try:
        server.start(port=port)
    except OSError as exc:
        raise ConfigurationError(
            f"rank 0 cannot listen on {address}:{port} for Gloo's rendezvous ({exc}). Another "
            f"step of this job may hold it: set {config.RENDEZVOUS_PORT} to a free port "
            "(the same for every task)."
        ) from None
    server.init(
        [
            slot_info(
                hostname=s["hostname"],
                rank=-1,  # the server counts ranks per scope; which rank is which is not needed
                local_rank=s["local_rank"],
                cross_rank=-1,
                size=slurm.size,
                local_size=s["local_size"],
                cross_size=s["cross_size"],
            )
            for s in slurm.slots()
        ]
    )
    _server = server


def _local_address_towards(address: str, port: int, timeout_s: float, host: str) -> str:
    """This node's address on the way to the rendezvous server, once the server answers."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        try:
            with socket.create_connection((address, port), timeout=5) as sock:
                return sock.getsockname()[0]
        except OSError as exc:
            last = exc
        if time.monotonic() > deadline:
            raise ConfigurationError(
                f"rank 0's Gloo rendezvous on {host} ({address}:{port}) did not answer within "
                f"{timeout_s:g} s ({config.SCHED_TIMEOUT}; {last}). Rank 0 may have failed "
                "(see its output), or the nodes cannot reach each other on that port: use MPI "
                f"('#SBATCH --mpi=pmix'), or set {config.RENDEZVOUS_PORT} to a port that is open."
            )
        time.sleep(POLL_S)


def allocation_hosts() -> list[tuple[str, int]] | None:
    """``hvdkitrun`` inside an allocation: ``(node, tasks)`` for each of its nodes, else None."""
    slurm = SlurmEnvironment.in_allocation()
    if slurm is None or slurm.task or not slurm.nodes or not slurm.tasks_per_node:
        return None
    return list(zip(slurm.nodes, slurm.tasks_per_node, strict=False))

"""A static Gloo world: ranks whose hosts are known up front meet at rank 0.

Slurm's ``srun``, Spark's barrier stage and Ray's actors all start every rank
themselves and can tell each rank where all the others run. What is left is
what ``horovodrun --gloo`` would do: rank 0 serves Horovod's rendezvous
(:class:`~hvdkit.launch.guard.GuardedRendezvous`, answering only the job's
hosts), and every rank gets Horovod's Gloo variables
(:func:`~hvdkit.launch.worker.horovod_env`) for its place in the world.

Example (two ranks on host ``a``, one on ``b``)::

    >>> [(s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
    ...  for s in places(["a", "a", "b"])]
    [(0, 0, 2, 0, 2), (1, 1, 2, 0, 1), (2, 0, 1, 1, 2)]
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .. import _compat
from ..errors import ConfigurationError

POLL_S = 0.2
# Rank 0's rendezvous is up before the others look for it: a host that cannot reach it
# within this long cannot reach it at all (a firewall, an address of another network).
REACH_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Place:
    """One rank's place in the world, in Horovod's terms."""

    rank: int
    size: int
    hostname: str
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def places(hosts: Sequence[str]) -> list[Place]:
    """Each rank's :class:`Place`, given the host of every rank (index = rank).

    ``local_rank`` counts the ranks before this one on its host; ``cross_rank``
    counts the hosts, in order of their first rank, that have a rank with this
    ``local_rank`` (Horovod's cross communicator).
    """
    order = list(dict.fromkeys(hosts))  # hosts in order of their first rank
    seen: dict[str, int] = {}
    local = []
    for h in hosts:
        local.append(seen.get(h, 0))
        seen[h] = local[-1] + 1
    out = []
    for rank, (h, lr) in enumerate(zip(hosts, local, strict=True)):
        with_lr = [o for o in order if seen[o] > lr]
        out.append(
            Place(
                rank=rank,
                size=len(hosts),
                hostname=h,
                local_rank=lr,
                local_size=seen[h],
                cross_rank=with_lr.index(h),
                cross_size=len(with_lr),
            )
        )
    return out


def horovod_env(
    place: Place, address: str, port: int, my_address: str, *, hosts: int
) -> dict[str, str]:
    """Horovod's Gloo variables for ``place``; the rendezvous at ``address:port``.

    ``hosts``: how many machines the world spans (on more than one, this
    machine's host name must not resolve to a loopback address:
    :func:`hvdkit._compat.check_gloo_hostname`).
    """
    from ..launch.worker import horovod_env as env_for
    from ..launch.worker import interface_for

    if hosts > 1:
        _compat.check_gloo_hostname(address)
    assign = dict(vars(place), rendezvous_port=port)
    return env_for(assign, address, interface_for(my_address))


def serve(address: str, port: int, allowed: set[str], world: Sequence[Place]):
    """Rank 0: Horovod's rendezvous server on ``address:port`` (0: any) for ``allowed``.

    Returns:
        ``(server, port)``; the server answers until it is stopped or the process ends.

    Raises:
        OSError: the port cannot be bound.
    """
    from ..launch.guard import GuardedRendezvous

    slot_info = _compat.horovod_slot_info()
    server = GuardedRendezvous(address, set(allowed) | {address})
    port = server.start(port=port)
    server.init(
        [
            slot_info(
                hostname=p.hostname,
                rank=-1,  # the server counts ranks per scope; which rank is which is not needed
                local_rank=p.local_rank,
                cross_rank=-1,
                size=p.size,
                local_size=p.local_size,
                cross_size=p.cross_size,
            )
            for p in world
        ]
    )
    return server, port


def local_address_towards(
    address: str, port: int, timeout_s: float, describe: str, *, where: str = "", setting: str = ""
) -> str:
    """This host's address on the way to ``address:port``, once something listens there.

    Raises:
        ConfigurationError: nothing answered within ``timeout_s``. The message
            names the rendezvous (``where``, else ``at address:port``), the
            variable that sets the wait (``setting``) and ends with
            ``describe`` (what to check, and the fix).
    """
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        try:
            with socket.create_connection((address, port), timeout=5) as sock:
                return sock.getsockname()[0]
        except OSError as exc:
            last = exc
        if time.monotonic() > deadline:
            said = f"{setting}; {last}" if setting else str(last)
            raise ConfigurationError(
                f"rank 0's Gloo rendezvous {where or f'at {address}:{port}'} did not answer "
                f"within {timeout_s:g} s ({said}). {describe}"
            )
        time.sleep(POLL_S)


def check_reachable(hosts: Sequence[str], addresses: Sequence[str], fix: str) -> None:
    """Refuse a world on several machines in which a rank's host is a loopback address.

    Raises:
        ConfigurationError: names the host and ``fix``.
    """
    import ipaddress

    if len(set(addresses)) < 2:
        return
    for host, address in zip(hosts, addresses, strict=True):
        if ipaddress.ip_address(address).is_loopback:
            raise ConfigurationError(
                f"a rank runs on {host!r} ({address}), a loopback address, while the others "
                "run on other machines: they could not reach it over Gloo. " + fix
            )


def resolve(host: str, what: str, fix: str) -> str:
    """``host``'s IPv4 address. Raises ConfigurationError naming ``what`` and ``fix``."""
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise ConfigurationError(
            f"cannot resolve {what} to an address ({exc}). Gloo's ranks meet there; {fix}"
        ) from None


class StallWatch:
    """The driver's ear on the ranks: hvdkit's heartbeats, and which ranks fell silent.

    Every rank sends a heartbeat a second from ``hvdkit.init()`` on
    (:mod:`hvdkit.launch.heartbeat`, signed with a token made here); a rank
    frozen (SIGSTOP, a lost machine that closed nothing) falls silent, and
    after ``HVDKIT_STALL_TIMEOUT`` (120 s) the driver ends the attempt instead
    of waiting for ever. :meth:`env` is what the ranks need. One per attempt:
    the last attempt's ranks are no stall.
    """

    def __init__(self, host: str):
        import secrets

        from ..launch.heartbeat import HeartbeatMonitor, stall_timeout

        self.host = host
        self.stall_s = stall_timeout()
        self._token = secrets.token_hex(16)
        self._monitor = HeartbeatMonitor(self._token, bind_host=host)

    def env(self) -> dict[str, str]:
        from .. import config
        from ..launch.heartbeat import horovod_stall_env, monitor_addr

        m = self._monitor
        return {
            config.MONITOR_ADDR: monitor_addr(self.host, m.port, m.receiver),
            config.JOB_TOKEN: self._token,
            **horovod_stall_env(self.stall_s),
        }

    def silent(self) -> str | None:
        """Which ranks have been silent past the stall timeout, as a sentence; None if none."""
        silent = self._monitor.silent_ranks(self.stall_s)
        if not silent:
            return None
        from .. import config

        ranks = ", ".join(f"rank {r}" for r, _ in silent)
        longest = max(s for _, s in silent)
        return (
            f"{ranks} sent no heartbeat for {longest:.0f} s (the stall timeout is "
            f"{self.stall_s:g} s, {config.named(config.STALL_TIMEOUT)})"
        )

    def close(self) -> None:
        self._monitor.close()

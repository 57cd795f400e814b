"""The scheduler of a multi-node job without SSH (MindSpore's scheduler role).

Workers register over TCP with the job token; when ``worker_num`` have come,
the scheduler assigns ranks (contiguous per host, in order of arrival),
starts Horovod's own Gloo rendezvous server, and hands every worker the
``HOROVOD_*`` settings Horovod's Gloo launcher would have given it. It then
watches: the first worker that fails or disappears makes it tell all others to
stop, and it exits non-zero naming that rank. This module and
:mod:`hvdkit.backends.horovod` are the only ones that import Horovod: this one
for the launcher's rendezvous server, that one for the collectives.
"""

from __future__ import annotations

import hmac
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass

from ..errors import LaunchError
from .output import lost_a_peer
from .protocol import Channel

log = logging.getLogger("hvdkit.scheduler")
FAILURE_GRACE_S = 3.0
ABORT_WAIT_S = 30.0


def root_cause(failures: dict[int, tuple[str, list[str]]]) -> int:
    """The failed rank to blame: one whose output does not show it lost a peer."""
    primary = [r for r, (_, tail) in failures.items() if not lost_a_peer(tail)]
    return min(primary) if primary else min(failures)


@dataclass
class Registration:
    channel: Channel
    host: str  # the worker's address as the scheduler sees it: one per machine
    hostname: str
    pid: int
    rank: int = -1


def assign_ranks(hosts_in_order: list[str], regs_by_host: dict[str, list]) -> list[dict]:
    """Rank layout: contiguous ranks per host, hosts in order of first arrival.

    Returns one dict per registration with Horovod's rank, size, local and
    cross coordinates (cross = among hosts that have that local rank).
    """
    size = sum(len(regs_by_host[h]) for h in hosts_in_order)
    out, rank = [], 0
    for host_index, host in enumerate(hosts_in_order):
        regs = regs_by_host[host]
        for local_rank, reg in enumerate(regs):
            peers = [h for h in hosts_in_order if len(regs_by_host[h]) > local_rank]
            out.append(
                dict(
                    reg=reg,
                    rank=rank,
                    size=size,
                    local_rank=local_rank,
                    local_size=len(regs),
                    cross_rank=peers.index(host),
                    cross_size=len(peers),
                    host_index=host_index,
                )
            )
            rank += 1
    return out


class Scheduler:
    def __init__(self, host: str, port: int, worker_num: int, token: str, timeout_s: float):
        if worker_num < 1:
            raise LaunchError(f"HVDKIT_WORKER_NUM={worker_num} must be at least 1.")
        self.worker_num, self.token, self.timeout_s = worker_num, token, timeout_s
        self.host, self.port = host, port
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise LaunchError(
                f"the scheduler cannot listen on {host}:{port}: {exc.strerror}. Another job may "
                "use this port: choose another HVDKIT_SCHED_PORT (and give it to the workers)."
            ) from None
        self.sock.listen(64)
        self.events: queue.Queue = queue.Queue()

    # ------------------------------------------------------------ registration
    def _accept_registrations(self) -> list[Registration]:
        regs: list[Registration] = []
        deadline = time.monotonic() + self.timeout_s
        while len(regs) < self.worker_num:
            left = deadline - time.monotonic()
            if left <= 0:
                where = ", ".join(f"{r.hostname} ({r.host}, pid {r.pid})" for r in regs) or "none"
                for r in regs:
                    r.channel.send(type="abort", reason="not all workers arrived")
                raise LaunchError(
                    f"only {len(regs)} of {self.worker_num} workers registered within "
                    f"{self.timeout_s:g} s (arrived: {where}). Start the missing workers with "
                    "the same HVDKIT_SCHED_HOST/PORT and job token, or lower HVDKIT_WORKER_NUM."
                )
            self.sock.settimeout(min(left, 1.0))
            try:
                conn, addr = self.sock.accept()
            except TimeoutError:
                continue
            conn.settimeout(10)
            ch = Channel(conn)
            try:
                msg = ch.recv() or {}
            except OSError:
                ch.close()
                continue
            conn.settimeout(None)
            given = str(msg.get("token", ""))
            if msg.get("type") != "register" or not hmac.compare_digest(
                given.encode(), self.token.encode()
            ):
                reason = "bad job token" if msg.get("type") == "register" else "not a registration"
                log.warning("refused a worker from %s:%d: %s", addr[0], addr[1], reason)
                try:
                    ch.send(type="refused", reason=reason)
                finally:
                    ch.close()
                continue
            reg = Registration(ch, addr[0], str(msg.get("hostname", "?")), int(msg.get("pid", -1)))
            regs.append(reg)
            log.info(
                "worker %d/%d registered from %s (%s, pid %d)",
                len(regs),
                self.worker_num,
                reg.hostname,
                reg.host,
                reg.pid,
            )
        return regs

    # ------------------------------------------------------------ the job
    def run(self) -> int:
        from horovod.runner.common.util.hosts import SlotInfo
        from horovod.runner.http.http_server import RendezvousServer

        log.info(
            "scheduler listening on %s:%d for %d workers", self.host, self.port, self.worker_num
        )
        try:
            regs = self._accept_registrations()
        finally:
            # A late or surplus worker is refused at once instead of waiting
            # on a socket nobody accepts from.
            self.sock.close()
        hosts: list[str] = []
        by_host: dict[str, list[Registration]] = {}
        for r in regs:
            if r.host not in by_host:
                hosts.append(r.host)
                by_host[r.host] = []
            by_host[r.host].append(r)
        layout = assign_ranks(hosts, by_host)
        plan = [
            SlotInfo(
                hostname=f"host{a['host_index']}",
                rank=a["rank"],
                local_rank=a["local_rank"],
                cross_rank=a["cross_rank"],
                size=a["size"],
                local_size=a["local_size"],
                cross_size=a["cross_size"],
            )
            for a in layout
        ]
        server = RendezvousServer()
        rdv_port = server.start()
        server.init(plan)
        try:
            for a in layout:
                reg = a.pop("reg")
                reg.rank = a["rank"]
                a["hostname"] = f"host{a.pop('host_index')}"
                reg.channel.send(type="assign", rendezvous_port=rdv_port, **a)
            log.info(
                "assigned %d ranks on %d host(s); rendezvous on port %d",
                len(regs),
                len(hosts),
                rdv_port,
            )
            return self._watch(regs)
        finally:
            server.stop()
            for r in regs:
                r.channel.close()

    def _watch(self, regs: list[Registration]) -> int:
        for reg in regs:
            threading.Thread(target=self._listen, args=(reg,), daemon=True).start()
        remaining = {r.rank for r in regs}
        failures: dict[int, tuple[str, list[str]]] = {}
        grace_until = None
        while remaining:
            timeout = None if grace_until is None else max(0.0, grace_until - time.monotonic())
            try:
                rank, code, detail, tail = self.events.get(timeout=timeout)
            except queue.Empty:
                break  # grace over: stop the rest
            remaining.discard(rank)
            if code != 0:
                failures[rank] = (detail, tail)
                if grace_until is None:
                    # Other ranks usually fail right after the real culprit;
                    # collect them briefly so the report names the right one.
                    grace_until = time.monotonic() + FAILURE_GRACE_S
        if failures:
            culprit = root_cause(failures)
            detail, tail = failures[culprit]
            log.error("rank %d failed: %s; stopping the other workers", culprit, detail)
            for r in regs:
                if r.rank in remaining:
                    try:
                        r.channel.send(type="abort", reason=f"rank {culprit} failed: {detail}")
                    except OSError:
                        pass
            deadline = time.monotonic() + ABORT_WAIT_S
            while remaining and time.monotonic() < deadline:
                try:
                    rank, *_ = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
                    remaining.discard(rank)
                except queue.Empty:
                    break
            shown = "\n".join(f"    {ln}" for ln in tail) or "    (no output)"
            log.error("job failed: rank %d %s; its last lines:\n%s", culprit, detail, shown)
            if remaining:
                log.error("ranks %s did not report after being told to stop", sorted(remaining))
            return 1
        log.info("all %d ranks finished successfully", len(regs))
        return 0

    def _listen(self, reg: Registration) -> None:
        while True:
            try:
                msg = reg.channel.recv()
            except OSError:
                msg = None
            if msg is None:
                lost = f"lost its worker (pid {reg.pid} on {reg.hostname} {reg.host})"
                self.events.put((reg.rank, -1, f"{lost} without an exit report", []))
                return
            if msg.get("type") == "exit":
                code = int(msg.get("code", -1))
                detail = str(msg.get("detail", f"exit code {code}"))
                self.events.put((reg.rank, code, detail, list(msg.get("tail", []))))
                return

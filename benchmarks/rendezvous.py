"""A regroup's Gloo rendezvous at N ranks, against the store hvdkit uses (its guarded HTTP server).

Each simulated rank (a thread, no TensorFlow) makes the requests a Horovod
0.28.1 rank built by hvdkit makes to the rendezvous server when it starts
Horovod over Gloo, one new TCP connection per request as Horovod's HTTP store
does, in its three scopes one after another (``global`` of N ranks,
``local_<host>`` of ``--per-host``, ``cross_<local rank>`` of N / per-host).
In a scope of n ranks, rank r:

1. hvdkit's patch (``hvdkit/patches/horovod-0.28.1-gloo-all-here-before-connect.patch``):
   PUT ``hvdkit_here_r``, then for each i GET ``hvdkit_here_i`` until found
   (every 10 ms, as Horovod's store waits);
2. Gloo's full mesh (``connectFullMesh`` of the Gloo Horovod 0.28.1 ships):
   PUT ``rank_r`` (its host name), GET ``rank_i`` for each i < r; PUT ``r``:
   its address for each of the n - 1 pairs (136 bytes each: a
   ``sockaddr_storage`` and a sequence number), then for each i != r GET
   ``i`` until found, and GET it again to read it;
3. DELETE ``r`` once done (Horovod's store ``Finalize``).

A request refused or failed is tried again after 500 ms, 3 times in all, then
the rank's start fails, as Horovod's store does. Measured per N: seconds to a
complete world (every rank through its three scopes), requests and bytes
served, requests refused, ranks failed. ``--cap`` seconds bound a size that
does not finish; its rates then predict the time from the counts (the
requests and bytes each scope needs at the least, :func:`least_requests`):
the elapsed time times the larger of the two ratios still to do.

    python benchmarks/rendezvous.py                      # N = 16, 64, 256, 1000
    python benchmarks/rendezvous.py --sizes 16,64 --cap 60

Prints a table; writes bench_results/rendezvous.json.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from collections import Counter
from types import SimpleNamespace

from _common import REPO, steal_share, write_results

sys.path.insert(0, str(REPO))
from hvdkit.launch.scheduler import Scheduler, layout_for
from hvdkit.launch.transport import cpu_ticks

SIZES = (16, 64, 256, 1000)
ADDRESS_BYTES = 136  # Gloo's TCP address of one pair: sockaddr_storage (128) + sequence (8)
POLL_S = 0.010  # Horovod's HTTP store between two looks for a key
RETRIES, RETRY_PAUSE_S = 3, 0.5  # Horovod's HTTP store: MAX_RETRY_TIMES, its pause


def least_requests(n: int) -> tuple[int, int]:
    """(requests, bytes read) of one scope of ``n`` ranks when every key is there at first look.

    >>> least_requests(2)
    (17, 544)
    """
    here = n + n * n  # PUT each; each rank GETs every rank's
    names = n + n * (n - 1) // 2
    addresses = n + 2 * n * (n - 1)  # PUT each; wait (one GET) and read (one GET) each peer's
    return here + names + addresses + n, 2 * n * (n - 1) * (n - 1) * ADDRESS_BYTES


class Failed(Exception):
    pass


class Client:
    """A rank's HTTP store: one connection per request, Horovod's retries; counts what it did."""

    def __init__(self, port: int, stats: Counter, errors: Counter, lock: threading.Lock):
        self.port, self.stats, self.errors, self.lock = port, stats, errors, lock

    def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        for _ in range(RETRIES):
            try:
                status, data = self._once(method, path, body)
                if status in (200, 404):
                    with self.lock:
                        self.stats["requests"] += 1
                        self.stats["bytes_read"] += len(data)
                    return status, data
                why = f"HTTP {status}"
            except OSError as exc:
                why = type(exc).__name__
            with self.lock:
                self.stats["retried"] += 1
                self.errors[why] += 1
            time.sleep(RETRY_PAUSE_S)
        raise Failed(f"{method} {path} failed {RETRIES} times")

    def _once(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as s:
            head = f"{method} {path} HTTP/1.1\r\nHost: rdv\r\nContent-Length: {len(body)}\r\n\r\n"
            s.sendall(head.encode() + body)
            chunks = []
            while True:
                chunk = s.recv(1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        raw = b"".join(chunks)
        top, _, rest = raw.partition(b"\r\n\r\n")
        if not top:
            raise ConnectionError("no answer")
        return int(top.split()[1]), rest

    def wait(self, path: str, deadline: float) -> bytes:
        while True:
            status, data = self.request("GET", path)
            if status == 200:
                return data
            if time.monotonic() > deadline:
                raise Failed(f"{path} did not come")
            time.sleep(POLL_S)


def scope(c: Client, name: str, r: int, n: int, deadline: float) -> None:
    """The requests of rank ``r`` in one scope of ``n`` ranks (the module's steps 1-3)."""
    c.request("PUT", f"/{name}/hvdkit_here_{r}", b"1")
    for i in range(n):
        c.wait(f"/{name}/hvdkit_here_{i}", deadline)
    c.request("PUT", f"/{name}/rank_{r}", b"simhost")
    for i in range(r):
        c.request("GET", f"/{name}/rank_{i}")
    c.request("PUT", f"/{name}/{r}", bytes(ADDRESS_BYTES * (n - 1)))
    for i in range(n):
        if i != r:
            c.wait(f"/{name}/{i}", deadline)
            c.request("GET", f"/{name}/{i}")
    c.request("DELETE", f"/{name}/{r}")


class _Reg:  # what layout_for needs of a worker
    def __init__(self, host: str):
        self.host = host


class _Host:  # what Scheduler._start_rendezvous needs of its scheduler
    def __init__(self, host: str):
        self.host = host


def measure(n: int, per_host: int, cap_s: float) -> dict:
    hosts = [f"10.0.{i // per_host // 250}.{i // per_host % 250}" for i in range(n)]
    layout = layout_for([_Reg(h) for h in hosts])
    # The scheduler's own start of a round's server (one address, only the job's
    # clients: here this machine), with Horovod's plan of the layout.
    server, port = Scheduler._start_rendezvous(_Host("127.0.0.1"), layout, {"127.0.0.1"})
    plan = [SimpleNamespace(**a, hostname=f"host{a['host_index']}") for a in layout]
    stats, errors, lock = Counter(), Counter(), threading.Lock()
    failures: list[str] = []
    done: list[float] = []
    t0 = time.monotonic()
    deadline = t0 + cap_s

    def rank(slot) -> None:
        c = Client(port, stats, errors, lock)
        try:
            scope(c, "global", slot.rank, slot.size, deadline)
            scope(c, f"local_{slot.hostname}", slot.local_rank, slot.local_size, deadline)
            scope(c, f"cross_{slot.local_rank}", slot.cross_rank, slot.cross_size, deadline)
            done.append(time.monotonic() - t0)
        except Failed as exc:
            failures.append(str(exc))

    ticks, load0 = cpu_ticks(), os.getloadavg()
    threads = [threading.Thread(target=rank, args=(s,), daemon=True) for s in plan]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline + 5 - time.monotonic()))
    elapsed = time.monotonic() - t0
    refusals = dict(server.httpd.refusals)
    server.stop()
    least = [least_requests(p) for p in scope_sizes(n, per_host)]
    need, bytes_need = sum(r for r, _ in least), sum(b for _, b in least)
    read = stats["bytes_read"]
    bytes_left = bytes_need / read if read > bytes_need / 100 else 0.0
    rate = stats["requests"] / elapsed
    return {
        "n": n,
        "per_host": per_host,
        "complete": len(done) == n,
        "world_s": max(done) if len(done) == n else None,
        "ranks_done": len(done),
        # a request failed RETRIES times: the rank's Horovod start would fail
        "ranks_failed": sum(1 for f in failures if "failed" in f),
        "ranks_cut": sum(1 for f in failures if "did not come" in f),  # by --cap
        "failures": sorted(set(failures))[:3],
        "requests": stats["requests"],
        "bytes_read": stats["bytes_read"],
        "retried": stats["retried"],
        "retried_why": dict(errors),
        "refusals": refusals,
        "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(rate),
        "least_requests": need,
        "least_bytes": bytes_need,
        # the larger of the two shares still to do, at the rates so far; with almost
        # no bytes read yet (the large values come last) only the requests' share
        "predicted_s": round(elapsed * max(need / max(1, stats["requests"]), bytes_left), 1),
        "load_avg_start": load0,
        "load_avg_end": os.getloadavg(),
        "steal": steal_share(ticks, cpu_ticks()),
    }


def scope_sizes(n: int, per_host: int) -> list[int]:
    """The size of every scope of a world of ``n`` ranks, ``per_host`` on each machine.

    >>> scope_sizes(16, 8)
    [16, 8, 8, 2, 2, 2, 2, 2, 2, 2, 2]
    """
    hosts = -(-n // per_host)
    local = [min(per_host, n - h * per_host) for h in range(hosts)]
    cross = [sum(1 for size in local if size > k) for k in range(max(local))]
    return [n, *local, *cross]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--per-host", type=int, default=8)
    p.add_argument("--cap", type=float, default=120.0, help="seconds at most per size")
    args = p.parse_args()
    rows = []
    print(
        f"{'N':>5} {'complete':>8} {'world s':>8} {'requests':>9} {'req/s':>6} {'MB read':>8} "
        f"{'refused':>7} {'failed':>6} {'least requests':>14} {'predicted s':>11}"
    )
    for n in [int(s) for s in args.sizes.split(",")]:
        r = measure(n, args.per_host, args.cap)
        rows.append(r)
        world = "-" if r["world_s"] is None else f"{r['world_s']:.2f}"
        print(
            f"{n:>5} {str(r['complete']):>8} {world:>8} {r['requests']:>9} "
            f"{r['requests_per_s']:>6} {r['bytes_read'] / 1e6:>8.1f} "
            f"{sum(r['refusals'].values()):>7} {r['ranks_failed']:>6} {r['least_requests']:>14} "
            f"{r['predicted_s']:>11}",
            flush=True,
        )
    payload = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "rows": rows}
    print(f"wrote {write_results('rendezvous', payload)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

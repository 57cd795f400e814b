"""A regroup's Gloo rendezvous at N ranks, against the store hvdkit uses (its guarded HTTP server).

Each simulated rank (a thread, no TensorFlow) makes the requests a Horovod
0.28.1 rank built by hvdkit makes to the rendezvous server when it starts
Horovod over Gloo, one new TCP connection per request as Horovod's HTTP store
does, in its six scopes one after another: ``global`` of N ranks,
``local_<host>`` of ``--per-host``, ``cross_<local rank>`` of N / per-host, and
the same three again for the global process set (``..._process_set_hash_<h>``,
as Horovod's ``InitializeForProcessSet`` does). After a scope's exchange a rank
waits for every rank of the scope (Gloo's barrier over the new pairs, here a
``threading.Barrier``) before its DELETE, as Horovod's ``Rendezvous`` does.

``--pattern hvdkit`` (the default: hvdkit's Horovod patch
``horovod-0.28.1-gloo-batched-mesh.patch`` against hvdkit's server): in a scope
of n ranks, rank r PUTs ``hvdkit_addrs_r`` (a
host line and its 136-byte address for each of the n - 1 pairs), GETs
``hvdkit_mesh_r?size=n&wait_ms=...`` (the server holds it until all n values
are there; asked again while it answers "missing") and DELETEs ``r``. Each
reader's answer is checked byte for byte (rank i's address for j is
recognisable): a wrong one counts as a failed rank. Before its first scope a
rank GETs the probe ``hvdkit_mesh`` (once per server and process).

``--pattern horovod`` (Gloo's own exchange, what the build did before that
patch and still does against Horovod's own server), in a scope of n ranks, rank r:

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
the rank's start fails, as Horovod's store does. The rank threads run in one
child process (``--ranks-here``: in the server's process, as the runs before
the batched mesh were measured), so that the server has a core of its own
and its process's CPU time is the server's. Measured per N: seconds to a
complete world (every rank through its six scopes), requests and bytes
served, requests refused, ranks failed. ``--cap`` seconds bound a size that
does not finish; its rates then predict the time from the counts (the
requests and bytes each scope needs at the least, :func:`least_requests`):
the elapsed time times the larger of the two ratios still to do.

``--what-if-no-delete`` is a what-if, not what hvdkit's ranks do: the simulated
ranks skip their DELETE (13 requests a rank instead of 19), as they could if the
server cleared a scope itself once all its ``n`` ranks had read their answers
(a change of the Horovod patch that is not made); the values then stay in the
store until the server stops. It estimates what that change would save.

    python benchmarks/rendezvous.py                      # N = 16, 64, 256, 1000
    python benchmarks/rendezvous.py --sizes 16,64 --cap 60

Prints a table; writes bench_results/rendezvous.json.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import sys
import threading
import time
from collections import Counter

from _common import REPO, steal_share, write_results

sys.path.insert(0, str(REPO))
from hvdkit.launch import mesh
from hvdkit.launch.scheduler import Scheduler, layout_for
from hvdkit.launch.transport import cpu_ticks

SIZES = (16, 64, 256, 1000)
ADDRESS_BYTES = 136  # Gloo's TCP address of one pair: sockaddr_storage (128) + sequence (8)
POLL_S = 0.010  # Horovod's HTTP store between two looks for a key
RETRIES, RETRY_PAUSE_S = 3, 0.5  # Horovod's HTTP store: MAX_RETRY_TIMES, its pause


PATTERNS = ("hvdkit", "horovod")


def least_requests(n: int, pattern: str = "horovod", delete: bool = True) -> tuple[int, int]:
    """(requests, bytes read) of one scope of ``n`` ranks when every key is there at first look.

    >>> least_requests(2), least_requests(2, "hvdkit"), least_requests(2, "hvdkit", False)
    ((17, 544), (6, 276), (4, 276))
    """
    if pattern == "hvdkit":  # PUT, one mesh read, DELETE; the answers' addresses
        return (3 if delete else 2) * n, n * (2 + (n - 1) * ADDRESS_BYTES)
    here = n + n * n  # PUT each; each rank GETs every rank's
    names = n + n * (n - 1) // 2
    addresses = n + 2 * n * (n - 1)  # PUT each; wait (one GET) and read (one GET) each peer's
    return here + names + addresses + n, 2 * n * (n - 1) * (n - 1) * ADDRESS_BYTES


class Failed(Exception):
    pass


class Client:
    """A rank's HTTP store: one connection per request, Horovod's retries; counts what it did."""

    def __init__(
        self, port: int, stats: Counter, errors: Counter, lock, meet: Barriers, delete: bool = True
    ):
        self.port, self.stats, self.errors, self.lock = port, stats, errors, lock
        self.meet = meet  # Gloo's barrier before the DELETE
        self.delete = delete  # False: --what-if-no-delete

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
        with socket.socket() as s:  # (no name to look up: the client's CPU is the ranks')
            s.settimeout(30)
            s.connect(("127.0.0.1", self.port))
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


_PADS = [bytes(k) for k in range(ADDRESS_BYTES + 1)]


def address(i: int, j: int) -> bytes:
    """Simulated rank ``i``'s address for its pair with ``j``: 136 bytes, recognisable."""
    head = b"%d>%d;" % (i, j)
    return head + _PADS[ADDRESS_BYTES - len(head)]


def scope_hvdkit(c: Client, name: str, r: int, n: int, deadline: float, host: str) -> None:
    """The requests of rank ``r`` in one scope of ``n`` ranks, hvdkit's batched mesh."""
    mine = host.encode() + b"\n" + b"".join(address(r, j) for j in range(n) if j != r)
    c.request("PUT", f"/{name}/{mesh.ADDRESSES_KEY}{r}", mine)
    while True:
        wait_ms = max(0, int((deadline - time.monotonic()) * 1000))
        status, data = c.request("GET", f"/{name}/{mesh.MESH_KEY}{r}?size={n}&wait_ms={wait_ms}")
        if status == 200:
            break
        if time.monotonic() > deadline:
            raise Failed(f"{name} rank {r}: did not come: {data[:60]!r}")
        time.sleep(POLL_S)
    line, _, slices = data.partition(b"\n")
    if slices != b"".join(address(i, r) for i in range(n) if i != r):
        raise Failed(f"{name} rank {r}: wrong addresses ({len(slices)} bytes)")
    with c.lock:  # (checked against the layout by measure)
        c.stats["local_rank_sum"] += int(line)
    c.meet(name, n, deadline)
    if c.delete:
        c.request("DELETE", f"/{name}/{r}")


def scope(c: Client, name: str, r: int, n: int, deadline: float, host: str = "") -> None:
    """The requests of rank ``r`` in one scope of ``n`` ranks, Gloo's exchange (steps 1-3)."""
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
    c.meet(name, n, deadline)
    c.request("DELETE", f"/{name}/{r}")


class Barriers:
    """Gloo's barrier after a scope's pairs connect, one per scope, among this process's ranks."""

    def __init__(self):
        self._lock = threading.Lock()
        self._scopes: dict[str, threading.Barrier] = {}

    def __call__(self, name: str, n: int, deadline: float) -> None:
        with self._lock:
            barrier = self._scopes.setdefault(name, threading.Barrier(n))
        try:
            barrier.wait(max(0.0, deadline - time.monotonic()))
        except threading.BrokenBarrierError:
            raise Failed(f"{name}: did not come to the barrier") from None


class _Reg:  # what layout_for needs of a worker
    def __init__(self, host: str):
        self.host = host


class _Host:  # what Scheduler._start_rendezvous needs of its scheduler
    def __init__(self, host: str):
        self.host = host


PROCESS_SET = "_process_set_hash_1f"  # the global process set's scopes (the hash, simulated)


def run_ranks(
    port: int, slots: list[dict], pattern: str, cap_s: float, start, out, delete: bool = True
) -> None:
    """Simulate a world's ``slots`` (a thread each) once ``start`` is set; what they did to ``out``.

    Run in a child process, or in this one (``--ranks-here``); every rank of the
    world runs in the one process (the barriers are threads').
    """
    stats, errors, lock = Counter(), Counter(), threading.Lock()
    meet = Barriers()
    failures: list[str] = []
    done: list[float] = []  # time.monotonic() (system-wide) when each rank was through
    one_scope = scope_hvdkit if pattern == "hvdkit" else scope
    out.put("ready")
    start.wait()
    deadline = time.monotonic() + cap_s
    cpu0 = time.process_time()

    def rank(slot: dict) -> None:
        c = Client(port, stats, errors, lock, meet, delete)
        host, local_rank = slot["hostname"], slot["local_rank"]
        try:
            if pattern == "hvdkit":
                _, probe = c.request("GET", f"/global/{mesh.MESH_PROBE_KEY}")
                if probe != mesh.MESH_PROTOCOL:
                    raise Failed(f"the server does not answer the batched mesh: {probe[:40]!r}")
            for suffix in ("", PROCESS_SET):
                one_scope(c, f"global{suffix}", slot["rank"], slot["size"], deadline, host)
                local = f"local_{host}{suffix}"
                one_scope(c, local, local_rank, slot["local_size"], deadline, host)
                cross = f"cross_{local_rank}{suffix}"
                one_scope(c, cross, slot["cross_rank"], slot["cross_size"], deadline, host)
            done.append(time.monotonic())
        except Failed as exc:
            failures.append(str(exc))

    threads = [threading.Thread(target=rank, args=(s,), daemon=True) for s in slots]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline + 5 - time.monotonic()))
    out.put(
        {
            "stats": dict(stats),
            "errors": dict(errors),
            "failures": failures,
            "done": done,
            "cpu_s": time.process_time() - cpu0,
        }
    )


def measure(
    n: int,
    per_host: int,
    cap_s: float,
    pattern: str = "hvdkit",
    apart: bool = True,
    delete: bool = True,
) -> dict:
    """One world of ``n`` ranks, their threads in a child process (``apart``) or this one.

    ``delete=False``: the what-if of ``--what-if-no-delete`` (the module's docstring).
    """
    hosts = [f"10.0.{i // per_host // 250}.{i // per_host % 250}" for i in range(n)]
    layout = layout_for([_Reg(h) for h in hosts])
    # The scheduler's own start of a round's server (one address, only the job's
    # clients: here this machine), with Horovod's plan of the layout.
    server, port = Scheduler._start_rendezvous(_Host("127.0.0.1"), layout, {"127.0.0.1"})
    plan = [dict(a, hostname=f"host{a['host_index']}") for a in layout]
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    args = (port, plan, pattern, cap_s, start, out, delete)
    kind = ctx.Process if apart else threading.Thread
    children = [kind(target=run_ranks, args=args, daemon=True)]
    for child in children:
        child.start()
    for _ in children:
        out.get()  # "ready"
    ticks, load0 = cpu_ticks(), os.getloadavg()
    cpu0 = time.process_time()  # this process: the server (and the ranks if not apart)
    t0 = time.monotonic()
    start.set()
    reports = [out.get() for _ in children]
    elapsed = time.monotonic() - t0
    server_cpu = time.process_time() - cpu0
    for child in children:
        child.join(10)
    stats, errors = Counter(), Counter()
    for report in reports:
        stats.update(report["stats"])
        errors.update(report["errors"])
    failures = [f for report in reports for f in report["failures"]]
    done = [at - t0 for report in reports for at in report["done"]]
    refusals = dict(server.httpd.refusals)
    server.stop()
    least = [least_requests(p, pattern, delete) for p in 2 * scope_sizes(n, per_host)]
    if pattern == "hvdkit":  # each rank's probe
        least.append((n, n * len(mesh.MESH_PROTOCOL)))
    need, bytes_need = sum(r for r, _ in least), sum(b for _, b in least)
    read = stats["bytes_read"]
    bytes_left = bytes_need / read if read > bytes_need / 100 else 0.0
    rate = stats["requests"] / elapsed
    # the local rank the server answers: a rank's place on its host in a global scope and
    # in its host's scope (all of one host), 0 in a cross scope (one rank a host); twice
    local_ranks = 4 * sum(s["local_rank"] for s in plan) if pattern == "hvdkit" else 0
    return {
        "n": n,
        "pattern": pattern,
        "deletes": delete,  # False: the what-if --what-if-no-delete
        "per_host": per_host,
        "ranks_apart": apart,
        "scopes": 2 * len(scope_sizes(n, per_host)),
        "complete": len(done) == n,
        "local_ranks_right": stats["local_rank_sum"] == local_ranks if len(done) == n else None,
        "world_s": max(done) if len(done) == n else None,
        "ranks_done": len(done),
        # a request failed RETRIES times: the rank's Horovod start would fail
        "ranks_failed": sum(1 for f in failures if "failed" in f or "wrong" in f),
        "ranks_cut": sum(1 for f in failures if "did not come" in f),  # by --cap
        "failures": sorted(set(failures))[:3],
        "requests": stats["requests"],
        "bytes_read": stats["bytes_read"],
        "retried": stats["retried"],
        "retried_why": dict(errors),
        "refusals": refusals,
        "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(rate),
        # CPU seconds of the server's process while the world formed (with
        # --ranks-here the ranks' too), and of the ranks' process
        "server_cpu_s": round(server_cpu, 2),
        "ranks_cpu_s": round(sum(r["cpu_s"] for r in reports), 2) if apart else None,
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
    p.add_argument(
        "--ranks-here",
        action="store_true",
        help="run the rank threads in the server's process (default: in a child process)",
    )
    p.add_argument(
        "--pattern",
        default="hvdkit",
        help=f"comma-separated, of {', '.join(PATTERNS)} (the module's docstring)",
    )
    p.add_argument(
        "--what-if-no-delete",
        action="store_true",
        help="a what-if, not hvdkit's behaviour: the ranks skip their DELETE (the docstring)",
    )
    args = p.parse_args()
    patterns = args.pattern.split(",")
    if not set(patterns) <= set(PATTERNS):
        p.error(f"--pattern {args.pattern!r}: each must be one of {', '.join(PATTERNS)}")
    if args.what_if_no_delete and patterns != ["hvdkit"]:
        p.error(f"--what-if-no-delete goes with --pattern hvdkit alone, not {args.pattern!r}")
    rows = []
    print(
        f"{'pattern':>8} {'N':>5} {'complete':>8} {'world s':>8} {'requests':>9} {'req/s':>6} "
        f"{'MB read':>8} {'refused':>7} {'failed':>6} {'least requests':>14} {'predicted s':>11} "
        f"{'server CPU s':>12}"
    )
    for n in [int(s) for s in args.sizes.split(",")]:
        for pattern in patterns:
            r = measure(
                n, args.per_host, args.cap, pattern, not args.ranks_here, not args.what_if_no_delete
            )
            rows.append(row(r))
    payload = {"date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "rows": rows}
    print(f"wrote {write_results('rendezvous', payload)}")
    return 0


def row(r: dict) -> dict:
    """Print one measured row of the table; the row."""
    world = "-" if r["world_s"] is None else f"{r['world_s']:.2f}"
    print(
        f"{r['pattern']:>8} {r['n']:>5} {str(r['complete']):>8} {world:>8} {r['requests']:>9} "
        f"{r['requests_per_s']:>6} {r['bytes_read'] / 1e6:>8.1f} "
        f"{sum(r['refusals'].values()):>7} {r['ranks_failed']:>6} {r['least_requests']:>14} "
        f"{r['predicted_s']:>11} {r['server_cpu_s']:>12}",
        flush=True,
    )
    return r


if __name__ == "__main__":
    sys.exit(main())

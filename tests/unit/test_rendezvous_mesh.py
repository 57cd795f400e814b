"""hvdkit's batched Gloo full mesh on its rendezvous server (launch/mesh.py, launch/guard.py).

A real server on loopback, threads as ranks: each rank PUTs its host line and
its n - 1 address slices, then one mesh read returns the slices meant for it.
"""

from __future__ import annotations

import http.client
import http.server
import io
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from listener_targets import wait_for

from hvdkit.launch import guard, mesh, plain_request

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import rendezvous as bench  # benchmarks/rendezvous.py

SLICE = 6  # bytes of one simulated pair address (Gloo's TCP address is 136)


def address(i: int, j: int) -> bytes:
    """Rank i's address for its pair with rank j: a fixed-size, recognisable slice."""
    return b"%02d>%02d;" % (i, j)


def value(i: int, n: int, host: bytes) -> bytes:
    """What rank i of n PUTs: its host line, then a slice for every peer in rank order."""
    return host + b"\n" + b"".join(address(i, j) for j in range(n) if j != i)


def expected(r: int, n: int, hosts: list[bytes]) -> bytes:
    local = sum(1 for i in range(r) if hosts[i] == hosts[r])
    return b"%d\n" % local + b"".join(address(i, r) for i in range(n) if i != r)


def request(port, method, path, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def read(port, scope, r, n, wait_ms=60_000):
    return request(port, "GET", f"/{scope}/{mesh.MESH_KEY}{r}?size={n}&wait_ms={wait_ms}")


def publish(port, scope, r, n, hosts):
    status, _ = request(port, "PUT", f"/{scope}/{mesh.ADDRESSES_KEY}{r}", value(r, n, hosts[r]))
    assert status == 200


@pytest.fixture
def server():
    srv = guard.GuardedRendezvous("127.0.0.1", {"127.0.0.1"})
    port = srv.start()
    yield srv, port
    srv.stop()


def test_mesh_answer_gives_every_reader_the_slices_meant_for_it():
    n = 5
    hosts = [b"a", b"b", b"a", b"a", b"b"]
    values = {i: value(i, n, hosts[i]) for i in range(n)}
    for r in range(n):
        got = mesh.mesh_answer(values, r, n)
        assert got == expected(r, n, hosts), r
        assert len(got) == 2 + (n - 1) * SLICE
    assert [mesh.mesh_answer(values, r, n)[:2] for r in range(n)] == [
        b"0\n",
        b"0\n",
        b"1\n",
        b"2\n",
        b"1\n",
    ]
    # the docstring's example
    three = {0: b"a\n0>10>2", 1: b"a\n1>01>2", 2: b"b\n2>02>1"}
    assert mesh.mesh_answer(three, 1, 3) == b"1\n0>12>1"
    assert mesh.mesh_answer({0: b"h\n"}, 0, 1) == b"0\n"  # a scope of one: no peers


@pytest.mark.parametrize(
    ("bad", "why"),
    [(b"no host line", "rank 2's value \\(12 bytes\\)"), (b"a\n12345", "rank 2's value")],
)
def test_mesh_answer_refuses_a_value_that_does_not_split(bad, why):
    values = {i: value(i, 3, b"h") for i in range(3)}
    values[2] = bad
    with pytest.raises(ValueError, match=why):
        mesh.mesh_answer(values, 0, 3)


def test_the_probe_tells_hvdkits_server_from_horovods(server):
    from horovod.runner.http.http_server import RendezvousServer

    _, port = server
    assert request(port, "GET", f"/global/{mesh.MESH_PROBE_KEY}") == (200, mesh.MESH_PROTOCOL)
    assert request(port, "GET", f"/local_host0/{mesh.MESH_PROBE_KEY}")[0] == 200
    horovods = RendezvousServer()
    hport = horovods.start()
    try:
        # Horovod's own server does not know the key: a patched rank keeps Gloo's exchange
        assert request(hport, "GET", f"/global/{mesh.MESH_PROBE_KEY}")[0] == 404
    finally:
        horovods.stop()


def test_ranks_as_threads_each_read_their_slices_once_all_have_published(server):
    srv, port = server
    n = 6
    hosts = [b"host0"] * 3 + [b"host1"] * 3
    answers: dict[int, tuple[int, bytes]] = {}

    def rank(r):
        publish(port, "global", r, n, hosts)
        answers[r] = read(port, "global", r, n)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n - 1)]
    for t in threads:
        t.start()
    # the five wait in the server (parked, off the connection cap) for the sixth
    assert wait_for(lambda: srv.httpd._waiting == n - 1, 60), srv.httpd._waiting
    assert answers == {}
    rank(n - 1)
    for t in threads:
        t.join(60)
    assert answers == {r: (200, expected(r, n, hosts)) for r in range(n)}
    # (a request's thread ends just after its answer went out)
    assert wait_for(lambda: (srv.httpd._waiting, srv.httpd._busy) == (0, 0), 60)
    assert dict(srv.httpd.refusals) == {}


def test_a_read_that_ends_before_all_came_names_the_missing_ranks(server):
    _, port = server
    n = 5
    hosts = [b"h"] * n
    for r in (0, 2, 4):
        publish(port, "cross_0", r, n, hosts)
    assert read(port, "cross_0", 0, n, wait_ms=0) == (404, b"missing 1,3")
    assert read(port, "cross_0", 2, n, wait_ms=50) == (404, b"missing 1,3")  # waited, in vain
    publish(port, "cross_0", 1, n, hosts)
    assert read(port, "cross_0", 4, n, wait_ms=0) == (404, b"missing 3")
    publish(port, "cross_0", 3, n, hosts)
    assert read(port, "cross_0", 4, n, wait_ms=0) == (200, expected(4, n, hosts))
    # other scopes are apart: the same ranks elsewhere have published nothing
    assert read(port, "global", 0, 2, wait_ms=0) == (404, b"missing 0,1")


def test_waiting_reads_do_not_take_the_connection_slots(server, monkeypatch):
    srv, port = server
    monkeypatch.setattr(guard, "MAX_CONNECTIONS", 3)
    monkeypatch.setattr(guard, "ADMIT_WAIT_S", 60.0)  # a burst waits for a slot, however loaded
    n = 9
    hosts = [b"h"] * n
    answers = {}

    def reader(r):
        answers[r] = read(port, "global", r, n)

    for r in range(n - 1):
        publish(port, "global", r, n, hosts)
    threads = [threading.Thread(target=reader, args=(r,)) for r in range(n - 1)]
    for t in threads:
        t.start()
    assert wait_for(lambda: srv.httpd._waiting == n - 1, 60), srv.httpd._waiting
    # eight reads wait, more than the three slots: ordinary requests are still served
    assert request(port, "GET", "/global/none")[0] == 404
    publish(port, "global", n - 1, n, hosts)
    for t in threads:
        t.join(60)
    assert answers == {r: (200, expected(r, n, hosts)) for r in range(n - 1)}
    assert guard.TOO_MANY not in srv.httpd.refusals


def test_more_waiting_reads_than_allowed_are_answered_at_once(server, monkeypatch):
    srv, port = server
    monkeypatch.setattr(guard, "MAX_WAITING", 0)
    # not parked: the state as it is now, without waiting (the reader asks again)
    assert read(port, "global", 1, 2) == (404, b"missing 0,1")
    assert srv.httpd._waiting == 0


@pytest.mark.parametrize(
    "key",
    [
        f"{mesh.MESH_KEY}2?size=2&wait_ms=0",  # rank not below size
        f"{mesh.MESH_KEY}x?size=2&wait_ms=0",
        f"{mesh.MESH_KEY}0?size=2",
        f"{mesh.MESH_KEY}0?size=2&wait_ms=-1",
        f"{mesh.MESH_KEY}0?size=2&wait_ms=1&wait_ms=2",
    ],
)
def test_a_malformed_mesh_read_is_refused(server, key):
    srv, port = server
    assert request(port, "GET", f"/global/{key}")[0] == 400
    assert dict(srv.httpd.refusals) == {guard.BAD_PATH: 1}


def test_a_value_of_the_wrong_shape_is_refused_to_its_readers(server):
    srv, port = server
    request(port, "PUT", f"/global/{mesh.ADDRESSES_KEY}0", value(0, 3, b"h"))
    request(port, "PUT", f"/global/{mesh.ADDRESSES_KEY}1", value(1, 3, b"h"))
    request(port, "PUT", f"/global/{mesh.ADDRESSES_KEY}2", b"h\n1234567")  # 7 bytes for 2 peers
    assert read(port, "global", 0, 3)[0] == 400
    assert dict(srv.httpd.refusals) == {guard.BAD_VALUE: 1}


def test_a_scope_horovod_clears_is_forgotten_and_can_meet_again(server):
    srv, port = server
    n = 2
    srv.init([SimpleNamespace(hostname="h", local_rank=r, size=n, local_size=n, cross_size=1)
              for r in range(n)])  # fmt: skip
    hosts = [b"h"] * n
    for r in range(n):
        publish(port, "global", r, n, hosts)
    assert read(port, "global", 0, n) == (200, expected(0, n, hosts))
    for r in range(n):  # each rank's Finalize; the last clears the scope (Horovod's server)
        assert request(port, "DELETE", f"/global/{r}")[0] == 200
    assert srv.httpd.cache.get("global", {}) == {}
    assert read(port, "global", 1, n, wait_ms=0) == (404, b"missing 0,1")
    hosts = [b"x", b"y"]
    for r in range(n):
        publish(port, "global", r, n, hosts)
    assert read(port, "global", 1, n) == (200, expected(1, n, hosts))


@pytest.mark.parametrize("pattern", bench.PATTERNS)
def test_a_simulated_world_of_16_forms_with_exactly_the_requests_its_pattern_needs(pattern):
    """benchmarks/rendezvous.py at 16 ranks (8 a host), the rank threads in this process:
    every rank through its six scopes (global 16, local 8 and 8, cross 2 x 8, twice), each
    answer checked byte for byte, the local ranks right, nothing refused or retried."""
    r = bench.measure(16, 8, cap_s=120.0, pattern=pattern, apart=False)
    assert (r["complete"], r["ranks_done"], r["ranks_failed"], r["ranks_cut"]) == (True, 16, 0, 0)
    assert (r["retried"], r["refusals"]) == (0, {})
    if pattern == "hvdkit":
        # a probe a rank, then 3 requests a rank a scope: O(N)
        assert r["requests"] == r["least_requests"] == 16 + 2 * 3 * (16 + 16 + 16)
        assert r["bytes_read"] == r["least_bytes"]
        assert r["local_ranks_right"] is True
    else:  # polls come on top of the least
        assert r["requests"] >= r["least_requests"] == 2 * 1528
        assert r["bytes_read"] >= r["least_bytes"]


def test_a_rank_done_takes_its_value_away_in_a_scope_horovod_does_not_know(server):
    # a process set's scopes ("global_process_set_hash_...") are not in Horovod's plan:
    # its server deletes only the key named, so the guard removes the rank's value with it
    srv, port = server
    scope, n, hosts = "global_process_set_hash_7d48", 3, [b"h"] * 3
    for r in range(n):
        publish(port, scope, r, n, hosts)
    assert read(port, scope, 2, n) == (200, expected(2, n, hosts))
    assert request(port, "DELETE", f"/{scope}/1")[0] == 200
    assert sorted(srv.httpd.cache[scope]) == [f"{mesh.ADDRESSES_KEY}0", f"{mesh.ADDRESSES_KEY}2"]
    for r in (0, 2):
        assert request(port, "DELETE", f"/{scope}/{r}")[0] == 200
    assert scope not in srv.httpd.cache
    assert srv.httpd.stored() == (0, 0)
    assert read(port, scope, 0, n, wait_ms=0) == (404, b"missing 0,1,2")


def other_address(i: int, j: int) -> bytes:
    """A second address of rank i for j (a retry's new value): as long, and told apart."""
    return b"%02d<%02d;" % (i, j)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16])
def test_the_grid_gives_every_reader_the_slices_built_from_the_values(n):
    # host names of unequal lengths, ranks of one host not next to each other
    names = [b"a", b"host-bb", b"c.example.org"]
    hosts = [names[(i * 5) % 3] for i in range(n)]
    grid = mesh.MeshGrid([value(i, n, hosts[i]) for i in range(n)])
    for r in range(n):
        want = expected(r, n, hosts)
        assert bytes(grid.answer(r)) == want, r
        assert grid.length(r) == len(want) == len(b"%d\n" % grid.local_ranks[r]) + (n - 1) * SLICE
        assert bytes(grid.answer(r, head=b"HTTP head\r\n\r\n")) == b"HTTP head\r\n\r\n" + want
    assert grid.local_ranks == [sum(h == hosts[r] for h in hosts[:r]) for r in range(n)]
    assert grid.nbytes == n * (n - 1) * SLICE


def test_the_grid_answers_slices_of_unequal_sizes_as_each_rank_cut_them():
    # rank i's slices are i + 1 bytes long: legal for mesh_answer, not one array
    n = 4
    slices = {(i, j): bytes([65 + i]) * (i + 1) for i in range(n) for j in range(n) if i != j}
    values = [b"h%d\n" % (i % 2) + b"".join(slices[i, j] for j in range(n) if j != i)
              for i in range(n)]  # fmt: skip
    grid = mesh.MeshGrid(values)
    for r in range(n):
        want = b"%d\n" % (r // 2) + b"".join(slices[i, r] for i in range(n) if i != r)
        assert (bytes(grid.answer(r)), grid.length(r)) == (want, len(want)), r


@pytest.mark.parametrize("bad", [b"no host line", b"a\n12345"])
def test_the_grid_refuses_a_value_that_does_not_split_naming_its_rank(bad):
    values = [value(i, 3, b"h") for i in range(3)]
    values[1] = bad
    with pytest.raises(ValueError, match=f"rank 1's value \\({len(bad)} bytes\\)"):
        mesh.MeshGrid(values)


def test_a_retry_put_is_answered_with_its_newest_value_and_the_parse_is_kept_once(server):
    srv, port = server
    n, hosts = 4, [b"h0", b"h0", b"h1", b"host-1"]
    for r in range(n):
        publish(port, "global", r, n, hosts)
    assert read(port, "global", 3, n) == (200, expected(3, n, hosts))
    assert srv.httpd.mesh.grids_bytes() == n * (n - 1) * SLICE  # one parse for the scope
    assert read(port, "global", 0, n) == (200, expected(0, n, hosts))
    # rank 2 PUTs again (Horovod's store retries a PUT): new addresses, a new host name
    again = b"other\n" + b"".join(other_address(2, j) for j in range(n) if j != 2)
    assert request(port, "PUT", f"/global/{mesh.ADDRESSES_KEY}2", again)[0] == 200
    assert srv.httpd.mesh.grids_bytes() == 0
    for r in range(n):
        want = b"%d\n" % (0 if r == 2 else [0, 1, 0, 0][r]) + b"".join(
            other_address(2, r) if i == 2 else address(i, r) for i in range(n) if i != r
        )
        assert read(port, "global", r, n) == (200, want), r
    # a rank done drops the scope's parse with its value
    assert request(port, "DELETE", "/global/3")[0] == 200
    assert srv.httpd.mesh.grids_bytes() == 0
    assert read(port, "global", 0, n, wait_ms=0) == (404, b"missing 3")
    assert dict(srv.httpd.refusals) == {}


def test_a_scope_of_one_reads_its_local_rank_alone(server):
    _, port = server
    publish(port, "cross_3", 0, 1, [b"somehost"])
    assert read(port, "cross_3", 0, 1) == (200, b"0\n")


def test_the_store_counts_what_it_holds_through_every_kind_of_change(server):
    srv, port = server
    httpd = srv.httpd

    def counted():
        return (
            sum(map(len, httpd.cache.values())),
            sum(len(v) for scope in httpd.cache.values() for v in scope.values()),
        )

    srv.init([SimpleNamespace(hostname="h", local_rank=r, size=2, local_size=2, cross_size=1)
              for r in range(2)])  # fmt: skip
    steps = [
        ("PUT", "/global/0", b"abc"),
        ("PUT", "/global/1", b"defgh"),
        ("PUT", "/global/1", b"x"),  # a key set again: its old bytes go
        ("PUT", "/adhoc/k", b"12345678"),
        ("PUT", "/adhoc/j", b""),
        ("DELETE", "/adhoc/k", None),
        ("DELETE", "/global/0", None),
        ("DELETE", "/global/1", None),  # the plan's scope cleared (Horovod's server)
        ("DELETE", "/adhoc/j", None),  # the ad-hoc scope deleted once empty
    ]
    seen = []
    for method, path, body in steps:
        assert request(port, method, path, body)[0] == 200
        seen.append(httpd.stored())
        assert seen[-1] == counted(), (method, path)
    assert seen == [(1, 3), (2, 8), (2, 4), (3, 12), (4, 12), (3, 4), (3, 4), (1, 0), (0, 0)]
    request(port, "PUT", "/global/0", b"abc")
    srv.init([])  # a new round: the store cleared
    assert httpd.stored() == (0, 0) == counted()


def test_every_way_a_dict_changes_is_counted_by_the_store():
    # Horovod's handler changes the store as a dict: none of its mutators may bypass the counts
    from hvdkit.launch.store import Scope, Store

    mutators = {"__setitem__", "__delitem__", "pop", "popitem", "clear", "setdefault", "update",
                "__ior__"}  # fmt: skip
    for cls in (Scope, Store):
        assert all(getattr(cls, m) is not getattr(dict, m) for m in mutators), cls
    store = Store()
    store.setdefault("a", {"x": b"12"})["y"] = b"345"
    store["b"] = {"z": b"6"}
    store["a"] |= {"w": b"78"}
    store["b"].setdefault("v", b"9")
    store.update(c={"u": b"0000"})
    assert (store.keys_held, store.bytes_held) == (6, 13)
    versions = {name: store.version(name) for name in store}
    store["a"].pop("x")
    store["b"].popitem()
    assert store.version("a") > versions["a"] and store.version("b") > versions["b"]
    assert store.version("c") == versions["c"]
    assert (store.keys_held, store.bytes_held) == (4, 10)
    popped = store.pop("c")
    assert (store.keys_held, store.bytes_held) == (3, 6)
    popped["t"] = b"later"  # a scope taken out no longer counts in the store
    del store["a"]
    assert (store.keys_held, store.bytes_held) == (1, 1)
    store.clear()
    assert (store.keys_held, store.bytes_held, store.version("b")) == (0, 0, None)


def test_reused_threads_serve_a_burst_with_as_many_threads_as_run_at_once():
    from hvdkit.launch.reused_threads import ReusedThreads

    release, ran, lock = threading.Event(), [], threading.Lock()

    def task(i, block):
        if block:
            release.wait(60)
        with lock:
            ran.append(i)

    threads = ReusedThreads(task, idle_s=60.0, name="test-reused")
    for i in range(5):  # five at once: five threads
        threads.submit(i, True)
    assert wait_for(lambda: threads.started == 5, 60)
    release.set()
    assert wait_for(lambda: threads._idle == 5, 60), threads._idle
    for i in range(5, 45):  # then one after another: the idle ones serve them
        threads.submit(i, False)
        assert wait_for(lambda: threads._idle == 5, 60), threads._idle
    assert (threads.started, sorted(ran)) == (5, list(range(45)))
    threads.stop(join_s=60)
    assert not [t for t in threading.enumerate() if t.name.startswith("test-reused")]


def test_a_reused_thread_idle_too_long_ends_and_a_task_after_starts_another():
    from hvdkit.launch.reused_threads import ReusedThreads

    ran = []
    threads = ReusedThreads(ran.append, idle_s=0.01, name="test-idle")
    threads.submit(1)
    assert wait_for(lambda: not threads._threads, 60)  # it ended, idle
    assert threads._idle == 0
    threads.submit(2)
    assert wait_for(lambda: ran == [1, 2], 60)
    assert threads.started == 2
    threads.stop(join_s=60)


def test_the_what_if_without_deletes_forms_a_world_of_16_with_two_requests_a_scope():
    """benchmarks/rendezvous.py --what-if-no-delete (a what-if, not hvdkit's behaviour): the
    ranks skip their DELETE; a probe, then 2 requests a rank a scope, each answer checked."""
    r = bench.measure(16, 8, cap_s=120.0, pattern="hvdkit", apart=False, delete=False)
    assert (r["complete"], r["ranks_failed"], r["retried"], r["refusals"]) == (True, 0, 0, {})
    assert r["requests"] == r["least_requests"] == 16 + 2 * 2 * (16 + 16 + 16)
    assert (r["deletes"], r["local_ranks_right"]) == (False, True)


ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "benchmarks/records/rendezvous_server_2026-11-29.json"
PERFORMANCE = ROOT / "docs/performance.md"


def table(page: str, header: str) -> str:
    """The markdown table of ``page`` whose header row starts with ``header``."""
    return page[page.index(header) :].split("\n\n")[0]


def test_performance_md_quotes_the_recorded_runs_of_the_rendezvous():
    """docs/performance.md's rendezvous table (hvdkit's mesh columns) and the model's G(N)
    are the record's "after" runs: the sizes run once, and 1,000 ranks as the median and
    range of its three runs; its what-if row is the what-if's runs."""
    import json
    import re
    import statistics

    runs = json.loads(RECORD.read_text())["runs"]
    after = [run["rows"] for run in runs if run["label"] == "after"]
    once = {row["n"]: row for row in after[0]}
    thousand = [row for rows in after for row in rows if row["n"] == 1000]
    assert len(thousand) == 3 and all(r["complete"] and r["ranks_failed"] == 0 for r in thousand)
    page = PERFORMANCE.read_text()
    rendezvous = table(page, "| ranks (machines) | hvdkit's mesh: requests")

    def spread(key):
        values = sorted(r[key] for r in thousand)
        return f"{statistics.median(values):.2f} ({values[0]:.2f}–{values[-1]:.2f}"

    world = {}
    for machines, n in [(1, 3), (2, 16), (8, 64), (32, 256), (38, 300), (125, 1000)]:
        line = re.search(rf"^\| {n:,} \({machines}\) \|([^\n]*)$", rendezvous, re.M)
        assert line, n
        cells = [c.strip() for c in line.group(1).split("|")]
        assert cells[0] == f"{once[n]['requests']:,}", n
        if n == 1000:
            assert cells[2] == spread("world_s") + ", three runs)"
            assert cells[3] == spread("server_cpu_s") + ")"
            world[n] = cells[2].split()[0]
        else:
            assert (cells[2], cells[3]) == (
                f"{once[n]['world_s']:.2f}",
                f"{once[n]['server_cpu_s']:.2f}",
            ), n
            world[n] = cells[2]
    # the model's G(N) is the rendezvous measured at N (at 4 ranks: at 3)
    rows = table(page, "| ranks | C(N), s | G(N), s |")
    g_column = r"^\| (4|64|300|1,000)(?![\d,])[^|]*\| [^|]+ \| ([\d.]+) \|"
    model = dict(re.findall(g_column, rows, re.M))
    assert model == {"4": world[3], "64": world[64], "300": world[300], "1,000": world[1000]}
    text = " ".join(page.split())
    low, high = spread("world_s").split("(")[1].split("–")
    assert f"at 1,000 in {low}–{high} s (three runs)" in text
    low, high = spread("server_cpu_s").split("(")[1].split("–")
    assert f"the server's process spent {low}–{high} CPU-seconds" in text
    what_if = sorted(run["rows"][0]["server_cpu_s"] for run in runs
                     if run["label"] == "what-if-no-delete")  # fmt: skip
    assert len(what_if) == 3
    assert f"spent {what_if[0]:.2f}–{what_if[-1]:.2f} CPU-seconds at 1,000 ranks" in text


class _StdlibReads(http.server.BaseHTTPRequestHandler):
    """http.server's own reading of one request, without a socket (the oracle)."""

    def __init__(self, raw: bytes):  # (no socketserver set-up)
        self.rfile, self.wfile = io.BytesIO(raw), io.BytesIO()
        self.client_address = ("127.0.0.1", 1)
        self.raw_requestline = self.rfile.readline(65537)

    def date_time_string(self, timestamp=None):
        return "a date"

    def log_message(self, *args):
        pass

    def outcome(self) -> tuple:
        if not self.parse_request():
            return False, None, self.rfile.read(), self.wfile.getvalue()
        seen = (self.command, self.path, self.request_version, list(self.headers.items()))
        return True, seen, self.rfile.read(), self.wfile.getvalue()


class _QuickReads(_StdlibReads):
    def parse_request(self):  # as GuardedHandler.parse_request reads
        rfile = self.rfile
        if plain_request.read_plain_request(self):
            return True
        parsed = super().parse_request()
        self.rfile = rfile
        return parsed


REQUESTS = [
    b"GET /global/hvdkit_mesh HTTP/1.1\r\nHost: 127.0.0.1:1234\r\nAccept: */*\r\n\r\n",
    b"PUT /global/0 HTTP/1.0\r\nContent-Length: 3\r\nX-Two: a\r\nx-two: b\r\n\r\nabc",
    b"PUT /global/0 HTTP/1.1\r\nContent-Length:  3 \t\r\n\r\nabcdef",
    b"DELETE /cross_0/1 HTTP/1.1\n\n",
    b"GET /global/x HTTP/1.1\r\nHost: x\r\n folded\r\nNext: y\r\n\r\nbody",
    b"GET /global/x HTTP/1.1\r\n" + b"H: v\r\n" * 40 + b"\r\nbody",
    b"GET /global/x HTTP/1.1\r\nLong: " + b"v" * 3000 + b"\r\nNext: y\r\n\r\nbody",
    b"GET /global/x HTTP/1.1\r\nno colon here\r\n\r\nbody",
    b"GET /global/x HTTP/1.1\r\nHost: x\r\n",
    b"GET /global/x HTTP/1.1\r\n" + b"H: v\r\n" * 120 + b"\r\n",
    b"GET /global/x HTTP/1.1\r\nLong: " + b"v" * 70000 + b"\r\n\r\n",
    b"GET //global/x HTTP/1.1\r\n\r\n",
    b"POST /global/x HTTP/1.1\r\n\r\n",
    b"GET /global/x HTTP/2.0\r\n\r\n",
    b"GET /global/x  HTTP/1.1\r\n\r\n",
    b"GET /global/x HTTP/1.1\r\nExpect: 100-continue\r\nConnection: keep-alive\r\n\r\n",
    b"GET /global/x\r\n",
    b"garbage\r\n\r\n",
]


@pytest.mark.parametrize("raw", REQUESTS, ids=range(len(REQUESTS)))
def test_the_quick_reading_of_a_request_is_http_servers_own(raw):
    # the same fields, headers, answer (an error's) and body left, plain or not
    assert _QuickReads(raw).outcome() == _StdlibReads(raw).outcome()


def test_plain_requests_are_read_without_http_servers_parser(monkeypatch):
    def not_called(*args, **kwargs):
        raise AssertionError("http.client.parse_headers was called")

    monkeypatch.setattr(http.client, "parse_headers", not_called)
    for raw in REQUESTS[:4]:
        assert _QuickReads(raw).outcome()[0] is True

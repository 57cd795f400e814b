"""Horovod's Gloo rendezvous server, bound to one address and answering only the job.

Horovod's Gloo ranks meet through an HTTP key-value store (PUT/GET/DELETE
``/scope/key``). Horovod's own server listens on every interface and answers
anyone, and its Gloo client cannot present a credential, so the guard is on
the server side: :class:`GuardedRendezvous` is a drop-in replacement for
``horovod.runner.http.http_server.RendezvousServer`` (same ``start``,
``init``, ``stop``) that

* binds the one address the job's ranks dial (loopback for a one-machine job);
* serves only clients whose address is in its allowed set (the scheduler puts
  there the addresses workers registered from with a valid token; hvdkitrun
  the addresses of the job's hosts); others get ``403`` before a byte of their
  request is read, and are logged;
* bounds every request: path shape, value size (:data:`MAX_VALUE_BYTES`), the
  store (:data:`MAX_KEYS`, :data:`MAX_STORED_BYTES`), a read timeout per
  operation and an overall deadline per connection
  (:data:`REQUEST_DEADLINE_S`, against slow-loris clients), and at most
  :data:`MAX_CONNECTIONS` requests served at once (one more waits up to
  :data:`ADMIT_WAIT_S` for a slot, then is refused); a failing request is
  logged in one line and never stops the server.

It also answers hvdkit's batched full mesh (:mod:`.mesh`; what hvdkit's Horovod patch
``horovod-0.28.1-gloo-batched-mesh.patch`` uses; Horovod's own server does not
answer it, and that patch then keeps Gloo's own exchange): in a scope of ``n``
ranks each rank PUTs one value, ``hvdkit_addrs_<rank>``, holding its host name,
a newline and its ``n - 1`` Gloo pair addresses (one equal-sized slice per peer,
in peer order), and then makes one long-polling GET, ``hvdkit_mesh_<rank>?size=n
&wait_ms=W``, that the server answers once all ``n`` values are there (or
after ``W`` ms, at most :data:`MESH_WAIT_CAP_S`): the slices meant for that rank
(:func:`mesh_answer`). A scope then costs ``2n`` requests besides Horovod's
DELETEs, instead of about ``2n²`` and polls, and each rank reads ``n - 1``
addresses instead of ``(n - 1)²``; a rank's DELETE of its rank when it is done
(after its scope's barrier) removes its value. ``GET /<scope>/hvdkit_mesh``
answers :data:`MESH_PROTOCOL`: the probe that tells a patched rank it talks to
this server.

Only the launcher imports this module (it imports Horovod's runner, never
TensorFlow).
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections.abc import Iterable

from .. import _compat
from . import auth
from .mesh import (
    ADDRESSES_KEY,
    MESH_KEY,
    MESH_PROBE_KEY,
    MESH_PROTOCOL,
    MESH_WAIT_CAP_S,
    MeshBoard,
    MeshGrid,
    mesh_query,
)
from .plain_request import read_plain_request
from .reused_threads import ReusedThreads
from .store import Store

log = logging.getLogger("hvdkit.rendezvous")
_HorovodHTTPServer, _HorovodHandler = _compat.horovod_rendezvous_classes()

MAX_VALUE_BYTES = 1 << 20  # Gloo stores addresses and small blobs per rank
MAX_KEYS = 1 << 16  # keys stored at once: a few per rank
MAX_STORED_BYTES = 1 << 30  # all values together (a scope of 1,000 ranks: 136 MB of addresses)
MAX_CONNECTIONS = 64  # requests served at once, besides the mesh reads that wait
# A connection beyond MAX_CONNECTIONS waits this long for a slot before it is refused
# (the next ones wait in the listen backlog meanwhile): every rank of a world sends its
# value and its mesh read at once, and a request's slot frees within milliseconds
# (a mesh read parks), so a burst of 1,000 is served, not refused.
ADMIT_WAIT_S = 1.0
# Mesh reads waiting at once (each holds a thread, not a slot of MAX_CONNECTIONS): a rank
# waits in one scope at a time, so a world of up to this many ranks waits without refusal.
MAX_WAITING = 4096
# A request's thread, done, waits this long to serve the next one before it ends: the
# requests of a world come in bursts (a rank's next scope follows its last one's barrier).
IDLE_THREAD_S = 5.0
READ_TIMEOUT_S = 5.0  # per socket operation
REQUEST_DEADLINE_S = 30.0  # per connection, however slowly bytes trickle in
DEADLINE_POLL_S = 0.25  # how often the server looks for connections past their deadline
# How often the serving loop looks whether stop() was called. The scheduler stops
# a round's server before it sends the next round's assignments: at socketserver's
# default (0.5 s) that wait was up to half of every in-process regroup
# (benchmarks/control_plane.py).
STOP_POLL_S = 0.05
FORBIDDEN = b"HTTP/1.0 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


# Why a request is refused: the fixed kinds the refusal log counts (never the path or size).
NOT_OF_JOB = "not a machine of this job"
MALFORMED = "malformed HTTP request"
BAD_PATH = "bad path"
NO_LENGTH = "PUT without a valid Content-Length"
TOO_LARGE = "value too large"
TOO_SLOW = "too slow"
TOO_MANY = "too many connections"
STORE_FULL = "store full"
BAD_VALUE = "mesh value of the wrong shape"
FAILED = "error while serving"
REFUSAL_KINDS = (
    NOT_OF_JOB,
    MALFORMED,
    BAD_PATH,
    NO_LENGTH,
    TOO_LARGE,
    STORE_FULL,
    TOO_SLOW,
    TOO_MANY,
    BAD_VALUE,
    FAILED,
)


class _ExactBody:
    """A request body reader that refuses a body shorter than announced.

    Horovod's PUT handler stores whatever ``rfile.read(length)`` returns; a
    client that closes early would leave a truncated value. A short read
    raises the timeout that handler already answers with 408, storing nothing.
    """

    def __init__(self, rfile):
        self._rfile = rfile

    def read(self, n: int = -1) -> bytes:
        data = self._rfile.read(n)
        if n >= 0 and len(data) != n:
            raise TimeoutError(f"request body ended after {len(data)} of {n} bytes")
        return data

    def __getattr__(self, name):
        return getattr(self._rfile, name)


class _Deadlines:
    """One thread that cuts the connections past their deadline.

    (A timer thread per request, as before, doubled the threads a burst of
    requests starts, and the threads 1,000 parked mesh reads hold.)
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._due: dict[GuardedHandler, float] = {}
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hvdkit-rdv-deadlines", daemon=True)
        self._thread.start()

    def add(self, handler: GuardedHandler, at: float) -> None:
        with self._lock:
            self._due[handler] = at

    def remove(self, handler: GuardedHandler) -> None:
        with self._lock:
            self._due.pop(handler, None)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stopped.wait(DEADLINE_POLL_S):
            now = time.monotonic()
            with self._lock:
                late = [h for h, at in self._due.items() if at <= now]
                for handler in late:
                    del self._due[handler]
            for handler in late:
                handler.expire()


class GuardedHandler(_HorovodHandler):
    """Horovod's rendezvous request handler behind an address check and size limits."""

    timeout = READ_TIMEOUT_S

    def setup(self):
        super().setup()
        self.server.deadlines.add(self, time.monotonic() + REQUEST_DEADLINE_S)

    def expire(self):
        self.server.refuse(self.client_address[0], TOO_SLOW, "request deadline passed")
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def finish(self):
        self.server.deadlines.remove(self)
        try:
            super().finish()
        except OSError:
            pass

    def handle(self):
        client = self.client_address[0]
        if not self.server.admits(client):
            self.server.refuse(client, NOT_OF_JOB, "403")
            try:
                self.wfile.write(FORBIDDEN)
            except OSError:
                pass
            return
        super().handle()

    def parse_request(self) -> bool:
        rfile = self.rfile
        if not read_plain_request(self):  # not plain: http.server's parser reads it all
            parsed = super().parse_request()
            self.rfile = rfile
            if not parsed:
                self.server.refuse(self.client_address[0], MALFORMED)
                return False
        if len(self.path.split("/")) != 3:
            return self._reject(400, BAD_PATH, repr(self.path[:80]))
        if self.command == "PUT":
            raw = self.headers.get("Content-Length")
            try:
                length = int(raw)
            except (TypeError, ValueError):
                return self._reject(411, NO_LENGTH, repr(str(raw)[:40]))
            if not 0 <= length <= MAX_VALUE_BYTES:
                return self._reject(413, TOO_LARGE, f"PUT of {length} bytes")
            keys, stored = self.server.stored()
            if keys >= MAX_KEYS or stored + length > MAX_STORED_BYTES:
                return self._reject(507, STORE_FULL, f"{keys} keys, {stored} bytes")
            self.rfile = _ExactBody(self.rfile)
        return True

    def do_GET(self):
        _, scope, key = self.path.split("/")
        if key == MESH_PROBE_KEY:
            self._answer(200, MESH_PROTOCOL)
        elif key.startswith(MESH_KEY):
            self._read_mesh(scope, key)
        else:
            super().do_GET()

    def _read_mesh(self, scope: str, key: str) -> None:
        try:
            rank, n, wait_s = mesh_query(key, MAX_KEYS)
        except (ValueError, KeyError) as exc:
            self._reject(400, BAD_PATH, f"mesh read {key[:80]!r}: {exc}")
            return
        server = self.server
        if wait_s > 0 and server.park():
            try:
                server.mesh.wait(scope, n, min(wait_s, MESH_WAIT_CAP_S))
            finally:
                server.unpark()
        try:
            grid = self._mesh_grid(scope, n)
        except ValueError as exc:
            self._reject(400, BAD_VALUE, f"scope {scope[:40]!r}: {exc}")
            return
        if isinstance(grid, list):
            # "not yet": a 404, which Horovod's store returns to its caller without retries
            self._answer(404, b"missing " + ",".join(map(str, grid)).encode())
            return
        self.wfile.write(grid.answer(rank, head=self._head(200, grid.length(rank))))

    def _mesh_grid(self, scope: str, n: int) -> MeshGrid | list[int]:
        """The parsed values of ``scope``'s ``n`` ranks, or the ranks whose value is missing.

        The ``n`` readers of a scope, woken together, find the grid the first of them
        parsed (:class:`.mesh.MeshBoard`), while the scope is as it was parsed.
        """
        server, board = self.server, self.server.mesh
        grid = board.cached(scope, n, server.cache.version(scope))
        if grid is not None:
            return grid
        with board.building:
            with server.cache_lock:
                version = server.cache.version(scope)
                grid = board.cached(scope, n, version)
                if grid is not None:
                    return grid
                stored = server.cache.get(scope, {})
                values = [stored.get(f"{ADDRESSES_KEY}{i}") for i in range(n)]
            missing = [i for i, value in enumerate(values) if value is None]
            if missing:
                return missing
            grid = MeshGrid(values)  # parsed outside the store's lock: PUTs go on meanwhile
            with server.cache_lock:
                if server.cache.version(scope) == version:  # else a later reader parses again
                    board.keep(scope, n, version, grid)
        return grid

    _date: tuple[int, str] = (0, "")  # (second, its Date header), for all handlers

    def date_time_string(self, timestamp=None) -> str:
        """The Date header's value, formatted once a second (7 % of a small request's CPU)."""
        if timestamp is not None:
            return super().date_time_string(timestamp)
        now = int(time.time())
        second, text = GuardedHandler._date
        if second != now:
            text = super().date_time_string(now)
            GuardedHandler._date = (now, text)
        return text

    def _head(self, status: int, length: int) -> bytes:
        """The status line and headers of an answer of ``length`` bytes (as send_response's)."""
        self.log_request(status, length)
        return (
            f"{self.protocol_version} {status} {self.responses[status][0]}\r\n"
            f"Server: {self.version_string()}\r\nDate: {self.date_time_string()}\r\n"
            f"Content-Length: {length}\r\n\r\n"
        ).encode("latin-1")

    def _answer(self, status: int, body: bytes) -> None:
        # one write: headers and body apart were two socket writes (and two TCP segments)
        self.wfile.write(self._head(status, len(body)) + body)

    def _put_value(self, scope, key, value):
        super()._put_value(scope, key, value)
        if key.startswith(ADDRESSES_KEY):
            self.server.mesh.published(scope, key)

    def do_DELETE(self):
        _, scope, key = self.path.split("/")
        if key.isdigit():
            # Rank <key> is done (Horovod's Finalize, after the barrier that follows every
            # pair's connect: every rank of the scope has had its mesh answer). Its value
            # goes now: in a scope Horovod's server does not know (a process set's), nothing
            # else would remove it, and at 1,000 ranks a scope's values are 136 MB.
            with self.server.cache_lock:
                self.server.cache.get(scope, {}).pop(f"{ADDRESSES_KEY}{key}", None)
            self.server.mesh.forget(scope, f"{ADDRESSES_KEY}{key}")
        super().do_DELETE()
        with self.server.cache_lock:
            values = self.server.cache.get(scope)
            cleared, removed = not values, key not in (values or {})
        if cleared:  # Horovod clears a scope once all its ranks are done
            self.server.mesh.forget(scope)
        elif removed:
            self.server.mesh.forget(scope, key)

    def _reject(self, status: int, kind: str, detail: str) -> bool:
        self.server.refuse(self.client_address[0], kind, detail)
        self.close_connection = True
        self.send_status_code(status)
        return False


class GuardedHTTPServer(_HorovodHTTPServer):
    """Horovod's threaded rendezvous HTTP server with an allowed set and a connection cap."""

    daemon_threads = True  # no per-request thread list that grows without bound
    # The listen backlog: a burst is accepted (and judged), not dropped. Every rank of a
    # world polls at once; beyond the backlog the kernel drops a connection and its SYN
    # is sent again after 1, 3, 7 ... s. With 128, 1,000 simulated ranks saw 1,283
    # requests time out after 30 s and 70 ranks a request fail 3 times (Horovod's
    # limit); with 4096 none (benchmarks/rendezvous.py). Linux caps it at somaxconn.
    request_queue_size = 4096

    def __init__(self, address: tuple[str, int], allowed: set[str], verbose: int = 0):
        self.allowed = allowed
        self.refuse = auth.RefusalLog(
            log, "rendezvous server refused a request from", REFUSAL_KINDS
        )
        self.refusals = self.refuse.counts
        self.mesh = MeshBoard()
        self._load = threading.Condition()
        self._busy = 0  # requests being served, besides those parked in a mesh wait
        self._waiting = 0  # mesh reads parked
        # a request is served on a thread of these (not a new thread each, ThreadingMixIn's)
        self._serving = ReusedThreads(self.process_request_thread, IDLE_THREAD_S, "hvdkit-rdv")
        super().__init__(address, GuardedHandler, verbose)
        self.cache = Store()  # Horovod's dict of scopes, its keys and bytes counted as they change
        self.deadlines = _Deadlines()

    def server_close(self) -> None:
        super().server_close()
        self.deadlines.stop()
        self._serving.stop()

    def init(self, host_alloc_plan) -> None:
        super().init(host_alloc_plan)
        self.mesh.forget()

    def park(self) -> bool:
        """Move this request from the served ones to the waiting ones; False when full."""
        with self._load:
            if self._waiting >= MAX_WAITING:
                return False
            self._busy -= 1
            self._waiting += 1
            self._load.notify()
            return True

    def unpark(self) -> None:
        with self._load:
            self._waiting -= 1
            self._busy += 1

    def admits(self, address: str) -> bool:
        return address in self.allowed

    def stored(self) -> tuple[int, int]:
        """``(keys, bytes)`` in the store now (counted as it changes: O(1))."""
        return self.cache.keys_held, self.cache.bytes_held

    def process_request(self, request, client_address):
        with self._load:
            admitted = self._load.wait_for(lambda: self._busy < MAX_CONNECTIONS, ADMIT_WAIT_S)
            self._busy += admitted
        if not admitted:
            self.refuse(client_address[0], TOO_MANY, f"more than {MAX_CONNECTIONS} at once")
            self.shutdown_request(request)
            return
        try:
            self._serving.submit(request, client_address)
        except BaseException:
            self._done()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._done()

    def _done(self) -> None:
        with self._load:
            self._busy -= 1
            self._load.notify()

    def handle_error(self, request, client_address):
        exc = sys.exc_info()[1]
        self.refuse(client_address[0], FAILED, f"{type(exc).__name__}: {exc}")


class GuardedRendezvous:
    """Drop-in for Horovod's ``RendezvousServer``: one address, only the job's clients.

    Example (what the scheduler does)::

        server = GuardedRendezvous("10.0.0.1", allowed={"10.0.0.1", "10.0.0.2"})
        port = server.start()
        server.init(host_alloc_plan)   # Horovod SlotInfo list, as for RendezvousServer
        ...
        server.stop()
    """

    def __init__(self, bind_host: str, allowed: Iterable[str] = (), verbose: int = 0):
        self.bind_host = bind_host
        self.allowed = set(allowed)
        self.verbose = verbose
        self.httpd: GuardedHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def allow(self, *addresses: str) -> None:
        self.allowed.update(addresses)

    def start(self, handler_cls=None, *, port: int = 0) -> int:
        """Listen on ``bind_host`` at ``port`` (0: any free port); the port. Ignores the handler."""
        self.httpd = GuardedHTTPServer((self.bind_host, port), self.allowed, self.verbose)
        self._thread = threading.Thread(
            target=self.httpd.serve_forever,
            kwargs={"poll_interval": STOP_POLL_S},
            name="hvdkit-rendezvous",
            daemon=True,
        )
        self._thread.start()
        port = self.httpd.server_address[1]
        log.info(
            "rendezvous server on %s:%d for %s", self.bind_host, port, sorted(self.allowed) or "-"
        )
        return port

    def init(self, host_alloc_plan) -> None:
        self.httpd.init(host_alloc_plan)

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self._thread.join(timeout=10)

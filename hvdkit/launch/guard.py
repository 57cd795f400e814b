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
  :data:`MAX_CONNECTIONS` connections at once; a failing request is logged in
  one line and never stops the server.

Only the launcher imports this module (it imports Horovod's runner, never
TensorFlow).
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from collections.abc import Iterable

from .. import _compat
from . import auth

log = logging.getLogger("hvdkit.rendezvous")
_HorovodHTTPServer, _HorovodHandler = _compat.horovod_rendezvous_classes()

MAX_VALUE_BYTES = 1 << 20  # Gloo stores addresses and small blobs per rank
MAX_KEYS = 1 << 16  # keys stored at once: a few per rank
MAX_STORED_BYTES = 1 << 28  # all values together
MAX_CONNECTIONS = 64
READ_TIMEOUT_S = 5.0  # per socket operation
REQUEST_DEADLINE_S = 30.0  # per connection, however slowly bytes trickle in
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


class GuardedHandler(_HorovodHandler):
    """Horovod's rendezvous request handler behind an address check and size limits."""

    timeout = READ_TIMEOUT_S

    def setup(self):
        super().setup()
        self._deadline = threading.Timer(REQUEST_DEADLINE_S, self._expire)
        self._deadline.daemon = True
        self._deadline.start()

    def _expire(self):
        self.server.refuse(self.client_address[0], TOO_SLOW, "request deadline passed")
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def finish(self):
        self._deadline.cancel()
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
        if not super().parse_request():
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
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, GuardedHandler, verbose)

    def admits(self, address: str) -> bool:
        return address in self.allowed

    def stored(self) -> tuple[int, int]:
        """``(keys, bytes)`` in the store now (bounded by :data:`MAX_KEYS`, so cheap)."""
        with self.cache_lock:
            scopes = list(self.cache.values())
            return sum(len(s) for s in scopes), sum(len(v) for s in scopes for v in s.values())

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.refuse(client_address[0], TOO_MANY, f"more than {MAX_CONNECTIONS} at once")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

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

"""Every listener of a job, running in this process, fed hostile input one case at a time.

Used by ``tests/unit/test_fuzz_listeners.py`` (a bounded number of cases) and
``benchmarks/fuzz_listeners.py`` (a longer run). Each :class:`Target` starts
the real listener on loopback and has

* ``feed(data)``: send ``data`` the way an outsider can reach that parser
  and return what came back (``"refused: <kind>"``, an HTTP status, ...);
* ``answers()``: whether the listener still serves a genuine client;
* ``state()``: sizes of everything the listener keeps between cases, which
  must stay bounded however many cases it took.

:func:`watching` collects uncaught exceptions of any thread and every log
record of hvdkit's loggers, so a run can assert none escaped and every
refusal line is short and has no traceback. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hvdkit.launch import auth, heartbeat, protocol
from hvdkit.launch.guard import GuardedRendezvous

TOKEN = "fuzz-job-token-0123456789abcdef"
WAIT_S = 10.0
MAX_LOG_LINE = 600  # characters: a refusal line's prefix, address, kind and detail


# ---------------------------------------------------------------- hostile input
def _json_values():
    leaves = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(10**30), max_value=10**30)
        | st.floats(allow_nan=True, allow_infinity=True)
        | st.text(max_size=30)
    )
    return st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
        max_leaves=20,
    )


def _nested(opener: bytes, closer: bytes):
    """``[[[...`` (the attack of issue 20), closed or not, at depths around every limit."""
    return st.tuples(st.integers(1, 3000), st.booleans()).map(
        lambda t: opener * t[0] + (closer * t[0] if t[1] else b"")
    )


def _mutated(genuine: bytes):
    """``genuine`` with a few bytes replaced, cut, or repeated."""

    def mutate(args):
        positions, cut, repeat = args
        data = bytearray(genuine)
        for pos, byte in positions:
            data[pos % len(data)] = byte
        data = data[: max(1, len(data) - cut)]
        return bytes(data) * repeat

    return st.tuples(
        st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=6),
        st.integers(0, 40),
        st.integers(1, 3),
    ).map(mutate)


def hostile_lines(genuine: bytes = b'{"b": "{}", "n": 0, "m": ""}'):
    """Bytes an outsider sends to a JSON line parser (no newline in them)."""
    envelope = st.fixed_dictionaries(
        {"b": st.one_of(st.text(max_size=40), _json_values().map(json.dumps)), "m": st.text()},
        optional={"n": _json_values(), "type": st.sampled_from(["register", "refused", "x"])},
    ).map(lambda d: json.dumps(d).encode())
    data = st.one_of(
        st.binary(max_size=3000),
        _json_values().map(lambda v: json.dumps(v).encode()),
        envelope,
        _nested(b"[", b"]"),
        _nested(b'{"a":', b"}"),
        _nested(b'{"b":"', b'"}'),  # nested inside a string: harmless, must be accepted as text
        st.binary(min_size=1, max_size=200).map(lambda b: b"\xff\xfe" + b + b"\xc3"),  # not UTF-8
        st.integers(1, 300_000).map(lambda n: b'{"b":"' + b"x" * n + b'"}'),  # huge
        st.integers(4000, 6000).map(lambda n: b'{"n":' + b"9" * n + b"}"),  # int over 4300 digits
        _mutated(genuine),
    )
    return data.map(lambda b: b.replace(b"\n", b" "))


def hostile_requests():
    """Raw HTTP requests to the rendezvous server (the connection is closed after them)."""
    method = st.sampled_from([b"GET", b"PUT", b"DELETE", b"POST", b"\xff\x00", b""])
    path = st.one_of(
        st.sampled_from([b"/global/0", b"/a/b/c/d", b"/", b"//", b"/x/" + b"\xff" * 8]),
        st.binary(max_size=300),
        st.integers(1, 70_000).map(lambda n: b"/" + b"a" * n),
    )
    headers = st.lists(
        st.one_of(
            st.integers(-5, 2 << 20).map(lambda n: b"Content-Length: %d" % n),
            st.sampled_from([b"Content-Length: lots", b"Content-Length: 1_0", b"X: \xff"]),
            st.binary(max_size=100).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
        ),
        max_size=4,
    )
    body = st.binary(max_size=2000)
    structured = st.tuples(method, path, headers, body).map(
        lambda t: (
            t[0]
            + b" "
            + t[1]
            + b" HTTP/1.0\r\n"
            + b"".join(h + b"\r\n" for h in t[2])
            + b"\r\n"
            + t[3]
        )
    )
    return st.one_of(structured, st.binary(max_size=3000), _nested(b"[", b"]"))


def hostile_datagrams(genuine: bytes):
    """Datagrams to a heartbeat receiver (at most the 4 KiB it reads, and beyond)."""
    return st.one_of(
        hostile_lines(genuine).map(lambda b: b[:8192]),
        _mutated(genuine),
        st.just(genuine),  # a replay
    )


# ---------------------------------------------------------------- watching a run
class Watch:
    """Uncaught thread exceptions and hvdkit's log records seen during a run.

    Every record is checked as it comes; the first :attr:`KEEP` are kept (a
    long run must not hold them all: that would be the run's leak).
    """

    KEEP = 200

    def __init__(self):
        self.uncaught: list[str] = []
        self.records: list[logging.LogRecord] = []
        self.count = 0
        self._bad: list[str] = []

    def add(self, record: logging.LogRecord) -> None:
        self.count += 1
        text = record.getMessage()
        if len(text) > MAX_LOG_LINE or "\n" in text or record.exc_info:
            self._bad.append(text[:300])
        if len(self.records) < self.KEEP:
            self.records.append(record)

    def bad_lines(self) -> list[str]:
        """Log lines that were too long, spanned lines, or carried a traceback."""
        return list(self._bad)


class _Keep(logging.Handler):
    def __init__(self, watch: Watch):
        super().__init__(logging.DEBUG)
        self.watch = watch

    def emit(self, record):
        self.watch.add(record)


def wait_for(predicate, seconds: float = WAIT_S) -> bool:
    """``predicate()`` once it holds, or its last value after ``seconds``.

    For counters a listener thread updates after its reply went out (a
    refusal is sent, then counted): the deadline only turns a count that never
    comes into a failure, it bounds no speed.
    """
    deadline = time.monotonic() + seconds
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return bool(predicate())


@contextlib.contextmanager
def watching():
    """Collect uncaught exceptions (any thread) and hvdkit's log records while inside."""
    watch = Watch()
    previous = threading.excepthook

    def hook(args):
        watch.uncaught.append(f"{args.exc_type.__name__}: {args.exc_value}"[:300])

    threading.excepthook = hook
    handler = _Keep(watch)
    root = logging.getLogger("hvdkit")  # hvdkit.protocol, .heartbeat, .rendezvous propagate here
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield watch
    finally:
        threading.excepthook = previous
        root.removeHandler(handler)
        root.setLevel(level)


# ---------------------------------------------------------------- the listeners
class RegistrationTarget:
    """The scheduler's admission: a line after its challenge."""

    name = "registration line"

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.admission = protocol.Admission(self.listener, TOKEN, timeout_s=WAIT_S)

    def feed(self, data: bytes) -> str:
        with socket.create_connection(("127.0.0.1", self.port), timeout=WAIT_S) as s:
            ch = protocol.Channel(s)
            deadline = time.monotonic() + WAIT_S
            first = ch.recv(deadline)
            if (first or {}).get("type") != "challenge":
                return f"no challenge: {str(first)[:80]}"
            try:
                ch.send_raw(data)
                reply = ch.recv(deadline)
            except OSError as exc:
                return f"closed ({type(exc).__name__})"
        if reply is None:
            return "closed"
        return f"{reply.get('type')}: {str(reply.get('reason', ''))[:40]}"

    def answers(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=WAIT_S) as s:
            ch = protocol.Channel(s)
            protocol.register(ch, TOKEN, time.monotonic() + WAIT_S, hostname="real", pid=1)
            got = self.admission.next(WAIT_S)
            if got is None:
                return False
            got[0].send(type="assign", rank=0)
            ok = ch.recv(time.monotonic() + WAIT_S) == {"type": "assign", "rank": 0}
            got[0].close()
            return ok

    def state(self) -> dict:
        deadline = time.monotonic() + WAIT_S
        while self.admission.pending and time.monotonic() < deadline:
            time.sleep(0.01)
        return {
            "handshakes in progress": self.admission.pending,
            "refusal kinds": len(self.admission.refusals),
            "queued": self.admission._ready.qsize(),
        }

    def close(self):
        self.admission.close()
        self.listener.close()


class SignedTarget:
    """A worker's secured channel: a line injected between the scheduler's signed ones."""

    name = "signed message"

    def __init__(self):
        a, b = socket.socketpair()
        out = {}

        def sched():
            out["ch"], _ = protocol.admit(a, TOKEN, time.monotonic() + WAIT_S)

        t = threading.Thread(target=sched)
        t.start()
        self.worker = protocol.Channel(b)
        protocol.register(self.worker, TOKEN, time.monotonic() + WAIT_S, hostname="h", pid=1)
        t.join(WAIT_S)
        self.sched, self.raw, self.n = out["ch"], a, 0

    def feed(self, data: bytes) -> str:
        self.worker.dropped = 0  # a fresh budget per case: each case is one injected line
        self.n += 1

        def send():  # on a thread: a long line fills the socket while nobody reads yet
            self.raw.sendall(data + b"\n")
            self.sched.send(type="ping", n=self.n)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        got = self.worker.recv(time.monotonic() + WAIT_S)
        sender.join(WAIT_S)
        if got != {"type": "ping", "n": self.n}:
            return f"lost the genuine line: {str(got)[:80]}"
        return "dropped" if self.worker.dropped else "accepted"

    def answers(self) -> bool:
        self.sched.send(type="assign", rank=1)
        return self.worker.recv(time.monotonic() + WAIT_S) == {"type": "assign", "rank": 1}

    def state(self) -> dict:
        return {"buffered bytes": len(self.worker._buf)}

    def close(self):
        self.sched.close()
        self.worker.close()


class HeartbeatTarget:
    """A heartbeat receiver: datagrams to its port, and each one to ``accept`` directly."""

    name = "heartbeat datagram"

    def __init__(self):
        self.monitor = heartbeat.HeartbeatMonitor(TOKEN)
        self.beats = heartbeat.Beats(TOKEN, 0, receiver=self.monitor.receiver)
        self.genuine = self.beats.next()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.wrong: list[str] = []  # what accept() raised besides AuthError

    def feed(self, data: bytes) -> str:
        try:
            self.monitor.accept(data[: heartbeat.MAX_DATAGRAM])
            outcome = "accepted"
        except auth.AuthError as exc:
            outcome = f"refused: {exc.kind}"
        except Exception as exc:  # the finding this target exists for
            self.wrong.append(f"{type(exc).__name__}: {exc}"[:200])
            outcome = f"raised {type(exc).__name__}"
        self.sock.sendto(data[:9000], ("127.0.0.1", self.monitor.port))
        return outcome

    def answers(self) -> bool:
        """A fresh beat every 0.2 s until one is taken (a full UDP buffer drops datagrams)."""
        before = self.monitor.ranks[0].beats if 0 in self.monitor.ranks else 0
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            self.sock.sendto(self.beats.next(), ("127.0.0.1", self.monitor.port))
            for _ in range(20):
                if 0 in self.monitor.ranks and self.monitor.ranks[0].beats > before:
                    return True
                time.sleep(0.01)
        return False

    def state(self) -> dict:
        return {
            "sessions": len(self.monitor._guard._sessions),
            "ranks": len(self.monitor.ranks),
            "refusal kinds": len(self.monitor.refused),
        }

    def close(self):
        self.sock.close()
        self.monitor.close()


class RendezvousTarget:
    """The guarded rendezvous server, with the fuzzer's address allowed (past the 403)."""

    name = "rendezvous HTTP"

    def __init__(self):
        self.server = GuardedRendezvous("127.0.0.1", {"127.0.0.1"})
        self.port = self.server.start()

    def feed(self, data: bytes) -> str:
        with socket.create_connection(("127.0.0.1", self.port), timeout=WAIT_S) as s:
            try:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
                answer = s.recv(64)
            except ConnectionResetError:
                return "reset"
            except OSError as exc:
                return type(exc).__name__
        if not answer:
            return "closed"
        if not answer.startswith(b"HTTP/"):
            return "an error page without status line (HTTP/0.9)"
        return answer.split(b" ")[1].decode("latin-1")

    def answers(self) -> bool:
        request = b"GET /hvdkit-probe/none HTTP/1.0\r\n\r\n"
        return self.feed(request) in ("404", "200")

    def state(self) -> dict:
        keys, stored = self.server.httpd.stored()
        return {
            "stored keys": keys,
            "stored bytes": stored,
            "refusal kinds": len(self.server.httpd.refusals),
        }

    def close(self):
        self.server.stop()


TARGETS = (RegistrationTarget, SignedTarget, HeartbeatTarget, RendezvousTarget)


def strategy_for(target):
    """The hostile input for ``target``."""
    if isinstance(target, RendezvousTarget):
        return hostile_requests()
    if isinstance(target, HeartbeatTarget):
        return hostile_datagrams(target.genuine)
    return hostile_lines()


def run_cases(target, cases: int, after_each=None) -> dict[str, int]:
    """Feed ``target`` ``cases`` hypothesis-drawn inputs; how often each outcome came.

    ``after_each(done)`` runs after every case (``done``: cases so far).
    """
    outcomes: dict[str, int] = {}

    @settings(
        max_examples=cases, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(data=strategy_for(target))
    def feed(data):
        outcome = target.feed(data)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if after_each is not None:
            after_each(sum(outcomes.values()))

    feed()
    return outcomes

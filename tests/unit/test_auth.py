"""The launcher's message authentication, in one process (no launcher, no TensorFlow).

Keys, MACs, replay and staleness rules; the registration handshake and signed
channels over socket pairs; heartbeats; the guarded rendezvous server. Every
byte a sender writes is captured and searched for the token. Every loop is
bounded in count, every wait in time.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from unittest import mock

import pytest
from listener_targets import wait_for

from hvdkit.launch import auth, heartbeat, protocol

TOKEN = "0123456789abcdef-job-token"
WRONG = "0123456789abcdef-not-the-token"


class Recorder:
    """A socket wrapper that keeps every byte written through it."""

    def __init__(self, sock: socket.socket):
        self._sock = sock
        self.written = bytearray()

    def sendall(self, data: bytes) -> None:
        self.written += data
        self._sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def assert_no_token(data: bytes) -> None:
    assert TOKEN.encode() not in data
    assert TOKEN.encode().hex().encode() not in data


# ---------------------------------------------------------------- keys and MACs
def test_keys_differ_per_purpose_and_from_the_token():
    purposes = [
        auth.REGISTER,
        auth.SCHEDULER_TO_WORKER,
        auth.WORKER_TO_SCHEDULER,
        auth.HEARTBEAT,
    ]
    keys = [auth.derive_key(TOKEN, p) for p in purposes]
    assert len(set(keys)) == 4 and all(len(k) == 32 for k in keys)
    assert all(TOKEN.encode() not in k for k in keys)
    assert auth.derive_key(TOKEN, auth.HEARTBEAT) == keys[3]  # deterministic
    assert auth.derive_key(WRONG, auth.HEARTBEAT) != keys[3]
    with pytest.raises(auth.AuthError, match="empty job token"):
        auth.derive_key("", auth.HEARTBEAT)


def test_mac_verify_and_framing():
    key = auth.derive_key(TOKEN, auth.REGISTER)
    sig = auth.mac(key, "nonce", "body")
    assert len(sig) == 64 and auth.verify(key, sig, "nonce", "body")
    assert not auth.verify(key, sig, "nonce", "bodY")
    assert not auth.verify(auth.derive_key(WRONG, auth.REGISTER), sig, "nonce", "body")
    # length-prefixed parts: moving a byte between parts changes the MAC
    assert auth.mac(key, "ab", "c") != auth.mac(key, "a", "bc")
    assert auth.mac(key, 12) == auth.mac(key, "12")
    for bad in (None, 5, sig[:-1], sig + "0", "é" * 64, sig.upper() if sig.upper() != sig else 1):
        assert not auth.verify(key, bad, "nonce", "body")


def test_seal_and_unseal():
    key = auth.derive_key(TOKEN, auth.HEARTBEAT)
    data = auth.seal(key, {"r": 1, "x": [1, 2]}, "ctx")
    assert_no_token(data)
    assert auth.unseal(key, data, "ctx") == {"r": 1, "x": [1, 2]}
    with pytest.raises(auth.AuthError, match="forged"):
        auth.unseal(key, data, "other-ctx")
    with pytest.raises(auth.AuthError, match="forged"):
        auth.unseal(auth.derive_key(WRONG, auth.HEARTBEAT), data, "ctx")
    env = json.loads(data)
    env["b"] = env["b"].replace('"r":1', '"r":0')
    with pytest.raises(auth.AuthError, match="forged"):
        auth.unseal(key, json.dumps(env).encode(), "ctx")
    for garbage in (b"", b"\xff\xfe", b"[1,2]", b'{"b": 3}', data[:-5]):
        with pytest.raises(auth.AuthError, match="malformed"):
            auth.unseal(key, garbage, "ctx")


class FakeClock:
    def __init__(self, now=1000.0):
        self.now = now

    def __call__(self):
        return self.now


def test_replay_guard_sequence_window_and_time():
    clock = FakeClock()
    guard = auth.ReplayGuard(max_skew_s=300, max_delay_s=30, clock=clock)
    guard.check(0, "s1", 0, 999.9)
    guard.check(0, "s1", 1, 999.9)
    with pytest.raises(auth.AuthError, match="replayed: sequence 1 of rank 0"):
        guard.check(0, "s1", 1, 999.9)
    guard.check(0, "s1", 5, 999.9)
    guard.check(0, "s1", 3, 999.9)  # late but unseen: accepted (UDP may reorder)
    with pytest.raises(auth.AuthError, match="replayed"):
        guard.check(0, "s1", 3, 999.9)
    guard.check(0, "s1", 200, 999.9)
    with pytest.raises(auth.AuthError, match="replayed"):  # below the window: refused
        guard.check(0, "s1", 200 - auth.ReplayGuard.WINDOW, 999.9)
    # same numbers in another session or for another rank are different datagrams
    guard.check(0, "s2", 1, 999.9)
    guard.check(1, "s1", 1, 999.9)
    # a datagram held back and delivered late is stale
    clock.now = 1100.0
    with pytest.raises(auth.AuthError, match="stale: arrived 100 s late"):
        guard.check(0, "s1", 201, 1000.0)
    guard.check(0, "s1", 202, 1099.5)
    # a new session must be close to our clock
    with pytest.raises(auth.AuthError, match="stale: sent \\+400 s from now"):
        guard.check(2, "s3", 0, 700.0)
    with pytest.raises(auth.AuthError, match="malformed"):
        guard.check(2, "s3", -1, 1100.0)


def test_replay_guard_constant_clock_offset_is_fine_and_memory_is_bounded():
    clock = FakeClock()
    guard = auth.ReplayGuard(max_skew_s=300, max_delay_s=30, max_sessions=3, clock=clock)
    for i in range(50):  # a sender whose clock is 200 s behind ours, steadily
        clock.now = 1000.0 + i
        guard.check(0, "slow-clock", i, 800.0 + i)
    for s in ("a", "b", "c"):
        guard.check(1, s, 0, clock.now)
    assert len(guard._sessions) == 3 and (0, "slow-clock") not in guard._sessions
    # a forgotten session replayed much later fails the clock test
    clock.now += 1000
    with pytest.raises(auth.AuthError, match="stale"):
        guard.check(0, "slow-clock", 10, 810.0)


# ---------------------------------------------------------------- the handshake
def handshake(timeout=10.0):
    """Run admit() and register() over a socket pair; both channels and what each wrote."""
    a, b = socket.socketpair()
    sched_sock, worker_sock = Recorder(a), Recorder(b)
    result = {}

    def sched():
        result["sched"] = protocol.admit(sched_sock, TOKEN, time.monotonic() + timeout)

    t = threading.Thread(target=sched)
    t.start()
    worker = protocol.Channel(worker_sock)
    protocol.register(worker, TOKEN, time.monotonic() + timeout, hostname="h", pid=7)
    t.join(timeout)
    assert not t.is_alive()
    sched, hello = result["sched"]
    return sched, hello, worker, sched_sock, worker_sock


def test_registration_proves_the_token_without_sending_it():
    sched, hello, worker, s_sock, w_sock = handshake()
    assert hello["type"] == "register" and hello["pid"] == 7 and auth.is_nonce(hello["nonce"])
    sched.send(type="assign", rank=1, size=2)
    assert worker.recv(time.monotonic() + 5) == {"type": "assign", "rank": 1, "size": 2}
    worker.send(type="exit", code=0)
    assert sched.recv(time.monotonic() + 5) == {"type": "exit", "code": 0}
    assert_no_token(bytes(s_sock.written))
    assert_no_token(bytes(w_sock.written))
    assert b"assign" in s_sock.written and b"register" in w_sock.written


def handshake_and_first(send_first):
    """Handshake, then the scheduler sends ``send_first(channel)`` before the worker reads."""
    a, b = socket.socketpair()
    out = {}

    def sched():
        ch, _ = protocol.admit(a, TOKEN, time.monotonic() + 10)
        out["ch"] = ch
        send_first(ch)

    t = threading.Thread(target=sched)
    t.start()
    worker = protocol.Channel(b)
    protocol.register(worker, TOKEN, time.monotonic() + 10, hostname="h", pid=1)
    t.join(10)
    return out["ch"], worker


def admit_in_thread(sock):
    """Start the scheduler's admit() on ``sock`` in a thread.

    Returns ``(thread, result)``; ``result["sched"]`` becomes what admit()
    returned, or the reason of its :class:`protocol.Refused`.
    """
    result = {}

    def sched():
        try:
            result["sched"] = protocol.admit(sock, TOKEN, time.monotonic() + 10)
        except protocol.Refused as exc:
            result["sched"] = str(exc)

    t = threading.Thread(target=sched)
    t.start()
    return t, result


def test_wrong_token_is_refused_on_both_sides():
    a, b = socket.socketpair()
    t, result = admit_in_thread(a)
    worker = protocol.Channel(Recorder(b))
    protocol.register(worker, WRONG, time.monotonic() + 10, hostname="h", pid=1)
    reply = worker.recv(time.monotonic() + 10)
    t.join(10)
    assert result["sched"] == "bad job token"
    assert reply == {"type": "refused", "reason": "bad job token"}
    assert WRONG.encode() not in worker.sock.written


def test_a_worker_sending_the_token_in_clear_is_refused():
    """The old message format (token inside) is not accepted any more."""
    a, b = socket.socketpair()
    t, result = admit_in_thread(a)
    old = protocol.Channel(b)
    assert old.recv(time.monotonic() + 10)["type"] == "challenge"
    old.send(type="register", token=TOKEN, hostname="h", pid=1)
    reply = old.recv(time.monotonic() + 10)
    t.join(10)
    assert result["sched"].startswith("bad job token (this worker's hvdkit sends it in clear")
    assert reply["type"] == "refused"


def test_a_captured_registration_replayed_on_a_new_connection_is_refused():
    # Capture a genuine worker's registration line.
    *_, w_sock = handshake()
    captured = bytes(w_sock.written).split(b"\n")[0]
    assert captured.startswith(b'{"b"')
    # Replay it to a fresh challenge.
    a, b = socket.socketpair()
    t, result = admit_in_thread(a)
    attacker = protocol.Channel(b)
    assert attacker.recv(time.monotonic() + 10)["type"] == "challenge"
    attacker.send_raw(captured)
    reply = attacker.recv(time.monotonic() + 10)
    t.join(10)
    assert result["sched"] == "bad job token"
    assert reply == {"type": "refused", "reason": "bad job token"}


def test_secured_channel_drops_forged_replayed_and_unsigned_messages():
    def forge(ch):
        ch.send(type="assign", rank=0)  # genuine, sequence 0
        bad_key = auth.derive_key(WRONG, auth.SCHEDULER_TO_WORKER)
        _, _, session = ch._keys
        body = json.dumps({"type": "abort", "reason": "forged"})
        forged = {"b": body, "n": 1, "m": auth.mac(bad_key, session, 1, body)}
        ch.send_raw(json.dumps(forged).encode())
        ch.send_raw(json.dumps({"type": "abort", "reason": "unsigned"}).encode())
        ch.send_raw(json.dumps({"type": "refused", "reason": "late refusal"}).encode())
        ch.send_raw(b"\x00\x01garbage")
        ch.send(type="abort", reason="genuine")  # sequence 1

    sched, worker = handshake_and_first(forge)
    deadline = time.monotonic() + 10
    assert worker.recv(deadline) == {"type": "assign", "rank": 0}
    assert worker.recv(deadline) == {"type": "abort", "reason": "genuine"}
    assert worker.dropped == 4


def test_a_replayed_genuine_line_is_dropped():
    a, b = socket.socketpair()
    rec = Recorder(a)
    out = {}

    def sched():
        ch, _ = protocol.admit(rec, TOKEN, time.monotonic() + 10)
        ch.send(type="assign", rank=3)
        out["ch"] = ch

    t = threading.Thread(target=sched)
    t.start()
    worker = protocol.Channel(b)
    protocol.register(worker, TOKEN, time.monotonic() + 10, hostname="h", pid=1)
    t.join(10)
    assert worker.recv(time.monotonic() + 10) == {"type": "assign", "rank": 3}
    assign_line = bytes(rec.written).strip().split(b"\n")[-1]
    a.sendall(assign_line + b"\n")  # the same bytes again
    out["ch"].send(type="done", code=0)
    assert worker.recv(time.monotonic() + 10) == {"type": "done", "code": 0}
    assert worker.dropped == 1


def test_too_many_forged_lines_end_the_connection():
    def flood(ch):
        for _ in range(protocol.MAX_DROPPED):
            ch.send_raw(b'{"b": "{}", "n": 0, "m": "00"}')

    _, worker = handshake_and_first(flood)
    assert worker.recv(time.monotonic() + 10) is None
    assert worker.dropped == protocol.MAX_DROPPED


def test_oversized_line_is_bounded_and_refused():
    a, b = socket.socketpair()
    ch = protocol.Channel(a, max_line=1000)
    sent = {"n": 0}

    def blast():
        try:
            for _ in range(100):  # 100 x 10 kB, no newline until the end
                b.sendall(b"x" * 10_000)
                sent["n"] += 10_000
            b.sendall(b"\n" + b'{"type": "after"}\n')
        except OSError:
            pass

    t = threading.Thread(target=blast)
    t.start()
    deadline = time.monotonic() + 30
    assert ch.recv(deadline)["type"] == "garbage"  # the long line, reported once
    assert len(ch._buf) <= 1000 + 65536
    assert ch.recv(deadline) == {"type": "after"}  # its rest skipped, the stream goes on
    t.join(30)


def test_slow_loris_registration_hits_the_deadline():
    a, b = socket.socketpair()
    result = {}

    def sched():
        t0 = time.monotonic()
        try:
            protocol.admit(a, TOKEN, time.monotonic() + 1.0)
        except TimeoutError:
            result["timeout_after"] = time.monotonic() - t0

    t = threading.Thread(target=sched)
    t.start()
    b.recv(4096)  # the challenge
    sent = 0
    # one byte every 0.05 s, each read quick, the whole not: the handshake's 1 s
    # deadline must end it long before the client would stop on its own (100 s)
    for _ in range(2000):
        if not t.is_alive():
            break
        try:
            b.sendall(b"{")
        except OSError:
            break
        sent += 1
        time.sleep(0.05)
    t.join(30)
    assert "timeout_after" in result, "the handshake did not give up on a slow client"
    assert sent < 2000  # it gave up before the client stopped on its own


def test_admission_serves_real_workers_while_hostile_clients_hold_connections():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    admission = protocol.Admission(listener, TOKEN, timeout_s=2.0)
    hostile = []
    try:
        # idle and slow clients (from another address), garbage, a wrong token: none
        # may hold up the real one
        for _ in range(protocol.MAX_PENDING_PER_ADDRESS):
            hostile.append(
                socket.create_connection(("127.0.0.1", port), source_address=("127.0.0.2", 0))
            )
        junk = socket.create_connection(("127.0.0.1", port))
        junk.sendall(b"GET / HTTP/1.0\r\n\r\n\x00\xff" * 10 + b"\n")
        wrong = protocol.Channel(socket.create_connection(("127.0.0.1", port)))
        protocol.register(wrong, WRONG, time.monotonic() + 10, hostname="x", pid=1)
        assert wrong.recv(time.monotonic() + 10)["reason"] == "bad job token"
        real = protocol.Channel(socket.create_connection(("127.0.0.1", port)))
        protocol.register(real, TOKEN, time.monotonic() + 10, hostname="real", pid=42)
        got = admission.next(10)
        assert got is not None and got[1]["hostname"] == "real" and got[1]["pid"] == 42
        got[0].send(type="assign", rank=0)
        assert real.recv(time.monotonic() + 10) == {"type": "assign", "rank": 0}
        # the idle clients are dropped after the handshake timeout
        for s in hostile:
            s.settimeout(30)
            assert s.recv(4096).startswith(b'{"type":"challenge"')
            assert s.recv(4096) == b""
        assert admission.refused >= 2 + len(hostile)
        # a registered worker that nobody takes is told when admission closes
        late = protocol.Channel(socket.create_connection(("127.0.0.1", port)))
        protocol.register(late, TOKEN, time.monotonic() + 10, hostname="late", pid=2)
        deadline = time.monotonic() + 10
        while admission._ready.qsize() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        admission.close()
        assert late.recv(time.monotonic() + 10)["type"] == "abort"
    finally:
        listener.close()
        for s in hostile:
            s.close()


# ---------------------------------------------------------------- heartbeats
def test_heartbeat_datagrams_never_contain_the_token():
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    receiver.settimeout(10)
    rid = auth.new_nonce()
    heartbeat.start_sender("127.0.0.1", receiver.getsockname()[1], TOKEN, 3, receiver=rid)
    key = auth.derive_key(TOKEN, auth.HEARTBEAT)
    bodies = []
    for _ in range(2):
        data, _ = receiver.recvfrom(65536)
        assert_no_token(data)
        bodies.append(auth.unseal(key, data, rid))
    receiver.close()
    assert [b["r"] for b in bodies] == [3, 3]
    assert bodies[1]["s"] == bodies[0]["s"] + 1 and bodies[0]["n"] == bodies[1]["n"]
    assert set(bodies[0]) >= {"r", "p", "h", "n", "s", "t"}


def test_the_first_heartbeat_is_sent_before_start_sender_returns():
    """A rank frozen right after ``hvdkit.init`` started its heartbeat (SIGSTOP as
    Horovod starts) must already be known to its launcher, which watches only ranks it
    has heard from: the first datagram is queued at the receiver when the call returns,
    not left to the beat thread (seen in CI: the freeze won that race, the rank was
    never found silent and the job failed)."""
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    rid = auth.new_nonce()
    with mock.patch.object(heartbeat.threading.Thread, "start") as no_thread:
        heartbeat.start_sender("127.0.0.1", receiver.getsockname()[1], TOKEN, 5, receiver=rid)
    assert no_thread.call_count == 1  # the beat thread would have started; it did not run
    receiver.setblocking(False)
    data, _ = receiver.recvfrom(65536)  # loopback UDP: queued by sendto itself
    receiver.close()
    body = auth.unseal(auth.derive_key(TOKEN, auth.HEARTBEAT), data, rid)
    assert (body["r"], body["s"]) == (5, 0)


def test_heartbeat_status_fields_are_carried():
    rid = auth.new_nonce()
    beats = heartbeat.Beats(TOKEN, 0, status=lambda: {"collective": "allreduce.w0"}, receiver=rid)
    body = auth.unseal(auth.derive_key(TOKEN, auth.HEARTBEAT), beats.next(bye=True), rid)
    assert body["collective"] == "allreduce.w0" and body["bye"] is True and body["s"] == 0


def test_monitor_refuses_bad_datagrams_and_keeps_serving():
    monitor = heartbeat.HeartbeatMonitor(TOKEN)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dest = ("127.0.0.1", monitor.port)
    try:
        genuine = heartbeat.Beats(TOKEN, 0, receiver=monitor.receiver)
        first = genuine.next()
        s.sendto(first, dest)
        assert wait_for(lambda: monitor.ranks.get(0) and monitor.ranks[0].beats == 1)
        bad = [
            first,  # replayed
            b"\x00" * 100,  # garbage
            first[: len(first) // 2],  # truncated
            b"{" * 5000,  # oversized (cut at 4096 bytes)
            heartbeat.Beats(WRONG, 1, receiver=monitor.receiver).next(),  # wrong token
            heartbeat.Beats(TOKEN, 1, receiver=auth.new_nonce()).next(),  # for another receiver
            auth.seal(auth.derive_key(TOKEN, auth.REGISTER), {"r": 1}, monitor.receiver),
            json.dumps({"t": TOKEN, "r": 1, "p": 1, "h": "x"}).encode(),  # the old clear format
        ]
        for i in range(20):  # a burst, in rounds the socket buffer holds (UDP may drop)
            for data in bad:
                s.sendto(data, dest)
            done = (i + 1) * len(bad)
            assert wait_for(lambda done=done: sum(monitor.refused.values()) == done)
        assert monitor.refused["replayed"] == 20
        assert monitor.refused["forged"] == 60
        assert monitor.refused["malformed"] == 80
        assert list(monitor.ranks) == [0] and monitor.ranks[0].beats == 1
        s.sendto(genuine.next(), dest)  # still listening
        assert wait_for(lambda: monitor.ranks[0].beats == 2)
    finally:
        s.close()
        monitor.close()


def test_monitor_logs_refusals_rate_limited(caplog):
    monitor = heartbeat.HeartbeatMonitor(TOKEN)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        with caplog.at_level("WARNING", logger="hvdkit.heartbeat"):
            for _ in range(50):
                s.sendto(b"junk", ("127.0.0.1", monitor.port))
            assert wait_for(lambda: monitor.refused["malformed"] == 50)
        lines = [r.getMessage() for r in caplog.records if "refused a heartbeat" in r.message]
        assert len(lines) == 1 and "malformed: not JSON" in lines[0]
    finally:
        s.close()
        monitor.close()


def test_stale_heartbeat_is_refused():
    monitor = heartbeat.HeartbeatMonitor(TOKEN)
    try:
        key = auth.derive_key(TOKEN, auth.HEARTBEAT)
        body = {"r": 0, "p": 1, "h": "x", "n": auth.new_nonce(), "s": 0, "t": time.time() - 3600}
        with pytest.raises(auth.AuthError, match="stale"):
            monitor.accept(auth.seal(key, body, monitor.receiver))
        assert monitor.ranks == {}
    finally:
        monitor.close()


def test_a_renumbered_rank_heard_under_its_old_number_is_not_left_behind_silent():
    # An in-process recovery: the worker files its rank under -1 - rank
    # (forget), the program meets the new world, and only then beats under its
    # new number. A beat under the old number in between (a slow meeting: a
    # newcomer starting cold) made a second entry that fell silent and was
    # stopped as a frozen rank 8 s later, although the process beat every second.
    monitor = heartbeat.HeartbeatMonitor(TOKEN)
    try:
        survivor = heartbeat.Beats(TOKEN, 2, receiver=monitor.receiver)
        other = heartbeat.Beats(TOKEN, 0, receiver=monitor.receiver)
        other._fixed["p"] += 1  # another process (this test is one)
        assert [monitor.accept(b.next()) for b in (survivor, other)] == [2, 0]
        monitor.forget()
        assert sorted(monitor.ranks) == [-3, -1]
        assert monitor.accept(survivor.next()) == 2  # still meeting: the old number
        assert sorted(monitor.ranks) == [-1, 2]
        survivor.set_rank(1)
        assert monitor.accept(survivor.next()) == 1
        assert sorted(monitor.ranks) == [-1, 1]  # (before: [-1, 1, 2], and 2 fell silent)
        assert monitor.ranks[1].beats == 1  # a new entry: this number's first beat
        for status in monitor.ranks.values():
            status.last_seen -= 60.0  # both quiet for a minute
        assert monitor.accept(survivor.next()) == 1
        assert monitor.silent_ranks(8) == [(-1, pytest.approx(60.0, abs=5.0))]  # only the quiet one
    finally:
        monitor.close()


def test_sender_without_token_is_a_clear_error():
    from hvdkit.errors import LaunchError

    with pytest.raises(LaunchError, match="neither HVDKIT_JOB_TOKEN nor HVDKIT_TOKEN_FILE"):
        heartbeat.start_sender("127.0.0.1", 9, "", 0, receiver=auth.new_nonce())


# ---------------------------------------------------------------- the rendezvous guard
@pytest.fixture
def guarded():
    from hvdkit.launch.guard import GuardedRendezvous

    servers = []

    def make(allowed):
        server = GuardedRendezvous("127.0.0.1", allowed)
        servers.append((server, server.start()))
        return servers[-1]

    yield make
    for server, _ in servers:
        server.stop()


def request(port, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def refused(port, method, path, body=None) -> str:
    """How an outsider's request ended: ``"403"``, or ``"cut"`` if the connection was.

    The guard answers a machine not of the job without reading its request
    and closes; when the request's bytes arrive after that close (a loaded
    machine, a body sent separately), the kernel resets the connection and
    the client sees a broken pipe or a reset instead of the 403. Both are a
    refusal; anything else (a status the store gives) is not.
    """
    try:
        status = request(port, method, path, body=body)[0]
    except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
        return "cut"
    return str(status)


def test_rendezvous_refuses_clients_not_of_the_job(guarded, caplog):
    server, port = guarded({"127.0.0.2"})  # the job's machine is not us
    with caplog.at_level("WARNING", logger="hvdkit.rendezvous"):
        assert refused(port, "PUT", "/global/0", body=b"evil") in ("403", "cut")
        assert refused(port, "GET", "/global/0") in ("403", "cut")
    assert server.httpd.cache == {}
    assert server.httpd.refusals["not a machine of this job"] == 2
    assert "refused a request from 127.0.0.1: not a machine of this job" in caplog.text


def test_rendezvous_serves_the_job_and_survives_bad_requests(guarded):
    from hvdkit.launch import guard

    server, port = guarded({"127.0.0.1"})
    assert request(port, "PUT", "/global/0", body=b"addr0")[0] == 200
    assert request(port, "GET", "/global/0") == (200, b"addr0")
    bad = [
        b"\x00\xff\xfe garbage\r\n\r\n",
        b"GET /a/b/c/d HTTP/1.0\r\n\r\n",  # Horovod's handler would crash on this path
        b"PUT /global/1 HTTP/1.0\r\nContent-Length: lots\r\n\r\n",
        b"PUT /global/1 HTTP/1.0\r\nContent-Length: %d\r\n\r\n" % (guard.MAX_VALUE_BYTES + 1),
        b"PUT /global/1 HTTP/1.0\r\nContent-Length: 100\r\n\r\nshort",  # truncated
        b"GET /" + b"a" * 70000 + b" HTTP/1.0\r\n\r\n",  # over-long request line
        b"POST /global/0 HTTP/1.0\r\n\r\n",
    ]
    statuses = []
    for raw in bad:
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            try:
                s.sendall(raw)
                s.shutdown(socket.SHUT_WR)
                statuses.append(s.recv(100).split(b" ")[1:2])
            except OSError:
                statuses.append([b"reset"])
    assert statuses[1:5] == [[b"400"], [b"411"], [b"413"], [b"408"]], statuses
    assert statuses[6] == [b"501"], statuses
    assert request(port, "GET", "/global/0") == (200, b"addr0")  # still serving
    assert server.httpd.cache == {"global": {"0": b"addr0"}}  # nothing truncated stored


def test_rendezvous_bounds_slow_and_many_connections(guarded, monkeypatch):
    from hvdkit.launch import guard

    monkeypatch.setattr(guard, "REQUEST_DEADLINE_S", 1.0)
    server, port = guarded({"127.0.0.1"})
    # slow loris: one header byte every 0.1 s, never finishing the request
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    closed = False
    s.sendall(b"GET /global/0 HTTP/1.0\r\n")
    for _ in range(300):
        try:
            s.sendall(b"X")
        except OSError:
            closed = True
            break
        time.sleep(0.1)
    s.close()
    assert closed, "a slow client kept its connection for 30 s"
    assert server.httpd.refusals["too slow"] >= 1
    # more connections than the cap: the surplus is closed at once, then service resumes
    monkeypatch.setattr(guard, "REQUEST_DEADLINE_S", 120.0)
    monkeypatch.setattr(guard.GuardedHandler, "timeout", 120.0)
    cap = guard.TOO_MANY
    held = []
    try:
        for _ in range(guard.MAX_CONNECTIONS + 8):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=30))
        assert wait_for(lambda: server.httpd.refusals[cap] >= 8, 30), server.httpd.refusals
    finally:
        for h in held:
            h.close()
    assert wait_for(lambda: request(port, "GET", "/global/none")[0] == 404, 30)


def _secured_pair() -> tuple[protocol.Channel, protocol.Channel]:
    a, b = socket.socketpair()
    one, two = protocol.Channel(a), protocol.Channel(b)
    s, w = auth.channel_keys(TOKEN, "scheduler"), auth.channel_keys(TOKEN, "worker")
    one.secure(s.send, s.receive, "session")
    two.secure(w.send, w.receive, "session")
    return one, two


def test_channel_keys_mirror_each_other_and_come_from_the_token():
    """One derivation for both sides: what one side sends under, the other receives under."""
    s, w = auth.channel_keys(TOKEN, "scheduler"), auth.channel_keys(TOKEN, "worker")
    assert (s.send, s.receive) == (w.receive, w.send)
    assert s.register == w.register == auth.derive_key(TOKEN, auth.REGISTER)
    assert s.send == auth.derive_key(TOKEN, auth.SCHEDULER_TO_WORKER)
    assert s.receive == auth.derive_key(TOKEN, auth.WORKER_TO_SCHEDULER)
    assert len({s.register, s.send, s.receive}) == 3
    assert auth.channel_keys(WRONG, "worker").send != w.send
    with pytest.raises(ValueError, match="side='server'"):
        auth.channel_keys(TOKEN, "server")


def test_keep_alives_are_skipped_and_a_silent_peer_ends_the_wait():
    """A cut network closes no connection: a kept-alive channel notices the silence."""
    sched, worker = _secured_pair()
    try:
        sched.keep_alive(silence_s=60, every_s=0.01)
        assert wait_for(lambda: sched._sent >= 3, 60)  # keep-alives went out ...
        sched.send(type="done", code=0)
        # ... and the reader sees only the message (it never called keep_alive: no limit)
        assert worker.recv(time.monotonic() + 60) == {"type": "done", "code": 0}
        assert worker.dropped == 0
        # The worker's side watches for silence too; the scheduler's keeps talking: a
        # deadline before any message is a plain timeout, not a silent peer.
        worker.keep_alive(silence_s=60, every_s=0.01)
        with pytest.raises(TimeoutError) as info:
            worker.recv(time.monotonic() + 0.2)
        assert not isinstance(info.value, protocol.Silent)
        # The scheduler stops talking (its machine froze): the worker's wait ends with
        # Silent, an OSError (a lost connection to the code that reads), naming the peer.
        sched._closed.set()
        worker._silence_s = 0.3  # a short limit for the test
        with pytest.raises(protocol.Silent, match=r"for 0\.3 s, not even a keep-alive"):
            worker.recv(time.monotonic() + 60)  # skips the keep-alives sent before the stop
        assert issubclass(protocol.Silent, OSError)
    finally:
        sched.close()
        worker.close()


def test_silence_limit_is_the_stall_timeout_but_never_below_the_floor():
    assert protocol.silence_limit(120.0) == 120.0
    assert protocol.silence_limit(8.0) == protocol.MIN_SILENCE_S == 10.0


def test_monitor_close_ends_its_receiving_thread_without_waiting_for_a_look(monkeypatch):
    # It looks whether to stop once an hour here: only close()'s datagram to itself
    # can end the thread's wait within close()'s own join.
    monkeypatch.setattr(heartbeat.HeartbeatMonitor, "LOOK_S", 3600.0)
    monitor = heartbeat.HeartbeatMonitor(TOKEN)
    monitor.close()
    assert not monitor._thread.is_alive()
    assert sum(monitor.refused.values()) == 0  # its own wake-up is no refused heartbeat

"""The attacks of issue 20 that need no second process, each reproduced first.

* ``[[[`` nesting (1.5 KB), huge and non-UTF-8 input on every parse path: the
  registration line, a signed line after the handshake, a heartbeat
  datagram: one refusal, one short log line, no exception, and the listener
  still serves (the rendezvous server parses no JSON; its input is fuzzed in
  ``test_fuzz_listeners.py``).
* The refusal log is keyed on a fixed set of kinds: 30 bad paths (or PUT
  sizes) are one kind, one line, one counter.
* A heartbeat is bound to its receiver: sent to one, refused by another.
* A worker that meets a busy scheduler (a held flood of connections) tries
  again and registers once the flood ends; a refusal still ends it at once.
* The token file: private, read by the ranks, refused when others may read it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest
from listener_targets import TOKEN, RegistrationTarget, SignedTarget, wait_for, watching

from hvdkit.errors import LaunchError
from hvdkit.launch import auth, guard, heartbeat, protocol, worker

NESTED = b"[" * 1536  # the attack as reported: about 1.5 KB of [[[
ATTACKS = {
    "nested": NESTED,
    "nested-closed": NESTED + b"]" * 1536,
    "nested-objects": b'{"b":' * 800,
    "not-utf8": b'{"b": "\xff\xfe\xc3", "m": ""}',
    "utf16": '{"b": "{}", "m": ""}'.encode("utf-16"),
    "huge": b'{"b": "' + b"x" * 200_000 + b'"}',
    "huge-int": b'{"n": ' + b"9" * 5000 + b"}",
}


def test_loads_refuses_deep_huge_and_non_utf8_and_keeps_depth_in_strings():
    for name, data in ATTACKS.items():
        with pytest.raises(auth.AuthError) as info:
            auth.loads(data, 100_000)
        assert info.value.kind == auth.MALFORMED, name
    assert auth.loads(b'{"a": "' + b"[" * 5000 + b'"}', 100_000) == {"a": "[" * 5000}
    depth_32 = b"[" * 32 + b"]" * 32
    assert auth.loads(depth_32, 100) is not None
    with pytest.raises(auth.AuthError, match="nested more than 32 deep"):
        auth.loads(b"[" * 33 + b"]" * 33, 100)
    # escaped quotes do not hide brackets, nor make the scan quadratic
    with pytest.raises(auth.AuthError, match="nested"):
        auth.loads(b'["\\"", ' + b"[" * 40 + b"]" * 41, 1000)


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_registration_line_attack_is_one_refusal_and_one_line(attack):
    target = RegistrationTarget()
    try:
        with watching() as watch:
            reply = target.feed(ATTACKS[attack])
            assert reply.startswith("refused: not a registration"), reply
            assert target.answers()
            assert wait_for(lambda: target.admission.refused == 1)
        assert watch.uncaught == []
        lines = [r.getMessage() for r in watch.records if r.levelno >= logging.WARNING]
        assert len(lines) == 1 and "refused a worker from 127.0.0.1:" in lines[0], lines
        assert watch.bad_lines() == []
        assert dict(target.admission.refusals) == {protocol.NOT_REGISTRATION: 1}
    finally:
        target.close()


def test_nested_lines_flood_is_rate_limited():
    """300 nested lines: 300 refusals counted, 20 lines logged (the scheduler's burst)."""
    target = RegistrationTarget()
    try:
        with watching() as watch:
            for _ in range(300):
                target.feed(NESTED)
            assert target.answers()
            # each refusal is counted after its reply went out: wait for the last one
            assert wait_for(lambda: target.admission.refused == 300)
        assert target.admission.refusals[protocol.NOT_REGISTRATION] == 300
        lines = [r for r in watch.records if "refused a worker" in r.getMessage()]
        assert len(lines) == 20 and watch.uncaught == []
    finally:
        target.close()


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_signed_channel_drops_the_attack_and_goes_on(attack):
    target = SignedTarget()
    try:
        with watching() as watch:
            assert target.feed(ATTACKS[attack]) == "dropped"
            assert target.answers()
        assert watch.uncaught == [] and watch.bad_lines() == []
        assert target.worker.dropped == 1
    finally:
        target.close()


def test_scheduler_side_listener_survives_an_injected_line():
    """The scheduler reads a worker's lines on a thread that must outlive any of them."""
    target = SignedTarget()

    def inject():  # on the worker's end of the socket, towards the scheduler
        for data in ATTACKS.values():
            target.worker.sock.sendall(data + b"\n")
        target.worker.send(type="exit", code=0)

    sender = threading.Thread(target=inject, daemon=True)
    try:
        with watching() as watch:
            sender.start()
            assert target.sched.recv(time.monotonic() + 30) == {"type": "exit", "code": 0}
        sender.join(30)
        assert target.sched.dropped == len(ATTACKS)
        assert watch.uncaught == [] and watch.bad_lines() == []
    finally:
        target.close()


def test_heartbeat_attack_is_refused_and_the_receiver_goes_on():
    monitor = heartbeat.HeartbeatMonitor(TOKEN)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        with watching() as watch:
            for name, data in ATTACKS.items():
                with pytest.raises(auth.AuthError) as info:
                    monitor.accept(data[: heartbeat.MAX_DATAGRAM])
                assert info.value.kind == auth.MALFORMED, name
                s.sendto(data[:9000], ("127.0.0.1", monitor.port))
            beats = heartbeat.Beats(TOKEN, 0, receiver=monitor.receiver)
            deadline = time.monotonic() + 10
            while 0 not in monitor.ranks and time.monotonic() < deadline:
                s.sendto(beats.next(), ("127.0.0.1", monitor.port))
                time.sleep(0.1)
        assert 0 in monitor.ranks
        assert watch.uncaught == [] and watch.bad_lines() == []
        assert set(monitor.refused) == {auth.MALFORMED}
    finally:
        s.close()
        monitor.close()


# ---------------------------------------------------------------- the refusal log
def test_refusal_log_is_keyed_on_fixed_kinds(caplog):
    """30 different bad paths and PUT sizes: two kinds, two counters, two lines."""
    server = guard.GuardedRendezvous("127.0.0.1", {"127.0.0.1"})
    port = server.start()
    try:
        with caplog.at_level("WARNING", logger="hvdkit.rendezvous"):
            for i in range(30):
                for raw in (
                    b"GET /a/b/%d/c HTTP/1.0\r\n\r\n" % i,
                    b"PUT /s/k HTTP/1.0\r\nContent-Length: %d\r\n\r\n"
                    % (guard.MAX_VALUE_BYTES + 1 + i),
                ):
                    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                        s.sendall(raw)
                        s.shutdown(socket.SHUT_WR)
                        s.recv(100)
        refusals = server.httpd.refusals
        assert dict(refusals) == {guard.BAD_PATH: 30, guard.TOO_LARGE: 30}
        lines = [r.getMessage() for r in caplog.records if "refused a request" in r.getMessage()]
        assert len(lines) == 2, lines
    finally:
        server.stop()


def test_refusal_log_counts_stay_as_few_as_the_kinds():
    refusals = auth.RefusalLog(logging.getLogger("test"), "refused from", ("a", "b"))
    for i in range(1000):
        refusals("x", f"attacker text {i}", "detail\nwith a forged second line" * 50)
        refusals("x", "a")
    assert dict(refusals.counts) == {auth.OTHER: 1000, "a": 1000}
    assert set(refusals._window) <= {"a", "b", auth.OTHER}


def test_refusal_line_is_one_bounded_line(caplog):
    refusals = auth.RefusalLog(logging.getLogger("test.line"), "refused from", ("kind",))
    with caplog.at_level("WARNING", logger="test.line"):
        refusals("1.2.3.4:5\n", "kind", "line one\nline two\x00" + "x" * 5000)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "\n" not in line and "\x00" not in line and len(line) < 300


# ---------------------------------------------------------------- heartbeats
def test_heartbeat_is_accepted_only_by_the_receiver_it_was_sent_to():
    """Issue 20: a beat captured on its way to rank 0's receiver, replayed to rank 1's."""
    mine, other = heartbeat.HeartbeatMonitor(TOKEN), heartbeat.HeartbeatMonitor(TOKEN)
    try:
        beat = heartbeat.Beats(TOKEN, 0, receiver=mine.receiver).next()
        assert other.receiver != mine.receiver
        with pytest.raises(auth.AuthError, match="forged"):
            other.accept(beat)
        assert mine.accept(beat) == 0
        with pytest.raises(auth.AuthError, match="replayed"):
            mine.accept(beat)
        assert other.ranks == {}
    finally:
        mine.close()
        other.close()


def test_monitor_addr_round_trip_and_errors():
    rid = auth.new_nonce()
    assert heartbeat.parse_monitor_addr(heartbeat.monitor_addr("10.0.0.1", 4000, rid)) == (
        "10.0.0.1",
        4000,
        rid,
    )
    for bad in ("10.0.0.1:4000", f"10.0.0.1:x/{rid}", f":4000/{rid}", "10.0.0.1:4000/short"):
        with pytest.raises(LaunchError, match="is not <host>:<port>/<receiver id>"):
            heartbeat.parse_monitor_addr(bad)


# ---------------------------------------------------------------- a flood, then a worker
def test_worker_waits_out_a_held_flood_and_registers():
    """Connections hold every slot from the worker's address; it retries, then gets in."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    admission = protocol.Admission(listener, TOKEN, timeout_s=60.0)
    held = [
        socket.create_connection(("127.0.0.1", port))
        for _ in range(protocol.MAX_PENDING_PER_ADDRESS)
    ]
    joined, attempts = {}, []
    real_connect = worker.connect

    def counting_connect(*args):
        attempts.append(admission.refusals[protocol.BUSY])
        return real_connect(*args)

    def join():
        try:
            joined["result"] = worker.join("127.0.0.1", port, TOKEN, 120.0)
        except LaunchError as exc:
            joined["error"] = str(exc)

    worker.connect = counting_connect
    try:
        wait_for(lambda: admission.pending >= len(held))
        t = threading.Thread(target=join)
        t.start()
        wait_for(lambda: admission.refusals[protocol.BUSY] >= 3, 30)
        busy_during_flood = admission.refusals[protocol.BUSY]
        for s in held:  # the flood ends
            s.close()
        got = admission.next(60)
        assert got is not None and got[1]["pid"] == os.getpid()
        got[0].send(type="assign", rank=0, size=1)
        t.join(60)
        assert "error" not in joined, joined
        ch, first = joined["result"]
        assert first == {"type": "assign", "rank": 0, "size": 1}
        assert busy_during_flood >= 3 and len(attempts) == busy_during_flood + 1
        ch.close()
    finally:
        worker.connect = real_connect
        for s in held:
            s.close()
        admission.close()
        listener.close()


def test_worker_with_a_wrong_token_is_not_retried():
    listener = socket.create_server(("127.0.0.1", 0))
    admission = protocol.Admission(listener, TOKEN)
    try:
        with pytest.raises(LaunchError, match="refused this worker: bad job token.*job token"):
            worker.join("127.0.0.1", listener.getsockname()[1], "not-" + TOKEN, 60.0)
        # The admission thread counts the refusal after sending it: wait for the count
        assert wait_for(lambda: admission.refused == 1, 60)
        assert dict(admission.refusals) == {protocol.BAD_TOKEN: 1}
    finally:
        admission.close()
        listener.close()


def test_worker_gives_up_a_busy_scheduler_at_its_timeout():
    """Nothing but 'busy' until the timeout: the error names the flood, not the token."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def always_busy():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            protocol._tell_busy(conn, "test")

    t = threading.Thread(target=always_busy)
    t.start()
    try:
        with pytest.raises(LaunchError) as info:
            worker.join("127.0.0.1", port, TOKEN, 1.5)
        text = str(info.value)
        assert "started no handshake" in text and "scheduler busy: test" in text
        assert "HVDKIT_SCHED_TIMEOUT" in text and "job token" not in text
    finally:
        stop.set()
        t.join(10)
        listener.close()


# ---------------------------------------------------------------- the token file
def test_token_file_is_read_only_when_private(tmp_path, monkeypatch):
    path = tmp_path / "job.token"
    auth.write_token_file(str(path), TOKEN)
    assert (path.stat().st_mode & 0o777) == 0o600
    assert auth.read_token_file(str(path)) == TOKEN
    monkeypatch.delenv("HVDKIT_JOB_TOKEN", raising=False)
    monkeypatch.setenv("HVDKIT_TOKEN_FILE", str(path))
    assert auth.job_token() == TOKEN
    monkeypatch.setenv("HVDKIT_JOB_TOKEN", "from-env")
    assert auth.job_token() == "from-env"
    path.chmod(0o640)
    with pytest.raises(LaunchError, match=r"mode 640\).*chmod 600"):
        auth.read_token_file(str(path))
    with pytest.raises(LaunchError, match="cannot be read here.*every machine"):
        auth.read_token_file(str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("")
    (tmp_path / "empty").chmod(0o600)
    with pytest.raises(LaunchError, match="is empty"):
        auth.read_token_file(str(tmp_path / "empty"))

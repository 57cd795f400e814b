"""An attacker without the job token, for tests/test_security_mp.py.

    python outsider.py ACTION HOST PORT [FILE]

Prints one JSON object per attempt ({"attack": ..., "result": ...}) so the
test can assert on each. Every loop is bounded in count and time.

Actions:
  register       registration without a token, with a wrong token, and the
                 captured registration line in FILE replayed
  burst-tcp      garbage, truncated JSON, an oversized line, a flood of
                 connections that close at once
  slow-tcp       8 connections that trickle one byte every 0.5 s for 15 s
  http           PUT/GET/DELETE of rendezvous keys, then malformed requests
  probe          one GET of a key no job uses (does the server answer?)
  udp            the captured heartbeat datagrams in FILE replayed, then garbage
  hold-tcp       N connections held open for S seconds (python outsider.py hold-tcp
                 HOST PORT N S): every one the server closes is opened again
                 (at most 20 times a second), then all are closed
"""

import json
import socket
import sys
import threading
import time

from hvdkit.launch import protocol

WRONG_TOKEN = "an-outsiders-guess-of-the-token"


def report(attack, result):
    print(json.dumps({"attack": attack, "result": result}), flush=True)


def reply_to(host, port, send_after_challenge: bytes | None, seconds=15.0) -> str:
    """Connect, read the challenge, send a line; the scheduler's answer (or what happened)."""
    try:
        with socket.create_connection((host, port), timeout=seconds) as s:
            ch = protocol.Channel(s)
            first = ch.recv(time.monotonic() + seconds)
            if send_after_challenge is None:
                return json.dumps(first)
            ch.send_raw(send_after_challenge)
            return json.dumps(ch.recv(time.monotonic() + seconds))
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def register(host, port, captured_file):
    no_token = json.dumps({"type": "register", "hostname": "intruder", "pid": 1}).encode()
    report("register-without-token", reply_to(host, port, no_token))
    try:
        with socket.create_connection((host, port), timeout=15) as s:
            ch = protocol.Channel(s)
            protocol.register(ch, WRONG_TOKEN, time.monotonic() + 15, hostname="x", pid=1)
            report("register-wrong-token", json.dumps(ch.recv(time.monotonic() + 15)))
    except (OSError, protocol.Refused) as exc:
        report("register-wrong-token", f"{type(exc).__name__}: {exc}")
    with open(captured_file, "rb") as f:
        captured = f.read().strip()
    report("register-replayed", reply_to(host, port, captured))


def burst_tcp(host, port):
    lines = {
        "garbage": b"\x00\xff\xfe\x80 garbage \x01\x02",
        "truncated-json": b'{"b": "{\\"type\\": \\"regis',
        "oversized": b"{" + b"x" * (2 << 20),
        "not-an-object": b"[1, 2, 3]",
    }
    for name, line in lines.items():
        report(f"tcp-{name}", reply_to(host, port, line))
    done = 0
    for _ in range(100):  # connect-and-close flood
        try:
            socket.create_connection((host, port), timeout=5).close()
            done += 1
        except OSError:
            pass
    report("tcp-connection-flood", f"{done} connections")


def slow_tcp(host, port):
    def one(i, results):
        sent = 0
        try:
            with socket.create_connection((host, port), timeout=5) as s:
                s.recv(4096)  # the challenge
                for _ in range(30):  # 15 s at most
                    s.sendall(b"{")
                    sent += 1
                    time.sleep(0.5)
                results[i] = f"still open after {sent} bytes"
        except OSError as exc:
            results[i] = f"closed by the server after {sent} bytes ({type(exc).__name__})"

    results = {}
    threads = [threading.Thread(target=one, args=(i, results)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    report("tcp-slow-loris", [results.get(i, "no result") for i in range(8)])


def raw_http(host, port, request: bytes) -> str:
    """The status line the server answers ``request`` with (or what went wrong)."""
    try:
        with socket.create_connection((host, port), timeout=10) as s:
            try:
                s.sendall(request)
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the server answered and closed before reading all of it
            answer = s.recv(200)
            return answer.split(b"\r\n")[0].decode("latin-1") or "closed"
    except ConnectionResetError:
        # closed with our bytes unread: the kernel resets, dropping the answer
        return "reset by the server"
    except OSError as exc:
        return f"{type(exc).__name__}"


def probe(host, port):
    report("http-probe", raw_http(host, port, b"GET /hvdkit-probe/none HTTP/1.0\r\n\r\n"))


def http(host, port):
    def raw(request: bytes) -> str:
        return raw_http(host, port, request)

    report("http-put-key", raw(b"PUT /global/0 HTTP/1.0\r\nContent-Length: 4\r\n\r\nevil"))
    report("http-get-key", raw(b"GET /global/0 HTTP/1.0\r\n\r\n"))
    report("http-delete-scope", raw(b"DELETE /global/0 HTTP/1.0\r\n\r\n"))
    burst = [
        b"\x00\xff garbage\r\n\r\n",
        b"GET /a/b/c/d HTTP/1.0\r\n\r\n",
        b"PUT /global/1 HTTP/1.0\r\nContent-Length: 99999999999\r\n\r\n",
        b"GET /" + b"a" * 100000 + b" HTTP/1.0\r\n\r\n",
        b"PUT /global/1 HTTP/1.0\r\nContent-Length: 100\r\n\r\nshort",
    ]
    report("http-burst", [raw(b) for b in burst for _ in range(4)])


def udp(host, port, captured_file):
    with open(captured_file) as f:
        captured = [bytes.fromhex(line) for line in f.read().split()]
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for data in captured:
        s.sendto(data, (host, port))
        time.sleep(0.01)
    report("udp-replayed", f"{len(captured)} datagrams")
    for data in [b"\x00" * 64, b"{" * 9000, b'{"b": "{}", "m": "00"}', captured[0][:30]] * 5:
        s.sendto(data, (host, port))
        time.sleep(0.01)
    report("udp-burst", "20 datagrams")


def hold_tcp(host, port, count, seconds):
    """Hold ``count`` connections for ``seconds``, reopening those the server closes."""
    held: list = [None] * int(count)
    opened = closed = 0
    end = time.monotonic() + float(seconds)
    announced = False
    while time.monotonic() < end:
        for i, s in enumerate(held):
            if s is not None:
                try:
                    gone = s.recv(4096, socket.MSG_DONTWAIT) == b""
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if not gone:
                    continue
                s.close()
                closed += 1
            try:
                held[i] = socket.create_connection((host, port), timeout=5)
                opened += 1
            except OSError:
                held[i] = None
        if not announced:
            print(f"holding {sum(s is not None for s in held)} connections", flush=True)
            announced = True
        time.sleep(0.05)
    for s in held:
        if s is not None:
            s.close()
    report("tcp-hold", {"opened": opened, "closed by the server": closed})


if __name__ == "__main__":
    action, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rest = sys.argv[4:]
    {
        "register": lambda: register(host, port, *rest),
        "burst-tcp": lambda: burst_tcp(host, port),
        "slow-tcp": lambda: slow_tcp(host, port),
        "http": lambda: http(host, port),
        "probe": lambda: probe(host, port),
        "udp": lambda: udp(host, port, *rest),
        "hold-tcp": lambda: hold_tcp(host, port, *rest),
    }[action]()

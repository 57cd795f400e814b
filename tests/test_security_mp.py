"""Security of a running job (issue 14), on three network namespaces (root).

Hosts A (10.213.9.1: scheduler and worker) and B (10.213.9.2: worker) run a
job; C (10.213.9.3) is an outsider on the same network who does not know the
token. A packet capture in A and in B records every frame, loopback included.

From the outsider: registration without and with a wrong token, a replayed
captured registration, a burst of malformed, oversized and slow input to the
scheduler's port, writes to Horovod's rendezvous server; from a process on A
without the token (the loopback listeners are reachable only there): the
worker's heartbeat datagrams replayed and garbage. Each is refused and logged,
every listener keeps serving, the job ends with the same weights as an
undisturbed run, and no captured packet carries the token.

Every loop is bounded in count and time; all traffic stays in the test's
namespaces.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from test_launch_mp import PY, SCHEDULER_SH, TRAIN, WORKERS_SH, sched_env, weights

from conftest import MULTIPROC, VENV_BIN, launcher_env, needs_netns

OUTSIDER = str(MULTIPROC / "outsider.py")
CAPTURE = str(MULTIPROC / "capture.py")
TOKEN = "sec-test-token-5f2b9c7e1d3a4b6c"
A_IP, B_IP, C_IP = "10.213.9.1", "10.213.9.2", "10.213.9.3"
# 200 steps of at least 0.1 s: the attacks land while the job trains (the
# undisturbed reference, same weights, trains without the sleep)
TRAIN_ARGS = ["--steps", "200", "--step-sleep", "0.1"]
QUICK = ["--steps", "200", "--step-sleep", "0"]

pytestmark = needs_netns("the outsider's attacks from another host (namespaces)")


@pytest.fixture
def three_hosts():
    """Namespaces A, B, C on one bridge (in A), as three machines on a shared network."""
    tag = str(os.getpid() % 100000)
    a, b, c = f"hvdsa{tag}", f"hvdsb{tag}", f"hvdsc{tag}"
    br = f"br{tag}"
    cmds = [f"ip netns add {ns}" for ns in (a, b, c)] + [
        f"ip -n {a} link add {br} type bridge",
        f"ip link add sb{tag} type veth peer name pb{tag}",
        f"ip link add sc{tag} type veth peer name pc{tag}",
        f"ip link set sb{tag} netns {a}",
        f"ip link set sc{tag} netns {a}",
        f"ip link set pb{tag} netns {b}",
        f"ip link set pc{tag} netns {c}",
        f"ip -n {a} link set sb{tag} master {br}",
        f"ip -n {a} link set sc{tag} master {br}",
        f"ip -n {a} addr add {A_IP}/24 dev {br}",
        f"ip -n {b} addr add {B_IP}/24 dev pb{tag}",
        f"ip -n {c} addr add {C_IP}/24 dev pc{tag}",
    ]
    for ns, ifaces in ((a, [br, f"sb{tag}", f"sc{tag}", "lo"]), (b, [f"pb{tag}", "lo"])):
        cmds += [f"ip -n {ns} link set {i} up" for i in ifaces]
    cmds += [f"ip -n {c} link set pc{tag} up", f"ip -n {c} link set lo up"]
    hosts_files = []
    try:
        for cmd in cmds:
            subprocess.run(cmd.split(), check=True, capture_output=True, text=True)
        for ns, ip in ((a, A_IP), (b, B_IP), (c, C_IP)):
            path = Path("/etc/netns") / ns / "hosts"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"127.0.0.1 localhost\n{ip} {socket.gethostname()}\n")
            hosts_files.append(path)
        yield a, b, c
    finally:
        for ns in (a, b, c):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for path in hosts_files:
            shutil.rmtree(path.parent, ignore_errors=True)


class Proc:
    """A process in a namespace whose merged output is collected on a thread."""

    def __init__(self, cmd, ns, env_extra=None, cwd=None):
        """``ns=None``: in this machine's own network namespace."""
        env = launcher_env()
        env.update(env_extra or {})
        self.popen = subprocess.Popen(
            cmd if ns is None else ["ip", "netns", "exec", ns, *cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=cwd,
        )
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self):
        for line in self.popen.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, fragment: str, seconds: float = 120.0) -> str:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if fragment in line:
                    return line
            if self.popen.poll() is not None and not self._thread.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"{fragment!r} did not appear; output:\n{self.text[-4000:]}")

    def finish(self, seconds: float = 240.0) -> int:
        try:
            code = self.popen.wait(seconds)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
            raise AssertionError(f"did not end within {seconds} s:\n{self.text[-4000:]}") from None
        self._thread.join(10)
        return code

    def stop(self):
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)


def outsider(ns, action, host, port, *extra, seconds=120.0) -> dict:
    """Run one outsider action in ``ns``; ``{attack: result}``."""
    proc = subprocess.run(
        ["ip", "netns", "exec", ns, PY, OUTSIDER, action, host, str(port), *map(str, extra)],
        capture_output=True,
        text=True,
        timeout=seconds,
        env=launcher_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["attack"]: r["result"] for r in results}


# ---------------------------------------------------------------- packet parsing
def packets(path: Path):
    """``(proto, src, sport, dst, dport, payload)`` of the TCP/UDP IPv4 frames captured."""
    data = path.read_bytes()
    i = 0
    while i + 4 <= len(data):
        (n,) = struct.unpack(">I", data[i : i + 4])
        frame = data[i + 4 : i + 4 + n]
        i += 4 + n
        if len(frame) < 34 or frame[12:14] != b"\x08\x00":
            continue
        ip = frame[14:]
        ihl = (ip[0] & 15) * 4
        total = struct.unpack(">H", ip[2:4])[0]
        if total:
            ip = ip[:total]
        proto = ip[9]
        src, dst = socket.inet_ntoa(ip[12:16]), socket.inet_ntoa(ip[16:20])
        l4 = ip[ihl:]
        if proto == 6 and len(l4) >= 20:
            payload = l4[(l4[12] >> 4) * 4 :]
        elif proto == 17 and len(l4) >= 8:
            payload = l4[8:]
        else:
            continue
        sport, dport = struct.unpack(">HH", l4[:4])
        yield proto, src, sport, dst, dport, payload


def captured(path: Path, keep, seconds: float = 60.0) -> list[tuple]:
    """The packets of the capture at ``path`` that ``keep`` accepts, read again until
    there is one (the capture, a process of its own, may lag behind what the test saw)
    or ``seconds`` passed (then none)."""
    deadline = time.monotonic() + seconds
    while True:
        found = [p for p in packets(path) if keep(p)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def start_capture(ns, path: Path) -> Proc:
    cap = Proc([PY, CAPTURE, str(path), "900"], ns)
    cap.wait_for("capturing", 60)
    return cap


def scheduler_port_free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(tmp, a, b, port, *, attacks=None, train_args=TRAIN_ARGS):
    """Scheduler + worker in A, worker in B; ``attacks(sched, workers)`` runs meanwhile."""
    env = sched_env(port, TOKEN, HVDKIT_SCHED_HOST=A_IP, HVDKIT_SCHED_TIMEOUT=120)
    sched = Proc([SCHEDULER_SH], a, env, tmp)
    workers = []
    try:
        sched.wait_for("scheduler listening on", 60)
        workers.append(Proc([WORKERS_SH, "1", PY, TRAIN, str(tmp), *train_args], b, env, tmp))
        if attacks is None:
            workers.append(Proc([WORKERS_SH, "1", PY, TRAIN, str(tmp), *train_args], a, env, tmp))
        else:
            attacks(sched, workers, env)
        codes = [p.finish() for p in (sched, *workers)]
    finally:
        for p in (sched, *workers):
            p.stop()
    return codes, sched, workers


def test_outsiders_are_refused_and_the_job_is_undisturbed(tmp_path, three_hosts):
    a, b, c = three_hosts
    # An undisturbed run first: the reference weights.
    ref_dir = tmp_path / "reference"
    ref_dir.mkdir()
    codes, sched, _ = run_job(ref_dir, a, b, scheduler_port_free(), train_args=QUICK)
    assert codes == [0, 0, 0], sched.text[-3000:]
    reference = weights(ref_dir)

    run_dir = tmp_path / "attacked"
    run_dir.mkdir()
    cap_a, cap_b = tmp_path / "a.frames", tmp_path / "b.frames"
    captures = [start_capture(a, cap_a), start_capture(b, cap_b)]
    port = scheduler_port_free()
    seen: dict[str, dict] = {}

    def attacks(sched, workers, env):
        sched.wait_for("worker 1/2 registered", 120)
        # The registration worker B sent, as captured on A (the capture, a process of
        # its own, may write it only after the scheduler said so: read until it is there).
        regs = [
            p[5]
            for p in captured(
                cap_a,
                lambda p: p[0] == 6 and p[1] == B_IP and p[4] == port and p[5].startswith(b'{"b"'),
            )
        ]
        assert regs, "the capture did not see worker B's registration within 60 s"
        captured_reg = tmp_path / "registration.line"
        captured_reg.write_bytes(regs[0].split(b"\n")[0])
        seen["register"] = outsider(c, "register", A_IP, port, captured_reg)
        seen["burst-tcp"] = outsider(c, "burst-tcp", A_IP, port)
        # Slow clients hold connections while the second worker registers.
        slow = Proc([PY, OUTSIDER, "slow-tcp", A_IP, str(port)], c)
        time.sleep(1.0)
        workers.append(Proc([WORKERS_SH, "1", PY, TRAIN, str(run_dir), *TRAIN_ARGS], a, env))
        line = sched.wait_for("rendezvous on port", 120)
        rdv_port = int(line.split("rendezvous on port ")[1].split()[0])
        seen["http"] = outsider(c, "http", A_IP, rdv_port)
        # The rendezvous server still answers the job's own machine.
        seen["rendezvous-after"] = outsider(a, "probe", A_IP, rdv_port)
        # Worker A's program sends heartbeats to its worker on A's loopback.
        workers[1].wait_for(" of 2 (local", 120)
        beats: dict[int, list[bytes]] = defaultdict(list)
        for *_, dport, payload in captured(
            cap_a, lambda p: p[0] == 17 and p[1] == p[3] == "127.0.0.1" and p[5].startswith(b'{"b"')
        ):
            beats[dport].append(payload)
        assert len(beats) == 1, f"expected one heartbeat receiver on A, saw ports {list(beats)}"
        ((monitor_port, datagrams),) = beats.items()
        captured_beats = tmp_path / "heartbeats.hex"
        captured_beats.write_text("\n".join(d.hex() for d in datagrams[:5]))
        seen["udp"] = outsider(a, "udp", "127.0.0.1", monitor_port, captured_beats)
        assert slow.finish(120) == 0
        seen["slow-tcp"] = {
            json.loads(ln)["attack"]: json.loads(ln)["result"]
            for ln in slow.lines
            if ln.startswith("{")
        }

    try:
        codes, sched, workers = run_job(run_dir, a, b, port, attacks=attacks)
    finally:
        for cap in captures:
            cap.stop()
    log = sched.text
    assert codes == [0, 0, 0], log[-4000:]
    assert "assigned 2 ranks on 2 host(s)" in log

    # --- registration: each refused (the replies) and logged (the scheduler)
    reg = seen["register"]
    assert '"refused"' in reg["register-without-token"], reg
    assert "bad job token" in reg["register-without-token"], reg
    assert reg["register-wrong-token"] == json.dumps(
        {"type": "refused", "reason": "bad job token"}
    ), reg
    assert reg["register-replayed"] == reg["register-wrong-token"], reg
    refusals = [ln for ln in log.splitlines() if f"refused a worker from {C_IP}" in ln]
    assert len([ln for ln in refusals if "bad job token" in ln]) >= 3, log[-4000:]
    # --- malformed input to the scheduler: refused, logged, and worker A still registered
    assert len([ln for ln in refusals if "not a registration" in ln]) >= 3, log[-4000:]
    assert "no registration within 10 s" in log  # the slow clients, dropped
    assert all("closed by the server" in r for r in seen["slow-tcp"]["tcp-slow-loris"]), seen
    assert "worker 2/2 registered" in log
    # --- the rendezvous server: the outsider is refused, the job's machine is served
    http = seen["http"]
    for attack in ("http-put-key", "http-get-key", "http-delete-scope"):
        assert http[attack] == "HTTP/1.0 403 Forbidden", http
    # a request the server refuses before reading all of it may end in a reset
    # that drops the 403 on the client's side; nothing else is acceptable
    burst = collections.Counter(http["http-burst"])
    assert set(burst) <= {"HTTP/1.0 403 Forbidden", "reset by the server"}, http
    assert burst["HTTP/1.0 403 Forbidden"] >= len(http["http-burst"]) // 2, http
    assert f"rendezvous server refused a request from {C_IP}: not a machine of this job" in log
    assert seen["rendezvous-after"]["http-probe"] == "HTTP/1.0 404 Not Found", seen
    # --- heartbeats: replays and garbage refused and logged by worker A, job not stalled
    wa = workers[1].text
    assert "refused a heartbeat from 127.0.0.1" in wa and "replayed" in wa, wa[-3000:]
    assert "malformed" in wa, wa[-3000:]
    assert "stalled" not in wa + log
    # --- the job: same weights as the undisturbed run
    for w in weights(run_dir):
        np.testing.assert_allclose(w, reference[0], rtol=1e-6, atol=1e-7)

    # --- the wire: no frame, and no TCP/UDP stream, carries the token
    flows: dict[tuple, bytearray] = defaultdict(bytearray)
    counted = defaultdict(int)
    for path in (cap_a, cap_b):
        for proto, src, sport, dst, dport, payload in packets(path):
            assert TOKEN.encode() not in payload, (src, sport, dst, dport)
            flows[(proto, src, sport, dst, dport)] += payload
            if payload.startswith(b'{"b"'):
                counted["tcp" if proto == 6 else "udp"] += 1
    for flow, stream in flows.items():
        assert TOKEN.encode() not in stream, flow
    # the capture saw the signed traffic it vouches for
    assert counted["tcp"] >= 4 and counted["udp"] >= 10, dict(counted)


def test_hvdkitrun_rendezvous_is_loopback_only(tmp_path, three_hosts):
    """A one-machine hvdkitrun job: Horovod's rendezvous server answers on loopback only."""
    a, _, c = three_hosts
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, sys, time, hvdkit\n"
        "hvdkit.init()\n"
        "if hvdkit.rank() == 0:\n"
        "    print('RDV', os.environ['HOROVOD_GLOO_RENDEZVOUS_ADDR'],\n"
        "          os.environ['HOROVOD_GLOO_RENDEZVOUS_PORT'], flush=True)\n"
        "    deadline = time.monotonic() + 120\n"
        "    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:\n"
        "        time.sleep(0.2)\n"
    )
    done = tmp_path / "done"
    job = Proc(
        [str(VENV_BIN / "hvdkitrun"), "-np", "2", "--gloo", PY, str(probe), str(done)],
        a,
        cwd=tmp_path,
    )
    try:
        line = job.wait_for("RDV ", 180)
        addr, port = line.split("RDV ")[1].split()
        assert addr == "127.0.0.1"
        # From the outsider and from A's own network address: nothing listens there.
        for ns, host in ((c, A_IP), (a, A_IP)):
            result = outsider(ns, "http", host, int(port))
            assert result["http-put-key"] == "ConnectionRefusedError", (ns, result)
        # On loopback the server answers the job's machine.
        result = outsider(a, "probe", "127.0.0.1", int(port))
        assert result["http-probe"] == "HTTP/1.0 404 Not Found", result
        done.write_text("")
        assert job.finish(180) == 0, job.text[-3000:]
    finally:
        job.stop()

"""The real scheduler with simulated workers over the real protocol (benchmarks/control_plane.py).

Six workers on three simulated machines (two loopback addresses each)
register with the job token, get their ranks, lose one of them (its
connection closes), regroup in-process, and are preempted: each step's
messages are counted and their order checked in every worker. The same code
measures the times at 16 to 1,000 workers (docs/performance.md, "Recovery at
scale"); here it runs in seconds and asserts no time.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from control_plane import TOKEN, SimWorker, free_port, wait_all
from listener_targets import wait_for

from hvdkit import config
from hvdkit.launch import auth, protocol
from hvdkit.launch.scheduler import Scheduler

N, PER_HOST = 6, 2
WAIT_S = 120.0  # only against a hang: nothing below is timed


def test_register_regroup_and_preempt_with_simulated_workers():
    port = free_port()
    sched = Scheduler(
        "127.0.0.1", port, N, TOKEN, WAIT_S, max_restarts=1, min_workers=N // 2, elastic=True
    )
    codes: list[int] = []
    runner = threading.Thread(target=lambda: codes.append(sched.run()), daemon=True)
    runner.start()
    silence = protocol.silence_limit(60.0)
    workers = [SimWorker(i, f"127.0.0.{2 + i // PER_HOST}", port, silence) for i in range(N)]
    try:
        for w in workers:
            w.start()
        assert wait_all(workers, "assign", 0, 0.0, WAIT_S) is not None
        first = {w.index: w.assigns[0] for w in workers}
        assert sorted(a["rank"] for a in first.values()) == list(range(N))
        assert {a["size"] for a in first.values()} == {N}
        assert {a["local_size"] for a in first.values()} == {PER_HOST}
        assert {(a["cross_size"], a["round"], a["inplace"]) for a in first.values()} == {
            (N // PER_HOST, 0, False)
        }
        # The two workers of a machine hold consecutive ranks (contiguous per host).
        by_host: dict[str, list[int]] = {}
        for w in workers:
            by_host.setdefault(w.source, []).append(first[w.index]["rank"])
        assert all(max(r) - min(r) == len(r) - 1 for r in by_host.values())

        # One worker's machine is lost: the others regroup in-process as round 1.
        victim = workers[3]
        survivors = [w for w in workers if w is not victim]
        victim.lose()
        assert wait_all(survivors, "go", 1, 0.0, WAIT_S) is not None
        second = [w.assigns[1] for w in survivors]
        assert sorted(a["rank"] for a in second) == list(range(N - 1))
        assert {(a["size"], a["round"], a["inplace"], a["lost"]) for a in second} == {
            (N - 1, 1, True, True)
        }
        assert sum(w.said["ready"] for w in survivors) == N - 1

        # SIGTERM to the scheduler (its handler's effect, as run() is not on the main
        # thread): every worker is told to stop at a common step, then the job's end.
        sched.sigterm.append("SIGTERM")
        assert wait_all(survivors, "done", None, 0.0, WAIT_S) is not None
        runner.join(WAIT_S)
        assert codes == [config.EXIT_PREEMPTED]
        for w in survivors:
            kinds = [(k, r) for _, k, r in w.got]
            assert kinds == [("assign", 0), ("assign", 1), ("go", 1), ("preempt", 1), ("done", -1)]
            assert w.said == Counter(ready=1, exit=1)
            assert not w.error
        # Per event, one message to each survivor and (for ready, exit) one back: O(N).
        got = Counter(k for w in survivors for _, k, _ in w.got)
        assert got == Counter(assign=2 * (N - 1), go=N - 1, preempt=N - 1, done=N - 1)
        assert [k for _, k, _ in victim.got] == ["assign"]
    finally:
        for w in workers:
            if w.ch is not None:
                w.ch.close()
        wait_for(lambda: not runner.is_alive(), 30)


def _secured_pair() -> tuple[protocol.Channel, protocol.Channel]:
    a, b = socket.socketpair()
    one, two = protocol.Channel(a), protocol.Channel(b)
    s, w = auth.channel_keys(TOKEN, config.SCHEDULER), auth.channel_keys(TOKEN, config.WORKER)
    one.secure(s.send, s.receive, "session")
    two.secure(w.send, w.receive, "session")
    return one, two


def test_one_thread_sends_every_channels_keep_alives_and_skips_a_peer_that_reads_nothing():
    """Keep-alives of many channels come from one thread; a full send buffer is not waited on."""
    pairs = [_secured_pair() for _ in range(20)]
    stuck, stuck_peer = _secured_pair()
    stuck.sock.setblocking(False)  # its peer reads nothing: fill what the kernel holds
    try:
        while True:
            stuck.sock.send(b"x" * 65536)
    except BlockingIOError:
        pass
    stuck.sock.setblocking(True)
    every = 0.013  # an interval no other test uses: the thread below is this test's
    try:
        for ours, _ in pairs:
            ours.keep_alive(60.0, every_s=every)
        stuck.keep_alive(60.0, every_s=every)
        assert wait_for(lambda: all(ours._sent >= 3 for ours, _ in pairs), WAIT_S)
        assert stuck._sent == 0  # skipped each time, so the others were never held up
        name = f"hvdkit-keepalive-{every:g}s"
        assert [t.name for t in threading.enumerate() if t.name == name] == [name]
        ours, theirs = pairs[0]
        ours.send(type="done", code=0)
        assert theirs.recv(time.monotonic() + WAIT_S) == {"type": "done", "code": 0}
        assert theirs.dropped == 0  # every keep-alive before it was authentic and skipped
    finally:
        for ours, theirs in [*pairs, (stuck, stuck_peer)]:
            ours.close()
            theirs.close()

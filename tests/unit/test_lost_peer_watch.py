"""A survivor leaves a world that lost a rank at the scheduler's word
(hvdkit/fault/_next_world.py, hvdkit/_comm/sockets.py).

The multi-process side: tests/multiproc/collectives_worker.py (a wait that nothing else
ends fails once the peer abandons; Gloo and MPI), and the elastic jobs of
tests/test_elastic_mp.py and tests/test_chaos_three_faults_mp.py.
"""

from __future__ import annotations

import json
import socket

import pytest

from hvdkit import config, runtime
from hvdkit._comm import meeting as _meeting
from hvdkit._comm import sockets as _sockets
from hvdkit.fault import _next_world

Watch = _next_world.LostPeerWatch


@pytest.fixture
def world(monkeypatch, tmp_path):
    """This rank is in round 2 of a running elastic job; ``calls`` counts abandons."""
    monkeypatch.setenv(config.RESTART_COUNT, "2")
    monkeypatch.setattr(runtime, "started", lambda: True)
    calls = []
    monkeypatch.setattr(runtime, "abandon", lambda: calls.append(1) or 3)
    monkeypatch.setattr(Watch, "ended", None)
    monkeypatch.setattr(Watch, "_recovering", False)

    def assign(round_: int, lost: bool) -> None:
        body = {"round": round_, "env": {}, "lost": lost}
        _meeting.write(str(tmp_path), _meeting.ASSIGN, json.dumps(body))

    return str(tmp_path), assign, calls


def test_a_world_without_a_lost_rank_is_abandoned_once(world):
    folder, assign, calls = world
    assert not Watch.check(folder)  # no assignment yet
    assign(3, lost=True)
    assert Watch.check(folder)
    assert (calls, Watch.ended) == ([1], 3)
    assert not Watch.check(folder)  # once per world
    assert calls == [1]


def test_a_growing_world_is_left_at_the_agreed_step_not_abandoned(world):
    folder, assign, calls = world
    assign(3, lost=False)
    assert not Watch.check(folder)
    assert calls == []


def test_this_worlds_own_assignment_is_no_reason_to_leave(world):
    folder, assign, calls = world
    assign(2, lost=True)  # the assignment this rank already joined
    assert not Watch.check(folder)
    assert calls == []


def test_nothing_is_abandoned_while_the_rank_recovers_or_without_a_runtime(world, monkeypatch):
    folder, assign, calls = world
    assign(3, lost=True)
    with Watch.recovering():
        assert not Watch.check(folder)  # the main thread shuts down and joins round 3
    assert calls == [] and Watch.ended is None
    monkeypatch.setattr(runtime, "started", lambda: False)
    assert not Watch.check(folder)
    assert calls == []


def test_recovering_forgets_the_abandoned_world(world):
    folder, assign, calls = world
    assign(3, lost=True)
    assert Watch.check(folder)
    with Watch.recovering():
        pass
    assert Watch.ended is None  # the next world may be abandoned in its turn


def test_shut_down_ends_the_connections_opened_since_and_nothing_else():
    older = socket.create_server(("127.0.0.1", 0))
    kept_client = socket.create_connection(older.getsockname())
    kept_server, _ = older.accept()
    before = _sockets.tcp_inodes()
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    try:
        opened = _sockets.opened_since(before)
        assert len(opened) == 2  # both ends of the new connection; not the listener
        assert _sockets.shut_down(opened) == 2
        assert client.recv(1) == accepted.recv(1) == b""  # ended: end-of-file at once
        kept_server.sendall(b"x")
        assert kept_client.recv(1) == b"x"  # the older connection still works
    finally:
        for s in (older, kept_client, kept_server, server, client, accepted):
            s.close()

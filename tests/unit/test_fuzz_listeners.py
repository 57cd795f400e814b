"""Every listener's parser, fuzzed (issue 20): hostile input never escapes as an exception.

For each listener of a job (the scheduler's registration line, a worker's
signed messages, Horovod's rendezvous HTTP behind hvdkit's guard, a heartbeat
receiver) hypothesis draws ``FUZZ_CASES`` inputs from ``tests/listener_targets.py``:
random bytes, JSON of every shape, envelopes with wrong fields, ``[[[``
nesting to 3000 deep (closed or not), non-UTF-8, lines up to 300 KB, integers
over Python's 4300-digit limit, and mutations of genuine messages. After
them: no exception escaped any thread, every log line the listener wrote is
one short line without a traceback, what the listener keeps between cases
is within its bounds, and it still serves a genuine client.
``benchmarks/fuzz_listeners.py`` runs the same for longer.
"""

from __future__ import annotations

import pytest
from listener_targets import TARGETS, HeartbeatTarget, RendezvousTarget, run_cases, watching

from hvdkit.launch import auth, guard, protocol

FUZZ_CASES = 150  # per listener


@pytest.fixture(params=TARGETS, ids=lambda t: t.name.replace(" ", "-"))
def target(request):
    t = request.param()
    yield t
    t.close()


def test_listener_survives_hostile_input(target):
    with watching() as watch:
        outcomes = run_cases(target, FUZZ_CASES)
        assert target.answers(), f"{target.name}: no longer serves a genuine client"
        state = target.state()
    assert watch.uncaught == [], watch.uncaught
    assert watch.bad_lines() == [], watch.bad_lines()
    assert sum(outcomes.values()) >= FUZZ_CASES // 2, outcomes  # the cases did run
    lost = [o for o in outcomes if o.startswith(("lost", "no challenge", "raised"))]
    assert lost == [], outcomes
    if isinstance(target, HeartbeatTarget):
        assert target.wrong == [], target.wrong
        assert state["ranks"] == 1 and state["refusal kinds"] <= len(auth.AUTH_KINDS) + 1
        assert state["sessions"] <= 2  # the genuine one (and nothing forged got in)
    elif isinstance(target, RendezvousTarget):
        assert state["refusal kinds"] <= len(guard.REFUSAL_KINDS) + 1, state
        assert state["stored keys"] <= guard.MAX_KEYS
    elif "handshakes in progress" in state:
        assert state["handshakes in progress"] == 0, state
        assert state["refusal kinds"] <= len(protocol.REFUSAL_KINDS) + 1, state
    else:
        assert state["buffered bytes"] == 0, state

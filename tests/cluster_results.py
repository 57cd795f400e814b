"""What tests/test_spark.py and tests/test_ray.py read from their driver script's results.

``seen`` is a file's fixture: ``got`` (the driver's JSON: case -> value or error),
``output`` (the driver's console), ``code`` (its exit status).
"""

from __future__ import annotations

import re


def value(seen: dict, name: str):
    """Case ``name``'s return value; fails naming the case's error or the driver's end."""
    entry = seen["got"].get(name)
    assert entry is not None, f"{name} not reached; exit {seen['code']}\n{seen['output'][-4000:]}"
    assert "value" in entry, f"{name} failed: {entry['error']}\n{seen['output'][-3000:]}"
    return entry["value"]


def error(seen: dict, name: str) -> dict:
    """Case ``name``'s error (``error``, ``type``, ``seconds``); fails if it returned."""
    entry = seen["got"].get(name)
    assert entry is not None, f"{name} not reached\n{seen['output'][-4000:]}"
    assert "error" in entry, f"{name} did not fail: {entry}"
    return entry


def assert_frozen_rank_resumed(seen: dict, stall_s: float) -> list:
    """The ``frozen`` case: named at the stall timeout, resumed from a checkpoint, same weights."""
    assert seen["frozen"], "no rank was frozen (no 'holding' marker)"
    plain, resumed = value(seen, "uninterrupted"), value(seen, "frozen")
    assert resumed[0]["resumed_from"] >= 5, resumed
    assert {r["fingerprint"] for r in resumed} == {plain[0]["fingerprint"]}
    said = rf"rank 1 sent no heartbeat for \d+ s \(the stall timeout is {stall_s:g} s, "
    assert re.search(said + "HVDKIT_STALL_TIMEOUT", seen["output"]), seen["output"][-3000:]
    return resumed

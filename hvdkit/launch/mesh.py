"""hvdkit's batched Gloo full mesh: its keys, the answer a reader gets, where readers wait.

The server side of hvdkit's Horovod patch ``horovod-0.28.1-gloo-batched-mesh.patch``
(:mod:`.guard` serves it). In a scope of ``n`` ranks each rank PUTs one value,
``hvdkit_addrs_<rank>`` (:data:`ADDRESSES_KEY`): its host name, a newline and its
``n - 1`` Gloo pair addresses, one equal-sized slice per peer in peer order. Then it
makes one GET, ``hvdkit_mesh_<rank>?size=n&wait_ms=W`` (:data:`MESH_KEY`), which the
server holds until all ``n`` values are there (:class:`MeshBoard`), or ``W`` ms (at
most :data:`MESH_WAIT_CAP_S`), and answers with :func:`mesh_answer` (or ``404
missing i,j,...``). ``GET <scope>/hvdkit_mesh`` (:data:`MESH_PROBE_KEY`) answers
:data:`MESH_PROTOCOL`: Horovod's own server answers 404, and the patched rank then
keeps Gloo's own exchange.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Mapping
from urllib.parse import parse_qs, urlsplit

MESH_PROBE_KEY = "hvdkit_mesh"
MESH_PROTOCOL = b"hvdkit-mesh-1"
ADDRESSES_KEY = "hvdkit_addrs_"  # + rank: PUT host name, "\n", n - 1 address slices
MESH_KEY = "hvdkit_mesh_"  # + rank + "?size=n&wait_ms=W": GET the slices meant for rank
MESH_WAIT_CAP_S = 10.0  # one mesh read waits at most this long (within the request deadline)


def mesh_answer(values: Mapping[int, bytes], rank: int, n: int) -> bytes:
    """What reader ``rank`` of a scope of ``n`` ranks gets back from a mesh read.

    Each of the ``n`` values is ``host + b"\\n" + addresses``, the addresses
    ``n - 1`` equal slices, one per peer in rank order (a rank keeps none for
    itself): peer ``i`` meant slice ``rank`` for a reader below it and slice
    ``rank - 1`` for a reader above it. The answer is the reader's local rank
    (how many ranks below it share its host), a newline, and the slice each peer
    meant for it, in peer order: ``(n - 1) * slice`` bytes.

    Example: three ranks on hosts a, a, b; peer i's slice for j is ``b"i>j"``::

        >>> values = {0: b"a\\n0>10>2", 1: b"a\\n1>01>2", 2: b"b\\n2>02>1"}
        >>> mesh_answer(values, 1, 3)
        b'1\\n0>12>1'
        >>> mesh_answer(values, 2, 3)
        b'0\\n0>21>2'

    Raises:
        ValueError: a value has no host line, or its addresses do not split into
            ``n - 1`` equal slices (the message names its rank and length).
    """
    parts, own_host = [], None
    for i in range(n):
        value = values[i]
        cut = value.find(b"\n")
        body = len(value) - cut - 1
        if cut < 0 or (n > 1 and (body == 0 or body % (n - 1))):
            raise ValueError(
                f"rank {i}'s value ({len(value)} bytes) is not a host line and {n - 1} "
                "equal address slices"
            )
        if i == rank:
            own_host = value[:cut]
            continue
        size = body // (n - 1)
        start = cut + 1 + size * (rank if rank < i else rank - 1)
        parts.append(value[start : start + size])
    local = sum(1 for i in range(rank) if values[i].startswith(own_host + b"\n"))
    return b"%d\n" % local + b"".join(parts)


def mesh_query(key: str, max_size: int) -> tuple[int, int, float]:
    """``(rank, size, wait in s)`` of a mesh read's key ``hvdkit_mesh_<rank>?size=n&wait_ms=W``.

    Raises:
        ValueError: the key is not of that shape, ``rank`` is not below ``size``, or
            ``size`` is above ``max_size``.
    """
    parts = urlsplit(key)
    query = parse_qs(parts.query, strict_parsing=True)
    rank = int(parts.path[len(MESH_KEY) :])
    (size,), (wait_ms,) = query["size"], query["wait_ms"]
    n, wait = int(size), int(wait_ms)
    if not (0 <= rank < n <= max_size and wait >= 0):
        raise ValueError(f"rank {rank} of {n}, wait {wait} ms")
    return rank, n, wait / 1000


class MeshBoard:
    """Which ranks of each scope have published their addresses; the mesh reads wait here.

    A read waits on its scope's condition, notified only when the scope's count
    reaches a size some read waits for: a scope of ``n`` ranks wakes its readers
    once, not at each of its ``n`` values (``n²`` wake-ups).
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._keys: dict[str, set[str]] = {}  # scope -> its address keys published
        self._waits: dict[str, tuple[threading.Condition, Counter]] = {}  # scope -> (cond, sizes)

    def published(self, scope: str, key: str) -> None:
        with self._lock:
            keys = self._keys.setdefault(scope, set())
            keys.add(key)
            waiting = self._waits.get(scope)
            if waiting is not None and waiting[1][len(keys)]:
                waiting[0].notify_all()

    def forget(self, scope: str | None = None, key: str | None = None) -> None:
        """Forget one key of ``scope``, all of ``scope`` (``key`` None), or everything."""
        with self._lock:
            if scope is None:
                self._keys.clear()
            elif key is None:
                self._keys.pop(scope, None)
            else:
                self._keys.get(scope, set()).discard(key)

    def wait(self, scope: str, n: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until ``scope`` holds ``n`` address keys; whether it does."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if scope not in self._waits:
                self._waits[scope] = (threading.Condition(self._lock), Counter())
            cond, sizes = self._waits[scope]
            sizes[n] += 1
            try:
                while len(self._keys.get(scope, ())) < n:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    cond.wait(left)
                return True
            finally:
                sizes[n] -= 1
                if not +sizes:
                    del self._waits[scope]

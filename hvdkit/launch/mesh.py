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
from collections.abc import Mapping, Sequence
from urllib.parse import parse_qs, urlsplit

import numpy as np

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
        cut = _host_end(value, i, n)
        body = len(value) - cut - 1
        if i == rank:
            own_host = value[:cut]
            continue
        size = body // (n - 1)
        start = cut + 1 + size * (rank if rank < i else rank - 1)
        parts.append(value[start : start + size])
    local = sum(1 for i in range(rank) if values[i].startswith(own_host + b"\n"))
    return b"%d\n" % local + b"".join(parts)


def _host_end(value: bytes, i: int, n: int) -> int:
    """Where rank ``i``'s host line ends in its ``value``: the index of its newline.

    Raises:
        ValueError: no host line, or the addresses do not split into ``n - 1`` equal slices.
    """
    cut = value.find(b"\n")
    body = len(value) - cut - 1
    if cut < 0 or (n > 1 and (body == 0 or body % (n - 1))):
        raise ValueError(
            f"rank {i}'s value ({len(value)} bytes) is not a host line and {n - 1} "
            "equal address slices"
        )
    return cut


class MeshGrid:
    """A complete scope's ``n`` values parsed once: any reader's answer in a few C copies.

    :func:`mesh_answer` of one reader walks all ``n`` values in Python; the ``n``
    readers of a scope woken together made that ``n²`` steps (a million at 1,000
    ranks) for every scope. The grid parses the values once: the host lines give
    every rank's local rank (one pass, counting each host's ranks so far), and
    when every rank's slices have one size ``s`` (Gloo's addresses all do) the
    address parts are one array ``addresses[i, k]`` of shape ``(n, n - 1, s)``,
    peer ``i``'s ``k``-th slice. Reader ``r``'s answer is then its local rank
    line, ``addresses[:r, r - 1]`` and ``addresses[r + 1:, r]``: the same bytes
    as :func:`mesh_answer`'s. Slices of unequal sizes are answered by
    :func:`mesh_answer` itself. Memory: the addresses once more (136 MB for a
    scope of 1,000 ranks), while the scope is unchanged (:class:`MeshBoard`).

    Example (three ranks on hosts a, a, b, as :func:`mesh_answer`'s)::

        >>> grid = MeshGrid([b"a\\n0>10>2", b"a\\n1>01>2", b"b\\n2>02>1"])
        >>> bytes(grid.answer(1)), bytes(grid.answer(2)), grid.local_ranks
        (b'1\\n0>12>1', b'0\\n0>21>2', [0, 1, 0])
        >>> bytes(grid.answer(2, head=b"HEAD:"))
        b'HEAD:0\\n0>21>2'

    Raises:
        ValueError: as :func:`mesh_answer`, for the first value of the wrong shape.
    """

    def __init__(self, values: Sequence[bytes]):
        n = self.n = len(values)
        cuts = [_host_end(value, i, n) for i, value in enumerate(values)]
        seen: Counter = Counter()
        self.local_ranks = []
        for value, cut in zip(values, cuts, strict=True):
            host = value[:cut]
            self.local_ranks.append(seen[host])
            seen[host] += 1
        self._bodies = [len(value) - cut - 1 for value, cut in zip(values, cuts, strict=True)]
        self._total = sum(self._bodies)
        self.nbytes = self._total
        self._values: Sequence[bytes] | None = None
        self._addresses = None
        if n > 1 and len(set(self._bodies)) == 1:
            size = self._bodies[0] // (n - 1)
            self._addresses = np.empty((n, n - 1, size), np.uint8)
            for i, (value, cut) in enumerate(zip(values, cuts, strict=True)):
                self._addresses[i] = np.frombuffer(value, np.uint8, offset=cut + 1).reshape(
                    n - 1, size
                )
        else:  # a scope of one, or slices of unequal sizes
            self._values = values

    def length(self, rank: int) -> int:
        """Bytes of reader ``rank``'s answer."""
        line = len(b"%d\n" % self.local_ranks[rank])
        if self.n == 1:
            return line
        # each peer's slices are its body / (n - 1); a reader gets one of every peer's
        return line + (self._total - self._bodies[rank]) // (self.n - 1)

    def answer(self, rank: int, head: bytes = b"") -> bytes | bytearray:
        """``head`` and reader ``rank``'s answer, as :func:`mesh_answer` gives it, in one buffer."""
        if self._addresses is None:
            return head + mesh_answer(dict(enumerate(self._values)), rank, self.n)
        n, grid, size = self.n, self._addresses, self._addresses.shape[2]
        at = len(head) + len(b"%d\n" % self.local_ranks[rank])
        out = bytearray(at + (n - 1) * size)
        out[:at] = head + b"%d\n" % self.local_ranks[rank]
        view = np.frombuffer(out, np.uint8)[at:].reshape(n - 1, size)
        if rank > 0:  # the peers below it meant their slice rank - 1 for it
            view[:rank] = grid[:rank, rank - 1]
        if rank < n - 1:  # the peers above it, their slice rank
            view[rank:] = grid[rank + 1 :, rank]
        return out


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

    It also keeps each complete scope's :class:`MeshGrid`, parsed by the first of
    its readers (under :attr:`building`) for all of them, tagged with the store's
    version of the scope it was parsed from (:class:`.store.Scope`): a reader uses
    it only while the scope is at that version, and any value published or
    forgotten in the scope drops it, so at most one grid a scope, of the values
    the store holds, is kept.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._keys: dict[str, set[str]] = {}  # scope -> its address keys published
        self._waits: dict[str, tuple[threading.Condition, Counter]] = {}  # scope -> (cond, sizes)
        self._grids: dict[str, tuple[int, int, MeshGrid]] = {}  # scope -> (n, version, grid)
        self.building = threading.Lock()  # one parse at a time: readers woken together wait

    def cached(self, scope: str, n: int, version: int | None) -> MeshGrid | None:
        """The grid of ``scope`` parsed at ``version`` for ``n`` ranks, if kept."""
        kept = self._grids.get(scope)
        return kept[2] if kept is not None and kept[:2] == (n, version) else None

    def keep(self, scope: str, n: int, version: int, grid: MeshGrid) -> None:
        """Keep ``grid``, parsed from ``scope`` at ``version`` (call under the store's lock)."""
        with self._lock:
            self._grids[scope] = (n, version, grid)

    def grids_bytes(self) -> int:
        """Bytes of addresses the kept grids hold."""
        with self._lock:
            return sum(grid.nbytes for _, _, grid in self._grids.values())

    def published(self, scope: str, key: str) -> None:
        with self._lock:
            self._grids.pop(scope, None)
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
                self._grids.clear()
            elif key is None:
                self._keys.pop(scope, None)
                self._grids.pop(scope, None)
            else:
                self._keys.get(scope, set()).discard(key)
                self._grids.pop(scope, None)

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

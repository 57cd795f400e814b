"""The end-of-job weight comparison's files: what a rank writes, how the launcher compares them.

With ``hvdkitrun --check-weights`` (or ``HVDKIT_CHECK_WEIGHTS=1`` for the
scheduler/worker launch) the launcher names a folder in
``HVDKIT_WEIGHTS_DIR``. At a clean exit each rank writes
``rank.<r>.json`` there: per trainable variable an optimizer updated in the
process (deliberately local ones left out), its path and three float64
numbers, the sum of its values, a position-weighted sum and the sum of
absolute values (the scale). The launcher then groups the ranks whose
numbers agree to ``RTOL`` of the scale; more than one group means the ranks
ended with different models.

Example, the groups of three ranks where rank 2 trained alone:

    >>> a = {"variables": [["dense/kernel", 1.0, 2.0, 3.0]]}
    >>> b = {"variables": [["dense/kernel", 1.5, 2.0, 3.0]]}
    >>> groups({0: a, 1: a, 2: b})
    [[0, 1], [2]]

No TensorFlow here: the launcher reads these files.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re

from .. import config
from ..errors import LaunchError

RTOL = 1e-6  # as the same-start check: ranks may sum equal weights in another order
POSITION_WEIGHTS = 97  # the weighted sum's positions weigh 1..97 (hvdkit._same_start)
_SHOWN = 5  # variables named in a message
_NAME = re.compile(r"rank\.(\d+)\.json$")


def path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank.{rank}.json")


def write(folder: str, rank: int, variables: list[tuple[str, float, float, float]]) -> None:
    """Write rank ``rank``'s fingerprint: ``(path, sum, weighted sum, scale)`` per variable."""
    os.makedirs(folder, exist_ok=True)  # a host other than the launcher's has none yet
    tmp = path(folder, rank) + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"rank": rank, "variables": [list(v) for v in variables]}, f)
    os.replace(tmp, path(folder, rank))


def read(folder: str) -> dict[int, dict]:
    """The fingerprints the ranks wrote in ``folder``, by rank (unreadable files left out)."""
    found = {}
    for name in glob.glob(os.path.join(folder, "rank.*.json")):
        match = _NAME.search(name)
        try:
            with open(name) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if match and isinstance(data, dict) and isinstance(data.get("variables"), list):
            found[int(match.group(1))] = data
    return found


def clear(folder: str) -> None:
    """Remove the fingerprints of an earlier run from ``folder``."""
    for name in glob.glob(os.path.join(folder, "rank.*.json")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def scheduler_folder() -> str | None:
    """The folder the scheduler compares at the end, or ``None`` (``HVDKIT_CHECK_WEIGHTS`` unset).

    The ranks of every worker must reach it (the workers pass their environment
    on): one machine, or shared storage.

    Raises:
        LaunchError: ``HVDKIT_CHECK_WEIGHTS=1`` without ``HVDKIT_WEIGHTS_DIR``.
    """
    if not config.get_bool(config.CHECK_WEIGHTS, False, error=LaunchError):
        return None
    folder = config.get(config.WEIGHTS_DIR)
    if not folder:
        raise LaunchError(
            f"{config.CHECK_WEIGHTS}=1 under the scheduler/worker launch needs "
            f"{config.WEIGHTS_DIR}: a folder that every worker's ranks and the scheduler "
            "reach (one machine, or shared storage), set for the scheduler and every worker."
        )
    os.makedirs(folder, exist_ok=True)
    clear(folder)
    return folder


def check(folder: str, size: int | None = None) -> str | None:
    """:func:`verdict` of the files in ``folder``."""
    return verdict(read(folder), size)


def unseen(prints: dict[int, dict], size: int) -> str | None:
    """A note on the ranks of ``0..size-1`` that left no fingerprint (``None``: all did).

    Such ranks were not compared: they never called ``hvdkit.init()``, or wrote to a
    folder of another host.
    """
    missing = [r for r in range(size) if r not in prints]
    if not missing:
        return None
    return (
        f"{_ranks(missing)} of {size} wrote no weight fingerprint, so "
        f"{'no rank was' if len(missing) == size else 'only the others were'} compared: a "
        f"rank writes one at exit after hvdkit.init(), into {config.WEIGHTS_DIR}; give jobs "
        "on several hosts a folder they all share."
    )


def _equal(a: dict, b: dict) -> bool:
    va, vb = a["variables"], b["variables"]
    if [v[0] for v in va] != [v[0] for v in vb]:
        return False
    for (_, s1, w1, c1), (_, s2, w2, c2) in zip(va, vb, strict=True):
        scale = max(c1, c2, 1e-30)
        if abs(s1 - s2) > RTOL * scale or abs(w1 - w2) > RTOL * scale * POSITION_WEIGHTS:
            return False
    return True


def groups(prints: dict[int, dict]) -> list[list[int]]:
    """The ranks, grouped by equal fingerprints (each group's ranks ascending)."""
    out: list[list[int]] = []
    for r in sorted(prints):
        for g in out:
            if _equal(prints[g[0]], prints[r]):
                g.append(r)
                break
        else:
            out.append([r])
    return out


def differing_variables(a: dict, b: dict) -> list[str]:
    """Paths of the variables whose fingerprints differ between two ranks' files."""
    if [v[0] for v in a["variables"]] != [v[0] for v in b["variables"]]:
        return ["(the ranks trained different lists of variables)"]
    return [
        va[0]
        for va, vb in zip(a["variables"], b["variables"], strict=True)
        if not _equal({"variables": [va]}, {"variables": [vb]})
    ]


def verdict(prints: dict[int, dict], size: int | None = None) -> str | None:
    """A message naming the ranks that ended with other weights, or ``None`` if all agree.

    ``size``: the job's number of ranks, to name those that wrote nothing.
    """
    found = groups(prints)
    missing = [r for r in range(size or 0) if r not in prints]
    if len(found) <= 1:
        return None
    names = differing_variables(prints[found[0][0]], prints[found[1][0]])
    more = len(names) - _SHOWN
    shown = ", ".join(names[:_SHOWN]) + (f" and {more} more" if more > 0 else "")
    parts = "; ".join(_ranks(g) for g in found)
    note = f" ({_ranks(missing)} wrote no fingerprint)" if missing else ""
    return (
        f"the ranks ended with different trainable weights: {len(found)} groups ({parts}) "
        f"differ in {shown}{note}. Each group trained its own model: reduce the gradients "
        "with hvdkit.DistributedOptimizer or hvdkit.DistributedGradientTape on every rank, "
        "and broadcast rank 0's weights before training (docs/divergence.md)."
    )


def _ranks(ranks: list[int]) -> str:
    """``rank 2`` or ``ranks 0, 1``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)

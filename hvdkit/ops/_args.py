"""Argument checks shared by the ops in this package."""

from __future__ import annotations

import numbers

import numpy as np

from ..errors import ConfigurationError


def is_int(value) -> bool:
    """True for Python and numpy integers, False for bools (``True`` is not a count)."""
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, bool)


def positive_int(value, name: str, what: str, meaning: str) -> int:
    """``value`` as an int >= 1, or a ConfigurationError naming it.

    Args:
        value: the argument as the user passed it.
        name: its parameter name, e.g. ``"num_height"``.
        what: the calling function, e.g. ``"slice_patches"``.
        meaning: what the number counts, e.g. ``"patch rows"``.
    """
    if not is_int(value) or value < 1:
        raise ConfigurationError(
            f"{what}: {name}={value!r} must be a positive int (the number of {meaning}); "
            f"pass an int >= 1."
        )
    return int(value)


def rank_and_size(rank, size, what: str) -> tuple[int, int]:
    """Explicit ``rank``/``size``, or hvdkit's runtime values where left as ``None``."""
    from .. import runtime

    size = runtime.size() if size is None else positive_int(size, "size", what, "ranks")
    rank = runtime.rank() if rank is None else rank
    if not is_int(rank) or not 0 <= rank < size:
        raise ConfigurationError(
            f"{what}: rank={rank!r} is outside the job's ranks [0, {size}); pass a rank "
            f"between 0 and {size - 1}, or leave rank=None to use hvdkit.rank()."
        )
    return int(rank), size

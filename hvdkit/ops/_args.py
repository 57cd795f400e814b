"""Argument checks shared by the ops in this package."""

from __future__ import annotations

from .._validate import check_int, is_int
from ..errors import ConfigurationError


def positive_int(value, name: str, what: str, meaning: str) -> int:
    """``value`` as an int >= 1, or a ConfigurationError naming it.

    Args:
        value: the argument as the user passed it.
        name: its parameter name, e.g. ``"num_height"``.
        what: the calling function, e.g. ``"slice_patches"``.
        meaning: what the number counts, e.g. ``"patch rows"``.
    """
    return check_int(
        name,
        value,
        minimum=1,
        message=f"{what}: {name}={value!r} must be a positive int (the number of {meaning}); "
        "pass an int >= 1.",
    )


def rank_and_size(rank, size, what: str) -> tuple[int, int]:
    """Explicit ``rank``/``size``, or hvdkit's runtime values where left as ``None``."""
    from .. import runtime

    if rank is None or size is None:
        job_rank, job_size = runtime.job_rank_size(
            f"{what}: rank/size", "pass both rank= and size= explicitly."
        )
    size = job_size if size is None else positive_int(size, "size", what, "ranks")
    rank = job_rank if rank is None else rank
    if not is_int(rank) or not 0 <= rank < size:
        raise ConfigurationError(
            f"{what}: rank={rank!r} is outside the job's ranks [0, {size}); pass a rank "
            f"between 0 and {size - 1}, or leave rank=None to use hvdkit.rank()."
        )
    return int(rank), size

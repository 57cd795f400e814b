"""The one rule for integer arguments: what counts as an int, and the error when one is not.

(And its sibling for real numbers, :func:`is_number`.)

Counts, sizes, steps and seeds passed to hvdkit are accepted as Python or
numpy integers and returned as a plain ``int``. A ``bool`` is refused even
though Python calls it an int (``shard(ds, True, 0)`` is a slip, not one
shard), and so is a float, even an integral one such as ``2.0``::

    check_int("num_shards", 2, minimum=1, fix="pass hvdkit.size().")            # -> 2
    check_int("num_shards", np.int64(2), minimum=1, fix="pass hvdkit.size().")  # -> 2
    check_int("num_shards", True, minimum=1, fix="pass hvdkit.size().")
    # ConfigurationError: num_shards=True is not an integer; pass hvdkit.size().

Each caller keeps its own error class and, where it has one, its own message.
This module imports only :mod:`hvdkit.errors`, so every layer may use it.
"""

from __future__ import annotations

import numbers
from typing import Any

from .errors import ConfigurationError, HvdkitError

__all__ = ["is_int", "is_number", "check_int"]


def is_int(value: Any) -> bool:
    """True for Python and numpy integers; False for bools, floats and everything else.

    numpy registers its integer types (``np.int64``, ``np.uint8``, ...) as
    :class:`numbers.Integral`; ``np.bool_`` and floats are not registered.
    """
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """True for Python and numpy ints and floats; False for bools and everything else.

    The one test for "a number but not a bool" (factors, seconds, fractional
    epochs): ``np.float32(0.5)`` and ``np.float64(0.5)`` pass alike, ``True``
    and ``np.True_`` do not.
    """
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = 0,
    fix: str = "",
    error: type[HvdkitError] = ConfigurationError,
    message: str | None = None,
) -> int:
    """``value`` as an ``int`` that is at least ``minimum``, or ``error`` naming it.

    Args:
        name: the argument's name as the user wrote it, e.g. ``"num_shards"``.
        value: the argument as passed.
        minimum: the smallest value allowed; ``None`` checks only that it is an
            integer (the caller checks the range with its own message).
        fix: what to pass instead; ends the default messages after a ``"; "``.
        error: the :class:`~hvdkit.errors.HvdkitError` subclass to raise.
        message: the whole message for either failure, in place of the default
            ``"{name}={value!r} is not an integer; {fix}"`` and
            ``"{name}={value} must be at least {minimum}; {fix}"``.

    Returns:
        ``int(value)``.

    Raises:
        error: ``value`` is not an integer (a bool or a float is not), or is
            below ``minimum``.

    Example:
        >>> check_int("epoch", np.int64(3), minimum=0, fix="count epochs from 0.")
        3
    """
    tail = f"; {fix}" if fix else "."
    if not is_int(value):
        raise error(message or f"{name}={value!r} is not an integer{tail}")
    if minimum is not None and value < minimum:
        raise error(message or f"{name}={value} must be at least {minimum}{tail}")
    return int(value)

"""Which gradients travel together: the buckets of the gradient allreduce.

The backward pass produces gradients from the last layer to the first. A
single allreduce of all of them can start only once the *first* layer's
gradient exists, after the whole backward pass. Buckets start earlier: each
is its own grouped allreduce, which Horovod starts as soon as that bucket's
gradients exist, while the backward pass computes the rest (the same idea as
PyTorch DDP's gradient buckets).

Two ways to form them, both returning lists of positions in the gradient list:

* :func:`by_bytes` (hvdkit's default): walk the list from the end (the last
  layer first) and close a bucket once it holds ``bucket_bytes``. A model
  whose gradients are smaller than one bucket keeps a single allreduce.
* :func:`horovod_groups`: Horovod's ``groups`` argument of
  ``DistributedOptimizer`` / ``DistributedGradientTape``, with Horovod's
  meaning (an int splits the gradients, in list order, into that many groups
  as even as possible; a list of lists of variables puts each inner list in
  one group and every other gradient in a group of its own).

Example (four gradients of 4, 4, 1 and 8 MB, ``bucket_bytes`` = 8 MB)::

    >>> by_bytes([4 << 20, 4 << 20, 1 << 20, 8 << 20], 8 << 20)
    [[3], [2, 1, 0]]
    >>> horovod_groups(2, present=[0, 1, 2, 3])
    [[0, 1], [2, 3]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import _compat, config
from .._validate import is_int
from ..errors import ConfigurationError


def by_bytes(nbytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Buckets of positions, last gradient first, each closed at ``bucket_bytes``.

    Args:
        nbytes: size in bytes of each gradient, in the model's order.
        bucket_bytes: a bucket is closed once it holds at least this many
            bytes; ``0`` gives one bucket per gradient.

    Returns:
        Lists of positions covering ``range(len(nbytes))`` exactly once, in
        the order the backward pass completes them (the last positions first).
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    held = 0
    for i in reversed(range(len(nbytes))):
        current.append(i)
        held += nbytes[i]
        if held >= bucket_bytes:
            buckets.append(current)
            current, held = [], 0
    if current:
        buckets.append(current)
    return buckets


def check_bucket_bytes(value: Any, what: str) -> int | None:
    """``None`` (the default) or an int >= 0, else an error naming ``what`` and the fix."""
    if value is None or (is_int(value) and value >= 0):
        return None if value is None else int(value)
    raise ConfigurationError(
        f"{what}: bucket_bytes={value!r} is not a size; give an int >= 0 (bytes per "
        f"gradient bucket; 0 = one allreduce per gradient), or None for the default "
        f"({config.DEFAULT_BUCKET_BYTES} bytes)."
    )


def check_groups(groups: Any, num_groups: Any, what: str) -> Any:
    """Horovod's ``groups`` / ``num_groups`` pair reduced to one value, checked.

    ``num_groups`` is Horovod's older name for an int ``groups``; ``0`` means unset.

    Returns:
        ``None`` (no explicit groups), an int >= 1, or a list of lists of variables.
    """
    if not (is_int(num_groups) and num_groups >= 0):
        raise ConfigurationError(
            f"{what}: num_groups={num_groups!r} must be an int >= 0 (0 = no explicit "
            "groups); Horovod replaced it by groups=<int>, which hvdkit accepts too."
        )
    if num_groups and groups is not None and groups != num_groups:
        raise ConfigurationError(
            f"{what}: num_groups={num_groups!r} and groups={groups!r} disagree; pass only "
            "groups (num_groups is its older name)."
        )
    if groups is None:
        return int(num_groups) or None
    if is_int(groups) and groups >= 1:
        return int(groups)
    if isinstance(groups, list) and all(isinstance(g, list | tuple) for g in groups):
        return [list(g) for g in groups]
    raise ConfigurationError(
        f"{what}: groups={groups!r} is not a grouping; give an int >= 1 (split the "
        "gradients into that many allreduces) or a list of lists of variables (each list "
        "reduced together), as in Horovod, or leave it None for hvdkit's bucket_bytes."
    )


def horovod_groups(
    groups: int | list, present: Sequence[int], variables: Sequence[Any] | None = None
) -> list[list[int]]:
    """Horovod's grouping of the gradients at positions ``present``.

    Args:
        groups: an int >= 1, or a list of lists of variables (as checked by
            :func:`check_groups`).
        present: positions of the gradients that are not ``None``, ascending.
        variables: the variable of every position; needed for a list ``groups``.

    Returns:
        Non-empty lists of positions covering ``present`` exactly once.

    Raises:
        ConfigurationError: a list ``groups`` without ``variables``.
    """
    if isinstance(groups, int):
        n = min(groups, len(present))  # Horovod's even split, without empty groups
        if n == 0:
            return []
        d, r = divmod(len(present), n)
        return [list(present[k * d + min(k, r) : (k + 1) * d + min(k + 1, r)]) for k in range(n)]
    if variables is None:
        raise ConfigurationError(
            "groups given as lists of variables needs the variables of the gradients: use "
            "it with DistributedOptimizer or DistributedGradientTape.gradient(loss, variables)."
        )
    by_ref = {_ref(variables[i]): i for i in present}
    out: list[list[int]] = []
    for group in groups:
        found = [by_ref.pop(_ref(v)) for v in group if _ref(v) in by_ref]
        if found:
            out.append(found)
    out.extend([i] for i in present if _ref(variables[i]) in by_ref)
    return out


def _ref(variable: Any) -> int:
    """One identity for a Keras variable and the ``tf.Variable`` inside it.

    Horovod matches by ``var.name``, which Keras 3 does not keep unique
    (every Dense layer has a ``kernel``), so hvdkit matches by object.
    """
    try:
        return id(_compat.tf_variable(variable))
    except TypeError:
        return id(variable)


def resolve_bucket_bytes(value: Any, what: str) -> int:
    """``value`` checked, else ``HVDKIT_BUCKET_BYTES``, else ``config.DEFAULT_BUCKET_BYTES``."""
    value = check_bucket_bytes(value, what)
    if value is not None:
        return value
    return config.get_int(
        config.BUCKET_BYTES,
        config.DEFAULT_BUCKET_BYTES,
        minimum=0,
        what="a size in bytes (an int >= 0)",
        fix="bytes per gradient bucket, 0 = one allreduce per gradient; unset it for the "
        f"default ({config.DEFAULT_BUCKET_BYTES} bytes).",
    )

"""Split each input of a batch across ranks by a layout (MindSpore's ``dataset_strategy``).

A layout gives, per axis of one input, how many pieces that axis is cut
into. ``((1, 1, 2, 4), (1,))`` cuts ``[N, C, H, W]`` images into 2 x 4 blocks
over height and width and replicates the labels; a layout of all ones
replicates an input on every rank.

Which rank gets which block, for an input whose splits multiply to ``p``:

* The blocks are numbered row-major over the layout (the last axis varies
  fastest), as the patches of :func:`hvdkit.ops.slice_patches`: block ``k``
  of ``(1, 1, 2, 4)`` is height block ``k // 4``, width block ``k % 4``.
* Rank ``r`` gets block ``r % p``. ``p`` must divide the job size; when it
  is smaller, the ranks ``r, r + p, r + 2p, ...`` hold the same block.
* Every split axis must divide evenly; an uneven axis is an error (slice
  with :func:`hvdkit.ops.slice_patches` in ``"pad"`` mode if you need pad).

With 2 ranks and ``((1, 1, 1, 2), (1,))`` on images ``[8, 3, 32, 64]``: rank
0 gets ``images[:, :, :, :32]``, rank 1 ``images[:, :, :, 32:]``, and both
get all 8 labels.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from .._autograph import not_converted
from .._validate import is_int
from ..errors import ConfigurationError
from ._args import rank_and_size

__all__ = ["layout_block", "slice_inputs", "slice_inputs_map"]

Layout = tuple[int, ...]


def _check_layout(layout, what: str) -> Layout:
    ok = isinstance(layout, Sequence) and len(layout) > 0
    if not ok or not all(is_int(s) and s >= 1 for s in layout):
        raise ConfigurationError(
            f"{what}: layout {layout!r} is not a tuple of positive ints, one per axis of "
            "the input (e.g. (1, 1, 2, 4) for NCHW images, (1,) for labels)."
        )
    return tuple(int(s) for s in layout)


def _check_divides(layout: Layout, size: int, what: str) -> int:
    pieces = math.prod(layout)
    if size % pieces:
        raise ConfigurationError(
            f"{what}: layout {layout} cuts an input into {pieces} blocks, which does not "
            f"divide the job size {size}; use a layout whose splits multiply to a divisor "
            f"of {size} (all ones replicates), or launch a multiple of {pieces} processes."
        )
    return pieces


def layout_block(layout: Sequence[int], rank: int, size: int) -> tuple[int, ...]:
    """Index of the block, along every axis, that ``rank`` receives (pure logic).

    Args:
        layout: splits per axis, e.g. ``(1, 1, 2, 4)``.
        rank: in ``[0, size)``.
        size: job size; ``prod(layout)`` must divide it.

    Returns:
        One block index per axis, ``0 <= index[a] < layout[a]``.

    Raises:
        ConfigurationError: bad layout, rank outside the job, or
            ``prod(layout)`` does not divide ``size``.

    Example:
        >>> [layout_block((1, 1, 2, 4), r, 8) for r in (0, 3, 4, 7)]
        [(0, 0, 0, 0), (0, 0, 0, 3), (0, 0, 1, 0), (0, 0, 1, 3)]
        >>> [layout_block((2, 1), r, 4) for r in range(4)]   # ranks 0, 2 share block 0
        [(0, 0), (1, 0), (0, 0), (1, 0)]
    """
    what = "layout_block"
    rank, size = rank_and_size(rank, size, what)
    return _block(_check_layout(layout, what), rank, size, what)


def _block(layout: Layout, rank: int, size: int, what: str) -> tuple[int, ...]:
    pieces = _check_divides(layout, size, what)
    return tuple(int(i) for i in np.unravel_index(rank % pieces, layout))


def _slice_one(x: tf.Tensor, layout: Layout, block: tuple[int, ...], what: str) -> tf.Tensor:
    if x.shape.rank != len(layout):
        shown = "unknown rank" if x.shape.rank is None else f"shape {x.shape.as_list()}"
        raise ConfigurationError(
            f"{what}: layout {layout} has {len(layout)} entries but the input has {shown}; "
            "give one split per axis."
        )
    if all(s == 1 for s in layout):
        return x
    begin, size, checks = [0] * len(layout), [-1] * len(layout), []
    for axis, (splits, index) in enumerate(zip(layout, block, strict=True)):
        if splits == 1:
            continue
        dim = x.shape[axis]
        if dim is None:
            dim = tf.shape(x)[axis]
            checks.append(
                tf.debugging.assert_equal(
                    dim % splits,
                    0,
                    message=f"{what}: layout {layout} splits axis {axis} into {splits}, "
                    "which does not divide its length",
                )
            )
        elif dim % splits:
            raise ConfigurationError(
                f"{what}: layout {layout} splits axis {axis} of an input of shape "
                f"{x.shape.as_list()} into {splits}, but {dim} is not divisible by {splits}; "
                "use a split that divides it, or pad the input first (slice_patches "
                "with mode='pad' pads images)."
            )
        begin[axis], size[axis] = index * (dim // splits), dim // splits
    with tf.control_dependencies(checks):
        return tf.slice(x, begin, size)


@not_converted
def slice_inputs(inputs, layouts, *, rank: int | None = None, size: int | None = None):
    """This rank's slice of every input, by one layout per input.

    Args:
        inputs: a tuple/list of tensors (e.g. ``(images, labels)``), or one
            tensor. Works eagerly and in ``tf.function``.
        layouts: one layout per input, e.g. ``((1, 1, 2, 4), (1,))``; for a
            single tensor, one layout such as ``(1, 2, 1, 1)``.
        rank, size: this process's rank and the job size; ``None`` reads
            ``hvdkit.rank()`` / ``hvdkit.size()``.

    Returns:
        The slices, in the structure of ``inputs``. Along a split axis of
        length ``L`` cut into ``s`` pieces, each slice has ``L // s``.

    Raises:
        ConfigurationError: the numbers of inputs and layouts differ, a layout
            does not match its input's rank, its product does not divide the
            job size, or a split does not divide its axis.

    Example (2 ranks, NHWC images ``[8, 32, 64, 3]``):
        >>> imgs, labels = slice_inputs((images, labels), ((1, 1, 2, 1), (1,)))
        >>> imgs.shape    # rank 0: images[:, :16], rank 1: images[:, 16:]
        TensorShape([8, 16, 64, 3])
    """
    what = "slice_inputs"
    single = not isinstance(inputs, (tuple, list))
    if single:
        inputs, layouts = [inputs], [layouts]
    elif not isinstance(layouts, Sequence) or len(layouts) != len(inputs):
        count = len(layouts) if isinstance(layouts, Sequence) else "no sequence of"
        raise ConfigurationError(
            f"{what}: got {len(inputs)} inputs but {count} layouts ({layouts!r}); pass one "
            "layout per input, e.g. ((1, 1, 2, 4), (1,)) for (images, labels)."
        )
    rank, size = rank_and_size(rank, size, what)
    out = []
    for x, layout in zip(inputs, layouts, strict=True):
        layout = _check_layout(layout, what)
        block = _block(layout, rank, size, what)
        out.append(_slice_one(tf.convert_to_tensor(x), layout, block, what))
    if single:
        return out[0]
    return type(inputs)(out) if isinstance(inputs, tuple) else out


def slice_inputs_map(layouts, *, rank: int | None = None, size: int | None = None) -> Callable:
    """A ``Dataset.map`` function applying :func:`slice_inputs` to batched elements.

    Rank and size are read once, when this is called.

    Example:
        >>> ds = ds.batch(8, drop_remainder=True)
        >>> ds = ds.map(slice_inputs_map(((1, 1, 1, 2), (1,))))   # 2 ranks: W halves
    """
    rank, size = rank_and_size(rank, size, "slice_inputs_map")
    layouts = tuple(layouts)
    single = len(layouts) > 0 and is_int(layouts[0])

    def slice_element(*element):
        if single:
            if len(element) != 1:
                raise ConfigurationError(
                    f"slice_inputs_map: one layout {layouts} was given but the dataset "
                    f"element has {len(element)} components; pass one layout per component."
                )
            return slice_inputs(element[0], layouts, rank=rank, size=size)
        return slice_inputs(tuple(element), layouts, rank=rank, size=size)

    return not_converted(slice_element)

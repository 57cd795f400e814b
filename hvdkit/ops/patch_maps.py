"""``tf.data`` map functions for patch parallelism, and one shuffle order for all ranks.

Every rank must read the same images in the same order, so the dataset is
shuffled with :func:`replicated_shuffle` (one seed for all ranks) before
:func:`rank_patch` keeps this rank's patch of every image::

    ds = replicated_shuffle(ds, 1000, seed=1000)
    ds = ds.map(rank_patch(1, 2))        # rank 0: left halves, rank 1: right halves
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import tensorflow as tf

from .. import collectives, runtime
from .._autograph import not_converted
from .._validate import is_int
from ..errors import ConfigurationError
from ._args import rank_and_size
from .patches import _check_index, _grid, _Plan, slice_patches

__all__ = ["patch_columns", "rank_patch", "replicated_shuffle"]


def _map_column(element: tuple, column, what: str, transform: Callable, names=None):
    """Apply ``transform`` to one column of a ``tf.data`` element.

    ``transform`` returns one tensor (kept in place of the column) or a list
    (spliced in its place, under ``names`` for dict elements).
    """
    if len(element) == 1 and isinstance(element[0], Mapping):
        features = dict(element[0])
        key = "image" if column is None else column
        if key not in features:
            raise ConfigurationError(
                f"{what}: column {key!r} is not in the dataset element, whose columns are "
                f"{sorted(features)}; pass column=<name of the image column>."
            )
        out = transform(features.pop(key))
        if not isinstance(out, list):
            features[key] = out
            return features
        clash = sorted(set(names) & set(features))
        if clash:
            raise ConfigurationError(
                f"{what}: the patch columns {clash} already exist in the dataset element; "
                "pass another prefix=."
            )
        features.update(zip(names, out, strict=True))
        return features
    index = 0 if column is None else column
    if not is_int(index) or not 0 <= index < len(element):
        raise ConfigurationError(
            f"{what}: column={column!r} does not select a component of the dataset "
            f"element, a tuple of {len(element)}; pass its position (0 to "
            f"{len(element) - 1}), or a name for dict elements."
        )
    out = transform(element[index])
    parts = list(element[:index]) + (out if isinstance(out, list) else [out])
    parts += list(element[index + 1 :])
    return parts[0] if len(parts) == 1 else tuple(parts)


def patch_columns(
    num_height: int,
    num_width: int,
    *,
    column: str | int | None = None,
    prefix: str = "img",
    mode: str = "pad",
    fill_value: float = 0,
    data_format: str = "channels_last",
) -> Callable:
    """A ``Dataset.map`` function that turns the image column into patch columns.

    Dict elements: the column (default ``"image"``) is replaced by
    ``f"{prefix}0"`` ... ``f"{prefix}{n-1}"``. Tuple elements: the component
    at position ``column`` (default 0) is replaced by the ``n`` patches, in
    place. A dataset of bare images yields a tuple of ``n`` patches.

    Args:
        num_height, num_width, mode, fill_value, data_format: as in
            :func:`slice_patches`.
        column: the image's key (dict elements) or position (tuples).
        prefix: names of the new columns of dict elements.

    Returns:
        A function to pass to ``tf.data.Dataset.map``.

    Example:
        >>> ds = tf.data.Dataset.from_tensor_slices({"image": imgs, "label": labels})
        >>> ds = ds.map(patch_columns(2, 2))
        >>> sorted(ds.element_spec)
        ['img0', 'img1', 'img2', 'img3', 'label']
    """
    what = "patch_columns"
    grid = _grid(num_height, num_width, mode, what)
    names = [f"{prefix}{k}" for k in range(grid.num_patches)]

    @not_converted
    def to_patches(*element):
        return _map_column(
            element,
            column,
            what,
            lambda image: slice_patches(
                image,
                num_height,
                num_width,
                mode=mode,
                fill_value=fill_value,
                data_format=data_format,
            ),
            names,
        )

    return to_patches


def rank_patch(
    num_height: int,
    num_width: int,
    *,
    index: int | None = None,
    rank: int | None = None,
    size: int | None = None,
    column: str | int | None = None,
    mode: str = "pad",
    fill_value: float = 0,
    data_format: str = "channels_last",
) -> Callable:
    """A ``Dataset.map`` function that keeps only this rank's patch of the image column.

    Only that patch is cut, not the whole grid. With 2 ranks and a 1 x 2
    grid, rank 0 keeps the left half of every image and rank 1 the right
    half; with a 2 x 2 grid and 4 ranks, rank ``r`` keeps patch ``r``; with 8
    ranks, ranks ``r`` and ``r + 4`` keep the same patch. The number of
    patches must divide the job size, so that every patch is kept by the same
    number of ranks (as for :func:`hvdkit.ops.slice_inputs`); pass ``index``
    to choose freely. The dataset must yield the same images in the same
    order on every rank: shuffle it with :func:`replicated_shuffle`.

    Args:
        num_height, num_width, mode, fill_value, data_format: as in
            :func:`slice_patches`.
        index: the patch to keep, ``0 <= index < num_height*num_width``.
            ``None`` keeps patch ``rank % (num_height * num_width)``.
        rank, size: this process's rank and the job size; ``None`` reads
            ``hvdkit.rank()`` / ``hvdkit.size()`` (call ``hvdkit.init()``
            first). Used only when ``index`` is ``None``.
        column: the image's key (dict elements, default ``"image"``) or
            position (tuples, default 0); the patch takes its place.

    Returns:
        A function to pass to ``tf.data.Dataset.map``.

    Raises:
        ConfigurationError: ``index`` outside the grid, a grid whose number of
            patches does not divide the job size, or a bad grid argument.

    Example:
        >>> ds = replicated_shuffle(ds, 1000, seed=1000)
        >>> ds = ds.map(rank_patch(1, 2))     # rank 0: left half, rank 1: right half
    """
    what = "rank_patch"
    grid = _grid(num_height, num_width, mode, what)
    if index is None:
        rank, size = rank_and_size(rank, size, what)
        if size % grid.num_patches:
            kept = {r % grid.num_patches for r in range(size)}
            left = [k for k in range(grid.num_patches) if k not in kept]
            why = f"patches {left} would be kept by no rank"
            if not left:
                why = "some patches would be kept by more ranks than others"
            raise ConfigurationError(
                f"{what}: a {num_height}x{num_width} grid has {grid.num_patches} patches, which "
                f"does not divide the job size {size}: {why}. Use a grid whose number of "
                f"patches divides {size}, or pass index= to choose each rank's patch."
            )
        index = rank % grid.num_patches
    _check_index(index, grid, what)
    index = int(index)

    def take(image):
        plan = _Plan(image, grid, fill_value, data_format, what)
        return plan.x if grid.num_patches == 1 else plan.patch(index)

    return not_converted(lambda *element: _map_column(element, column, what, take))


def replicated_shuffle(
    dataset: tf.data.Dataset,
    buffer_size: int,
    *,
    seed: int | None = None,
    reshuffle_each_iteration: bool = True,
) -> tf.data.Dataset:
    """Shuffle ``dataset`` into the same order on every rank.

    Patch parallelism needs every rank to see the same image at the same
    step; a plain ``shuffle`` gives each process its own order. This one uses
    one seed for all ranks: ``seed`` if given, otherwise a seed drawn on rank
    0 and broadcast. When the job has several ranks it also checks that the
    ranks' global TensorFlow seeds (``tf.random.set_seed``), which TensorFlow
    mixes into the shuffle, agree. The pipeline is made deterministic so that
    parallel ``map`` calls after it keep the order. In a job of several ranks
    this is a collective call: every rank must call it, in the same order.

    Args:
        dataset: a ``tf.data.Dataset`` built identically on every rank.
        buffer_size: as in ``Dataset.shuffle``.
        seed: the shared seed; ``None`` needs ``hvdkit.init()`` (rank 0 picks
            it). Every epoch is reshuffled the same way on every rank when
            ``reshuffle_each_iteration`` is True.

    Returns:
        The shuffled dataset.

    Raises:
        ConfigurationError: the ranks' global TensorFlow seeds differ, so the
            orders would differ too.

    Example:
        >>> ds = tf.data.Dataset.range(6)
        >>> list(replicated_shuffle(ds, 6, seed=1).as_numpy_iterator())
        [4, 5, 1, 2, 3, 0]    # on every rank (without tf.random.set_seed)
    """
    what = "replicated_shuffle"
    if seed is None:
        mine = int(np.random.default_rng().integers(0, 2**31 - 1))
        seed = collectives.broadcast_object(mine, root_rank=0)
    elif not is_int(seed):
        raise ConfigurationError(f"{what}: seed={seed!r} must be an int (or None).")
    seed = int(seed)
    if runtime.is_initialized() and runtime.size() > 1:
        # TensorFlow derives the shuffle from (global seed, op seed); a rank
        # that called tf.random.set_seed(rank) would silently use another order.
        seeds = tuple(tf.compat.v1.random.get_seed(seed))
        every = collectives.allgather_object(seeds)
        if len(set(every)) > 1:
            shown = ", ".join(f"rank {r}: {s}" for r, s in enumerate(every))
            raise ConfigurationError(
                f"{what}: the ranks would shuffle differently, because their (global, "
                f"op) TensorFlow seeds differ ({shown}). Call tf.random.set_seed with the "
                "same value on every rank, or not at all."
            )
    options = tf.data.Options()
    options.deterministic = True
    shuffled = dataset.shuffle(
        buffer_size, seed=seed, reshuffle_each_iteration=reshuffle_each_iteration
    )
    return shuffled.with_options(options)

"""Cut images into a grid of patches, give each rank one, and put them back together.

For images too large for one device (remote-sensing scenes, pathology
slides) each image is cut into a ``num_height`` x ``num_width`` grid and every
rank works on one patch. Patches are numbered row-major, and by default rank
``r`` takes patch ``r % (num_height * num_width)``. A 2 x 2 grid::

    +-----------+-----------+
    | patch 0   | patch 1   |
    | rank 0    | rank 1    |
    +-----------+-----------+
    | patch 2   | patch 3   |
    | rank 2    | rank 3    |
    +-----------+-----------+

The ``tf.data`` side (patch columns, this rank's patch, one shuffle order for
all ranks) is in :mod:`hvdkit.ops.patch_maps`.
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np
import tensorflow as tf

from .._autograph import not_converted
from .._validate import is_int
from ..errors import ConfigurationError
from ._args import positive_int

__all__ = [
    "PatchGrid",
    "slice_patches",
    "merge_patches",
]

MODES = ("pad", "drop")
DATA_FORMATS = ("channels_last", "channels_first")


@dataclasses.dataclass(frozen=True)
class PatchGrid:
    """Geometry of a ``num_height`` x ``num_width`` grid of patches (plain Python).

    Patch ``k`` sits in row ``k // num_width`` and column ``k % num_width``.
    In ``"pad"`` mode a patch is ``ceil(H / num_height)`` x
    ``ceil(W / num_width)`` and the image is (virtually) padded at the bottom
    and right; in ``"drop"`` mode it is ``floor(H / num_height)`` x
    ``floor(W / num_width)`` and the remainder at the bottom and right is lost.

    Args:
        num_height: patch rows, >= 1.
        num_width: patch columns, >= 1.
        mode: ``"pad"`` or ``"drop"``.

    Raises:
        ConfigurationError: a count is not a positive int, or the mode is unknown.

    Example:
        >>> grid = PatchGrid(2, 3, mode="pad")
        >>> grid.patch_size(5, 7)              # a 5 x 7 image
        (3, 3)
        >>> grid.position(5)                   # the last patch: row 1, column 2
        (1, 2)
        >>> grid.region(5, 5, 7)               # image rows 3-4, column 6; the rest is pad
        (3, 5, 6, 7)
    """

    num_height: int = 1
    num_width: int = 1
    mode: str = "pad"

    def __post_init__(self):
        _check_grid(self.num_height, self.num_width, self.mode, "PatchGrid")

    @property
    def num_patches(self) -> int:
        """``num_height * num_width``."""
        return self.num_height * self.num_width

    def position(self, index: int) -> tuple[int, int]:
        """``(row, column)`` of patch ``index`` (row-major numbering)."""
        _check_index(index, self, "PatchGrid.position")
        return divmod(int(index), self.num_width)

    def patch_size(self, height: int, width: int) -> tuple[int, int]:
        """``(patch_height, patch_width)`` for an image of ``height`` x ``width``."""
        _check_fits(self, height, width, "PatchGrid.patch_size", "")
        return _length(height, self.num_height, self.mode), _length(
            width, self.num_width, self.mode
        )

    def region(self, index: int, height: int, width: int) -> tuple[int, int, int, int]:
        """Image pixels that patch ``index`` holds: ``(top, bottom, left, right)``, half-open.

        In ``"pad"`` mode the rest of the patch (below ``bottom``, right of
        ``right``) is fill; the region can be empty when the pad is as high
        as a whole patch row (e.g. 5 rows in 4 patch rows of 2).
        """
        row, col = self.position(index)
        ph, pw = self.patch_size(height, width)
        top, left = min(row * ph, height), min(col * pw, width)
        return top, min(top + ph, height), left, min(left + pw, width)


def _check_grid(num_height, num_width, mode, what: str) -> None:
    positive_int(num_height, "num_height", what, "patch rows")
    positive_int(num_width, "num_width", what, "patch columns")
    if mode not in MODES:
        raise ConfigurationError(
            f"{what}: mode={mode!r} is unknown; use 'pad' (pad the bottom and right with "
            "fill_value so that every patch has the same size) or 'drop' (discard the "
            "remainder)."
        )


def _grid(num_height, num_width, mode, what: str) -> PatchGrid:
    _check_grid(num_height, num_width, mode, what)  # so that errors name the caller
    return PatchGrid(int(num_height), int(num_width), mode)


def _check_index(index, grid: PatchGrid, what: str) -> None:
    if not is_int(index) or not 0 <= index < grid.num_patches:
        raise ConfigurationError(
            f"{what}: patch index {index!r} is outside the {grid.num_height}x"
            f"{grid.num_width} grid, whose patches are numbered 0 to {grid.num_patches - 1} "
            "(row-major); pass an index in that range."
        )


def _check_fits(grid: PatchGrid, height, width, what: str, context: str) -> None:
    """Raise if the grid has more rows/columns than the image; ``None`` sizes are skipped."""
    for n, name, dim, dim_name in (
        (grid.num_height, "num_height", height, "height"),
        (grid.num_width, "num_width", width, "width"),
    ):
        if dim is not None and n > dim:
            raise ConfigurationError(
                f"{what}: {name}={n} is larger than the image {dim_name} {dim}{context}; "
                f"each patch needs at least one pixel of the image: use {name} <= {dim}."
            )


def _length(total, count: int, mode: str):
    """Patch length along one axis; ``total`` is an int or a scalar tensor."""
    return (total + count - 1) // count if mode == "pad" else total // count


def _spatial_axes(x: tf.Tensor, data_format: str, what: str) -> tuple[int, int]:
    if data_format not in DATA_FORMATS:
        raise ConfigurationError(
            f"{what}: data_format={data_format!r} is unknown; use 'channels_last' "
            "(HWC / NHWC) or 'channels_first' (CHW / NCHW)."
        )
    ndim = x.shape.rank
    if ndim not in (3, 4):
        shown = "unknown" if ndim is None else f"{x.shape.as_list()} ({ndim} dims)"
        raise ConfigurationError(
            f"{what}: expected one image (3 dims: HWC or CHW) or a batch (4 dims: NHWC or "
            f"NCHW); got shape {shown}. Add a channel axis to a 2-D image "
            "(x[..., None]) and give tensors inside tf.function a known rank."
        )
    first = ndim - 3 + (1 if data_format == "channels_first" else 0)
    return first, first + 1


def _check_dtype(dtype: tf.DType, what: str) -> None:
    if not (dtype.is_integer or dtype.is_floating or dtype.is_complex or dtype.is_bool):
        raise ConfigurationError(
            f"{what}: dtype {dtype.name} is not supported; pass a numeric or bool image "
            "(decode strings first, e.g. with tf.io.decode_image)."
        )


def _check_fill(fill_value, dtype: tf.DType, what: str):
    """``fill_value`` as a Python number that ``dtype`` holds exactly in range."""
    bad = None
    is_number = isinstance(fill_value, (numbers.Number, np.generic)) and not isinstance(
        fill_value, (str, bytes)
    )
    if not is_number:
        bad = "is not a number"
    elif dtype.is_complex:
        return complex(fill_value)
    elif isinstance(fill_value, (complex, np.complexfloating)):
        bad = f"is complex, but the image is {dtype.name}"
    elif dtype.is_bool:
        if fill_value in (0, 1):
            return bool(fill_value)
        bad = "is not 0/1/False/True"
    elif dtype.is_integer:
        value = float(fill_value)
        if not value.is_integer():
            bad = "is not a whole number"
        elif not dtype.min <= int(fill_value) <= dtype.max:
            bad = f"is outside the range [{dtype.min}, {dtype.max}]"
        else:
            return int(fill_value)
    else:
        value = float(fill_value)
        if np.isfinite(value) and abs(value) > float(dtype.max):
            bad = f"is outside the finite range of {dtype.name} (|x| <= {float(dtype.max):g})"
        else:
            return value
    raise ConfigurationError(
        f"{what}: fill_value={fill_value!r} {bad}, so a {dtype.name} image cannot hold it; "
        f"pass a fill value representable in {dtype.name} (e.g. 0), or cast the image first."
    )


def _static_or_checked(x: tf.Tensor, axis: int, count: int, name: str, what: str):
    """Length of ``x`` along ``axis`` (int if static) and ``x``, guarded if it is not."""
    dim = x.shape[axis]
    if dim is not None:
        return dim, x
    dim = tf.shape(x)[axis]
    check = tf.debugging.assert_greater_equal(
        dim, count, message=f"{what}: {name}={count} is larger than the image along axis {axis}"
    )
    with tf.control_dependencies([check]):
        return dim, tf.identity(x)


class _Plan:
    """Everything needed to cut patch ``k`` out of one image tensor."""

    def __init__(self, image, grid: PatchGrid, fill_value, data_format: str, what: str):
        x = tf.convert_to_tensor(image)
        self.h_axis, self.w_axis = _spatial_axes(x, data_format, what)
        _check_dtype(x.dtype, what)
        self.fill = _check_fill(fill_value, x.dtype, what) if grid.mode == "pad" else None
        context = f" (shape {x.shape.as_list()}, {data_format})"
        _check_fits(grid, x.shape[self.h_axis], x.shape[self.w_axis], what, context)
        self.height, x = _static_or_checked(x, self.h_axis, grid.num_height, "num_height", what)
        self.width, x = _static_or_checked(x, self.w_axis, grid.num_width, "num_width", what)
        self.x, self.grid = x, grid
        self.ph = _length(self.height, grid.num_height, grid.mode)
        self.pw = _length(self.width, grid.num_width, grid.mode)

    def patch(self, k: int) -> tf.Tensor:
        # Slicing each patch out of the unpadded image and padding only the
        # patches on the bottom and right edge avoids copying the whole image
        # into a padded buffer first.
        row, col = divmod(k, self.grid.num_width)
        ndim = self.x.shape.rank
        begin, size, pads = [0] * ndim, [-1] * ndim, [[0, 0] for _ in range(ndim)]
        for axis, index, length, total in (
            (self.h_axis, row, self.ph, self.height),
            (self.w_axis, col, self.pw, self.width),
        ):
            start = index * length
            if self.grid.mode == "pad":
                start = _minimum(start, total)
                take = _minimum(length, total - start)
                pads[axis][1] = length - take
            else:
                take = length
            begin[axis], size[axis] = start, take
        out = tf.slice(self.x, begin, size)
        if any(not isinstance(p, int) or p > 0 for _, p in pads):
            out = tf.pad(out, pads, constant_values=tf.constant(self.fill, self.x.dtype))
        return out


def _minimum(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return tf.minimum(a, b)


@not_converted
def slice_patches(
    image,
    num_height: int = 1,
    num_width: int = 1,
    *,
    mode: str = "pad",
    fill_value: float = 0,
    data_format: str = "channels_last",
) -> list[tf.Tensor]:
    """Cut an image (or a batch of images) into a ``num_height`` x ``num_width`` grid.

    Works eagerly, inside ``tf.function`` and in ``tf.data`` ``map`` (then
    the height and width may be unknown until run time).

    Args:
        image: ``[H, W, C]`` / ``[N, H, W, C]`` (``channels_last``) or
            ``[C, H, W]`` / ``[N, C, H, W]`` (``channels_first``); any numeric
            or bool dtype.
        num_height: patch rows, ``1 <= num_height <= H``.
        num_width: patch columns, ``1 <= num_width <= W``.
        mode: ``"pad"``: patches are ``ceil(H/num_height)`` x
            ``ceil(W/num_width)``, the image is padded at the bottom and right
            with ``fill_value``. ``"drop"``: patches are ``floor(H/num_height)``
            x ``floor(W/num_width)``, the bottom and right remainder is dropped.
        fill_value: pad value (``"pad"`` mode only); must be representable in
            the image's dtype.
        data_format: ``"channels_last"`` or ``"channels_first"``.

    Returns:
        ``num_height * num_width`` tensors of the image's dtype, row-major
        (row 0 left to right, then row 1, ...), each the image's shape with H
        and W replaced by the patch size. A 1 x 1 grid returns ``[image]``.

    Raises:
        ConfigurationError: a count is not a positive int or exceeds the image
            size, ``mode``/``data_format`` is unknown, ``fill_value`` does not
            fit the dtype, or the image is not 3-D/4-D.

    Example:
        >>> x = tf.reshape(tf.range(35), [5, 7, 1])          # a 5 x 7 image
        >>> p = slice_patches(x, 2, 3, mode="pad", fill_value=9)
        >>> len(p), p[5].shape                              # six 3 x 3 patches
        (6, TensorShape([3, 3, 1]))
        >>> p[5][..., 0].numpy()                            # rows 3-4, column 6, then pad
        array([[27,  9,  9],
               [34,  9,  9],
               [ 9,  9,  9]], dtype=int32)
    """
    grid = _grid(num_height, num_width, mode, "slice_patches")
    plan = _Plan(image, grid, fill_value, data_format, "slice_patches")
    if grid.num_patches == 1:
        return [plan.x]
    return [plan.patch(k) for k in range(grid.num_patches)]


@not_converted
def merge_patches(
    patches,
    num_height: int,
    num_width: int,
    *,
    original_size: tuple[int, int] | None = None,
    data_format: str = "channels_last",
) -> tf.Tensor:
    """Put the patches of :func:`slice_patches` back together.

    The exact inverse of ``slice_patches(..., mode="pad")`` when
    ``original_size`` is given. After ``mode="drop"`` the rows and columns
    that slicing dropped are gone: the result is the cropped image.

    Args:
        patches: the ``num_height * num_width`` patches in row-major order, as
            a list, or one tensor whose first dimension indexes them. All have
            the same shape and dtype (``[h, w, C]``, ``[N, h, w, C]`` or the
            ``channels_first`` equivalents).
        num_height, num_width: the grid they were cut with.
        original_size: ``(H, W)`` of the image before slicing. Given, the pad
            that ``"pad"`` mode added is cropped off; ``None`` returns the full
            ``num_height*h`` x ``num_width*w`` mosaic.
        data_format: ``"channels_last"`` or ``"channels_first"``.

    Returns:
        The image, ``[H, W, C]`` (or ``[N, H, W, C]``, ``[C, H, W]``, ...).

    Raises:
        ConfigurationError: wrong number of patches, patches of different
            shapes/dtypes, or ``original_size`` larger than the mosaic (a
            ``"drop"`` slice cannot give back what it dropped).

    Example:
        >>> x = tf.random.uniform([5, 7, 3])
        >>> p = slice_patches(x, 2, 3)
        >>> merge_patches(p, 2, 3, original_size=(5, 7)).shape
        TensorShape([5, 7, 3])
    """
    what = "merge_patches"
    grid = _grid(num_height, num_width, "pad", what)
    if isinstance(patches, (tf.Tensor, np.ndarray)):
        patches = tf.convert_to_tensor(patches)
        count = patches.shape[0] if patches.shape.rank else None
        if count is not None and count != grid.num_patches:
            raise ConfigurationError(
                f"{what}: the tensor of patches has {count} entries along its first "
                f"dimension, but a {num_height}x{num_width} grid has {grid.num_patches}."
            )
        patches = tf.unstack(patches, num=grid.num_patches)
    patches = [tf.convert_to_tensor(p) for p in patches]
    if len(patches) != grid.num_patches:
        raise ConfigurationError(
            f"{what}: got {len(patches)} patches for a {num_height}x{num_width} grid; pass "
            f"all {grid.num_patches} in row-major order (the list slice_patches returns)."
        )
    first = patches[0]
    for k, p in enumerate(patches):
        if p.dtype != first.dtype or not p.shape.is_compatible_with(first.shape):
            raise ConfigurationError(
                f"{what}: patch {k} has shape {p.shape.as_list()} dtype {p.dtype.name}, "
                f"patch 0 has shape {first.shape.as_list()} dtype {first.dtype.name}; all "
                "patches must come from one slice_patches call."
            )
    h_axis, w_axis = _spatial_axes(first, data_format, what)
    rows = [
        tf.concat(patches[i * num_width : (i + 1) * num_width], axis=w_axis)
        if num_width > 1
        else patches[i]
        for i in range(num_height)
    ]
    merged = tf.concat(rows, axis=h_axis) if num_height > 1 else rows[0]
    if original_size is None:
        return merged
    return _crop(merged, original_size, h_axis, w_axis, what)


def _crop(merged: tf.Tensor, original_size, h_axis: int, w_axis: int, what: str) -> tf.Tensor:
    try:
        height, width = original_size
    except (TypeError, ValueError):
        height = width = None
    for name, value in (("height", height), ("width", width)):
        positive_int(value, f"original_size {name}", what, f"image {name} pixels")
    mosaic = (merged.shape[h_axis], merged.shape[w_axis])
    if (mosaic[0] is not None and height > mosaic[0]) or (
        mosaic[1] is not None and width > mosaic[1]
    ):
        raise ConfigurationError(
            f"{what}: original_size={tuple(original_size)} is larger than the merged patches "
            f"({mosaic[0]}, {mosaic[1]}); patches cut with mode='drop' lost the bottom/right "
            "remainder and cannot restore it. Pass the size the patches cover, or slice with "
            "mode='pad'."
        )
    size = [-1] * merged.shape.rank
    size[h_axis], size[w_axis] = int(height), int(width)
    return tf.slice(merged, [0] * merged.shape.rank, size)

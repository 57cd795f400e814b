"""Tensor ops for model-size inputs: patch slicing and layout-based batch slicing.

* :mod:`~hvdkit.ops.patches`: ``slice_patches`` / ``merge_patches`` cut an
  image into a grid of patches and put it back; ``PatchGrid`` is the
  geometry alone.
* :mod:`~hvdkit.ops.patch_maps`: ``tf.data`` map functions (``patch_columns``,
  ``rank_patch``) and ``replicated_shuffle``, one shuffle order on every rank.
* :mod:`~hvdkit.ops.layout`: ``slice_inputs`` splits each input of a batch
  across ranks by a layout such as ``((1, 1, 2, 4), (1,))``.

Example (2 ranks, each training on half of every image)::

    ds = hvdkit.ops.replicated_shuffle(ds, 1000, seed=1000)
    ds = ds.map(hvdkit.ops.rank_patch(1, 2)).batch(16)
"""

from .layout import layout_block, slice_inputs, slice_inputs_map
from .patch_maps import patch_columns, rank_patch, replicated_shuffle
from .patches import PatchGrid, merge_patches, slice_patches

__all__ = [
    "PatchGrid",
    "slice_patches",
    "merge_patches",
    "patch_columns",
    "rank_patch",
    "replicated_shuffle",
    "layout_block",
    "slice_inputs",
    "slice_inputs_map",
]

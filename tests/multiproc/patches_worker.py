"""Patch parallelism and layout slicing on 2 ranks.

Each rank keeps its patch of every image of a dataset shuffled with one seed;
the patches are allgathered and merged, and must give back the original batch
exactly. Layout slicing is checked on both ranks with exact values.
"""

import sys

import numpy as np
import tensorflow as tf

import hvdkit as hvd
from hvdkit import ops

from _harness import Checks

hvd.init()
r, n = hvd.rank(), hvd.size()
c = Checks(r, sys.argv[1])
other = 1 - r

N_IMAGES, H, W, C = 20, 9, 11, 3  # odd sizes: a 1x2 or 2x2 grid needs pad
IMAGES = np.random.default_rng(7).integers(0, 256, (N_IMAGES, H, W, C), dtype=np.uint8)
BATCH = 4


def images_dataset(images=IMAGES, data_format="channels_last"):
    if data_format == "channels_first":
        images = images.transpose(0, 3, 1, 2)
    return tf.data.Dataset.from_tensor_slices({"image": images, "id": np.arange(N_IMAGES)})


def order_of(ds):
    return [int(e["id"]) for e in ds]


with c.check("topology"):
    assert n == 2 and r in (0, 1)

with c.check("seeded_shuffle_same_order_on_every_rank"):
    ds = ops.replicated_shuffle(images_dataset(), N_IMAGES, seed=1000)
    epochs = [order_of(ds), order_of(ds)]
    every = hvd.allgather_object(epochs)
    assert every[0] == every[1], every
    assert epochs[0] != epochs[1] and sorted(epochs[0]) == list(range(N_IMAGES))
    c.record("seeded_order", epochs[0])

with c.check("plain_shuffle_differs_between_ranks"):
    # why the seed matters: an unseeded shuffle gives each process its own order
    plain = order_of(images_dataset().shuffle(N_IMAGES))
    assert hvd.allgather_object(plain)[other] != plain

with c.check("seed_none_is_broadcast_from_rank_0"):
    drawn = order_of(ops.replicated_shuffle(images_dataset(), N_IMAGES))
    every = hvd.allgather_object(drawn)
    assert every[0] == every[1] and sorted(drawn) == list(range(N_IMAGES))


def gather_and_merge(parts, ids, nh, nw, data_format, size):
    """Allgather every rank's patches of one step and merge them into whole images.

    ``parts`` maps patch index -> this rank's ``[B, ...]`` patches.
    """
    indices = sorted(parts)
    every_ids = hvd.allgather(ids[None])  # [2, B]
    assert (every_ids.numpy()[0] == every_ids.numpy()[1]).all(), every_ids  # same images
    held = hvd.allgather_object(indices)  # which patch indices each rank holds
    gathered = [hvd.allgather(parts[k][None]) for k in indices]  # each [2, B, ...]
    by_index = {}
    for rank, rank_indices in enumerate(held):
        for j, k in enumerate(rank_indices):
            by_index[k] = gathered[j][rank]
    assert sorted(by_index) == list(range(nh * nw)), sorted(by_index)
    patches = [by_index[k] for k in range(nh * nw)]
    return ops.merge_patches(patches, nh, nw, original_size=size, data_format=data_format)


def check_reassembly(nh, nw, data_format, take, images=IMAGES):
    """Every step: the merged patches of both ranks equal the step's original images."""
    ds = ops.replicated_shuffle(images_dataset(images, data_format), N_IMAGES, seed=77)
    steps = 0
    for element in take(ds).batch(BATCH):
        parts, ids = element["parts"], element["id"]
        merged = gather_and_merge(parts, ids, nh, nw, data_format, images.shape[1:3])
        want = images[ids.numpy()]
        if data_format == "channels_first":
            want = want.transpose(0, 3, 1, 2)
        assert merged.dtype == tf.uint8 and merged.shape == want.shape, merged.shape
        np.testing.assert_array_equal(merged.numpy(), want)
        steps += 1
    assert steps == N_IMAGES // BATCH
    return steps


with c.check("rank_patch_1x2_pad_allgather_merge_is_the_batch"):
    # rank r keeps patch r % 2: rank 0 the left 9x6, rank 1 the right 9x6 (one pad column)
    def take_1x2(ds):
        keep = ops.rank_patch(1, 2, fill_value=255)
        return ds.map(keep).map(lambda e: {"parts": {r: e["image"]}, "id": e["id"]})

    probe = next(iter(images_dataset().map(ops.rank_patch(1, 2, fill_value=255))))["image"]
    assert probe.shape == (H, 6, C)
    if r == 1:
        assert (probe.numpy()[:, 5] == 255).all()  # the pad column
    check_reassembly(1, 2, "channels_last", take_1x2)

with c.check("rank_patch_2x1_drop_channels_first_allgather_merge_is_the_batch"):
    # 9 rows in 2 patch rows: drop would lose row 8, so use images of 8 rows
    def take_2x1(ds):
        keep = ops.rank_patch(2, 1, mode="drop", data_format="channels_first")
        return ds.map(keep).map(lambda e: {"parts": {r: e["image"]}, "id": e["id"]})

    check_reassembly(2, 1, "channels_first", take_2x1, images=IMAGES[:, :8])

with c.check("patch_columns_2x2_two_patches_per_rank_merge_is_the_batch"):
    # 4 patches, 2 ranks: rank r keeps columns img{r} and img{r + 2}
    def take_2x2(ds):
        cols = ds.map(ops.patch_columns(2, 2, fill_value=1))
        return cols.map(
            lambda e: {"parts": {r: e[f"img{r}"], r + 2: e[f"img{r + 2}"]}, "id": e["id"]}
        )

    check_reassembly(2, 2, "channels_last", take_2x2)


# --------------------------------------------------------------------------- layouts
NCHW = np.arange(4 * 3 * 4 * 6, dtype=np.int32).reshape(4, 3, 4, 6)
NHWC = NCHW.transpose(0, 2, 3, 1)
LABELS = np.array([10, 11, 12, 13], np.int64)

with c.check("layout_nchw_width_halves_labels_replicated"):
    imgs, labels = ops.slice_inputs((NCHW, LABELS), ((1, 1, 1, 2), (1,)))
    np.testing.assert_array_equal(imgs.numpy(), NCHW[..., 3 * r : 3 * r + 3])
    np.testing.assert_array_equal(labels.numpy(), LABELS)
    whole = tf.concat(tf.unstack(hvd.allgather(imgs[None])), axis=3)  # rank order = W order
    np.testing.assert_array_equal(whole.numpy(), NCHW)
    c.record("nchw_w_sum", int(tf.reduce_sum(imgs)))

with c.check("layout_nhwc_height_halves"):
    imgs, labels = ops.slice_inputs((NHWC, LABELS), ((1, 2, 1, 1), (1,)))
    np.testing.assert_array_equal(imgs.numpy(), NHWC[:, 2 * r : 2 * r + 2])
    np.testing.assert_array_equal(labels.numpy(), LABELS)
    whole = tf.concat(tf.unstack(hvd.allgather(imgs[None])), axis=1)
    np.testing.assert_array_equal(whole.numpy(), NHWC)

with c.check("layout_batch_split_and_replicate"):
    imgs, labels = ops.slice_inputs((NCHW, LABELS), ((2, 1, 1, 1), (2,)))
    np.testing.assert_array_equal(imgs.numpy(), NCHW[2 * r : 2 * r + 2])
    assert labels.numpy().tolist() == LABELS[2 * r : 2 * r + 2].tolist()
    same, same_labels = ops.slice_inputs((NCHW, LABELS), ((1, 1, 1, 1), (1,)))
    np.testing.assert_array_equal(same.numpy(), NCHW)
    np.testing.assert_array_equal(same_labels.numpy(), LABELS)

with c.check("layout_dataset_map_in_tf_data"):
    ds = tf.data.Dataset.from_tensor_slices((NCHW, LABELS))
    ds = ops.replicated_shuffle(ds, 4, seed=3).batch(2)
    ds = ds.map(ops.slice_inputs_map(((1, 1, 2, 1), (1,))))  # H halves of NCHW
    seen = []
    for imgs, labels in ds:
        np.testing.assert_array_equal(
            imgs.numpy(), NCHW[labels.numpy() - 10][:, :, 2 * r : 2 * r + 2]
        )
        seen.append(labels.numpy().tolist())
    assert hvd.allgather_object(seen)[other] == seen  # the same batches on both ranks

with c.check("layout_errors_name_layout_and_job_size"):
    try:
        ops.slice_inputs((NCHW, LABELS), ((1, 1, 2, 2), (1,)))
    except hvd.ConfigurationError as e:
        assert "layout (1, 1, 2, 2) cuts an input into 4 blocks" in str(e), e
        assert "does not divide the job size 2" in str(e), e
    else:
        raise AssertionError("no error for 4 blocks on 2 ranks")

with c.check("different_global_seeds_are_detected"):
    tf.random.set_seed(100 + r)
    try:
        ops.replicated_shuffle(images_dataset(), N_IMAGES, seed=5)
    except hvd.ConfigurationError as e:
        assert "rank 0: (100, 5), rank 1: (101, 5)" in str(e), e
    else:
        raise AssertionError("no error for different global seeds")
    tf.random.set_seed(100)  # the same on both ranks: accepted, and the same order
    same = order_of(ops.replicated_shuffle(images_dataset(), N_IMAGES, seed=5))
    assert hvd.allgather_object(same)[other] == same

c.finish()

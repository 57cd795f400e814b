"""slice_patches / merge_patches / the tf.data maps, against a numpy reference, in one process."""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import hvdkit
from hvdkit.ops import (
    PatchGrid,
    merge_patches,
    patch_columns,
    rank_patch,
    replicated_shuffle,
    slice_patches,
)

DTYPES = [np.uint8, np.int8, np.int32, np.int64, np.float16, np.float32, np.float64, np.bool_]
FORMATS = ["channels_last", "channels_first"]


@pytest.fixture
def size_one():
    """hvdkit's size-1 runtime (global state), shut down afterwards."""
    hvdkit.shutdown()
    hvdkit.init(backend="local")
    yield
    hvdkit.shutdown()


# --------------------------------------------------------------------------- reference
def to_nhwc(x, data_format):
    """numpy image(s) in either format -> (NHWC array, undo function)."""
    single = x.ndim == 3
    y = x[None] if single else x
    if data_format == "channels_first":
        y = y.transpose(0, 2, 3, 1)

    def undo(p):
        if data_format == "channels_first":
            p = p.transpose(0, 3, 1, 2)
        return p[0] if single else p

    return y, undo


def reference_slice(x, nh, nw, mode, fill, data_format):
    y, undo = to_nhwc(x, data_format)
    n, h, w, c = y.shape
    if mode == "pad":
        ph, pw = -(-h // nh), -(-w // nw)
        canvas = np.full((n, nh * ph, nw * pw, c), fill, y.dtype)
        canvas[:, :h, :w] = y
    else:
        ph, pw = h // nh, w // nw
        canvas = y
    return [
        undo(canvas[:, i * ph : (i + 1) * ph, j * pw : (j + 1) * pw])
        for i in range(nh)
        for j in range(nw)
    ]


def random_image(rng, dtype, shape):
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, endpoint=True, dtype=dtype)
    return rng.normal(scale=100, size=shape).astype(dtype)


def fill_for(dtype):
    if dtype == np.bool_:
        return True
    if np.issubdtype(dtype, np.integer):
        return int(np.iinfo(dtype).max)
    return -1.5


@st.composite
def cases(draw, divisible=False):
    h_count, w_count = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    if divisible:
        height = h_count * draw(st.integers(1, 4))
        width = w_count * draw(st.integers(1, 4))
    else:
        height = draw(st.integers(h_count, 13))
        width = draw(st.integers(w_count, 13))
    channels = draw(st.integers(1, 3))
    batch = draw(st.sampled_from([None, 1, 3]))
    data_format = draw(st.sampled_from(FORMATS))
    dtype = draw(st.sampled_from(DTYPES))
    shape = (
        [height, width, channels] if data_format == "channels_last" else [channels, height, width]
    )
    if batch is not None:
        shape = [batch, *shape]
    x = random_image(np.random.default_rng(draw(st.integers(0, 2**32 - 1))), dtype, shape)
    return x, h_count, w_count, data_format, (height, width)


# --------------------------------------------------------------------------- slicing
@settings(max_examples=150, deadline=None)
@given(case=cases(), mode=st.sampled_from(["pad", "drop"]))
def test_slice_patches_matches_numpy_reference(case, mode):
    x, nh, nw, data_format, _ = case
    fill = fill_for(x.dtype.type)
    got = slice_patches(x, nh, nw, mode=mode, fill_value=fill, data_format=data_format)
    want = reference_slice(x, nh, nw, mode, fill, data_format)
    assert len(got) == nh * nw
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype.as_numpy_dtype == x.dtype, k
        assert g.shape == w.shape, (k, g.shape, w.shape)
        np.testing.assert_array_equal(g.numpy(), w, err_msg=f"patch {k}")


@settings(max_examples=100, deadline=None)
@given(case=cases(divisible=True), mode=st.sampled_from(["pad", "drop"]))
def test_merge_inverts_slice_when_sizes_divide(case, mode):
    x, nh, nw, data_format, _ = case
    patches = slice_patches(x, nh, nw, mode=mode, data_format=data_format)
    merged = merge_patches(patches, nh, nw, data_format=data_format)
    np.testing.assert_array_equal(merged.numpy(), x)
    stacked = merge_patches(tf.stack(patches), nh, nw, data_format=data_format)
    np.testing.assert_array_equal(stacked.numpy(), x)


@settings(max_examples=100, deadline=None)
@given(case=cases())
def test_merge_with_original_size_crops_the_pad(case):
    x, nh, nw, data_format, (height, width) = case
    fill = fill_for(x.dtype.type)
    patches = slice_patches(x, nh, nw, fill_value=fill, data_format=data_format)
    merged = merge_patches(patches, nh, nw, original_size=(height, width), data_format=data_format)
    np.testing.assert_array_equal(merged.numpy(), x)
    # without original_size: the padded mosaic, with the pad on the bottom and right
    ph, pw = PatchGrid(nh, nw).patch_size(height, width)
    mosaic, _ = to_nhwc(
        merge_patches(patches, nh, nw, data_format=data_format).numpy(), data_format
    )
    assert mosaic.shape[1:3] == (nh * ph, nw * pw)
    assert (mosaic[:, height:] == fill).all() and (mosaic[:, :, width:] == fill).all()


def test_drop_mode_merge_gives_the_kept_part():
    x = np.arange(2 * 7 * 10, dtype=np.int32).reshape(2, 7, 10)  # CHW
    patches = slice_patches(x, 3, 4, mode="drop", data_format="channels_first")
    assert [p.shape for p in patches] == [(2, 2, 2)] * 12
    merged = merge_patches(patches, 3, 4, data_format="channels_first")
    np.testing.assert_array_equal(merged.numpy(), x[:, :6, :8])


def test_tutorial_example_5x7_image_2x3_grid_pad_9():
    image = np.arange(35, dtype=np.int64).reshape(5, 7, 1)
    patches = [p.numpy()[..., 0] for p in slice_patches(image, 2, 3, fill_value=9)]
    assert len(patches) == 6 and all(p.shape == (3, 3) for p in patches)
    rows = image[..., 0]
    assert patches[0].tolist() == rows[0:3, 0:3].tolist()
    assert patches[1].tolist() == rows[0:3, 3:6].tolist()
    assert patches[2].tolist() == [[6, 9, 9], [13, 9, 9], [20, 9, 9]]
    assert patches[3].tolist() == [[21, 22, 23], [28, 29, 30], [9, 9, 9]]
    assert patches[4].tolist() == [[24, 25, 26], [31, 32, 33], [9, 9, 9]]
    # the last patch (row 1, column 2): image rows 3-4, column 6 top-left, 9 elsewhere
    assert patches[5].tolist() == [[27, 9, 9], [34, 9, 9], [9, 9, 9]]
    assert PatchGrid(2, 3).region(5, 5, 7) == (3, 5, 6, 7)


def test_one_by_one_grid_returns_the_input():
    x = tf.random.uniform([4, 5, 6, 2])
    out = slice_patches(x, 1, 1, data_format="channels_first")
    assert len(out) == 1 and out[0] is x
    assert merge_patches(out, 1, 1) is x


def test_pad_can_leave_a_whole_patch_row_of_fill():
    # 5 rows in 4 patch rows of 2: the last row of patches is all fill
    x = np.ones([5, 2, 1], np.float32)
    patches = slice_patches(x, 4, 1, fill_value=-1.0)
    assert [float(tf.reduce_sum(p)) for p in patches] == [4.0, 4.0, 0.0, -4.0]
    assert PatchGrid(4, 1).region(3, 5, 2) == (5, 5, 0, 2)


def test_grid_regions_tile_the_image_for_every_rank():
    for nh, nw, mode, (height, width) in [
        (2, 2, "pad", (7, 9)),
        (1, 2, "pad", (8, 5)),
        (3, 4, "drop", (10, 11)),
        (2, 3, "pad", (5, 7)),
    ]:
        grid = PatchGrid(nh, nw, mode)
        owner = np.full((height, width), -1)
        for rank in range(grid.num_patches):  # rank r takes patch r % num_patches
            top, bottom, left, right = grid.region(rank, height, width)
            assert (owner[top:bottom, left:right] == -1).all(), (nh, nw, rank)
            owner[top:bottom, left:right] = rank
            assert grid.position(rank) == (rank // nw, rank % nw)
        ph, pw = grid.patch_size(height, width)
        covered = owner[: nh * ph, : nw * pw] if mode == "drop" else owner
        assert (covered >= 0).all(), (nh, nw, owner)
        assert (owner >= 0).sum() == min(height, nh * ph) * min(width, nw * pw)


def test_pad_only_copies_edge_patches_into_padded_buffers():
    """Interior patches are plain slices: their shape is static and no fill appears."""
    x = np.zeros([9, 9, 3], np.uint8)
    patches = slice_patches(x, 2, 2, fill_value=7)
    assert [int(tf.reduce_sum(tf.cast(p == 7, tf.int32))) for p in patches] == [0, 15, 15, 27]


# --------------------------------------------------------------------------- graph and tf.data
def test_inside_tf_function_with_unknown_height_and_width():
    spec = tf.TensorSpec([None, None, None, 3], tf.uint8)
    f = tf.function(lambda t: slice_patches(t, 2, 3, fill_value=5), input_signature=[spec])
    g = tf.function(
        lambda t: merge_patches(slice_patches(t, 2, 3, mode="drop"), 2, 3), input_signature=[spec]
    )
    rng = np.random.default_rng(1)
    for shape in ([2, 5, 7, 3], [1, 8, 9, 3]):
        x = random_image(rng, np.uint8, shape)
        for got, want in zip(
            f(x), reference_slice(x, 2, 3, "pad", 5, "channels_last"), strict=True
        ):
            np.testing.assert_array_equal(got.numpy(), want)
        h, w = shape[1] // 2 * 2, shape[2] // 3 * 3
        np.testing.assert_array_equal(g(x).numpy(), x[:, :h, :w])
    with pytest.raises(
        tf.errors.InvalidArgumentError, match="num_width=3 is larger than the image"
    ):
        f(np.zeros([1, 4, 2, 3], np.uint8))
    # a known width is checked while tracing, an unknown height when the data arrives
    half = tf.TensorSpec([None, 2, 3], tf.float32)
    traced = tf.function(lambda t: slice_patches(t, 1, 3), input_signature=[half], autograph=False)
    with pytest.raises(
        hvdkit.ConfigurationError, match="num_width=3 is larger than the image width 2"
    ):
        traced.get_concrete_function()


def test_patch_columns_dict_and_tuple_elements():
    images = np.arange(2 * 4 * 6 * 1, dtype=np.float32).reshape(2, 4, 6, 1)
    labels = np.array([3, 4])
    ds = tf.data.Dataset.from_tensor_slices({"image": images, "label": labels})
    out = list(ds.map(patch_columns(2, 2)).as_numpy_iterator())
    assert sorted(out[0]) == ["img0", "img1", "img2", "img3", "label"]
    for i, element in enumerate(out):
        want = reference_slice(images[i], 2, 2, "pad", 0, "channels_last")
        for k in range(4):
            np.testing.assert_array_equal(element[f"img{k}"], want[k])
        assert element["label"] == labels[i]
    tuples = tf.data.Dataset.from_tensor_slices((labels, images)).map(patch_columns(1, 2, column=1))
    label, left, right = next(iter(tuples))
    assert int(label) == 3
    np.testing.assert_array_equal(left.numpy(), images[0, :, :3])
    np.testing.assert_array_equal(right.numpy(), images[0, :, 3:])
    bare = tf.data.Dataset.from_tensor_slices(images).map(patch_columns(2, 1, prefix="p"))
    assert len(bare.element_spec) == 2


def test_rank_patch_keeps_rank_modulo_grid_or_explicit_index(size_one):
    images = np.arange(3 * 5 * 7, dtype=np.int32).reshape(3, 1, 5, 7)  # NCHW, one channel
    ds = tf.data.Dataset.from_tensor_slices((images, np.arange(3)))
    for rank in range(8):  # every rank of an 8-rank job, 2x2 grid: patch rank % 4
        mapped = ds.map(
            rank_patch(2, 2, rank=rank, size=8, fill_value=-1, data_format="channels_first")
        )
        for i, (patch, label) in enumerate(mapped.as_numpy_iterator()):
            want = reference_slice(images[i], 2, 2, "pad", -1, "channels_first")[rank % 4]
            np.testing.assert_array_equal(patch, want)
            assert label == i
    explicit = ds.map(rank_patch(2, 2, index=3, rank=0, data_format="channels_first"))
    want = np.zeros(
        [1, 3, 4], np.int32
    )  # 5x7 in a 2x2 grid of 3x4: patch 3 holds rows 3-4, cols 4-6
    want[:, :2, :3] = images[0][:, 3:, 4:]
    np.testing.assert_array_equal(next(iter(explicit))[0].numpy(), want)
    default = next(iter(ds.map(rank_patch(1, 2, size=2, data_format="channels_first"))))[
        0
    ]  # hvdkit.rank() == 0
    np.testing.assert_array_equal(default.numpy(), images[0][:, :, :4])
    dicts = tf.data.Dataset.from_tensor_slices({"image": images[:, 0, :, :, None]})  # HWC
    top = next(iter(dicts.map(rank_patch(2, 1, index=0, mode="drop"))))["image"]
    np.testing.assert_array_equal(top.numpy(), images[0, 0, :2, :, None])


def test_replicated_shuffle_is_the_same_order_for_the_same_seed(size_one):
    def order(seed):
        ds = replicated_shuffle(tf.data.Dataset.range(50), 50, seed=seed)
        return [list(ds.as_numpy_iterator()) for _ in range(2)]  # two epochs

    first = order(1000)
    assert first == order(1000)
    assert sorted(first[0]) == list(range(50))
    assert first[0] != first[1]  # reshuffled each epoch, the same way every time
    assert first != order(1001)
    drawn = replicated_shuffle(tf.data.Dataset.range(5), 5)  # seed broadcast from rank 0
    assert sorted(drawn.as_numpy_iterator()) == [0, 1, 2, 3, 4]
    assert drawn.options().deterministic is True


def test_replicated_shuffle_without_seed_needs_init():
    hvdkit.shutdown()
    with pytest.raises(hvdkit.NotInitializedError):
        replicated_shuffle(tf.data.Dataset.range(3), 3)


# --------------------------------------------------------------------------- errors
IMG = np.zeros([5, 7, 3], np.uint8)


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda: slice_patches(IMG, 6, 1), "num_height=6 is larger than the image height 5"),
        (lambda: slice_patches(IMG, 1, 8), "num_width=8 is larger than the image width 7"),
        (
            lambda: slice_patches(IMG, 1, 4, data_format="channels_first"),
            "num_width=4 is larger than the image width 3",
        ),
        (lambda: slice_patches(IMG, 0, 1), "num_height=0 must be a positive int"),
        (lambda: slice_patches(IMG, 2, -1), "num_width=-1 must be a positive int"),
        (lambda: slice_patches(IMG, 2.0, 1), "num_height=2.0 must be a positive int"),
        (lambda: slice_patches(IMG, True, 1), "num_height=True must be a positive int"),
        (
            lambda: slice_patches(IMG, 2, 2, fill_value=256),
            "fill_value=256 is outside the range [0, 255]",
        ),
        (lambda: slice_patches(IMG, 2, 2, fill_value=-1), "fill_value=-1 is outside the range"),
        (lambda: slice_patches(IMG, 2, 2, fill_value=0.5), "fill_value=0.5 is not a whole number"),
        (lambda: slice_patches(IMG, 2, 2, fill_value="x"), "fill_value='x' is not a number"),
        (
            lambda: slice_patches(IMG.astype(np.float16), 2, 2, fill_value=1e5),
            "outside the finite range of float16",
        ),
        (lambda: slice_patches(IMG.astype(bool), 2, 2, fill_value=2), "is not 0/1/False/True"),
        (lambda: slice_patches(IMG, 2, 2, fill_value=1j), "is complex, but the image is uint8"),
        (lambda: slice_patches(IMG, 2, 2, mode="crop"), "mode='crop' is unknown; use 'pad'"),
        (lambda: slice_patches(IMG, 2, 2, data_format="NHWC"), "data_format='NHWC' is unknown"),
        (lambda: slice_patches(IMG[..., 0], 2, 2), "got shape [5, 7] (2 dims)"),
        (lambda: slice_patches(tf.constant([[["a"]]]), 1, 1), "dtype string is not supported"),
        (lambda: rank_patch(2, 2, index=4), "patch index 4 is outside the 2x2 grid"),
        (lambda: rank_patch(2, 2, index=-1), "numbered 0 to 3"),
        (lambda: rank_patch(2, 2, rank=-2, size=4), "rank=-2 is outside the job's ranks [0, 4)"),
        (
            lambda: rank_patch(2, 2, rank=0, size=2),
            "a 2x2 grid has 4 patches, which does not divide the job size 2: patches [2, 3] "
            "would be kept by no rank",
        ),
        (
            lambda: rank_patch(1, 2, rank=0, size=3),
            "some patches would be kept by more ranks than others",
        ),
        (lambda: PatchGrid(2, 2).position(4), "patch index 4 is outside"),
        (lambda: merge_patches([IMG] * 5, 2, 3), "got 5 patches for a 2x3 grid"),
        (lambda: merge_patches(np.zeros([4, 2, 2, 1]), 1, 2), "has 4 entries along its first"),
        (lambda: merge_patches([IMG, IMG[:4]], 1, 2), "patch 1 has shape [4, 7, 3]"),
        (
            lambda: merge_patches(
                slice_patches(IMG, 2, 3, mode="drop"), 2, 3, original_size=(5, 7)
            ),
            "original_size=(5, 7) is larger than the merged patches (4, 6)",
        ),
        (lambda: merge_patches([IMG], 1, 1, original_size=(0, 7)), "original_size height=0"),
    ],
)
def test_errors_name_the_value_and_the_fix(call, fragment):
    with pytest.raises(hvdkit.ConfigurationError) as info:
        call()
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_dataset_map_errors_name_the_columns():
    ds = tf.data.Dataset.from_tensor_slices({"pixels": np.zeros([2, 4, 4, 1])})
    with pytest.raises(hvdkit.ConfigurationError, match=r"column 'image' is not in .*\['pixels'\]"):
        ds.map(patch_columns(2, 2))
    with pytest.raises(hvdkit.ConfigurationError, match=r"patch columns \['img0'\] already exist"):
        tf.data.Dataset.from_tensor_slices(
            {"image": np.zeros([2, 4, 4, 1]), "img0": np.zeros(2)}
        ).map(patch_columns(2, 1))
    tuples = tf.data.Dataset.from_tensor_slices((np.zeros([2, 4, 4, 1]), np.zeros(2)))
    with pytest.raises(hvdkit.ConfigurationError, match=r"column=2 does not select"):
        tuples.map(rank_patch(2, 2, index=0, column=2))
    with pytest.raises(hvdkit.ConfigurationError, match=r"seed='1' must be an int"):
        replicated_shuffle(tuples, 2, seed="1")


def test_rank_and_size_defaults_need_init_and_name_the_caller():
    """rank/size left as None come from hvdkit.runtime.job_rank_size, as shard()'s do."""
    hvdkit.shutdown()
    with pytest.raises(hvdkit.NotInitializedError, match=r"rank_patch: rank/size left as None"):
        rank_patch(1, 2)
    with pytest.raises(hvdkit.NotInitializedError, match=r"rank_patch: rank/size"):
        rank_patch(1, 2, rank=0)  # one of the two still needs the job
    rank_patch(1, 2, rank=1, size=2)  # both given: no job needed

"""Layout (dataset_strategy-style) batch slicing, looping over every rank in one process."""

import itertools
import math

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import given, settings
from hypothesis import strategies as st

import hvdkit
from hvdkit.ops import layout_block, slice_inputs, slice_inputs_map, slice_patches


def reference_block(x, layout, rank, size):
    """numpy: rank r gets block r % prod(layout), numbered row-major over the layout."""
    k = rank % math.prod(layout)
    index = np.unravel_index(k, layout)
    slices = tuple(
        slice(i * (d // s), (i + 1) * (d // s))
        for i, s, d in zip(index, layout, x.shape, strict=True)
    )
    return x[slices]


@st.composite
def layouts_and_inputs(draw):
    size = draw(st.sampled_from([1, 2, 4, 8]))
    ndim = draw(st.integers(1, 4))
    divisors = [d for d in range(1, size + 1) if size % d == 0]
    pieces = draw(st.sampled_from(divisors))
    # spread the prime factors of `pieces` over random axes
    layout = [1] * ndim
    for _ in range(int(math.log2(pieces))):
        layout[draw(st.integers(0, ndim - 1))] *= 2
    shape = [s * draw(st.integers(1, 3)) for s in layout]
    x = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(-50, 50, shape)
    return x, tuple(layout), size


@settings(max_examples=80, deadline=None)
@given(case=layouts_and_inputs())
def test_every_rank_gets_its_block_and_the_blocks_tile_the_input(case):
    x, layout, size = case
    pieces = math.prod(layout)
    seen = {}
    for rank in range(size):
        got = slice_inputs(x, layout, rank=rank, size=size)
        want = reference_block(x, layout, rank, size)
        np.testing.assert_array_equal(got.numpy(), want)
        block = layout_block(layout, rank, size)
        assert block == tuple(int(i) for i in np.unravel_index(rank % pieces, layout))
        seen.setdefault(block, []).append(rank)
    # every block is held by size/pieces ranks: r, r + pieces, r + 2*pieces, ...
    assert len(seen) == pieces
    for ranks in seen.values():
        assert ranks == list(range(ranks[0], size, pieces))
    # and putting the blocks of ranks 0..pieces-1 back together gives the input
    blocks = np.empty(layout, dtype=object)
    for rank in range(pieces):
        blocks[layout_block(layout, rank, size)] = slice_inputs(x, layout, rank=rank, size=size)
    np.testing.assert_array_equal(np.block(blocks.tolist()), x)


def test_issue_layout_nchw_images_and_replicated_labels_on_8_ranks():
    images = np.arange(2 * 3 * 4 * 8).reshape(2, 3, 4, 8)  # N C H W
    labels = np.array([5, 6])
    for rank in range(8):
        imgs, labs = slice_inputs((images, labels), ((1, 1, 2, 4), (1,)), rank=rank, size=8)
        row, col = divmod(rank, 4)
        np.testing.assert_array_equal(
            imgs.numpy(), images[:, :, 2 * row : 2 * row + 2, 2 * col : 2 * col + 2]
        )
        np.testing.assert_array_equal(labs.numpy(), labels)


def test_layout_blocks_are_the_patches_of_slice_patches():
    """(1, 1, h, w) on NCHW is rank r's patch of an h x w grid, when the sizes divide."""
    images = np.random.default_rng(0).normal(size=(2, 3, 6, 8)).astype(np.float32)
    for (nh, nw), size in itertools.product([(1, 2), (2, 1), (2, 2), (3, 4)], [12, 24]):
        patches = slice_patches(images, nh, nw, data_format="channels_first")
        for rank in range(size):
            got = slice_inputs(images, (1, 1, nh, nw), rank=rank, size=size)
            np.testing.assert_array_equal(got.numpy(), patches[rank % (nh * nw)].numpy())


def test_two_ranks_nhwc_halves_and_structure():
    images = np.arange(4 * 4 * 6 * 2).reshape(4, 4, 6, 2)
    labels = np.arange(4)
    for rank in (0, 1):
        out = slice_inputs([images, labels], [(1, 2, 1, 1), (1,)], rank=rank, size=2)
        assert isinstance(out, list)
        np.testing.assert_array_equal(out[0].numpy(), images[:, 2 * rank : 2 * rank + 2])
        np.testing.assert_array_equal(out[1].numpy(), labels)
        by_batch = slice_inputs((images, labels), ((2, 1, 1, 1), (2,)), rank=rank, size=2)
        assert isinstance(by_batch, tuple)
        np.testing.assert_array_equal(by_batch[0].numpy(), images[2 * rank : 2 * rank + 2])
        np.testing.assert_array_equal(by_batch[1].numpy(), labels[2 * rank : 2 * rank + 2])
        # all ones replicates, and returns the input itself
        x = tf.constant(images)
        assert slice_inputs(x, (1, 1, 1, 1), rank=rank, size=2) is x


def test_defaults_come_from_the_runtime():
    hvdkit.shutdown()
    hvdkit.init(backend="local")
    try:
        x = np.arange(8).reshape(2, 4)
        np.testing.assert_array_equal(slice_inputs(x, (1, 1)).numpy(), x)
        with pytest.raises(hvdkit.ConfigurationError, match=r"does not divide the job size 1"):
            slice_inputs(x, (1, 2))
    finally:
        hvdkit.shutdown()


def test_tf_function_and_dataset_map_with_unknown_batch_size():
    images = np.arange(5 * 2 * 4 * 6).reshape(5, 2, 4, 6).astype(np.float32)
    labels = np.arange(5)
    ds = tf.data.Dataset.from_tensor_slices((images, labels)).batch(2)  # batch dim None
    for rank in (0, 1):
        mapped = ds.map(slice_inputs_map(((1, 1, 1, 2), (1,)), rank=rank, size=2))
        assert mapped.element_spec[0].shape.as_list() == [None, 2, 4, 3]
        got = list(mapped.as_numpy_iterator())
        assert [g[0].shape[0] for g in got] == [2, 2, 1]
        np.testing.assert_array_equal(
            np.concatenate([g[0] for g in got]), images[..., 3 * rank : 3 * rank + 3]
        )
        np.testing.assert_array_equal(np.concatenate([g[1] for g in got]), labels)
    single = tf.data.Dataset.from_tensor_slices(images).batch(2, drop_remainder=True)
    out = next(iter(single.map(slice_inputs_map((2, 1, 1, 1), rank=1, size=2))))
    np.testing.assert_array_equal(out.numpy(), images[1:2])
    # an uneven batch is only known at run time: TensorFlow's assertion names the layout
    uneven = tf.data.Dataset.from_tensor_slices(images).batch(5)
    with pytest.raises(
        tf.errors.InvalidArgumentError, match=r"layout \(2, 1, 1, 1\) splits axis 0"
    ):
        next(iter(uneven.map(slice_inputs_map((2, 1, 1, 1), rank=0, size=2))))


X = np.zeros([4, 3, 6, 8])


@pytest.mark.parametrize(
    "call, fragment",
    [
        (
            lambda: slice_inputs((X, X[:, 0, 0, 0]), ((1, 1, 2, 2), (1,)), rank=0, size=2),
            "layout (1, 1, 2, 2) cuts an input into 4 blocks, which does not divide the job size 2",
        ),
        (
            lambda: slice_inputs(X, (1, 1, 3, 1), rank=0, size=4),
            "layout (1, 1, 3, 1) cuts an input into 3 blocks, which does not divide the job size 4",
        ),
        (
            lambda: slice_inputs(X, (1, 1, 1, 3), rank=0, size=3),
            "splits axis 3 of an input of shape [4, 3, 6, 8] into 3, but 8 is not divisible by 3",
        ),
        (
            lambda: slice_inputs((X, X), ((1, 1, 1, 1),), rank=0, size=1),
            "got 2 inputs but 1 layouts",
        ),
        (
            lambda: slice_inputs(X, (1, 2), rank=0, size=2),
            "layout (1, 2) has 2 entries but the input has shape",
        ),
        (lambda: slice_inputs(X, (1, 0, 1, 1), rank=0, size=1), "is not a tuple of positive ints"),
        (
            lambda: slice_inputs(X, (1, 1, 1, 2), rank=2, size=2),
            "rank=2 is outside the job's ranks [0, 2)",
        ),
        (lambda: layout_block((2,), 0, 0), "size=0 must be a positive int"),
        (lambda: layout_block((), 0, 1), "layout () is not a tuple"),
        (
            lambda: slice_inputs_map([(1,), (1,)], rank=0, size=1)(tf.zeros([2])),
            "got 1 inputs but 2",
        ),
    ],
)
def test_errors_name_the_layout_and_the_job_size(call, fragment):
    with pytest.raises(hvdkit.ConfigurationError) as info:
        call()
    assert fragment in str(info.value)

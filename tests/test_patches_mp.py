"""Patch parallelism and layout slicing with 2 processes under horovodrun, over Gloo and MPI."""

from conftest import launch

EXPECTED = [
    "topology",
    "seeded_shuffle_same_order_on_every_rank",
    "plain_shuffle_differs_between_ranks",
    "seed_none_is_broadcast_from_rank_0",
    "rank_patch_1x2_pad_allgather_merge_is_the_batch",
    "rank_patch_2x1_drop_channels_first_allgather_merge_is_the_batch",
    "patch_columns_2x2_two_patches_per_rank_merge_is_the_batch",
    "layout_nchw_width_halves_labels_replicated",
    "layout_nhwc_height_halves",
    "layout_batch_split_and_replicate",
    "layout_dataset_map_in_tf_data",
    "layout_errors_name_layout_and_job_size",
    "different_global_seeds_are_detected",
]


def test_patches_two_ranks(tmp_path, transport):
    res = launch("patches_worker.py", tmp_path, transport)
    res.assert_all_passed(EXPECTED)
    # both ranks read the same images in the same order
    assert res.values(0)["seeded_order"] == res.values(1)["seeded_order"]
    assert sorted(res.values(0)["seeded_order"]) == list(range(20))
    # the two width halves of the NCHW batch: 0..287 split by columns 0-2 / 3-5
    sums = [res.values(r)["nchw_w_sum"] for r in (0, 1)]
    assert sum(sums) == sum(range(4 * 3 * 4 * 6)) and sums[1] - sums[0] == 3 * 4 * 3 * 4 * 3

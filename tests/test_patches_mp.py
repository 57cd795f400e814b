"""Patch parallelism and layout slicing with 2 processes under horovodrun, over Gloo and MPI."""

import pytest

from conftest import WorkerRun

RUN = WorkerRun("patches_worker.py")

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


@pytest.mark.parametrize("check", EXPECTED)
def test_patches(check, transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_check(check)


def test_patches_reports_exactly_these_checks(transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_reported_exactly(EXPECTED)


def test_patches_values_agree_across_ranks(transport, tmp_path_factory):
    res = RUN.result(transport, tmp_path_factory)
    # both ranks read the same images in the same order
    assert res.values(0)["seeded_order"] == res.values(1)["seeded_order"]
    assert sorted(res.values(0)["seeded_order"]) == list(range(20))
    # the two width halves of the NCHW batch: 0..287 split by columns 0-2 / 3-5
    sums = [res.values(r)["nchw_w_sum"] for r in (0, 1)]
    assert sum(sums) == sum(range(4 * 3 * 4 * 6)) and sums[1] - sums[0] == 3 * 4 * 3 * 4 * 3

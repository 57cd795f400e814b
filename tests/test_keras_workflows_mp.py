"""A Keras user's everyday workflows on 2 ranks, over Gloo and MPI (issue 22; docs/keras.md).

One 2-rank job per transport runs every check (tests/multiproc/keras_workflows_worker.py);
the tests here also load the model it saved in fresh processes, as a serving or
evaluation machine would: with hvdkit imported in any order, and without hvdkit.
"""

import json
import subprocess
import sys

import pytest

from conftest import REPO, WorkerRun, launcher_env

RUN = WorkerRun("keras_workflows_worker.py", timeout=900)

CHECKS = [
    "keras_file_loads_and_resumes_the_same_trajectory",
    "load_model_wraps_a_plain_keras_file",
    "model_checkpoint_full_weights_only_and_best",
    "weights_h5_and_export_for_serving",
    "backup_and_restore_refused_for_checkpointer",
    "subclassed_train_step_calls_optimizer_apply",
    "two_wrapped_optimizers_in_one_step_gan",
    "deciding_callbacks_agree_whatever_the_order",
    "rank_zero_only_refuses_deciding_callbacks",
    "tensorboard_csv_progbar_on_rank_zero_only",
    "evaluate_reports_the_whole_set",
    "predict_then_unshard_in_original_order",
    "validation_split_and_validation_freq",
    "class_weight_and_sample_weight",
    "optimizer_features_through_the_wrapper",
    "batch_normalization_keeps_local_statistics",
    "sync_batch_normalization_equals_one_process",
    "dropout_with_seed_keeps_ranks_identical",
    "horovod_names_refused_where_unsupported",
    "alltoall_errors_are_horovods_classes",
    "object_collectives_register_their_wait",
]


@pytest.mark.parametrize("check", CHECKS)
def test_keras_workflow(check, transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_check(check)


def test_keras_workflows_report_exactly_these_checks(transport, tmp_path_factory):
    RUN.result(transport, tmp_path_factory).assert_reported_exactly(CHECKS)


def test_best_checkpoints_are_the_same_epochs_on_both_ranks(transport, tmp_path_factory):
    res = RUN.result(transport, tmp_path_factory)
    res.assert_check("model_checkpoint_full_weights_only_and_best")
    assert res.values(0)["best_epochs_rank0"] == res.values(1)["best_epochs_rank1"]
    assert res.values(0)["best_epochs_rank0"][0] == 1


# What a fresh process does with rank 0's dist.keras (a DistributedOptimizer inside).
_LOAD = """
import json, sys
{imports}
model = keras.models.load_model(sys.argv[1]{kwargs})
opt = getattr(model, "optimizer", None)
print(json.dumps({{"optimizer": type(opt).__name__ if opt is not None else None,
                  "inner": type(getattr(opt, "inner_optimizer", None)).__name__,
                  "iterations": int(opt.iterations.numpy()) if opt is not None else None,
                  "outputs": model.predict(__import__("numpy").ones((2, 8), "float32"),
                                           verbose=0).shape[1]}}))
"""

FRESH = {
    "import_hvdkit_then_keras": ("import hvdkit\nimport keras", ""),
    "import_keras_then_hvdkit": ("import keras\nimport hvdkit", ""),
    "import_hvdkit_then_tensorflow": (
        "import hvdkit\nimport tensorflow as tf\nkeras = tf.keras",
        "",
    ),
    "without_hvdkit_compile_false": (
        "sys.modules['hvdkit'] = None  # hvdkit is not installed here\nimport keras",
        ", compile=False",
    ),
}


def _fresh_load(saved, imports, kwargs):
    script = _LOAD.format(imports=imports, kwargs=kwargs)
    env = launcher_env()
    proc = subprocess.run(
        [sys.executable, "-c", script, str(saved)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    return proc


@pytest.mark.parametrize("how", sorted(FRESH))
def test_saved_model_loads_in_a_fresh_process(how, tmp_path_factory):
    res = RUN.result("gloo", tmp_path_factory)
    res.assert_check("keras_file_loads_and_resumes_the_same_trajectory")
    proc = _fresh_load(res.outdir / "dist.keras", *FRESH[how])
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if how == "without_hvdkit_compile_false":
        assert got == {"optimizer": None, "inner": "NoneType", "iterations": None, "outputs": 3}
    else:
        assert got == {
            "optimizer": "DistributedOptimizer",
            "inner": "Adam",
            "iterations": 8,
            "outputs": 3,
        }


def test_without_hvdkit_the_file_names_what_is_missing(tmp_path_factory):
    res = RUN.result("gloo", tmp_path_factory)
    imports = "sys.modules['hvdkit'] = None\nimport keras"
    proc = _fresh_load(res.outdir / "dist.keras", imports, "")
    assert proc.returncode != 0
    assert "Could not locate class 'DistributedOptimizer'" in proc.stderr, proc.stderr[-2000:]

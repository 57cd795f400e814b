"""Every "refused / not supported / not exposed / an error" in the docs is a test's assertion.

The convention (docs/contributing.md, "Docs that stay true"): a block (paragraph,
list item or table row) that says hvdkit refuses something either names, in a
code span, the test that asserts the refusal (`test_name`, `tests/x.py::test_name`,
`tests/x.py`), or is listed in :data:`CLAIMS` below with that test. A claim
with neither fails :func:`test_every_refusal_in_the_docs_has_its_test`; a CLAIMS
line whose words left the page fails too, so the list cannot rot.

Evidence is a test of the suite (its existence is checked here; the suite runs
it) or a ``probe:`` of this file, run here in one process: it asserts the
refusal, so it fails on the day the feature arrives and the doc must change.
"""

from __future__ import annotations

import re

import pytest
from _docs import PAGES, blocks, find_module, missing_test

import hvdkit

CLAIM = re.compile(
    r"refus|not supported|unsupported|not exposed|(?<!`, `)NotSupportedError|is an error|"
    r"argument error|Arguments are checked",
    re.I,
)
CITED = re.compile(r"`((?:tests/[\w/]+\.py(?:::[^`]+)?)|test_\w+(?:\[[^`\]]*\])?)`")

U = "tests/unit/"
KW = U + "test_keras_workflows_local.py::"
PRE = U + "test_preemption.py::"
MP = "tests/multiproc/"

# (page, words of the claim, the test that asserts it). Words are a substring of one block.
CLAIMS: list[tuple[str, str, str]] = [
    # --- limits.md
    (
        "docs/limits.md",
        "hvdkit refuses with a clear error instead of failing in XLA",
        MP + "training_worker.py::xla_compile_refused_with_clear_error",
    ),
    (
        "docs/limits.md",
        "`LearningRateWarmupCallback(momentum_correction=True)`** is refused",
        U + "test_runtime.py::test_warmup_callback_keeps_horovods_argument_positions",
    ),
    (
        "docs/limits.md",
        "hvdkit's workers check and refuse with the fix",
        "tests/test_launch_mp.py::test_worker_refuses_a_host_name_that_resolves_to_loopback",
    ),
    (
        "docs/limits.md",
        "only (over Gloo `NotSupportedError`, as Horovod has no Gloo Adasum)",
        MP + "horovod_features_worker.py",
    ),
    # --- collectives.md
    (
        "docs/collectives.md",
        "Argument errors are caught before any communication",
        U + "test_runtime.py::test_collective_argument_errors",
    ),
    (
        "docs/collectives.md",
        "a `process_set` that is not an `hvdkit.ProcessSet`",
        U + "test_keras_workflows_local.py::test_adasum_and_global_process_set_in_collectives",
    ),
    (
        "docs/collectives.md",
        "A rank that never calls the collective at all is not an argument error",
        "tests/test_divergence_mp.py",
    ),
    # --- training.md
    (
        "docs/training.md",
        "an op other than `Average`/`Sum`/`Adasum`",
        "probe:distributed_optimizer_takes_average_sum_or_adasum",
    ),
    (
        "docs/training.md",
        "Horovod's `gradient_predivide_factor` (not implemented)",
        U + "test_runtime.py::test_distributed_optimizer_forwards_configuration",
    ),
    (
        "docs/training.md",
        "Refuses callbacks that change the training",
        KW + "test_rank_zero_only_refuses_callbacks_that_change_training",
    ),
    (
        "docs/training.md",
        "A bool, a string or a value below 1 is refused",
        U + "test_runtime.py::test_warmup_callback_keeps_horovods_argument_positions",
    ),
    # --- keras.md
    (
        "docs/keras.md",
        "refused in jobs of several ranks (`ConfigurationError` at `fit`)",
        "tests/test_keras_workflows_mp.py::backup_and_restore_refused_for_checkpointer",
    ),
    (
        "docs/keras.md",
        "refused with the reason (`EarlyStopping`",
        KW + "test_rank_zero_only_refuses_callbacks_that_change_training",
    ),
    # --- runtime.md
    (
        "docs/runtime.md",
        'Asking for `"local"` while a launcher started several processes is refused',
        U + "test_runtime.py::test_backend_selection_errors",
    ),
    (
        "docs/runtime.md",
        "something Horovod also refuses, e.g. `allreduce` of `tf.IndexedSlices`",
        U + "test_horovod_api_local.py::test_process_set_and_session_refused",
    ),
    # --- sink.md
    (
        "docs/sink.md",
        "a `device` that is not a CPU or GPU",
        U + "test_sink.py::test_prefetch_to_device_refuses_bad_arguments",
    ),
    (
        "docs/sink.md",
        "`True` is refused up front",
        MP + "sink_worker.py::jit_compile_refused_in_a_multi_process_job",
    ),
    (
        "docs/sink.md",
        "a model that is not compiled or was compiled with `run_eagerly=True`",
        U + "test_sink.py::test_train_refuses_bad_arguments",
    ),
    ("docs/sink.md", "and refuse different lengths on every rank at once", "tests/test_sink_mp.py"),
    ("docs/sink.md", "next to a known length is refused", "tests/test_sink_mp.py"),
    (
        "docs/sink.md",
        "giving both names of one argument is refused",
        U + "test_mindspore_names.py::test_train_takes_mindsporess_argument_names",
    ),
    ("docs/sink.md", "catching the error and continuing is not supported", "tests/test_sink_mp.py"),
    # --- patches.md
    ("docs/patches.md", "a 2 x 2 grid on 2 ranks is refused", U + "test_patches.py"),
    ("docs/patches.md", "`fill_value=256` for `uint8` is an error", U + "test_patches.py"),
    ("docs/patches.md", "asking for the full size then is an error", U + "test_patches.py"),
    ("docs/patches.md", "an uneven axis is an error", U + "test_layout.py"),
    ("docs/patches.md", "Layout slicing refuses uneven splits", U + "test_layout.py"),
    ("docs/patches.md", "Argument errors found while tracing", U + "test_autograph.py"),
    # --- fault-tolerance.md, preemption.md, sharding.md, install.md
    ("docs/fault-tolerance.md", "what can it refuse?", U + "test_checkpoint.py"),
    (
        "docs/fault-tolerance.md",
        "so it is refused rather than skipped",
        U + "test_checkpoint.py::test_corrupt_manifest_is_an_error_naming_the_file",
    ),
    (
        "docs/preemption.md",
        "refused with an error naming both",
        PRE + "test_steps_longer_than_the_grace_period_are_refused_after_three_intervals",
    ),
    (
        "docs/preemption.md",
        "the ranks did not stop within the grace period",
        PRE + "test_a_process_that_never_reaches_a_step_boundary_ends_after_the_grace_period",
    ),
    (
        "docs/sharding.md",
        "It refuses a state taken with",
        U + "test_sharding.py::test_sampler_epochs_positions_and_state",
    ),
    (
        "docs/install.md",
        "refuses a TensorFlow outside the supported",
        U + "test_install_horovod.py::test_unsupported_tensorflow_is_refused_unless_asked",
    ),
    # --- launching.md, porting-mindspore.md
    (
        "docs/launching.md",
        "`MS_PSERVER` is refused",
        U + "test_mindspore_names.py::test_parameter_server_and_unknown_roles_are_refused",
    ),
    (
        "docs/launching.md",
        "the worker is refused (`refused this worker: bad",
        "tests/test_launch_mp.py::test_scheduler_refuses_a_wrong_token_and_jobs_do_not_mix",
    ),
    ("docs/launching.md", "(a forged `abort` or rank assignment is dropped)", U + "test_auth.py"),
    (
        "docs/launching.md",
        "The worker checks this before registering and refuses",
        "tests/test_launch_mp.py::test_worker_refuses_a_host_name_that_resolves_to_loopback",
    ),
    (
        "docs/porting-mindspore.md",
        "`MS_PSERVER` is refused",
        U + "test_mindspore_names.py::test_parameter_server_and_unknown_roles_are_refused",
    ),
    (
        "docs/porting-mindspore.md",
        "refuses a dataset that repeats forever",
        U + "test_mindspore_names.py::test_get_dataset_size",
    ),
    (
        "docs/porting-mindspore.md",
        "other options are refused",
        U + "test_mindspore_names.py::test_data_sink_jit_config",
    ),
    (
        "docs/porting-mindspore.md",
        "a script piped on standard input is refused",
        U + "test_mindspore_names.py::test_a_script_from_stdin_cannot_be_a_worker",
    ),
    (
        "docs/porting-mindspore.md",
        "A process refuses instead of training alone",
        U + "test_mindspore_names.py::test_job_variables_without_a_launcher_refuse_to_train_alone",
    ),
    # --- porting-horovod.md
    ("docs/porting-horovod.md", "which Keras 3 refuses", "tests/test_examples_horovod_mp.py"),
    (
        "docs/porting-horovod.md",
        "**refused on use**",
        U + "test_keras_workflows_local.py::test_horovod_only_names_import_and_refuse_on_use",
    ),
    (
        "docs/porting-horovod.md",
        "Horovod refuses allgather/broadcast/alltoall/reducescatter while",
        MP + "horovod_api_worker.py",
    ),
    (
        "docs/porting-horovod.md",
        "over Gloo `NotSupportedError` naming MPI",
        MP + "horovod_features_worker.py",
    ),
    (
        "docs/porting-horovod.md",
        "`renorm` refused",
        "probe:sync_batch_norm_refuses_fused_and_renorm",
    ),
    (
        "docs/porting-horovod.md",
        "`True` is refused: Keras 3 optimizers",
        U + "test_runtime.py::test_warmup_callback_keeps_horovods_argument_positions",
    ),
    (
        "docs/porting-horovod.md",
        "refuses to start `fit` without one",
        MP + "horovod_features_worker.py::BestModelCheckpoint has no filepath",
    ),
    (
        "docs/porting-horovod.md",
        "Argument errors hvdkit finds before communicating",
        U + "test_runtime.py::test_collective_argument_errors",
    ),
    (
        "docs/porting-horovod.md",
        "Gloo hvdkit raises `NotSupportedError` naming MPI",
        MP + "horovod_features_worker.py",
    ),
    (
        "docs/porting-horovod.md",
        "refused at `hvdkit.init()` (`NotSupportedError`",
        KW + "test_horovodrun_elastic_mode_is_refused_naming_hvdkits_launch",
    ),
    (
        "docs/porting-horovod.md",
        "`process_set_id` was set by hand is refused with a `ValueError`",
        U + "test_process_sets_local.py",
    ),
    # --- security.md
    (
        "docs/security.md",
        "it is refused as a `bad job token`",
        U + "test_auth.py::test_a_captured_registration_replayed_on_a_new_connection_is_refused",
    ),
    (
        "docs/security.md",
        "The one unsigned message a worker accepts is a `refused`",
        U + "test_auth.py::test_secured_channel_drops_forged_replayed_and_unsigned_messages",
    ),
    (
        "docs/security.md",
        "gets `403 Forbidden` before any of its request is read",
        U + "test_auth.py::test_rendezvous_refuses_clients_not_of_the_job",
    ),
    (
        "docs/security.md",
        "does not resolve to is refused (403)",
        U + "test_auth.py::test_rendezvous_refuses_clients_not_of_the_job",
    ),
    (
        "docs/security.md",
        "(and refuses a file that others may read)",
        U + "test_hostile_input.py::test_token_file_is_read_only_when_private",
    ),
    (
        "docs/security.md",
        "Watch the launcher's log for `refused a worker from`",
        U + "test_hostile_input.py::test_refusal_log_is_keyed_on_fixed_kinds",
    ),
    # --- more of porting-horovod.md, sink.md, training.md, divergence.md
    (
        "docs/porting-horovod.md",
        "`horovodrun --host-discovery-script` is refused",
        KW + "test_horovodrun_elastic_mode_is_refused_naming_hvdkits_launch",
    ),
    (
        "docs/porting-horovod.md",
        "`average_aggregated_gradients=True` is refused, as Horovod",
        MP + "horovod_features_worker.py::average_aggregated_gradients=True",
    ),
    (
        "docs/sink.md",
        "`steps_per_epoch` conflicts with sink mode and is refused",
        U + "test_sink.py::test_train_refuses_bad_arguments",
    ),
    (
        "docs/training.md",
        "`fused=True` and `renorm=True` are refused",
        "probe:sync_batch_norm_refuses_fused_and_renorm",
    ),
    (
        "docs/divergence.md",
        "is refused with `ConfigurationError` naming the variable",
        U + "test_divergence.py::test_malformed_launcher_size_is_refused",
    ),
    # --- spark.md
    (
        "docs/spark.md",
        "`use_mpi=True`, `extra_mpi_args` and `nics` are refused with",
        "probe:spark_refuses_mpi_and_nics",
    ),
    (
        "docs/spark.md",
        "`ConfigurationError` (barrier stages refuse it)",
        "probe:spark_refuses_dynamic_allocation",
    ),
]


# --- probes: run here; each asserts a refusal the docs state -----------------------


@pytest.fixture(scope="module")
def size_one():
    hvdkit.init(backend="local")
    yield
    hvdkit.shutdown()


def probe_sync_batch_norm_refuses_fused_and_renorm(request):
    request.getfixturevalue("size_one")
    with pytest.raises(hvdkit.ConfigurationError, match="renorm"):
        hvdkit.SyncBatchNormalization(renorm=True)
    with pytest.raises(hvdkit.ConfigurationError, match="fused"):
        hvdkit.SyncBatchNormalization(fused=True)


def probe_distributed_optimizer_takes_average_sum_or_adasum(request):
    import keras

    request.getfixturevalue("size_one")
    with pytest.raises(hvdkit.ConfigurationError, match="hvdkit.Adasum"):
        hvdkit.DistributedOptimizer(keras.optimizers.SGD(0.1), op=hvdkit.Max)


class _SparkConf:
    def __init__(self, values: dict[str, str]):
        self.values = values

    def get(self, key: str, default: str | None = None) -> str | None:
        return self.values.get(key, default)


class _SparkContext:
    """The driver's active context, as far as ``hvdkit.spark.run``'s first checks read it."""

    def __init__(self, **values: str):
        self.conf = _SparkConf(values)

    def getConf(self) -> _SparkConf:  # pyspark's name
        return self.conf


def _spark_with(request, **conf: str):
    pyspark = pytest.importorskip("pyspark")
    request.getfixturevalue("monkeypatch").setattr(
        pyspark.SparkContext, "_active_spark_context", _SparkContext(**conf)
    )
    return find_module("spark.py")  # wherever the Spark environment lives


def probe_spark_refuses_mpi_and_nics(request):
    spark = _spark_with(request)
    for kwargs, fragment in (
        ({"use_mpi": True}, "use_mpi"),
        ({"extra_mpi_args": "-x A"}, "extra_mpi_args"),
        ({"nics": {"eth0"}}, "nics"),
    ):
        with pytest.raises(hvdkit.NotSupportedError, match=fragment):
            spark.run(print, num_proc=1, **kwargs)


def probe_spark_refuses_dynamic_allocation(request):
    spark = _spark_with(request, **{"spark.dynamicAllocation.enabled": "true"})
    with pytest.raises(hvdkit.ConfigurationError, match="dynamicAllocation"):
        spark.run(print, num_proc=1)


PROBES = {
    name.removeprefix("probe_"): f
    for name, f in dict(globals()).items()
    if name.startswith("probe_")
}


# --- the checks ----------------------------------------------------------------------


def claim_blocks():
    for page in PAGES:
        for number, block in blocks(page):
            if CLAIM.search(block):
                yield page, number, block


def covered(page: str, block: str) -> bool:
    """Whether a claim block cites an existing test or is listed in CLAIMS."""
    if any(missing_test(c) is None for c in CITED.findall(block)):
        return True
    return any(p == page and words in block for p, words, _ in CLAIMS)


def test_every_refusal_in_the_docs_has_its_test():
    untested = [
        f"{page}:{number}: {block[:160]}"
        for page, number, block in claim_blocks()
        if not covered(page, block)
    ]
    assert not untested, "claims with no test (cite one, or add it to CLAIMS):\n" + "\n".join(
        untested
    )


def test_every_listed_claim_is_still_in_its_page_and_its_test_exists():
    problems = []
    texts = {page: [b for _, b in blocks(page)] for page in PAGES}
    for page, words, evidence in CLAIMS:
        if not any(words in b for b in texts.get(page, [])):
            problems.append(f"{page}: no longer says {words!r}: drop or update its CLAIMS line")
        if evidence.startswith("probe:"):
            if evidence.removeprefix("probe:") not in PROBES:
                problems.append(f"{page}: {words!r}: no {evidence}")
        elif (why := missing_test(evidence)) is not None:
            problems.append(f"{page}: {words!r}: {why}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("page", "words", "probe"),
    [(p, w, e.removeprefix("probe:")) for p, w, e in CLAIMS if e.startswith("probe:")],
)
def test_the_docs_refusals_still_hold(page, words, probe, request):
    """Fails on the day the feature arrives: then the doc's sentence must change."""
    PROBES[probe](request)


def test_the_claim_reader_on_known_blocks():
    assert CLAIM.search("`x=2` is refused") and CLAIM.search("over Gloo `NotSupportedError`")
    assert not CLAIM.search("errors: `LaunchError`, `NotSupportedError`")  # a list of names
    assert not covered("docs/x.md", "A negative size is refused.")
    assert covered("docs/x.md", "A negative size is refused (`test_backend_selection_errors`).")
    assert not covered("docs/x.md", "A negative size is refused (`test_no_such_test_here`).")

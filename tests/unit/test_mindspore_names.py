"""MindSpore's names and environment in one process: roles, refusals, sink arguments, sizes."""

import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import hvdkit
from hvdkit import config, sink
from hvdkit.launch import inprocess, roles
from hvdkit.launch.scheduler import Scheduler

JOB_VARS = [
    "HVDKIT_ROLE", "MS_ROLE", "HVDKIT_WORKER_NUM", "MS_WORKER_NUM", "HVDKIT_SCHED_HOST",
    "MS_SCHED_HOST", "HVDKIT_SCHED_PORT", "MS_SCHED_PORT", "HOROVOD_SIZE",
    "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "HVDKIT_BACKEND",
]  # fmt: skip


@pytest.fixture
def clean_env(monkeypatch):
    for var in JOB_VARS:
        monkeypatch.delenv(var, raising=False)
    hvdkit.shutdown()
    yield monkeypatch
    hvdkit.shutdown()


@pytest.mark.parametrize(
    "var, value, role",
    [
        ("MS_ROLE", "MS_SCHED", "scheduler"),
        ("MS_ROLE", "MS_WORKER", "worker"),
        ("HVDKIT_ROLE", "MS_WORKER", "worker"),
        ("HVDKIT_ROLE", "scheduler", "scheduler"),
        ("HVDKIT_ROLE", "worker", "worker"),
    ],
)
def test_role_values_of_both_projects(clean_env, var, value, role):
    clean_env.setenv(var, value)
    assert config.role() == role


def test_parameter_server_and_unknown_roles_are_refused(clean_env):
    assert config.role() is None
    clean_env.setenv("MS_ROLE", "MS_PSERVER")
    with pytest.raises(hvdkit.LaunchError, match=r"MS_ROLE='MS_PSERVER': hvdkit has no param"):
        config.role()
    clean_env.setenv("HVDKIT_ROLE", "sched")  # hvdkit's variable wins over MS_ROLE
    with pytest.raises(hvdkit.LaunchError, match=r"HVDKIT_ROLE='sched' is not a role.*MS_SCHED"):
        config.role()


@pytest.mark.parametrize(
    "var, value",
    [("MS_WORKER_NUM", "2"), ("MS_SCHED_HOST", "10.0.0.1"), ("HVDKIT_SCHED_PORT", "8117")],
)
def test_job_variables_without_a_launcher_refuse_to_train_alone(clean_env, var, value):
    clean_env.setenv(var, value)
    with pytest.raises(hvdkit.ConfigurationError) as info:
        hvdkit.init()
    assert f"{var}={value!r}" in str(info.value) and "train alone" in str(info.value)
    assert not hvdkit.is_initialized()
    hvdkit.init(backend="local")  # said explicitly: one process, on purpose
    assert hvdkit.size() == 1


def test_runtime_init_with_a_role_refuses_instead_of_training_alone(clean_env):
    from hvdkit import runtime

    clean_env.setenv("MS_ROLE", "MS_WORKER")
    with pytest.raises(hvdkit.ConfigurationError, match=r"MS_ROLE='MS_WORKER'"):
        runtime.init()


def test_role_under_a_launcher_is_refused(clean_env):
    clean_env.setenv("MS_ROLE", "MS_WORKER")
    clean_env.setenv("HOROVOD_SIZE", "2")
    with pytest.raises(hvdkit.LaunchError, match=r"MS_ROLE asks .* worker .* one of 2 processes"):
        hvdkit.init()


def test_messages_name_the_variable_the_user_set(clean_env):
    # hvdkit's name unless only MindSpore's is set; hvdkit's too when neither is (to set it)
    assert config.named(config.WORKER_NUM) == "HVDKIT_WORKER_NUM"
    clean_env.setenv("MS_WORKER_NUM", "two")
    clean_env.setenv("MS_SCHED_HOST", "127.0.0.1")
    assert [config.named(n) for n in config.JOB_VARS] == [
        "HVDKIT_ROLE", "MS_WORKER_NUM", "MS_SCHED_HOST", "HVDKIT_SCHED_PORT",
    ]  # fmt: skip
    assert config.named(config.MIN_WORKERS) == "HVDKIT_MIN_WORKERS"  # no alias
    with pytest.raises(hvdkit.LaunchError, match=r"^MS_WORKER_NUM='two' is not a whole number"):
        roles.main("scheduler", [])
    clean_env.setenv("MS_ROLE", "sched")
    with pytest.raises(hvdkit.LaunchError, match=r"^MS_ROLE='sched' is not a role"):
        roles.main("sched", [])
    clean_env.setenv("MS_SCHED_PORT", "80.5")
    with pytest.raises(hvdkit.LaunchError, match=r"^MS_SCHED_PORT='80.5' .*e\.g\. MS_SCHED_PORT="):
        roles.main("worker", ["python", "-c", "pass"])
    clean_env.setenv("HVDKIT_WORKER_NUM", "0")  # both set: hvdkit's wins, and is named
    with pytest.raises(hvdkit.LaunchError, match=r"^HVDKIT_WORKER_NUM=0 must be at least 1"):
        Scheduler("127.0.0.1", 0, 0, "t" * 32, 1.0)


def test_launched_processes_may_keep_the_job_variables(clean_env):
    # what a worker's rank sees: HOROVOD_SIZE plus the job's HVDKIT_* settings
    clean_env.setenv("HVDKIT_WORKER_NUM", "2")
    clean_env.setenv("HOROVOD_SIZE", "1")
    hvdkit.init()
    assert hvdkit.size() == 1 and hvdkit.backend_name() == "horovod"


def test_a_script_from_stdin_cannot_be_a_worker(tmp_path):
    code = (
        "import sys; from hvdkit.launch import inprocess\n"
        "try:\n    inprocess.script_command()\n"
        "except Exception as e:\n    print(type(e).__name__, e)\n"
    )
    out = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True)
    assert "LaunchError" in out.stdout and "standard input" in out.stdout, out
    assert inprocess.script_command()[0] == sys.executable


def test_scheduler_token_file_follows_the_port(clean_env, tmp_path):
    clean_env.delenv("HVDKIT_TOKEN_FILE", raising=False)
    clean_env.setenv("HOME", str(tmp_path))
    clean_env.setenv("MS_SCHED_PORT", "8117")
    assert inprocess.default_token_file() == str(tmp_path / ".hvdkit" / "job-8117.token")


# ----------------------------------------------------------------------------- sink names
def make_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=False)
    return model


def dataset():
    x = np.arange(48, dtype="float32").reshape(12, 4) / 48
    return tf.data.Dataset.from_tensor_slices((x, x[:, :3] * 2)).batch(4)


def test_train_takes_mindsporess_argument_names(local_runtime):
    a, b = make_model(), make_model()
    sink.train(a, 3, dataset(), None, True, 2, verbose=0)
    sink.train(
        b, epoch=3, train_dataset=dataset(), callbacks=None, dataset_sink_mode=True,
        sink_size=2, verbose=0,
    )  # fmt: skip
    for wa, wb in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_array_equal(wa, wb)
    assert not np.array_equal(a.get_weights()[0], make_model().get_weights()[0])
    with pytest.raises(hvdkit.ConfigurationError, match=r"epochs=3 and epoch=3 are the same"):
        sink.train(a, 3, dataset(), epoch=3)
    with pytest.raises(hvdkit.ConfigurationError, match=r"pass dataset \(or MindSpore's train_"):
        sink.train(a, 3)


def test_data_sink_jit_config(local_runtime):
    seen = []
    step = lambda x, y: tf.reduce_sum(x)
    run = sink.data_sink(step, dataset(), sink_size=3, jit_config=sink.JitConfig())
    seen.append(float(run()))
    assert seen == [pytest.approx(np.arange(32, 48).sum() / 48)]  # batch 3: rows 8-11
    for level in ("", "O0", "O2"):
        assert sink.JitConfig(jit_level=level).jit_level == level
    with pytest.raises(hvdkit.ConfigurationError, match=r"jit_level='O3' is not one of"):
        sink.JitConfig(jit_level="O3")
    with pytest.raises(hvdkit.ConfigurationError, match=r"\['infer_boost'\] have no TensorFlow"):
        sink.JitConfig(infer_boost="on")
    with pytest.raises(
        hvdkit.ConfigurationError, match=r"hvdkit.sink.JitConfig\(\.\.\.\).*jit_compile"
    ):
        sink.data_sink(step, dataset(), jit_config={"jit_level": "O1"})


def test_get_dataset_size():
    from hvdkit.data import get_dataset_size

    assert get_dataset_size(dataset()) == 3
    assert get_dataset_size(tf.data.Dataset.range(10).filter(lambda i: i % 3 == 0)) == 4
    assert get_dataset_size(tf.data.Dataset.range(0)) == 0
    with pytest.raises(hvdkit.ConfigurationError, match="repeats forever"):
        get_dataset_size(dataset().repeat())
    with pytest.raises(hvdkit.ConfigurationError, match="needs a tf.data.Dataset; got list"):
        get_dataset_size([1, 2])


def test_hvdkitrun_accepts_mindspores_role_values(clean_env, capsys):
    from hvdkit.launch.cli import main

    clean_env.setenv("MS_ROLE", "MS_PSERVER")
    assert main([]) == 2
    assert "MS_ROLE='MS_PSERVER': hvdkit has no parameter-server role" in capsys.readouterr().err
    clean_env.setenv("MS_ROLE", "MS_SCHED")  # taken as the scheduler, which needs a worker count
    assert main([]) == 2
    assert "set HVDKIT_WORKER_NUM" in capsys.readouterr().err

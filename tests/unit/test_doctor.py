"""hvdkit doctor's report logic: facts in, rows, fixes and exit code out (no processes).

tests/test_doctor_mp.py runs the real thing in this venv.
"""

from __future__ import annotations

import dataclasses

import pytest

from hvdkit import __main__ as cli
from hvdkit.tools import doctor
from hvdkit.tools.doctor import Check, Facts

BUILD = "python -m hvdkit install-horovod"


def healthy(**changes) -> Facts:
    facts = Facts(
        python=(3, 11),
        tf_distributions={"tensorflow-cpu": "2.19.0"},
        tf_location="/venv/site-packages",
        tf_version="2.19.0",
        keras_version="3.15.1",
        keras_location="/venv/site-packages",
        horovod_version="0.28.1",
        horovod_location="/venv/site-packages",
        horovod_source="/cache/horovod-0.28.1-cp311-cp311-linux_x86_64.whl",
        horovod_built_for="2.19.0",
        horovod_built={"gloo": True, "mpi": True, "nccl": False},
        mpirun="/usr/bin/mpirun",
        mpirun_version="mpirun (Open MPI) 4.1.4",
        allreduce={"gloo": "ok", "mpi": "ok"},
    )
    return dataclasses.replace(facts, **changes)


def rows_by_name(facts: Facts) -> dict[str, Check]:
    return {row.name: row for row in doctor.judge(facts)}


def failed(facts: Facts) -> list[str]:
    return [r.name for r in doctor.judge(facts) if r.ok is False]


def test_a_healthy_environment_passes_every_check_and_exits_0():
    rows = doctor.judge(healthy())
    assert [r.name for r in rows] == [
        "Python",
        "TensorFlow",
        "Keras",
        "Horovod",
        "Horovod transports",
        "mpirun",
        "GPUs",
        "allreduce, 2 processes, gloo",
        "allreduce, 2 processes, mpi",
    ]
    assert [r.ok for r in rows] == [True, True, True, True, None, True, None, True, True]
    assert doctor.exit_code(rows) == 0
    by_name = {r.name: r for r in rows}
    assert by_name["Horovod transports"].detail == "built with gloo, mpi"
    assert "built for TensorFlow 2.19.0, from /cache/horovod-0.28.1" in by_name["Horovod"].detail
    text = doctor.render(rows)
    assert text.splitlines()[-1] == "hvdkit doctor: all good"
    assert "fix:" not in text


def test_no_tensorflow_fails_with_the_install_command():
    facts = healthy(tf_distributions={}, tf_version=None, keras_version=None, horovod_built={})
    facts.allreduce = {}
    rows = rows_by_name(facts)
    assert rows["TensorFlow"].ok is False
    assert rows["TensorFlow"].fix.startswith("pip install tensorflow-cpu==2.21.0")
    assert ">=2.18,<2.22" in rows["TensorFlow"].fix
    assert "Keras" not in rows and "GPUs" not in rows
    assert doctor.exit_code(list(rows.values())) == 1


def test_two_tensorflow_distributions_fail():
    facts = healthy(tf_distributions={"tensorflow": "2.19.0", "tensorflow-cpu": "2.19.0"})
    assert failed(facts) == ["TensorFlow"]
    row = next(r for r in doctor.judge(facts) if r.ok is False)
    assert "tensorflow 2.19.0, tensorflow-cpu 2.19.0" in row.detail
    assert "pip uninstall all but one" in row.fix


def test_a_tensorflow_that_does_not_import_fails_and_hides_what_depends_on_it():
    facts = healthy(tf_version=None, keras_version=None, tf_import_error="ImportError: libcudart")
    rows = doctor.judge(facts)
    assert [r.name for r in rows if r.ok is False] == ["TensorFlow"]
    assert "import fails: ImportError: libcudart" in rows[1].detail


def test_tensorflow_outside_the_range_is_a_note_not_a_failure():
    facts = healthy(tf_version="2.17.1", horovod_built_for="2.17.1")
    facts.tf_distributions = {"tensorflow-cpu": "2.17.1"}
    rows = rows_by_name(facts)
    assert rows["TensorFlow range"].ok is None
    assert "2.17.1 is outside the tested >=2.18,<2.22" in rows["TensorFlow range"].detail
    assert doctor.exit_code(list(rows.values())) == 0


@pytest.mark.parametrize(
    "changes, detail, fix",
    [
        (dict(horovod_version=None), "not installed", BUILD),
        (dict(horovod_version="0.27.0"), "hvdkit needs 0.28.1", BUILD),
        (
            dict(horovod_built_for="2.21.0"),
            "built for TensorFlow 2.21.0, from /cache/horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
            ", but TensorFlow 2.19.0 is installed",
            BUILD + "  (builds it for this TensorFlow)",
        ),
        (
            dict(horovod_built={"gloo": None, "mpi": None, "nccl": None}),
            "its TensorFlow extension does not load",
            BUILD + " --rebuild",
        ),
    ],
)
def test_each_horovod_problem_names_the_build_command(changes, detail, fix):
    rows = rows_by_name(healthy(**changes))
    assert rows["Horovod"].ok is False
    assert rows["Horovod"].detail.endswith(detail), rows["Horovod"].detail
    assert rows["Horovod"].fix == fix
    assert doctor.exit_code(list(rows.values())) == 1


def test_horovod_without_mpi_says_what_the_rebuild_needs():
    rows = rows_by_name(healthy(horovod_built={"gloo": True, "mpi": False, "nccl": False}))
    assert rows["Horovod mpi"].ok is False
    assert (
        rows["Horovod mpi"].fix
        == BUILD + " --rebuild (needs Debian's libopenmpi-dev while building)"
    )
    assert rows["Horovod transports"].detail == "built with gloo"


def test_no_mpirun_is_a_warning_gloo_still_works():
    facts = healthy(mpirun=None, mpirun_version=None)
    facts.allreduce = {"gloo": "ok"}
    rows = doctor.judge(facts)
    row = next(r for r in rows if r.name == "mpirun")
    assert (row.ok, row.essential, row.fix) == (False, False, "sudo apt-get install openmpi-bin")
    assert doctor.exit_code(rows) == 0
    assert "[warn] mpirun" in doctor.render(rows)
    assert "allreduce, 2 processes, mpi" not in {r.name for r in rows}


def test_a_failed_allreduce_is_essential_and_tells_how_to_see_the_job():
    facts = healthy(allreduce={"gloo": "ok", "mpi": "no answer within 180 s"})
    rows = rows_by_name(facts)
    row = rows["allreduce, 2 processes, mpi"]
    assert (row.ok, row.detail) == (False, "no answer within 180 s")
    assert row.fix.startswith("run `hvdkitrun -np 2 --mpi python -m hvdkit.tools._doctor_probe`")
    text = doctor.render(list(rows.values()))
    assert text.splitlines()[-1] == "hvdkit doctor: 1 essential check(s) failed"
    assert doctor.exit_code(list(rows.values())) == 1


def test_gpus_without_nccl_are_reported():
    rows = rows_by_name(healthy(gpus=["/physical_device:GPU:0"]))
    assert rows["GPUs"].detail == (
        "1 visible: /physical_device:GPU:0; Horovod has no NCCL, so GPU tensors are "
        "reduced through host memory"
    )


def test_untested_python_and_keras_are_notes():
    rows = rows_by_name(healthy(python=(3, 12), keras_version="3.9.2"))
    assert rows["Python"].ok is None and "untested" in rows["Python"].detail
    assert rows["Keras"].ok is None and "outside the tested >=3.10,<4" in rows["Keras"].detail
    assert rows_by_name(healthy(keras_version="2.15.0"))["Keras"].ok is False


@pytest.mark.parametrize(
    "code, output, verdict",
    [
        (
            0,
            "[0] HVDKIT-DOCTOR rank=0 size=2 sum=3.0\n[1] HVDKIT-DOCTOR rank=1 size=2 sum=3.0\n",
            "ok",
        ),
        (
            0,
            "HVDKIT-DOCTOR rank=0 size=1 sum=1.0\n",
            "exit code 0, ranks said ['rank=0 size=1 sum=1.0']; "
            "last lines: HVDKIT-DOCTOR rank=0 size=1 sum=1.0",
        ),
        (1, "a\nb\nboom\n", "exit code 1, ranks said nothing; last lines: a | b | boom"),
    ],
)
def test_probe_verdict(code, output, verdict):
    assert doctor.probe_verdict(code, output) == verdict


def test_the_hvdkit_command_lists_its_subcommands(capsys):
    assert cli.main([]) == 2
    assert "hvdkit doctor" in capsys.readouterr().out
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err

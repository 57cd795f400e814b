"""hvdkit.tools.install_horovod: prerequisites, header fixes, cache, build-failure messages.

The header logic runs the real preprocessor (g++ -E) over a fake TensorFlow include
tree made here, and once over the installed TensorFlow.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from hvdkit.tools import install_horovod as ih

PACKAGE = Path(ih.__file__).resolve().parents[1]


def fake_tf(tmp_path: Path, files: dict[str, str]) -> ih.TensorFlow:
    include = tmp_path / "tf-include"
    for name, text in files.items():
        (include / name).parent.mkdir(parents=True, exist_ok=True)
        (include / name).write_text(text)
    return ih.TensorFlow("tensorflow-cpu", "2.99.0", str(include), (f"-I{include}",))


@pytest.fixture
def horovod_includes(monkeypatch):
    def use(*headers):
        monkeypatch.setattr(ih, "HOROVOD_TF_INCLUDES", headers)

    return use


def test_a_moved_header_gets_a_forwarding_header_to_where_tf_has_it(tmp_path, horovod_includes):
    old = "tensorflow/compiler/xla/client/xla_builder.h"
    horovod_includes("tensorflow/core/framework/op.h", old)
    tf = fake_tf(
        tmp_path,
        {"tensorflow/core/framework/op.h": "", "xla/hlo/builder/xla_builder.h": "int b;\n"},
    )
    plan = ih.plan_headers(tf, tmp_path / "shim")
    assert plan.forwarded == {old: "xla/hlo/builder/xla_builder.h"}
    assert (tmp_path / "shim" / old).read_text() == '#include "xla/hlo/builder/xla_builder.h"\n'
    assert plan.include_dirs == []


def test_an_older_tf_with_the_header_in_place_needs_no_fix(tmp_path, horovod_includes):
    old = "tensorflow/compiler/xla/client/xla_builder.h"
    horovod_includes(old)
    plan = ih.plan_headers(fake_tf(tmp_path, {old: ""}), tmp_path / "shim")
    assert plan.forwarded == {} and plan.include_dirs == []


def test_a_header_a_debian_package_ships_adds_its_directory(
    tmp_path, horovod_includes, monkeypatch
):
    # TF 2.19's case: its XLA headers include LLVM's, which Debian's llvm-14-dev ships
    system = tmp_path / "usr-lib-llvm-14-include"
    (system / "llvm" / "ADT").mkdir(parents=True)
    (system / "llvm" / "ADT" / "ArrayRef.h").write_text("")
    monkeypatch.setattr(ih, "HEADER_PACKAGES", (("llvm/", "llvm-14-dev", (str(system),)),))
    horovod_includes("x.h")
    tf = fake_tf(tmp_path, {"x.h": '#include "llvm/ADT/ArrayRef.h"\n'})
    plan = ih.plan_headers(tf, tmp_path / "shim")
    assert plan.include_dirs == [str(system)]
    assert plan.cplus_include_path().split(":")[:2] == [str(tmp_path / "shim"), str(system)]


def test_a_missing_package_is_named_with_the_command_to_install_it(
    tmp_path, horovod_includes, monkeypatch
):
    monkeypatch.setattr(
        ih, "HEADER_PACKAGES", (("llvm/", "llvm-14-dev", (str(tmp_path / "none"),)),)
    )
    horovod_includes("x.h")
    tf = fake_tf(tmp_path, {"x.h": '#include "llvm/ADT/ArrayRef.h"\n'})
    with pytest.raises(ih.BuildError) as caught:
        ih.plan_headers(tf, tmp_path / "shim")
    message = str(caught.value)
    assert "TensorFlow 2.99.0's headers include llvm/ADT/ArrayRef.h" in message
    assert "sudo apt-get update && sudo apt-get install -y llvm-14-dev" in message


def test_an_unknown_missing_header_is_named(tmp_path, horovod_includes):
    horovod_includes("x.h")
    tf = fake_tf(tmp_path, {"x.h": '#include "nowhere/thing.h"\n'})
    with pytest.raises(ih.BuildError, match=r"include nowhere/thing\.h, which is not installed"):
        ih.plan_headers(tf, tmp_path / "shim")


# What Horovod 0.28.1's build needs per TensorFlow (docs/install.md), found on Debian 12:
# xla_builder.h moved (2.19+); 2.19's XLA headers include LLVM's (llvm-14-dev); 2.21's
# highwayhash/farmhash come from /usr/include (libhighwayhash-dev, libfarmhash-dev).
XLA_BUILDER = {"tensorflow/compiler/xla/client/xla_builder.h": "xla/hlo/builder/xla_builder.h"}
NEEDS = {
    "2.18": ({}, []),
    "2.19": (XLA_BUILDER, ["/usr/lib/llvm-14/include"]),
    "2.20": (XLA_BUILDER, []),
    "2.21": (XLA_BUILDER, []),
}


def test_the_installed_tensorflow_gets_the_fixes_its_version_needs():
    # the repository's venv has TF 2.21; scripts/matrix.sh runs this in each version's venv
    tf = ih.query_tensorflow()
    assert tf.distribution in ih.tensorflow_distributions()
    import tempfile

    with tempfile.TemporaryDirectory() as shim:
        plan = ih.plan_headers(tf, Path(shim))
    minor = ".".join(tf.version.split(".")[:2])
    assert (plan.forwarded, plan.include_dirs) == NEEDS[minor], tf.version


def test_missing_tools_name_their_debian_packages():
    present = {"g++", "make"}
    missing = ih.missing_tools(which=lambda cmd: f"/usr/bin/{cmd}" if cmd in present else None)
    assert [(what, pkg) for what, pkg, _ in missing] == [
        ("mpicxx", "libopenmpi-dev"),
        ("mpirun", "openmpi-bin"),
        ("cmake", "cmake"),
        ("patch", "patch"),
    ]
    assert ih.apt_command(["a", "b", "a"]) == "sudo apt-get update && sudo apt-get install -y a b"


def test_install_refuses_before_building_when_a_tool_is_missing(monkeypatch, capsys):
    monkeypatch.setattr(
        ih, "query_tensorflow", lambda: ih.TensorFlow("tensorflow-cpu", "2.19.0", "/x", ())
    )
    monkeypatch.setattr(ih, "horovod_works", lambda v: "Horovod is not installed")
    monkeypatch.setattr(ih, "cached_wheel", lambda d: None)
    monkeypatch.setattr(ih, "missing_tools", lambda: [("mpicxx", "libopenmpi-dev", "Open MPI")])
    monkeypatch.setattr(ih, "build_wheel", lambda *a: pytest.fail("must not build"))
    assert ih.main([]) == 1
    err = capsys.readouterr().err
    assert "mpicxx: Open MPI (Debian: libopenmpi-dev)" in err
    assert "sudo apt-get install -y libopenmpi-dev" in err


def test_unsupported_tensorflow_is_refused_unless_asked(monkeypatch, capsys):
    monkeypatch.setattr(
        ih, "query_tensorflow", lambda: ih.TensorFlow("tensorflow-cpu", "2.17.1", "/x", ())
    )
    monkeypatch.setattr(ih, "horovod_works", lambda v: None)
    assert ih.main([]) == 1
    assert "2.17.1 is outside the range hvdkit is tested with" in capsys.readouterr().err
    assert ih.main(["--any-tensorflow"]) == 0  # then Horovod is already right for it


def test_cache_dir_is_per_python_and_tensorflow(monkeypatch, tmp_path):
    monkeypatch.setenv("HVDKIT_CACHE_DIR", str(tmp_path))
    tag = f"py{sys.version_info[0]}{sys.version_info[1]}"
    patches = f"p{ih.patch_set_id()}"  # a changed patch set is built anew
    assert (
        ih.cache_dir("2.19.0") == tmp_path / "wheels" / f"horovod-0.28.1-{tag}-tf2.19.0-{patches}"
    )
    monkeypatch.delenv("HVDKIT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert ih.cache_dir("2.21.0").parent == tmp_path / "xdg" / "hvdkit" / "wheels"


def test_a_failed_build_says_which_package_its_missing_header_is_in(tmp_path):
    log = "x\n/a/b.h:3:10: fatal error: farmhash.h: No such file or directory\nmake: *** Error 1\n"
    message = ih.build_failure(log, tmp_path / "build.log")
    assert "fatal error: farmhash.h: No such file or directory" in message
    assert "Install Debian's libfarmhash-dev" in message
    assert str(tmp_path / "build.log") in message


def test_the_installed_horovod_is_the_one_built_for_the_installed_tensorflow():
    tf = ih.query_tensorflow()
    assert ih.horovod_built_for() == tf.version
    assert ih.horovod_works(tf.version) is None
    assert ih.horovod_works("2.0.0") == (
        f"the installed Horovod was built for TensorFlow {tf.version}, not 2.0.0"
    )


@pytest.mark.parametrize("module", ["tools/install_horovod.py", "tools/doctor.py", "__main__.py"])
def test_installer_and_doctor_never_import_tensorflow_keras_or_horovod(module):
    # they ask TensorFlow and Horovod in child processes, so a broken TensorFlow
    # cannot stop them from saying what is wrong (hvdkit/tools/_doctor_probe.py is the job)
    tree = ast.parse((PACKAGE / module).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    bad = [n for n in names if n.split(".")[0] in ("tensorflow", "keras", "horovod")]
    assert not bad, bad


def test_a_cached_wheel_replaces_a_horovod_built_for_another_tensorflow(monkeypatch, tmp_path):
    # pip takes an installed horovod 0.28.1 as satisfying the wheel of the same version
    wheel = tmp_path / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    tf = ih.TensorFlow("tensorflow-cpu", "2.19.0", "/x", ())
    answers = iter(["the installed Horovod was built for TensorFlow 2.21.0, not 2.19.0", None])
    calls = []
    monkeypatch.setattr(ih, "query_tensorflow", lambda: tf)
    monkeypatch.setattr(ih, "horovod_works", lambda v: next(answers))
    monkeypatch.setattr(ih, "cached_wheel", lambda d: wheel)
    monkeypatch.setattr(ih, "build_wheel", lambda *a: pytest.fail("must not build"))
    monkeypatch.setattr(ih, "pip_install", lambda *args: calls.append(args))
    assert ih.main([]) == 0
    assert calls == [("--force-reinstall", "--no-deps", str(wheel)), (str(wheel),)]


def test_every_patch_is_listed_shipped_with_the_package_and_installable_by_apt():
    # a non-editable install must carry hvdkit/patches/ (setup.py package_data), and
    # scripts/install.sh must install patch(1); each patch file is named in PATCHES
    import fnmatch

    repo = ih.PATCHES_DIR.parents[1]
    on_disk = sorted(p.name for p in ih.PATCHES_DIR.iterdir())
    assert on_disk == sorted(ih.PATCHES)
    setup = ast.parse((repo / "setup.py").read_text())
    (package_data,) = [
        kw.value
        for n in ast.walk(setup)
        if isinstance(n, ast.Call)
        for kw in n.keywords
        if kw.arg == "package_data"
    ]
    globs = ast.literal_eval(package_data)["hvdkit"]
    assert all(any(fnmatch.fnmatch(f"patches/{n}", g) for g in globs) for n in on_disk), globs
    assert " patch)" in (repo / "scripts" / "install.sh").read_text()

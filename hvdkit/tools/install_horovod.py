"""Build Horovod 0.28.1 for the TensorFlow installed in this Python environment.

Run it with the environment's own Python, after TensorFlow and hvdkit::

    python -m hvdkit install-horovod            # build (or take the cached wheel), install, check
    python -m hvdkit install-horovod --check    # only check what the build needs, build nothing
    python -m hvdkit install-horovod --rebuild  # ignore a cached wheel

PyPI has only Horovod's source, and Horovod 0.28.1 no longer compiles against
the headers of TensorFlow >= 2.19 as they ship. This module

1. reads the installed TensorFlow's version and compile flags (in a child
   process: this module, like the launcher, never imports TensorFlow);
2. checks the tools the build needs (Open MPI, a C++ compiler, make, cmake,
   Python's headers) and names the Debian package of each missing one;
3. runs the C preprocessor over the TensorFlow headers Horovod's sources
   include and fixes each header that is not found: a forwarding header where
   TensorFlow moved it (:data:`MOVED_HEADERS`), a system include directory where
   a Debian package ships it (:data:`HEADER_PACKAGES`), or an error naming the
   package to install. So the fixes follow from the installed TensorFlow, not
   from a list of versions (docs/install.md says what each version needed);
4. downloads Horovod's source (cached in ``~/.cache/hvdkit/sdist/``) and applies
   hvdkit's patches to it (:data:`PATCHES`, ``hvdkit/patches/``: each says
   what it fixes and why);
5. builds the wheel with MPI and Gloo (``pip wheel --no-build-isolation``,
   against this TensorFlow), caches it per Python, TensorFlow version and
   patch set in ``~/.cache/hvdkit/wheels/horovod-0.28.1-py311-tf2.19.0-p<hash>/``
   (``HVDKIT_CACHE_DIR`` moves the cache), installs it and checks it loads
   with both transports and carries the patches.

A second run for the same versions takes seconds. ``scripts/install.sh`` runs
this module for the repository's own ``.venv``.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from importlib import metadata, util
from pathlib import Path

from .. import _compat, config
from ..errors import HvdkitError

HOROVOD_VERSION = "0.28.1"
TENSORFLOW_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tf-nightly", "tf-nightly-cpu")


class BuildError(HvdkitError, RuntimeError):
    """Horovod cannot be built or installed here; the message names what to install or do."""


# --- what the build needs -----------------------------------------------------------
# (command on PATH, the Debian package that ships it, what it is for)
TOOLS = (
    ("mpicxx", "libopenmpi-dev", "Open MPI's headers and compiler wrapper"),
    ("mpirun", "openmpi-bin", "Open MPI's launcher"),
    ("g++", "g++", "a C++17 compiler"),
    ("make", "make", "make"),
    ("cmake", "cmake", "CMake >= 3.13"),
    ("patch", "patch", "applies hvdkit's patches to Horovod's source"),
)

# hvdkit's changes to Horovod's source, applied in this order before the build (each
# file opens with what it fixes and why). The installed Horovod names them in
# horovod/hvdkit_patches.py, so that an unpatched build counts as not installed.
PATCHES_DIR = Path(__file__).resolve().parents[1] / "patches"
PATCHES = (
    "horovod-0.28.1-init-failure-raises.patch",
    "horovod-0.28.1-gloo-all-here-before-connect.patch",
    "horovod-0.28.1-gloo-batched-mesh.patch",
)
PATCH_MARKER = "hvdkit_patches.py"  # written into horovod/ before the build

# The TensorFlow headers horovod/tensorflow/mpi_ops.cc and xla_mpi_ops.cc of Horovod
# 0.28.1 include in a CPU build (the GPU-only ones are left out).
HOROVOD_TF_INCLUDES = (
    "tensorflow/core/framework/op.h",
    "tensorflow/core/framework/op_kernel.h",
    "tensorflow/core/framework/shape_inference.h",
    "tensorflow/core/framework/common_shape_fns.h",
    "tensorflow/core/framework/resource_mgr.h",
    "tensorflow/core/framework/resource_var.h",
    "tensorflow/core/kernels/training_op_helpers.h",
    "tensorflow/compiler/tf2xla/xla_op_kernel.h",
    "tensorflow/compiler/tf2xla/xla_op_registry.h",
    "tensorflow/compiler/xla/client/xla_builder.h",
    "tensorflow/compiler/xla/service/custom_call_target_registry.h",
    "tensorflow/compiler/xla/service/hlo.pb.h",
    "tensorflow/compiler/xla/shape.h",
    "tensorflow/compiler/xla/xla_data.pb.h",
    "tensorflow/core/lib/hash/hash.h",
    "tensorflow/core/platform/human_readable_json.h",
)

# Headers Horovod 0.28.1 includes by a path TensorFlow no longer ships, and where the
# installed TensorFlow may have them instead (the first that exists gets a forwarding
# header). xla_builder.h moved to xla/hlo/builder/ (TF >= 2.19; Horovod's unmerged PR
# #4302 makes the same change in its source).
MOVED_HEADERS = {
    "tensorflow/compiler/xla/client/xla_builder.h": (
        "xla/hlo/builder/xla_builder.h",
        "xla/client/xla_builder.h",
        "tensorflow/compiler/xla/hlo/builder/xla_builder.h",
    ),
}

# Headers TensorFlow's own headers include but its wheel does not ship:
# (path prefix, Debian package, include directories to look in besides the default ones).
# LLVM's (TF 2.19's XLA headers): any llvm-N-dev; 14 is the one Debian 12 has and the
# one verified. highwayhash/farmhash (TF 2.21's): installed into /usr/include.
HEADER_PACKAGES = (
    ("llvm/", "llvm-14-dev", ("/usr/lib/llvm-14/include", "/usr/lib/llvm-*/include")),
    ("llvm-c/", "llvm-14-dev", ("/usr/lib/llvm-14/include", "/usr/lib/llvm-*/include")),
    ("highwayhash/", "libhighwayhash-dev", ()),
    ("farmhash.h", "libfarmhash-dev", ()),
)

_MISSING_HEADER = re.compile(r"fatal error: ([^:\s]+): No such file or directory")

_TF_QUERY = """
import json, tensorflow as tf, keras
print(json.dumps({"version": tf.__version__, "keras": keras.__version__,
                  "include": tf.sysconfig.get_include(), "flags": tf.sysconfig.get_compile_flags(),
                  "gpus": [d.name for d in tf.config.list_physical_devices("GPU")]}))
"""


@dataclasses.dataclass(frozen=True)
class TensorFlow:
    """The installed TensorFlow, as its child process reported it."""

    distribution: str  # "tensorflow-cpu", ...
    version: str
    include: str
    flags: tuple[str, ...]


@dataclasses.dataclass
class HeaderPlan:
    """How the build finds every header: forwarding headers and extra include directories."""

    shim_dir: Path
    forwarded: dict[str, str] = dataclasses.field(default_factory=dict)
    include_dirs: list[str] = dataclasses.field(default_factory=list)

    def cplus_include_path(self) -> str:
        dirs = [str(self.shim_dir), *self.include_dirs]
        if os.environ.get("CPLUS_INCLUDE_PATH"):
            dirs.append(os.environ["CPLUS_INCLUDE_PATH"])
        return os.pathsep.join(dirs)


def log(message: str) -> None:
    print(f"[install_horovod] {message}", flush=True)


# --- the installed TensorFlow -------------------------------------------------------
def tensorflow_distributions() -> dict[str, str]:
    """``{distribution: version}`` of each TensorFlow distribution installed here."""
    found = {}
    for name in TENSORFLOW_DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def query_tensorflow(python: str = sys.executable) -> TensorFlow:
    """Version, include directory and compile flags of the TensorFlow ``python`` imports.

    Raises:
        BuildError: no TensorFlow is installed, or it fails to import.
    """
    installed = tensorflow_distributions()
    if not installed:
        raise BuildError(
            f"no TensorFlow is installed for {python}. Install a supported one first "
            f"(TensorFlow {_compat.SUPPORTED_TENSORFLOW}), e.g. "
            "`pip install tensorflow-cpu==2.21.0` or `pip install 'hvdkit[cpu]'`, then run "
            "`python -m hvdkit install-horovod` again."
        )
    answer, error = ask_tensorflow(python)
    if answer is None:
        raise BuildError(
            f"TensorFlow ({installed}) is installed but `import tensorflow` fails in {python}:\n"
            f"{error}\nRepair that installation first."
        )
    dist = next(name for name, version in installed.items() if version == answer["version"])
    return TensorFlow(dist, answer["version"], answer["include"], tuple(answer["flags"]))


def ask_tensorflow(python: str = sys.executable) -> tuple[dict | None, str]:
    """TensorFlow's answers to :data:`_TF_QUERY` in a child of ``python``, or ``(None, error)``."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([python, "-c", _TF_QUERY], capture_output=True, text=True, env=env)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return None, done.stderr.strip()[-2000:] or f"exit code {done.returncode}"
    return json.loads(lines[-1]), ""


def refuse_unsupported(tf: TensorFlow) -> None:
    """Raise unless ``tf``'s version is in hvdkit's tested range."""
    if not _compat.tensorflow_supported(tf.version):
        raise BuildError(
            f"{tf.distribution} {tf.version} is outside the range hvdkit is tested with "
            f"(TensorFlow {_compat.SUPPORTED_TENSORFLOW}). Install a supported TensorFlow, "
            "or pass --any-tensorflow to try the build anyway."
        )


# --- prerequisites -----------------------------------------------------------------
def python_headers_package() -> str:
    """The Debian package with this Python's headers (``python3.11-dev``)."""
    return f"python{sys.version_info[0]}.{sys.version_info[1]}-dev"


def missing_tools(which=shutil.which) -> list[tuple[str, str, str]]:
    """``(what, Debian package, why)`` of each tool or header file the build needs and lacks."""
    missing = [(cmd, pkg, why) for cmd, pkg, why in TOOLS if which(cmd) is None]
    python_h = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not python_h.is_file():
        missing.append((str(python_h), python_headers_package(), "Python's C headers"))
    return missing


def missing_python_modules(find_spec=util.find_spec) -> list[str]:
    """Modules Horovod's setup.py needs in this environment (no build isolation) and lacks."""
    return [name for name in ("setuptools", "wheel", "packaging") if find_spec(name) is None]


def apt_command(packages: list[str]) -> str:
    unique = list(dict.fromkeys(packages))
    return "sudo apt-get update && sudo apt-get install -y " + " ".join(unique)


# --- headers -----------------------------------------------------------------------
def first_missing_header(tf: TensorFlow, plan: HeaderPlan) -> tuple[str | None, str]:
    """Preprocess Horovod's TensorFlow includes as its build would; the first header not found.

    Returns:
        ``(header, "")`` for a missing header, ``(None, "")`` when all are found,
        ``(None, message)`` when the preprocessor failed for another reason.
    """
    source = "".join(f'#include "{h}"\n' for h in HOROVOD_TF_INCLUDES)
    cmd = ["g++", "-E", "-x", "c++", "-", "-o", os.devnull, "-DEIGEN_USE_THREADS", *tf.flags]
    env = dict(os.environ, CPLUS_INCLUDE_PATH=plan.cplus_include_path())
    done = subprocess.run(cmd, input=source, capture_output=True, text=True, env=env)
    if done.returncode == 0:
        return None, ""
    found = _MISSING_HEADER.search(done.stderr)
    if found:
        return found.group(1), ""
    return None, done.stderr.strip()[-2000:]


def header_package(header: str) -> tuple[str, tuple[str, ...]] | None:
    """``(Debian package, directories to look in)`` of a header TF's wheel lacks, if known."""
    for prefix, package, dirs in HEADER_PACKAGES:
        if header.startswith(prefix):
            return package, dirs
    return None


def directory_with(header: str, patterns: tuple[str, ...]) -> str | None:
    for pattern in patterns:
        for directory in sorted(glob.glob(pattern)):
            if (Path(directory) / header).is_file():
                return directory
    return None


def plan_headers(tf: TensorFlow, shim_dir: Path, rounds: int = 10) -> HeaderPlan:
    """Find every header Horovod's build includes, fixing what can be fixed.

    Raises:
        BuildError: a header is missing that no installed package provides; the
            message names the Debian package (or the header, when unknown).
    """
    plan = HeaderPlan(shim_dir)
    for _ in range(rounds):
        header, failure = first_missing_header(tf, plan)
        if failure:
            raise BuildError(f"the C++ preprocessor fails on TensorFlow's headers:\n{failure}")
        if header is None:
            return plan
        target = next(
            (t for t in MOVED_HEADERS.get(header, ()) if (Path(tf.include) / t).is_file()), None
        )
        if target is not None and header not in plan.forwarded:
            forward = shim_dir / header
            forward.parent.mkdir(parents=True, exist_ok=True)
            forward.write_text(f'#include "{target}"\n')
            plan.forwarded[header] = target
            continue
        known = header_package(header)
        directory = directory_with(header, known[1]) if known else None
        if directory is not None and directory not in plan.include_dirs:
            plan.include_dirs.append(directory)
            continue
        if known:
            raise BuildError(
                f"TensorFlow {tf.version}'s headers include {header}, which its wheel does not "
                f"ship. Install Debian's {known[0]}: `{apt_command([known[0]])}`, then run "
                "`python -m hvdkit install-horovod` again."
            )
        raise BuildError(
            f"TensorFlow {tf.version}'s headers include {header}, which is not installed and "
            "hvdkit does not know its package (`apt-file search " + header + "` finds it). "
            "Install it, then run `python -m hvdkit install-horovod` again."
        )
    raise BuildError(f"headers still missing after {rounds} fixes: {plan}")


# --- the patches -------------------------------------------------------------------
def patch_texts() -> dict[str, str]:
    """``{file name: text}`` of :data:`PATCHES`.

    Raises:
        BuildError: a patch file is missing (an hvdkit installed without its data).
    """
    texts = {}
    for name in PATCHES:
        path = PATCHES_DIR / name
        if not path.is_file():
            raise BuildError(
                f"hvdkit's patch {path} is missing, so the Horovod it would build would abort "
                "on a failed start. Reinstall hvdkit from its repository (pip install -e .)."
            )
        texts[name] = path.read_text()
    return texts


def patch_set_id(texts: dict[str, str] | None = None) -> str:
    """A short hash of the patches' names and texts: part of the wheel cache's key."""
    digest = hashlib.sha256()
    for name, text in (patch_texts() if texts is None else texts).items():
        digest.update(f"{name}\0{text}\0".encode())
    return digest.hexdigest()[:10]


def marker_text(texts: dict[str, str] | None = None) -> str:
    """The module written into the patched source: which patches the build carries."""
    names = list(patch_texts() if texts is None else texts)
    return (
        '"""Written by hvdkit.tools.install_horovod: the patches this Horovod was built '
        'with."""\n\n'
        f"PATCHES = {names!r}\nPATCH_SET = {patch_set_id(texts)!r}\n"
    )


def patched_source(directory: Path) -> Path:
    """Horovod's source, unpacked in ``directory`` with :data:`PATCHES` applied; its folder.

    The sdist is downloaded once into ``<cache>/sdist``.

    Raises:
        BuildError: the download or a patch failed (the message has the tool's output).
    """
    texts = patch_texts()
    sdist_dir = cache_base() / "sdist"
    sdist = sdist_dir / f"horovod-{HOROVOD_VERSION}.tar.gz"
    if not sdist.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        cmd += ["--disable-pip-version-check", "-d", str(sdist_dir), f"horovod=={HOROVOD_VERSION}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not sdist.is_file():
            raise BuildError(
                f"could not download Horovod {HOROVOD_VERSION}'s source (`{' '.join(cmd)}`):\n"
                + (done.stderr.strip()[-1500:] or done.stdout.strip()[-1500:])
            )
    with tarfile.open(sdist) as archive:
        archive.extractall(directory, filter="data")
    source = directory / f"horovod-{HOROVOD_VERSION}"
    for name, text in texts.items():
        done = subprocess.run(
            ["patch", "-p1", "--forward", "--batch"],
            input=text,
            capture_output=True,
            text=True,
            cwd=source,
        )
        if done.returncode != 0:
            raise BuildError(
                f"hvdkit's patch {name} does not apply to Horovod {HOROVOD_VERSION}'s source "
                f"({sdist}):\n{done.stdout.strip()[-1500:]}\nDelete {sdist} and try again."
            )
    (source / "horovod" / PATCH_MARKER).write_text(marker_text(texts))
    return source


def installed_patch_set() -> str | None:
    """The patch set the installed Horovod was built with (its hvdkit_patches.py), if any."""
    spec = util.find_spec("horovod")
    if spec is None or spec.origin is None:
        return None
    found = re.search(
        r"^PATCH_SET = '([0-9a-f]+)'$",
        _read(Path(spec.origin).parent / PATCH_MARKER),
        re.MULTILINE,
    )
    return found.group(1) if found else None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


# --- the wheel ---------------------------------------------------------------------
def cache_base() -> Path:
    """``~/.cache/hvdkit`` (``$XDG_CACHE_HOME/hvdkit``), or ``HVDKIT_CACHE_DIR``."""
    base = config.get(config.CACHE_DIR)
    if base is None:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        base = os.path.join(xdg, "hvdkit")
    return Path(base)


def cache_dir(tf_version: str) -> Path:
    """``<cache>/wheels/horovod-0.28.1-py311-tf2.19.0-p<hash>``: per Python, TF and patch set."""
    tag = f"py{sys.version_info[0]}{sys.version_info[1]}"
    name = f"horovod-{HOROVOD_VERSION}-{tag}-tf{tf_version}-p{patch_set_id()}"
    return cache_base() / "wheels" / name


def cached_wheel(directory: Path) -> Path | None:
    wheels = sorted(directory.glob(f"horovod-{HOROVOD_VERSION}-*.whl"))
    return wheels[0] if wheels else None


def build_environment(plan: HeaderPlan) -> dict[str, str]:
    """The build's variables: TensorFlow with MPI and Gloo, no PyTorch or MXNet."""
    return dict(
        os.environ,
        CPLUS_INCLUDE_PATH=plan.cplus_include_path(),
        # a cmake 4.x (from PyPI) rejects Gloo's old cmake_minimum_required without it
        CMAKE_POLICY_VERSION_MINIMUM="3.5",
        HOROVOD_WITH_TENSORFLOW="1",
        HOROVOD_WITHOUT_PYTORCH="1",
        HOROVOD_WITHOUT_MXNET="1",
        HOROVOD_WITH_GLOO="1",
        HOROVOD_WITH_MPI="1",
        MAKEFLAGS=f"-j{os.cpu_count() or 1}",
    )


def build_wheel(tf: TensorFlow, plan: HeaderPlan, directory: Path) -> Path:
    """Compile Horovod against ``tf`` into ``directory``; its log is ``directory/build.log``."""
    directory.mkdir(parents=True, exist_ok=True)
    build_log = directory / "build.log"
    with tempfile.TemporaryDirectory(prefix="building-", dir=directory) as out:
        source = patched_source(Path(out))
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
        cmd += ["--no-cache-dir", "--disable-pip-version-check", str(source)]
        with open(build_log, "w") as sink:
            done = subprocess.run(
                [*cmd, "-w", out],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=build_environment(plan),
            )
        built = sorted(Path(out).glob("horovod-*.whl"))
        if done.returncode != 0 or not built:
            raise BuildError(build_failure(build_log.read_text(errors="replace"), build_log))
        wheel = directory / built[0].name
        os.replace(built[0], wheel)
    return wheel


def build_failure(text: str, path: Path) -> str:
    """What to say about a failed build: its first compiler error and, if known, the fix."""
    header = _MISSING_HEADER.search(text)
    known = header_package(header.group(1)) if header else None
    errors = [ln.strip() for ln in text.splitlines() if "error" in ln.lower()][:3]
    fix = f" Install Debian's {known[0]}: `{apt_command([known[0]])}`." if known else ""
    return (
        f"building Horovod {HOROVOD_VERSION} failed (full log: {path}):\n  "
        + "\n  ".join(errors or text.strip().splitlines()[-5:])
        + f"\n{fix} Then run `python -m hvdkit install-horovod` again."
    )


# --- the installed Horovod ---------------------------------------------------------
def horovod_built_for() -> str | None:
    """The TensorFlow version the installed Horovod was compiled against (its metadata.json)."""
    spec = util.find_spec("horovod")
    if spec is None or spec.origin is None:
        return None
    try:
        built = json.loads((Path(spec.origin).parent / "metadata.json").read_text())
    except (OSError, ValueError):
        return None
    return built.get("tensorflow")


def horovod_source() -> str | None:
    """Where pip installed Horovod from (a cached wheel's path), if pip recorded it."""
    try:
        direct = metadata.distribution("horovod").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    url = json.loads(direct).get("url", "") if direct else ""
    return url.removeprefix("file://") or None


def horovod_version() -> str | None:
    try:
        return metadata.version("horovod")
    except metadata.PackageNotFoundError:
        return None


_IMPORT_CHECK = (
    "import horovod.tensorflow as hvd; print(int(hvd.gloo_built()), int(hvd.mpi_built()))"
)


def horovod_works(tf_version: str) -> str | None:
    """None if the installed Horovod is 0.28.1, built for ``tf_version``, with Gloo and MPI.

    Otherwise what is wrong, in a few words.
    """
    version = horovod_version()
    if version is None:
        return "Horovod is not installed"
    if version != HOROVOD_VERSION:
        return f"Horovod {version} is installed, hvdkit needs {HOROVOD_VERSION}"
    built_for = horovod_built_for()
    if built_for != tf_version:
        return f"the installed Horovod was built for TensorFlow {built_for}, not {tf_version}"
    if installed_patch_set() != patch_set_id():
        return (
            "the installed Horovod lacks hvdkit's patches "
            f"({', '.join(PATCHES)}: a failed start would abort the process)"
        )
    quick = [_compat.horovod_tf_built(t) for t in ("gloo", "mpi")]
    if quick == [True, True]:
        return None
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_CHECK], capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        return "`import horovod.tensorflow` fails: " + done.stderr.strip()[-500:]
    if done.stdout.split()[-2:] != ["1", "1"]:
        return "the installed Horovod lacks Gloo or MPI (built without them)"
    return None


# --- the command -------------------------------------------------------------------
def install(rebuild: bool = False, check_only: bool = False, any_tensorflow: bool = False) -> int:
    """Make the installed Horovod one built for the installed TensorFlow; 0 when it is."""
    tf = query_tensorflow()
    log(f"{tf.distribution} {tf.version} ({sys.executable})")
    installed = tensorflow_distributions()
    if len(installed) > 1:
        log(f"warning: several TensorFlow distributions are installed: {installed}")
    if not any_tensorflow:
        refuse_unsupported(tf)
    problem = None if check_only else horovod_works(tf.version)
    if problem is None and not rebuild and not check_only:
        log(f"Horovod {HOROVOD_VERSION} is installed, built for TensorFlow {tf.version}, MPI+Gloo")
        return 0
    directory = cache_dir(tf.version)
    wheel = None if rebuild else cached_wheel(directory)
    if wheel is None or check_only:
        tools = missing_tools()
        if tools:
            lines = "".join(f"\n  {what}: {why} (Debian: {pkg})" for what, pkg, why in tools)
            raise BuildError(
                f"the Horovod build needs what is missing here:{lines}\n"
                f"Run `{apt_command([pkg for _, pkg, _ in tools])}`, then this command again."
            )
        with tempfile.TemporaryDirectory(prefix="hvdkit-shim-") as shim:
            plan = plan_headers(tf, Path(shim))
            for old, new in plan.forwarded.items():
                log(f"forwarding header {old} -> {new}")
            for directory_used in plan.include_dirs:
                log(f"system headers from {directory_used}")
            if check_only:
                log(f"ready to build Horovod {HOROVOD_VERSION} for TensorFlow {tf.version}")
                return 0
            modules = missing_python_modules()
            if modules:
                log(f"installing the build's Python modules: {' '.join(modules)}")
                pip_install(*modules)
            log(f"building Horovod {HOROVOD_VERSION} for TensorFlow {tf.version} with MPI and Gloo")
            log(f"with hvdkit's patches: {', '.join(PATCHES)}")
            log(f"(about 5 minutes on 2 cores; log: {directory / 'build.log'})")
            started = time.monotonic()
            wheel = build_wheel(tf, plan, directory)
            log(f"built {wheel} in {time.monotonic() - started:.0f} s")
    else:
        log(f"using the cached wheel {wheel}")
    # a Horovod 0.28.1 built for another TensorFlow counts as installed for pip: replace it
    pip_install("--force-reinstall", "--no-deps", str(wheel))
    pip_install(str(wheel))  # then its own requirements (cloudpickle, psutil, pyyaml, packaging)
    problem = horovod_works(tf.version)
    if problem is not None:
        raise BuildError(
            f"Horovod was installed from {wheel} but {problem}. Delete {directory} and run "
            "`python -m hvdkit install-horovod --rebuild`."
        )
    log(f"Horovod {HOROVOD_VERSION} installed for TensorFlow {tf.version} (MPI and Gloo)")
    return 0


def pip_install(*what: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", *what]
    if subprocess.run(cmd).returncode != 0:
        raise BuildError(f"`{' '.join(cmd)}` failed (its output is above)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hvdkit install-horovod",
        description=f"Build Horovod {HOROVOD_VERSION} (MPI, Gloo) for the installed TensorFlow.",
    )
    parser.add_argument("--check", action="store_true", help="check prerequisites, build nothing")
    parser.add_argument("--rebuild", action="store_true", help="ignore a cached wheel")
    parser.add_argument(
        "--any-tensorflow",
        action="store_true",
        help=f"build for a TensorFlow outside {_compat.SUPPORTED_TENSORFLOW} (untested)",
    )
    args = parser.parse_args(argv)
    try:
        return install(args.rebuild, args.check, args.any_tensorflow)
    except BuildError as exc:
        print(f"[install_horovod] error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

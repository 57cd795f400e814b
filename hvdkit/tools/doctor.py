"""``hvdkit doctor``: what this environment can do, and the fix for each problem.

    hvdkit doctor               # versions, builds, mpirun, GPUs, a 2-process job per transport
    python -m hvdkit doctor     # the same
    hvdkit doctor --no-run      # without the 2-process jobs (a second instead of ~20)

It gathers :class:`Facts` (package metadata in this process; TensorFlow, Horovod's
extension and the jobs in child processes: like the launcher, this module never
imports TensorFlow), turns them into :class:`Check` rows with :func:`judge` (pure:
the unit tests feed it facts) and prints them. The exit code is 1 when an
essential check fails (no usable TensorFlow, Keras 3 or Horovod, or an allreduce
that does not work), else 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
from importlib import metadata

from .. import _compat
from . import install_horovod

PROBE_MARK = "HVDKIT-DOCTOR"  # hvdkit/tools/_doctor_probe.py prints it; 2 ranks: sum=3.0 on each
TESTED_PYTHON = (3, 11)
KERAS_RANGE = ">=3.10,<4"  # setup.py's requirement (tests/unit/test_pins.py keeps them equal)
BUILD = "python -m hvdkit install-horovod"


@dataclasses.dataclass
class Facts:
    """What doctor found; ``None`` where a thing is absent or could not be asked."""

    python: tuple[int, int] = TESTED_PYTHON
    tf_distributions: dict[str, str] = dataclasses.field(default_factory=dict)
    tf_location: str | None = None
    tf_import_error: str | None = None
    tf_version: str | None = None  # as imported
    keras_version: str | None = None
    keras_location: str | None = None
    gpus: list[str] = dataclasses.field(default_factory=list)
    horovod_version: str | None = None
    horovod_location: str | None = None
    horovod_source: str | None = None  # the wheel pip installed it from
    horovod_built_for: str | None = None  # TF version in Horovod's metadata.json
    horovod_built: dict[str, bool | None] = dataclasses.field(default_factory=dict)
    mpirun: str | None = None
    mpirun_version: str | None = None
    allreduce: dict[str, str] = dataclasses.field(default_factory=dict)  # transport: "ok" | why not


@dataclasses.dataclass
class Check:
    """One row of the report: ``ok`` True (works), False (fails) or None (a note)."""

    name: str
    ok: bool | None
    detail: str
    fix: str = ""
    essential: bool = True


# --- gathering ---------------------------------------------------------------------
def _where(dist: str) -> str | None:
    try:
        return str(metadata.distribution(dist).locate_file(""))
    except metadata.PackageNotFoundError:
        return None


def gather(run_jobs: bool = True, timeout: float = 180.0) -> Facts:
    """Collect the facts of this Python environment (children for TF, Horovod and the jobs)."""
    facts = Facts(python=sys.version_info[:2])
    facts.tf_distributions = install_horovod.tensorflow_distributions()
    if facts.tf_distributions:
        facts.tf_location = _where(next(iter(facts.tf_distributions)))
        answer, error = install_horovod.ask_tensorflow()
        if answer is not None:
            facts.tf_version, facts.keras_version = answer["version"], answer["keras"]
            facts.gpus = answer["gpus"]
        else:
            facts.tf_import_error = error.splitlines()[-1]
    facts.keras_location = _where("keras")
    facts.horovod_version = install_horovod.horovod_version()
    if facts.horovod_version is not None:
        facts.horovod_location = _where("horovod")
        facts.horovod_source = install_horovod.horovod_source()
        facts.horovod_built_for = install_horovod.horovod_built_for()
        if facts.tf_version is not None:
            facts.horovod_built = {t: _compat.horovod_tf_built(t) for t in ("gloo", "mpi", "nccl")}
    facts.mpirun = shutil.which("mpirun")
    if facts.mpirun:
        done = subprocess.run([facts.mpirun, "--version"], capture_output=True, text=True)
        facts.mpirun_version = (done.stdout.strip().splitlines() or ["?"])[0]
    if run_jobs and facts.horovod_built.get("gloo"):
        facts.allreduce["gloo"] = allreduce_job("gloo", timeout)
    if run_jobs and facts.horovod_built.get("mpi") and facts.mpirun:
        facts.allreduce["mpi"] = allreduce_job("mpi", timeout)
    return facts


def allreduce_job(transport: str, timeout: float) -> str:
    """Run hvdkit/tools/_doctor_probe.py on 2 processes; "ok", or what went wrong."""
    cmd = [sys.executable, "-m", "hvdkit.launch", "-np", "2", f"--{transport}"]
    cmd += [sys.executable, "-m", "hvdkit.tools._doctor_probe"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    job = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGTERM)  # hvdkitrun passes it on to its ranks
        try:
            job.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate()
        return f"no answer within {timeout:.0f} s"
    return probe_verdict(job.returncode, out)


def probe_verdict(returncode: int, output: str) -> str:
    """ "ok" if both ranks printed the right sum, else the job's last lines."""
    sums = sorted(
        line.split(PROBE_MARK, 1)[1].strip() for line in output.splitlines() if PROBE_MARK in line
    )
    if returncode == 0 and sums == ["rank=0 size=2 sum=3.0", "rank=1 size=2 sum=3.0"]:
        return "ok"
    tail = " | ".join(line.strip() for line in output.strip().splitlines()[-4:] if line.strip())
    return f"exit code {returncode}, ranks said {sums or 'nothing'}; last lines: {tail}"


# --- judging -----------------------------------------------------------------------
def judge(f: Facts) -> list[Check]:
    """The report's rows, from facts alone."""
    rows = [_python(f), *_tensorflow(f), _keras(f), *_horovod(f), _mpirun(f), _gpus(f)]
    for transport in ("gloo", "mpi"):
        rows.append(_allreduce(f, transport))
    return [row for row in rows if row is not None]


def _python(f: Facts) -> Check:
    version = ".".join(map(str, f.python))
    if f.python == TESTED_PYTHON:
        return Check("Python", True, f"{version} ({sys.executable})")
    return Check("Python", None, f"{version}: untested (hvdkit is tested on 3.11)", essential=False)


def _tensorflow(f: Facts) -> list[Check]:
    if not f.tf_distributions:
        return [
            Check(
                "TensorFlow", False, "not installed",
                "pip install tensorflow-cpu==2.21.0  (or tensorflow; any of "
                f"{_compat.SUPPORTED_TENSORFLOW})",
            )
        ]  # fmt: skip
    names = ", ".join(f"{d} {v}" for d, v in f.tf_distributions.items())
    rows = []
    if len(f.tf_distributions) > 1:
        rows.append(
            Check(
                "TensorFlow", False, f"several distributions installed: {names}",
                "they overwrite each other's files: pip uninstall all but one, then reinstall it",
            )
        )  # fmt: skip
    if f.tf_import_error is not None:
        rows.append(
            Check("TensorFlow", False, f"{names}: import fails: {f.tf_import_error}",
                  "repair the TensorFlow installation (pip install --force-reinstall it)")
        )  # fmt: skip
        return rows
    rows.append(Check("TensorFlow", True, f"{f.tf_version} ({names}, in {f.tf_location})"))
    if f.tf_version and not _compat.tensorflow_supported(f.tf_version):
        rows.append(
            Check(
                "TensorFlow range", None,
                f"{f.tf_version} is outside the tested {_compat.SUPPORTED_TENSORFLOW}",
                "expect surprises; a tested TensorFlow is 2.18-2.21", essential=False,
            )
        )  # fmt: skip
    return rows


def _keras(f: Facts) -> Check | None:
    if f.keras_version is None:
        return None  # TensorFlow's own row already failed
    from packaging.specifiers import SpecifierSet

    where = f"{f.keras_version} (in {f.keras_location})"
    if int(f.keras_version.split(".")[0]) < 3:
        return Check("Keras", False, where, "hvdkit needs Keras 3: pip install 'keras>=3.10,<4'")
    if not SpecifierSet(KERAS_RANGE).contains(f.keras_version, prereleases=True):
        return Check(
            "Keras", None, f"{where}: outside the tested {KERAS_RANGE}",
            "pip install 'keras>=3.10,<4'", essential=False,
        )  # fmt: skip
    return Check("Keras", True, where)


def _horovod(f: Facts) -> list[Check]:
    want = install_horovod.HOROVOD_VERSION
    if f.horovod_version is None:
        return [Check("Horovod", False, "not installed", BUILD)]
    where = f"{f.horovod_version} (in {f.horovod_location}), built for TensorFlow "
    where += f"{f.horovod_built_for or '?'}"
    if f.horovod_source:
        where += f", from {f.horovod_source}"
    if f.horovod_version != want:
        return [Check("Horovod", False, where + f"; hvdkit needs {want}", BUILD)]
    if f.tf_version is not None and f.horovod_built_for != f.tf_version:
        return [
            Check("Horovod", False, where + f", but TensorFlow {f.tf_version} is installed",
                  BUILD + "  (builds it for this TensorFlow)")
        ]  # fmt: skip
    built = f.horovod_built
    if f.tf_version is not None and built.get("gloo") is None and built.get("mpi") is None:
        return [Check("Horovod", False, where + "; its TensorFlow extension does not load",
                      BUILD + " --rebuild")]  # fmt: skip
    rows = [Check("Horovod", True, where)]
    for transport, package in (("gloo", None), ("mpi", "libopenmpi-dev")):
        if built.get(transport) is False:
            need = f" (needs Debian's {package} while building)" if package else ""
            rows.append(
                Check(f"Horovod {transport}", False, "not built in", BUILD + " --rebuild" + need)
            )
    has = [t for t in ("gloo", "mpi", "nccl") if built.get(t)]
    rows.append(Check("Horovod transports", None, "built with " + (", ".join(has) or "none")))
    return rows


def _mpirun(f: Facts) -> Check:
    if f.mpirun is None:
        return Check(
            "mpirun", False, "not found: MPI jobs cannot start (Gloo can)",
            "sudo apt-get install openmpi-bin", essential=False,
        )  # fmt: skip
    return Check("mpirun", True, f"{f.mpirun_version} ({f.mpirun})")


def _gpus(f: Facts) -> Check | None:
    if f.tf_version is None:
        return None
    if not f.gpus:
        return Check("GPUs", None, "none visible to TensorFlow (training runs on the CPU)")
    detail = f"{len(f.gpus)} visible: {', '.join(f.gpus)}"
    if not f.horovod_built.get("nccl"):
        detail += "; Horovod has no NCCL, so GPU tensors are reduced through host memory"
    return Check("GPUs", None, detail)


def _allreduce(f: Facts, transport: str) -> Check | None:
    name = f"allreduce, 2 processes, {transport}"
    verdict = f.allreduce.get(transport)
    if verdict is None:
        return None  # not run: Horovod or mpirun already reported missing, or --no-run
    if verdict == "ok":
        return Check(name, True, f"hvdkitrun -np 2 --{transport}: 1+2 = 3.0 on both ranks")
    fix = f"run `hvdkitrun -np 2 --{transport} python -m hvdkit.tools._doctor_probe` to see the job"
    if transport == "mpi" and os.geteuid() == 0:
        fix += "; as root Open MPI needs OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
    return Check(name, False, verdict, fix)


# --- output ------------------------------------------------------------------------
MARKS = {True: "ok  ", False: "FAIL", None: "note"}


def render(rows: list[Check]) -> str:
    width = max(len(r.name) for r in rows)
    lines = []
    for r in rows:
        mark = MARKS[r.ok] if r.essential or r.ok is not False else "warn"
        lines.append(f"[{mark}] {r.name:<{width}}  {r.detail}")
        if r.fix and r.ok is not True:
            lines.append(f"       {'':<{width}}  fix: {r.fix}")
    failed = [r.name for r in rows if r.ok is False and r.essential]
    lines.append(
        "hvdkit doctor: " + (f"{len(failed)} essential check(s) failed" if failed else "all good")
    )
    return "\n".join(lines)


def exit_code(rows: list[Check]) -> int:
    return 1 if any(r.ok is False and r.essential for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hvdkit doctor", description="What this environment can do for hvdkit, and fixes."
    )
    parser.add_argument("--no-run", action="store_true", help="skip the 2-process allreduce jobs")
    parser.add_argument(
        "--timeout", type=float, default=180.0, help="seconds for each job (default 180)"
    )
    args = parser.parse_args(argv)
    rows = judge(gather(run_jobs=not args.no_run, timeout=args.timeout))
    print(render(rows), flush=True)
    return exit_code(rows)

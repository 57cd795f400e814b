"""hvdkit's dependencies point one way (each layer imports only lower ones): a walk over
every import statement. The folders are the layers; lowest first:

====  ==============================================  =====================================
 0    ``errors``, ``config``,                          facts: what can go wrong, every
      ``horovod_only``, ``_phases``                    setting and its default, the
                                                       elastic job's phases
 1    ``_compat``, ``_validate``, ``_comm/``            version quirks, what counts as an
                                                       int, how processes talk (progress
                                                       markers, op names, buckets and their
                                                       compression, threads, sockets, the
                                                       worker/rank files)
 2    ``backends/``, ``process_sets``                  the one place that calls Horovod; the
                                                       sets of ranks it runs collectives over
 3    ``runtime``                                      the job: init, rank, size
 4    ``collectives``                                  allreduce & co. over the backend
 5    ``optimizer``, ``partial``, ``probes``,           training: gradients averaged, data
      ``_same_start``, ``data/``, ``ops/``, ``sink/``   sharded, patches, sink mode
 6    ``keras/``, ``fault/``                           the Keras integration; checkpoints,
                                                       preemption, elastic recovery
 7    ``tools/`` (``doctor``, ``install_horovod``)     the ``hvdkit`` command's tools
====  ==============================================  =====================================

A module may import only from lower layers or from its own layer. ``launch/``
stands beside the stack: it uses layers 0 and 1 and two files of ``fault/``
(``_checkpoint_files``: the checkpoint format, to name the resume step;
nothing else), and never TensorFlow or Keras. ``clusters/`` (Slurm, Spark,
Ray: one module each) stands beside it the same way and may start a world
through ``launch/``; the stack may use it as layer 1. Only ``backends/horovod.py``
uses Horovod's collectives. The package facade ``hvdkit/__init__.py`` may
wire anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hvdkit"
LAYERS = {"errors": 0, "config": 0, "horovod_only": 0, "_phases": 0}
LAYERS |= {"_compat": 1, "_validate": 1, "_autograph": 1, "_comm": 1, "clusters": 1}
LAYERS |= {"backends": 2, "process_sets": 2, "runtime": 3}
LAYERS |= {"collectives": 4}
LAYERS |= {u: 5 for u in ("optimizer", "partial", "probes", "_same_start", "data", "ops", "sink")}
LAYERS |= {"keras": 6, "fault": 6}
TOP = 7  # any other unit: tools/ (the hvdkit command's doctor, install_horovod)
# hvdkit/'s own modules at most: the facade, the layers' modules above, the public paths
# (callbacks, elastic, preemption); a new concept gets a folder (docs: README's layout).
MAX_ROOT_MODULES = 18
LAUNCH_MAY_USE = {"config", "errors", "clusters", "_phases", "_comm", "_compat", "_validate"}
LAUNCH_MAY_USE |= {"launch", "fault._checkpoint_files"}
# The launcher and the cluster environments (Slurm, Spark, Ray) start ranks: never TensorFlow.
BESIDE_THE_STACK = {"launch", "clusters"}
TENSOR_LIBRARIES = ("tensorflow", "keras", "horovod.tensorflow", "horovod.keras")


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def unit(path: Path) -> str:
    """The top-level unit a file belongs to: ``optimizer``, ``data``, ``launch``, ..."""
    rel = path.relative_to(PACKAGE).with_suffix("")
    return rel.parts[0]


def imports(path: Path) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` of every import statement, nested ones too."""
    pkg = ["hvdkit", *path.relative_to(PACKAGE).parent.parts]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            if node.module is not None and not _is_package(prefix):
                found.append((node.lineno, prefix))
            found += [(node.lineno, f"{prefix}.{a.name}") for a in node.names]
    return found


def _is_package(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "hvdkit" and (PACKAGE.joinpath(*parts[1:]) / "__init__.py").exists()


def hvdkit_unit(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if parts[0] == "hvdkit" and len(parts) > 1 else None


FILES = [p for p in modules() if p.name != "__init__.py" or p.parent != PACKAGE]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down_the_layers(path):
    mine = unit(path)
    wrong = []
    for line, name in imports(path):
        other = hvdkit_unit(name)
        if other is None or other == mine:
            continue
        if mine in BESIDE_THE_STACK:
            if other not in LAUNCH_MAY_USE and ".".join(name.split(".")[1:3]) not in LAUNCH_MAY_USE:
                wrong.append(f"line {line}: {mine} imports {name}")
        elif other == "launch" and mine != "clusters":
            wrong.append(f"line {line}: {mine} imports the launcher ({name})")
        elif LAYERS.get(other, TOP) > LAYERS.get(mine, TOP):
            wrong.append(
                f"line {line}: {mine} (layer {LAYERS.get(mine, TOP)}) imports {name} "
                f"(layer {LAYERS.get(other, TOP)})"
            )
    assert not wrong, f"{path.relative_to(PACKAGE)} imports upwards:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    "path",
    [p for p in modules() if unit(p) in BESIDE_THE_STACK],
    ids=lambda p: str(p.relative_to(PACKAGE)),
)
def test_launcher_never_imports_tensorflow_or_keras(path):
    bad = [(line, n) for line, n in imports(path) if n.startswith(TENSOR_LIBRARIES)]
    assert not bad, f"{path.name} imports {bad}: hvdkitrun must start without TensorFlow"


def test_only_the_horovod_backend_uses_horovods_collectives():
    users = sorted(
        str(p.relative_to(PACKAGE))
        for p in modules()
        if any(n.startswith(("horovod.tensorflow", "horovod.keras")) for _, n in imports(p))
    )
    assert users == ["backends/horovod.py"], users


def test_exactly_these_modules_import_horovod():
    # backends/horovod.py's docstring and docs/porting-horovod.md name them and say why
    users = sorted(
        str(p.relative_to(PACKAGE))
        for p in modules()
        if any(n == "horovod" or n.startswith("horovod.") for _, n in imports(p))
    )
    assert users == [
        "_compat.py",
        "backends/horovod.py",
        "launch/guarded_horovodrun.py",
        "launch/scheduler.py",
    ], users


def test_the_walk_sees_relative_and_nested_imports():
    # the checker itself: it must resolve the forms hvdkit uses, or the tests above prove nothing
    got = dict((n, line) for line, n in imports(PACKAGE / "data" / "sampler.py"))
    assert "hvdkit.errors" in got and "hvdkit.data.sharding" in got, sorted(got)
    facade = {n for _, n in imports(PACKAGE / "__init__.py")}
    assert "hvdkit.launch.heartbeat" in facade  # nested inside init()


def _exists(name: str) -> bool:
    parts = name.split(".")[1:]
    return _is_package(name) or PACKAGE.joinpath(*parts).with_suffix(".py").exists()


def test_every_import_from_hvdkit_names_a_module_that_exists():
    # a moved module's relative imports (``from .errors`` one folder down) fail only when
    # the line runs, which for a nested import may be in no test: the walk sees them all
    missing = []
    for path in FILES:
        pkg = ["hvdkit", *path.relative_to(PACKAGE).parent.parts]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level and node.module:
                name = ".".join([*pkg[: len(pkg) - node.level + 1], node.module])
                if not _exists(name):  # (``from . import x`` may name the package's attribute)
                    missing.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {name}")
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)


def module_name(path: Path) -> str:
    """``hvdkit.elastic``, ``hvdkit.data.sampler``, ``hvdkit.launch`` (a package's __init__)."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["hvdkit", *parts])


def import_graph() -> dict[str, dict[str, int]]:
    """Each module's hvdkit modules it imports (nested imports too), with the first line."""
    known = {module_name(p): p for p in modules()}
    graph: dict[str, dict[str, int]] = {}
    for name, path in known.items():
        edges: dict[str, int] = {}
        for line, imported in imports(path):
            while imported and imported not in known:  # hvdkit.x.name -> hvdkit.x
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                edges.setdefault(imported, line)
        graph[name] = edges
    return graph


# Import circles kept on purpose, each with its reason: none. (runtime and process_sets
# were one: runtime.init() registers the sets, which asked runtime for the rank; now
# init() hands the sets the backend.)
KNOWN_CIRCLES: set[frozenset] = set()


def test_no_module_imports_one_that_imports_it_back():
    # e.g. fault.elastic -> fault.checkpoint -> fault.elastic (inside a function) was
    # one: a module below may not reach up, not even at call time. The facade
    # (hvdkit/__init__.py) is exempt.
    graph = import_graph()
    circles = sorted(
        f"{a} (line {graph[a][b]}) <-> {b} (line {graph[b][a]})"
        for a in graph
        for b in graph[a]
        if a < b and a in graph.get(b, {}) and "hvdkit" not in (a, b)
        if frozenset({a, b}) not in KNOWN_CIRCLES
    )
    assert not circles, "modules that import each other:\n" + "\n".join(circles)


def test_the_circle_check_sees_one():
    # the checker itself: the facade and its lazily loaded modules import each other
    graph = import_graph()
    assert "hvdkit.fault.elastic" in graph["hvdkit"]
    assert "hvdkit.runtime" in graph["hvdkit.fault.elastic"]
    assert "hvdkit.process_sets" in graph["hvdkit.runtime"]
    assert "hvdkit.runtime" not in graph["hvdkit.process_sets"]  # the circle that was


def test_the_package_root_holds_at_most_max_root_modules():
    # the root shows the layers; tools and concepts with several modules live in folders
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules in hvdkit/: {root}"


# A class is a concept a reader takes in at one sitting: none over this many lines
# (docstring included). Those still over it, each with what splits it:
MAX_CLASS_LINES = 400
LONG_CLASSES: set[str] = set()  # a class that must stay longer, with its reason


def class_lengths() -> dict[str, int]:
    """``{"fault/checkpoint.py:Checkpointer": lines, ...}`` for every class, nested ones too."""
    return {
        f"{p.relative_to(PACKAGE)}:{node.name}": node.end_lineno - node.lineno + 1
        for p in modules()
        for node in ast.walk(ast.parse(p.read_text(), str(p)))
        if isinstance(node, ast.ClassDef)
    }


def test_no_class_is_longer_than_max_class_lines():
    lengths = class_lengths()
    long = sorted(
        f"{name} ({n} lines)"
        for name, n in lengths.items()
        if n > MAX_CLASS_LINES and name not in LONG_CLASSES
    )
    assert not long, f"classes over {MAX_CLASS_LINES} lines; split them by job:\n" + "\n".join(long)
    # the checker itself: it measures whole classes
    assert 100 < lengths["fault/checkpoint.py:Checkpointer"] <= MAX_CLASS_LINES


def test_the_elastic_folder_has_one_reader():
    # HVDKIT_ELASTIC_DIR (where a worker and its rank meet) is read by _comm.meeting only;
    # every other module asks it (shared_folder, enabled)
    readers = sorted(
        f"{path.relative_to(PACKAGE)}:{node.lineno}"
        for path in modules()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and any(isinstance(a, ast.Attribute) and a.attr == "ELASTIC_DIR" for a in node.args)
    )
    assert [r.split(":")[0] for r in readers] == ["_comm/meeting.py"], readers

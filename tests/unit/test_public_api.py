"""The public API is written down in several places; they must agree.

``hvdkit/__init__.py`` maps each public name to its module (``_EXPORTS``) and
imports the same names for type checkers; each module lists its own
``__all__``; the README's API table names them for people. Read by ``ast``,
so no TensorFlow is needed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hvdkit

PACKAGE = Path(hvdkit.__file__).resolve().parent
README = (PACKAGE.parent / "README.md").read_text()
FACADE = ast.parse((PACKAGE / "__init__.py").read_text())


def _exports() -> dict[str, str]:
    for node in FACADE.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_EXPORTS":
            return ast.literal_eval(node.value)
    raise AssertionError("hvdkit/__init__.py has no _EXPORTS")


def _type_checking_imports() -> dict[str, str]:
    """name -> module imported in the ``if TYPE_CHECKING:`` block."""
    for node in FACADE.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            names = {}
            for imp in node.body:
                for alias in imp.names:
                    names[alias.name] = imp.module or alias.name
            return names
    raise AssertionError("hvdkit/__init__.py has no TYPE_CHECKING block")


def _module_all(module: str) -> list[str] | None:
    path = PACKAGE / f"{module.replace('.', '/')}.py"
    if not path.exists():
        path = PACKAGE / module.replace(".", "/") / "__init__.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "__all__":
            return ast.literal_eval(node.value)
    return None


EXPORTS = _exports()
FACADE_FUNCTIONS = {n.name for n in FACADE.body if isinstance(n, ast.FunctionDef)}


def test_all_is_exports_plus_facade_functions():
    public_functions = {f for f in FACADE_FUNCTIONS if not f.startswith("_")}
    assert set(hvdkit.__all__) == set(EXPORTS) | public_functions | {"__version__"}
    assert len(hvdkit.__all__) == len(set(hvdkit.__all__)), "a name is listed twice"


def test_type_checking_block_imports_exactly_the_exports_from_their_modules():
    got = _type_checking_imports()
    assert set(got) == set(EXPORTS), set(got) ^ set(EXPORTS)
    for name, module in EXPORTS.items():
        where = got[name]
        if module.rpartition(".")[2] == name:  # a module as itself: "from .fault import elastic"
            assert f"{where}.{name}" == module or where == name == module, (name, where)
        else:
            assert where == module, f"{name}: _EXPORTS says {module}, TYPE_CHECKING says {where}"


def test_every_exported_name_is_in_its_modules_all():
    for name, module in EXPORTS.items():
        if module.rpartition(".")[2] == name:
            continue
        listed = _module_all(module)
        assert listed is not None, f"hvdkit/{module} has no __all__"
        assert name in listed, f"{name} is exported from {module} but not in its __all__"


def test_readme_table_names_every_public_name():
    section = README.split("## Public API", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([A-Za-z_][\w.]*)", section))
    named |= {part for n in named for part in re.split(r"[.{},\s]+", n) if part}
    missing = sorted(n for n in hvdkit.__all__ if n != "__version__" and n not in named)
    assert not missing, f"README's Public API table does not name {missing}"

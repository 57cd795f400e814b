"""What the doc tests read: the pages, their blocks and code, and hvdkit's public names.

The doc tests (``test_docs_*.py``) compare what README.md and docs/*.md say with
the live code. They find the code through ``hvdkit``'s own public lists and by
file name, never by a module path written here, so moving a module does not
break them. The conventions they enforce are in docs/contributing.md
("Docs that stay true").
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from functools import cache
from pathlib import Path

import hvdkit

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(hvdkit.__file__).resolve().parent
# The record keeps dated runs as they were measured: it quotes old figures on purpose.
RECORD = "performance-record.md"
PAGES = {
    p.name if p.parent.name != "docs" else f"docs/{p.name}": p
    for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    if p.name != RECORD
}

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def text(page: str) -> str:
    return PAGES[page].read_text()


def blocks(page: str) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph, list item and table row; code blocks left out."""
    out: list[tuple[int, str]] = []
    current: list[str] = []
    start = 0
    in_code = False
    for number, line in enumerate(text(page).splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
            if current:
                out.append((start, " ".join(current)))
                current = []
            continue
        if in_code:
            continue
        new_item = re.match(r"\s*([*-]|\d+\.)\s|\s*\||#", line)
        if not line.strip() or new_item:
            if current:
                out.append((start, " ".join(current)))
            current = [line.strip()] if line.strip() else []
            start = number
            if line.lstrip().startswith(("|", "#")):  # a table row or heading is one block
                if current:
                    out.append((start, current[0]))
                current = []
            continue
        if not current:
            start = number
        current.append(line.strip())
    if current:
        out.append((start, " ".join(current)))
    return out


def code(page: str) -> list[tuple[int, str]]:
    """(line number, text) of every inline code span and every line of every code block."""
    body = text(page)
    out = []
    for fence in _FENCE.finditer(body):
        first = body.count("\n", 0, fence.start()) + 1
        for offset, line in enumerate(fence.group(0).splitlines()[1:-1], 1):
            out.append((first + offset, line))
    prose = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), body)
    for number, line in enumerate(prose.splitlines(), 1):
        out.extend((number, span) for span in re.findall(r"`([^`\n]+)`", line))
    return out


# --- hvdkit's public names -----------------------------------------------------------


@cache
def public_modules() -> dict[str, object]:
    """``hvdkit`` and each public submodule it exports (``hvdkit.sink``, ...), by dotted name."""
    modules = {"hvdkit": hvdkit}
    for name in hvdkit.__all__:
        if name.startswith("_"):
            continue
        value = getattr(hvdkit, name)
        if type(value).__name__ == "module" and hasattr(value, "__all__"):
            modules[f"hvdkit.{name}"] = value
    return modules


@cache
def public_names() -> dict[str, list[str]]:
    """Unqualified public name -> the dotted names it may mean (``train``: ``sink.train``)."""
    names: dict[str, list[str]] = {}
    for module_name, module in public_modules().items():
        for name in module.__all__:
            if not name.startswith("_"):
                names.setdefault(name, []).append(f"{module_name}.{name}")
    return names


def resolve(dotted: str, page_module: str | None = None) -> tuple[str, object] | None:
    """The public object a documented name means, or None when it is not a public hvdkit name.

    ``hvdkit.sink.train``, ``sink.train`` and (on the page about ``hvdkit.sink``) ``train``
    all mean ``hvdkit.sink.train``; a bare name that two modules export is resolved by
    the page's module, else not at all.
    """
    parts = dotted.removeprefix("hvdkit.").split(".")
    candidates = public_names().get(parts[0], [])
    if len(parts) == 1 and len(candidates) > 1 and page_module:
        candidates = [c for c in candidates if c.startswith(page_module + ".")]
    if len(candidates) != 1:
        return None
    value: object = _object(candidates[0])
    for part in parts[1:]:
        if not hasattr(value, part):
            return None
        value = getattr(value, part)
    return ".".join([candidates[0], *parts[1:]]), value


def _object(dotted: str) -> object:
    module_name, _, name = dotted.rpartition(".")
    return getattr(public_modules()[module_name], name)


def page_module(page: str) -> str | None:
    """The public module a page is about: the ``hvdkit.X`` its title names, if any."""
    title = text(page).splitlines()[0]
    for module_name in sorted(public_modules(), key=len, reverse=True):
        if f"`{module_name}`" in title:
            return module_name
    return None


# --- the code a doc sentence is compared with -------------------------------------


def find_module(file_name: str):
    """Import the hvdkit module in ``file_name`` (``install_horovod.py``), wherever it lives."""
    found = sorted(PACKAGE.rglob(file_name))
    assert len(found) == 1, f"expected one {file_name} under hvdkit/, found {found}"
    dotted = ".".join(found[0].relative_to(PACKAGE.parent).with_suffix("").parts)
    return importlib.import_module(dotted)


def module_exists(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except ModuleNotFoundError:
        return False


@cache
def suite_sources() -> dict[str, str]:
    """Relative path -> text of every Python file under tests/."""
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "tests").rglob("*.py"))}


def missing_test(reference: str) -> str | None:
    """None when ``reference`` names a real test, else why not.

    ``tests/x.py::test_name[case]`` (the case a string in that file), ``tests/x.py::name``
    (also a check of a launched script, ``c.check("name")``), a bare ``test_name``, or a
    whole file ``tests/x.py``.
    """
    path, _, rest = reference.partition("::")
    if path.endswith(".py") and not rest:
        return None if path in suite_sources() else f"{reference}: no such file"
    name, _, case = (rest or path).partition("[")
    sources = suite_sources() if not rest else {path: suite_sources().get(path)}
    defined = re.compile(rf"^\s*(async )?def {re.escape(name)}\(|[\"']{re.escape(name)}[\"']", re.M)
    for source in sources.values():
        if source and defined.search(source):
            if not case or case.rstrip("]").strip("…. ") in source:
                return None
            return f"{reference}: {name} exists but has no case {case.rstrip(']')!r}"
    return f"{reference}: no such test"

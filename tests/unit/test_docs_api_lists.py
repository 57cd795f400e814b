"""The lists of public names in the docs are ``__all__``: nothing missing, nothing extra.

Two kinds of list (docs/contributing.md, "Docs that stay true"):
* README.md's "Public API" table names every name of ``hvdkit.__all__``, and every
  name in its names column is a public hvdkit name;
* each public submodule (``hvdkit.sink``, ``hvdkit.data``, ...) has one block
  "The public names of `hvdkit.X` are ..." (on the page whose title names the
  module, "The public names are ..." will do) listing exactly its ``__all__``.
"""

from __future__ import annotations

import re

from _docs import PAGES, blocks, page_module, public_modules, resolve, text

_LIST = re.compile(r"^(?:The )?[Pp]ublic names(?: of `(hvdkit[\w.]*)`)? (?:are|:)")
_IDENTIFIER = re.compile(r"`(?:hvdkit\.)?([A-Za-z_][\w.]*)`")


def readme_api_rows() -> list[str]:
    section = text("README.md").split("## Public API", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if line.startswith("|") and "---" not in line]


def names_column(row: str) -> list[str]:
    """Backticked names of a row's second cell; ``callbacks.{A, B}`` counts as both."""
    cell = row.split("|")[2]
    names = []
    for braced in re.findall(r"`([\w.]*)\{([^}]*)\}`", cell):
        names += [f"{braced[0]}{part.strip()}" for part in braced[1].split(",")]
    cell = re.sub(r"`[\w.]*\{[^}]*\}`", "", cell)
    return names + _IDENTIFIER.findall(cell)


def test_readme_api_table_is_hvdkit_all():
    rows = readme_api_rows()
    assert rows, "README.md has no Public API table"
    listed = [n for row in rows[1:] for n in names_column(row)]
    unknown = sorted({n for n in listed if resolve(n) is None})
    assert not unknown, f"README's API table names what hvdkit does not export: {unknown}"
    top = {n.split(".")[0] for n in listed}
    missing = sorted(set(__import__("hvdkit").__all__) - top - {"__version__"})
    assert not missing, f"README's API table leaves out public names: {missing}"


def module_lists() -> dict[str, list[tuple[str, int, set[str]]]]:
    """Public module -> (page, line, names) of each block listing its public names."""
    found: dict[str, list[tuple[str, int, set[str]]]] = {}
    for page in PAGES:
        for number, block in blocks(page):
            match = _LIST.match(block)
            if not match:
                continue
            module = match.group(1) or page_module(page)
            assert module in public_modules(), f"{page}:{number}: a names list of no module"
            names = set()
            for name in _IDENTIFIER.findall(block):
                local = name.removeprefix(module.removeprefix("hvdkit.") + ".")
                if local in public_modules()[module].__all__:
                    names.add(local)
                elif resolve(name) is None and resolve(name.rpartition(".")[2]) is None:
                    names.add(local)  # public nowhere (an error class is hvdkit's): extra
            found.setdefault(module, []).append((page, number, names))
    return found


def test_each_public_module_lists_its_names_once_and_exactly():
    lists = module_lists()
    problems = []
    for module_name, module in public_modules().items():
        if module_name == "hvdkit":
            continue  # README's table (above)
        where = lists.get(module_name, [])
        if len(where) != 1:
            problems.append(f"{module_name}: {len(where)} name lists in the docs, want 1")
        for page, number, names in where:
            missing = sorted(set(module.__all__) - names)
            extra = sorted(names - set(module.__all__))
            if missing or extra:
                problems.append(f"{page}:{number}: {module_name} missing {missing}, extra {extra}")
    assert not problems, "\n".join(problems)


def test_the_list_reader_on_a_known_row():
    row = "| t | `DistributedOptimizer`, `callbacks.{RankZeroOnly, MetricAverageCallback}` | x |"
    assert names_column(row) == [
        "callbacks.RankZeroOnly",
        "callbacks.MetricAverageCallback",
        "DistributedOptimizer",
    ]
    assert resolve("callbacks.RankZeroOnly")[0] == "hvdkit.callbacks.RankZeroOnly"
    assert resolve("no_such_name") is None


def test_readme_opens_with_the_two_commands():
    first_block = re.search(r"```\w*\n(.*?)```", text("README.md"), re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands == ["scripts/demo.sh", "scripts/test.sh"], commands

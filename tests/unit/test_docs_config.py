"""Settings, defaults, paths and packages quoted in the docs are the code's.

* every ``HVDKIT_*`` variable the docs name is one of :mod:`hvdkit.config` (or, for
  the test suite's own, one its scripts read);
* a default quoted next to a variable (``HVDKIT_PREEMPT_GRACE`` ... default 25,
  or a table row's last cell) is config's ``DEFAULT_*`` for it;
* the Horovod wheel cache quoted in the docs has the shape ``cache_dir()`` builds;
* a list of five or more Debian packages is one of the two lists the code keeps:
  what the Horovod build needs (``install_horovod``) or what ``scripts/install.sh``
  installs;
* a package "installed with hvdkit" is one of ``setup.py``'s ``install_requires``;
* a path of this repository in a code span or block (``hvdkit/launch/transport.py``)
  exists, so a moved module cannot leave its old name in the docs.
"""

from __future__ import annotations

import ast
import re

from _docs import PAGES, ROOT, blocks, code, find_module, suite_sources

from hvdkit import config

VARIABLE = re.compile(r"\bHVDKIT_[A-Z0-9_]*[A-Z0-9]")
SETTINGS = {
    value: name
    for name, value in vars(config).items()
    if name.isupper() and isinstance(value, str) and value.startswith("HVDKIT_")
}
_UNITS = {"s": 1, "MiB": 1 << 20, "": 1}


def default_of(variable: str) -> float | None:
    """config's ``DEFAULT_<NAME>[_S]`` of the setting ``variable`` names, if it has one."""
    name = SETTINGS[variable]
    for candidate in (f"DEFAULT_{name}", f"DEFAULT_{name}_S"):
        if hasattr(config, candidate):
            return getattr(config, candidate)
    return None


def test_every_variable_the_docs_name_exists():
    elsewhere = "\n".join(
        text for path, text in suite_sources().items() if not path.startswith("tests/unit/")
    )
    elsewhere += "\n".join(p.read_text() for p in (ROOT / "scripts").glob("*"))
    unknown = []
    for page in PAGES:
        for number, snippet in code(page):
            for variable in VARIABLE.findall(snippet):
                if variable not in SETTINGS and variable not in elsewhere:
                    unknown.append(f"{page}:{number}: {variable}")
    assert not unknown, "variables hvdkit does not read:\n" + "\n".join(unknown)


_NEAR = re.compile(r"`(HVDKIT_\w+)`[^`|]{0,40}?default:? ([\d.]+) ?(s|MiB)?\b")
_DEFAULT = re.compile(
    r"default(?:s| is|:)? (?:of )?(?:`?\$?HVDKIT_\w+`? or )?\**(\d+(?:\.\d+)?)\** ?(s|MiB)?\b"
)


def quoted_defaults():
    """(page, line, variable, quoted value) of every default quoted for a variable.

    A default right after the variable (`HVDKIT_X` ..., default 25), any "default N"
    in a block naming one variable that has a default, and the last cell of a table
    row that starts with the variable.
    """
    for page in PAGES:
        for number, block in blocks(page):
            for variable, value, unit in _NEAR.findall(block):
                yield page, number, variable, float(value) * _UNITS[unit]
            named = {v for v in VARIABLE.findall(block) if v in SETTINGS and default_of(v)}
            if len(named) == 1:
                for value, unit in _DEFAULT.findall(block):
                    yield page, number, next(iter(named)), float(value) * _UNITS[unit]
            row = re.match(r"\| `(HVDKIT_\w+)`.*\| `(\d+(?:\.\d+)?)` \|$", block)
            if row:
                yield page, number, row.group(1), float(row.group(2))


def test_quoted_defaults_are_configs():
    wrong, seen = [], 0
    for page, number, variable, value in quoted_defaults():
        if variable not in SETTINGS or default_of(variable) is None:
            continue
        seen += 1
        if value != default_of(variable):
            wrong.append(
                f"{page}:{number}: {variable} default {value:g}, config says {default_of(variable)}"
            )
    assert not wrong, "\n".join(wrong)
    assert seen >= 8, "the check found almost no quoted defaults: is the pattern still right?"


def test_the_wheel_cache_quoted_in_the_docs_is_where_the_build_puts_it(monkeypatch, tmp_path):
    build = find_module("install_horovod.py")
    monkeypatch.delenv(config.CACHE_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    real = build.cache_dir("2.21.0").relative_to(tmp_path / "hvdkit").as_posix()
    wrong, seen = [], 0
    for page in PAGES:
        for number, snippet in code(page):
            for quoted in re.findall(r"~/\.cache/hvdkit/(wheels/(?:[^\s`<]|<[^>]*>)+)", snippet):
                seen += 1
                # <placeholder>: one field of the name; "...": the rest of the path
                pattern = re.escape(quoted.rstrip("/")).replace(re.escape("..."), ".*")
                pattern = re.sub(r"<[^>]*>", "[^-/]+", pattern)
                if not re.fullmatch(pattern, real):
                    wrong.append(f"{page}:{number}: ~/.cache/hvdkit/{quoted} (the build: {real})")
    assert not wrong, "\n".join(wrong)
    assert seen, "no page quotes the wheel cache: is the pattern still right?"


def package_lists() -> dict[str, set[str]]:
    build = find_module("install_horovod.py")
    needed = {pkg for _, pkg, _ in build.TOOLS} | {pkg for _, pkg, _ in build.HEADER_PACKAGES}
    needed.add(build.python_headers_package())
    script = (ROOT / "scripts" / "install.sh").read_text()
    apt = set(re.search(r"APT_PACKAGES=\(([^)]*)\)", script).group(1).split())
    return {"the Horovod build (install_horovod)": needed, "scripts/install.sh": apt}


def test_lists_of_debian_packages_are_the_codes():
    lists = package_lists()
    known = set().union(*lists.values())
    wrong = []
    for page in PAGES:
        for number, block in blocks(page):
            named = {p for p in re.findall(r"[\w.+-]+", " ".join(re.findall(r"`([^`]+)`", block)))}
            named &= known
            if len(named) < 5:
                continue
            if not any(named == packages for packages in lists.values()):
                closest = min(lists, key=lambda k: len(named ^ lists[k]))
                wrong.append(
                    f"{page}:{number}: {sorted(named)}; {closest} has "
                    f"{sorted(lists[closest])} (missing {sorted(lists[closest] - named)}, "
                    f"extra {sorted(named - lists[closest])})"
                )
    assert not wrong, "\n".join(wrong)


def install_requires() -> set[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            return {re.split(r"[<>=!\[ ]", ast.literal_eval(e))[0] for e in node.value.elts}
    raise AssertionError("setup.py has no install_requires")


def test_what_the_docs_say_comes_with_hvdkit_is_a_requirement():
    wrong = []
    for page in PAGES:
        for number, block in blocks(page):
            for package in re.findall(r"`([\w-]+)` is installed with hvdkit\b", block):
                if package not in install_requires():
                    wrong.append(f"{page}:{number}: {package} is not in install_requires")
    assert not wrong, "\n".join(wrong)


_PATH = re.compile(r"(?<![\w/.~-])((?:hvdkit|tests|scripts|examples|benchmarks|docs)/[\w./*<>-]*)")
# Horovod's own repository's files, named as the counterpart of ours (porting-horovod.md)
HOROVODS = ("examples/tensorflow2/", "examples/elastic/")


def test_paths_the_docs_name_exist():
    missing = []
    for page in PAGES:
        for number, snippet in code(page):
            for path in _PATH.findall(snippet):
                path = path.rstrip(".")
                if any(c in path for c in "*<>") or path.startswith(HOROVODS):
                    continue  # a pattern (tests/test_*_mp.py), a placeholder, Horovod's file
                if not (ROOT / path).exists():
                    missing.append(f"{page}:{number}: {path}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)

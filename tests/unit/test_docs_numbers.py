"""A measured figure has one home page; other pages link to it instead of quoting it.

Two checks (docs/contributing.md, "Docs that stay true"):
* a family of figures named in :data:`FAMILIES` (a pattern that finds it) may be
  quoted only on its home page;
* a range of ratios, percentages or minutes (``0.97–1.35x``) quoted on two pages
  with one end the same and the other within 5 % of it is one figure quoted two
  ways: one of them is stale.
* a reference page carries no dated run and no "before this was fixed": dates,
  numbered runs and history belong to the performance record;
* "Two ports are in [`examples/horovod/`](...)": a count of the scripts of a linked
  folder is the number of its scripts (``*.py`` not starting with ``_``).
The performance record keeps every dated run and is not read here.
"""

from __future__ import annotations

import re
from itertools import combinations

from _docs import PAGES, ROOT, blocks

# name -> (pattern that finds the figure in a block, the one page that may quote it)
FAMILIES = {
    "Horovod's build time": (
        re.compile(
            r"(?:build|compil)[^|]*?(?:about|takes) (\d+(?:–\d+)?) minutes"
            r"|(\d+(?:–\d+)?) minutes, most of it compiling"
        ),
        "docs/install.md",
    ),
    "hvdkit's allreduce against Horovod's": (
        re.compile(r"(\d\.\d+–\d\.\d+) ?[x×] Horovod's time"),
        "docs/performance.md",
    ),
    "sink mode's gain with 2 processes": (
        re.compile(r"2 processes \((\d\.\d+)×\)|(\d\.\d+)× over Gloo, [\d.–]+× over MPI"),
        "docs/sink.md",
    ),
    "the ResNet-50-sized prediction": (
        re.compile(r"(\d+–\d+) ?% scaling efficiency"),
        "docs/performance.md",
    ),
}

RANGE = re.compile(r"(\d+(?:\.\d+)?) ?[–-] ?(\d+(?:\.\d+)?) ?(x|×|%|minutes)(?!\w)")
_UNIT = {"×": "x"}


def quotes(pattern: re.Pattern) -> list[tuple[str, int, str]]:
    return [
        (page, number, value)
        for page in PAGES
        for number, block in blocks(page)
        for match in pattern.finditer(block)
        for value in [next(g for g in match.groups() if g)]
    ]


def test_each_family_is_quoted_on_its_home_page_only():
    wrong = []
    for family, (pattern, home) in FAMILIES.items():
        found = quotes(pattern)
        away = [(p, n, v) for p, n, v in found if p != home]
        if away:
            values = sorted({v for _, _, v in found})
            how = "quoted differently" if len(values) > 1 else "quoted twice"
            places = ", ".join(f"{p}:{n} ({v})" for p, n, v in found)
            wrong.append(f"{family}: {how} {values}: {places}; link to {home} instead")
    assert not wrong, "\n".join(wrong)


def ranges() -> list[tuple[str, int, tuple[str, str, str]]]:
    found = []
    for page in PAGES:
        for number, block in blocks(page):
            for low, high, unit in RANGE.findall(block):
                found.append((page, number, (low, high, _UNIT.get(unit, unit))))
    return found


def near_miss(a: tuple[str, str, str], b: tuple[str, str, str]) -> bool:
    """One end the same, the other within 5 %: one figure, one copy stale."""
    ends = list(zip(map(float, a[:2]), map(float, b[:2]), strict=True))
    same = [x == y for x, y in ends]
    if same.count(True) != 1:
        return False
    x, y = ends[same.index(False)]
    return abs(x - y) <= 0.05 * max(abs(x), abs(y))


def test_no_range_is_quoted_two_ways_on_two_pages():
    wrong = set()
    for (p1, n1, a), (p2, n2, b) in combinations(ranges(), 2):
        if p1 == p2 or a[2] != b[2] or a == b:
            continue
        if near_miss(a, b):
            wrong.add(f"{p1}:{n1} {a[0]}–{a[1]}{a[2]} against {p2}:{n2} {b[0]}–{b[1]}{b[2]}")
    assert not wrong, "one figure quoted two ways:\n" + "\n".join(sorted(wrong))


def test_the_range_reader_and_the_near_miss():
    assert near_miss(("0.98", "1.35", "x"), ("0.97", "1.35", "x"))
    assert not near_miss(("0.97", "1.02", "x"), ("0.97", "1.35", "x"))
    assert not near_miss(("0.97", "1.35", "x"), ("0.97", "1.35", "x"))
    assert RANGE.findall("ran 0.98–1.35× the raw loop, and 4-6 minutes; 81–91 %") == [
        ("0.98", "1.35", "×"),
        ("4", "6", "minutes"),
        ("81", "91", "%"),
    ]


WORDS = "zero one two three four five six seven eight nine ten eleven twelve".split()
COUNTED = re.compile(r"\b(\w+) [\w-]+ (?:are|is) in \[`([\w./-]+/)`\]", re.I)


def test_counts_of_a_linked_folders_scripts_are_its_scripts():
    wrong, seen = [], 0
    for page in PAGES:
        for number, block in blocks(page):
            for word, folder in COUNTED.findall(block):
                said = int(word) if word.isdigit() else WORDS.index(word.lower())
                scripts = sorted(p.name for p in (ROOT / folder).glob("*.py") if p.name[0] != "_")
                seen += 1
                if said != len(scripts):
                    wrong.append(f"{page}:{number}: says {word} in {folder}, it has {scripts}")
    assert not wrong, "\n".join(wrong)
    assert seen, "no counted folder found: is the pattern still right?"


DIARY = re.compile(
    r"\b20\d\d-\d\d-\d\d\b"  # a date
    r"|\b[Rr]uns? \d+\b(?! (?:steps|epochs|times|tests|seeds|faults|rounds|ranks|ms|s)\b)"
    r"|[Bb]efore (?:this|the fix|it was)\b|\bused to\b|\bwas fixed\b|\bnow (?:refuses|keeps)\b"
)


# contributing.md names the rule.
NOT_CHECKED_FOR_DIARY = {"docs/contributing.md"}


def test_reference_pages_carry_no_dated_runs():
    found = [
        f"{page}:{number}: {match.group(0)!r} in {block[:100]}"
        for page in PAGES
        if page not in NOT_CHECKED_FOR_DIARY
        for number, block in blocks(page)
        for match in DIARY.finditer(block)
    ]
    assert not found, "move to docs/performance-record.md:\n" + "\n".join(found)

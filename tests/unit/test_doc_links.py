"""Every relative link in README.md and docs/ points at a file that exists, and its heading."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(page: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.*)$", page.read_text(), re.M)}


def test_relative_links_and_anchors_resolve():
    broken = []
    for page in PAGES:
        for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", link):
                continue  # http(s), mailto: not checked here
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.name}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in headings(target):
                broken.append(f"{page.name}: {link} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_check_sees_a_broken_anchor(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# Real heading, with 90 %\n")
    assert slug("Real heading, with 90 %") == "real-heading-with-90-"
    assert "missing" not in headings(page) and "real-heading-with-90-" in headings(page)

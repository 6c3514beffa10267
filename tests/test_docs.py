"""Every relative link in the README, CONTRIBUTING.md and docs/ resolves: the file exists and,
where the link names an anchor, the target file has a heading that GitHub gives that anchor."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", *(REPO / "docs").glob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code (links there are not links)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes of a Markdown file's headings (a repeated one gets -1, -2...)."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", FENCE.sub("", path.read_text()), re.M):
        text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def links(source: Path) -> list[str]:
    return [
        target
        for target in LINK.findall(prose(source.read_text()))
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto:
    ]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(source: Path) -> None:
    problems = []
    for target in links(source):
        name, _, anchor = target.partition("#")
        path = (source.parent / name).resolve() if name else source
        if not path.exists():
            problems.append(f"{target}: no {path.relative_to(REPO)}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            problems.append(f"{target}: no heading with anchor #{anchor} in {path.name}")
    assert not problems, "\n".join(problems)


def test_the_checker_sees_links_and_anchors(tmp_path: Path) -> None:
    doc = tmp_path / "a.md"
    doc.write_text(
        "# Title\n## 2. Scale `out`\n## Notes\n## Notes\n"
        "[x](b.md#top) ![i](img.png) `[no](code.md)` <https://example.com>\n"
        "```\n[not](fenced.md)\n# not a heading\n```\n"
    )
    assert links(doc) == ["b.md#top", "img.png"]
    assert anchors(doc) == {"title", "2-scale-out", "notes", "notes-1"}

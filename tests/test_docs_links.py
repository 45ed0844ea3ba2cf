"""Every link in the docs leads somewhere: each relative markdown link (and its #anchor) in
README.md and docs/*.md, each raw result named as `benchmarks/results/...` in the docs, tests
and benchmark scripts, and each docs page a training recipe cites."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULT_PATH = re.compile(r"benchmarks/results/[A-Za-z0-9_<\[][A-Za-z0-9_.+<>\[\]-]*")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans, where links are links."""
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)
    return re.sub(r"(`+).+?\1", "", text, flags=re.S)


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of a page (duplicates numbered -1, -2, ...) and
    any explicit `<a id=...>` / `<a name=...>`."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    text = re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", markdown, flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    anchors.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", markdown))
    return anchors


def test_github_anchors_follow_githubs_rules():
    page = ("# Training speed against HF\n## `--pad-packs`: fixed shapes\n## Notes\n## Notes\n"
            "```\n# not a heading\n```\n")
    assert github_anchors(page) == {"training-speed-against-hf", "--pad-packs-fixed-shapes", "notes", "notes-1"}


def _links(page: Path) -> list[str]:
    return [target for target in LINK.findall(_prose(page.read_text(encoding="utf-8")))
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto:


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in github_anchors(resolved.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading with that anchor in {resolved.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def _text_files():
    yield from PAGES
    for folder in ("tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".md", ".json", ".yaml", ".txt") \
                    and (ROOT / "benchmarks" / "results") not in path.parents:
                yield path


def test_every_named_result_file_exists():
    missing = []
    for path in _text_files():
        for name in RESULT_PATH.findall(path.read_text(encoding="utf-8", errors="replace")):
            name = name.rstrip(".")
            if "<" in name or "[" in name:  # a pattern for a future result, e.g. <yyyymmdd>
                continue
            if not (ROOT / name).is_file():
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, "\n".join(missing)


def test_the_recipes_cite_docs_anchors_that_exist():
    cited = []
    for recipe in sorted((ROOT / "train" / "recipes").glob("*.yaml")):
        for page, anchor in re.findall(r"(docs/[\w-]+\.md)#([\w-]+)", recipe.read_text(encoding="utf-8")):
            if anchor not in github_anchors((ROOT / page).read_text(encoding="utf-8")):
                cited.append(f"{recipe.name}: {page}#{anchor}")
    assert not cited, cited


def test_the_benchmarks_page_stays_a_page_of_current_figures():
    """docs/benchmarks.md holds one table per area, current figures only: at most 400 lines
    (superseded figures are deleted, experiments not kept are one line in performance.md)."""
    lines = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 400, f"docs/benchmarks.md has {lines} lines: delete superseded figures, condense"

"""The README and docs/: the README stays the first page of a newcomer (at most 15 KB, linking
every docs page), every relative link of them resolves to a file and, with a #fragment, to a
heading there; the field table of docs/fields.md is the schema's (a field added without docs fails)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sparkform.commands.fields import field_table

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The fragments GitHub gives a page's headings (lower case, punctuation gone, spaces as -)."""
    text = re.sub(r"(?ms)^```.*?^```", "", page.read_text())
    return {
        re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")
        for heading in re.findall(r"(?m)^#{1,6} (.+)$", text)
    }


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"(?ms)^```.*?^```", "", page.read_text())
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


def test_the_readme_is_at_most_15_kb():
    assert len(README.read_bytes()) <= 15 * 1024, len(README.read_bytes())


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / target.partition("#")[0]).resolve() for target in relative_links(README)}
    assert set(DOCS.glob("*.md")) - linked == set()


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_resolves_to_a_file_and_its_heading(page):
    broken = []
    for target in relative_links(page):
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target}: no such heading in {file.relative_to(REPO)}")
    assert broken == [], broken


def test_the_link_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](#nowhere) [missing](no-such.md)\n")
    targets = relative_links(page)
    assert targets == ["#title", "#nowhere", "no-such.md"]
    assert "nowhere" not in anchors(page) and "title" in anchors(page)


def test_docs_field_table_matches_schema():
    assert field_table() in (DOCS / "fields.md").read_text(), (
        "regenerate the table in docs/fields.md with `sparkform fields`"
    )


def test_every_field_has_a_description():
    for line in field_table().splitlines()[2:]:
        assert not line.endswith("| None |"), line

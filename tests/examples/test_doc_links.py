"""Every relative link of the README, the top-level pages and docs/ points to a file that exists, and an anchor in
it (`page.md#section`, `#section`) to one of that page's headings."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # https:, mailto:, ...


def links(page: Path) -> list[str]:
    """The targets of the page's markdown links outside code blocks and inline code."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of the page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    headings = re.findall(r"^#+\s+(.+?)\s*$", text, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_the_pages_are_found():
    assert ROOT / "README.md" in PAGES
    assert ROOT / "docs" / "architecture.md" in PAGES


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_points_to_an_existing_file_and_heading(page: Path):
    broken = []
    for target in links(page):
        if EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor in {linked.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("From plain PyTorch: modules, torch.optim, schedules", "from-plain-pytorch-modules-torchoptim-schedules"),
        ("When a process dies: the failure model", "when-a-process-dies-the-failure-model"),
        ("The input pipeline: tf.data's, by changing the import", "the-input-pipeline-tfdatas-by-changing-the-import"),
    ],
)
def test_anchors_are_made_as_github_makes_them(heading: str, anchor: str, tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text(f"## {heading}\n")
    assert anchors(page) == {anchor}

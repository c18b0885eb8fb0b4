"""The documentation is true to the code: the configuration table is the one the code prints,
every relative link lands on a file and a heading that exist, and README.md stays short.
(Its runnable blocks run in ``test_readme_commands.py``; the dashboard's metrics are checked
against a real server's ``/metrics`` in ``test_vllm_e2e.py``.)"""

import re
from pathlib import Path

import pytest

from kvtier.common.config import markdown_table

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # no headings inside code
    return {slug(m) for m in re.findall(r"^#+ (.+)$", text, re.M)}


def test_the_configuration_page_lists_every_key_as_the_code_defines_it():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert markdown_table() in page, "docs/configuration.md's table is stale: paste `kvtier config --markdown`"


def test_the_readme_stays_within_250_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # an absolute URL
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_lands_on_a_file_and_heading_that_exist(page):
    broken = broken_links(page)
    assert not broken, "\n".join(broken)


def test_the_docs_have_the_pages_a_reader_looks_for():
    for name in ("configuration", "tiers", "deployment", "operations", "architecture", "compatibility",
                 "benchmarks"):
        assert (ROOT / "docs" / f"{name}.md").exists(), name
    assert (ROOT / "docs" / "grafana" / "kvtier.json").exists()


def test_the_link_check_finds_a_broken_link_and_a_missing_heading(tmp_path):
    """The check above can fail: a link to no file and one to no heading are found; a link to a
    heading with punctuation, and a URL, are not."""
    (tmp_path / "a.md").write_text("# Title\n\n[x](missing.md) [y](b.md#nowhere) [z](b.md#prefilldecode-it-is) "
                                   "[u](https://example.com/x.md)\n")
    (tmp_path / "b.md").write_text("# Prefill/decode: it is\n\n```\n# not a heading\n```\n")
    assert broken_links(tmp_path / "a.md") == [f"missing.md: no file {tmp_path / 'missing.md'}",
                                               "b.md#nowhere: no heading #nowhere in b.md"]
    assert "not-a-heading" not in anchors(tmp_path / "b.md")

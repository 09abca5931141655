"""issue 39: a README a newcomer can finish, and docs/ pages whose links lead somewhere.

Every relative markdown link ``[text](path)`` or ``[text](path#anchor)`` of README.md and
of every ``docs/**/*.md`` (``docs/notes/`` included: its links all resolve) names a file
or folder that exists, and an anchor into a ``.md`` file names one of that file's headings,
slugged as GitHub does (lowercase; every character but letters, digits, ``_``, ``-`` and
spaces dropped, so backticks, parentheses, colons and dots go; each space becomes ``-``;
a repeated heading gets ``-1``, ``-2``, ...). Links inside fenced code blocks and code
spans are not links. The README stays at most 300 lines, its table cells short, and the
examples it shows are the ones the docs pages show.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.helpers.paths import REPO

README_MAX_LINES = 300
TABLE_CELL_MAX_CHARS = 200

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target) or [text](target "title"); the text may hold one level of brackets
_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:name|id)=\"([^\"]+)\"", re.I)
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
        elif fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip(fence[0] + " "):
                fence = None
        else:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (its markdown stripped first)."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a link into ``path`` may name: its headings' slugs and HTML anchors."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    previous = ""
    for _, line in prose_lines(path.read_text("utf-8")):
        found.update(_HTML_ANCHOR.findall(line))
        heading = None
        atx = _ATX.match(line)
        if atx:
            heading = atx.group(2) or ""
        elif _SETEXT.match(line) and previous.strip() and not previous.lstrip().startswith(("|", "-", "*", ">")):
            heading = previous
        previous = line
        if heading is None:
            continue
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every markdown link outside code blocks and code spans."""
    out = []
    for number, line in prose_lines(text):
        line = _CODE_SPAN.sub(lambda m: "`" + re.sub(r"[\[\]()]", "_", m.group(2)) + "`", line)
        out.extend((number, target) for target in _LINK.findall(line))
    return out


def broken_links(page: Path) -> list[str]:
    problems = []
    for number, target in links(page.read_text("utf-8")):
        if _EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path_part)).resolve() if path_part else page
        where = f"{page.relative_to(REPO)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            problems.append(f"{where} (no heading with that anchor in {dest.name})")
    return problems


def test_github_slugs() -> None:
    """The anchors the README used before issue 39 are what GitHub makes of those headings."""
    assert slug("Measured (H100 80GB HBM3, one run each; `docs/results/`)") == (
        "measured-h100-80gb-hbm3-one-run-each-docsresults"
    )
    assert slug("Whole-model parity: `load_model` and `marlin-verify --model`") == (
        "whole-model-parity-load_model-and-marlin-verify---model"
    )
    assert slug("`marlin-convert`") == "marlin-convert"
    assert slug("What converts and what passes through") == "what-converts-and-what-passes-through"
    assert slug("Quirks handled (the data wins over the label)") == "quirks-handled-the-data-wins-over-the-label"
    assert slug("The artifact (schema v2)") == "the-artifact-schema-v2"
    assert slug("sm_90 (132 SMs, 227 KB shared per block)") == "sm_90-132-sms-227-kb-shared-per-block"
    assert slug('1.5 The "zeros minus one" history (v1) and `gptq_v2`') == (
        "15-the-zeros-minus-one-history-v1-and-gptq_v2"
    )
    assert slug("See [the spec](spec/x.md)") == "see-the-spec"


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_link_check_finds_broken_links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: a missing file, a missing anchor (in this page and in another)."""
    monkeypatch.setattr("tests.test_doc_links.REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title `x` (y)\n\n## Twice\n\n## Twice\n\nText\n---\n", "utf-8")
    page = tmp_path / "README.md"
    page.write_text(
        "# Top\n\n"
        "[ok](docs/a.md) [ok](docs/a.md#title-x-y) [ok](docs/a.md#twice-1) [ok](docs/a.md#text) [ok](#top)\n"
        "[ok](https://example.com/x#y) `[not a link](nowhere.md)`\n"
        "```\n[not a link](nowhere.md)\n```\n"
        "[bad](docs/b.md) [bad](docs/a.md#twice-2) [bad](#nowhere)\n",
        "utf-8",
    )
    assert broken_links(page) == [
        "README.md:8: docs/b.md (no such file)",
        "README.md:8: docs/a.md#twice-2 (no heading with that anchor in a.md)",
        "README.md:8: #nowhere (no heading with that anchor in README.md)",
    ]


def test_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text("utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move sections to docs/"


def test_readme_table_cells_are_short() -> None:
    long_cells = [
        f"README.md:{number}: {cell[:60]}..."
        for number, line in prose_lines((REPO / "README.md").read_text("utf-8"))
        if line.lstrip().startswith("|")
        for cell in line.strip().strip("|").split("|")
        if len(cell.strip()) > TABLE_CELL_MAX_CHARS
    ]
    assert long_cells == []


def test_readme_examples_are_the_docs_examples() -> None:
    """The README shows one example of each command; the docs page of that command shows
    the same one, word for word, so the two cannot drift apart."""
    readme = (REPO / "README.md").read_text("utf-8")
    blocks = re.findall(r"```console\n(.*?)```", readme, flags=re.S)
    assert len(blocks) == 2
    docs = {name: (REPO / "docs" / name).read_text("utf-8") for name in ("convert.md", "verify.md")}
    assert blocks[0].startswith("$ marlin-convert ") and blocks[0] in docs["convert.md"]
    assert blocks[1].startswith("$ marlin-verify ") and blocks[1] in docs["verify.md"]


def test_readme_links_every_docs_page() -> None:
    """Everything that left the README is one link away from it."""
    readme = (REPO / "README.md").read_text("utf-8")
    linked = {(REPO / unquote(t.partition("#")[0])).resolve() for _, t in links(readme) if not _EXTERNAL.match(t)}
    top = sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "docs" / "spec").glob("*.md"))
    assert [str(p.relative_to(REPO)) for p in top if p.resolve() not in linked] == []

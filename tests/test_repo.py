"""The repository keeps its promises: CI runs what the README says, and the map of the
repository (docs/layout.md, moved from the README in issue 39) names every module of the
package."""

from __future__ import annotations

import re

from tests.helpers.paths import REPO


def test_ci_runs_the_readme_command() -> None:
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index("Set up for development") :]
    command = re.search(r"```bash\n(.+?)\n```", block, flags=re.S).group(1).strip()
    ci = [
        ln for ln in (REPO / ".ci" / "run").read_text().splitlines() if ln and not ln.startswith(("#", "set ", "cd "))
    ]
    assert ci == [command]
    assert "ruff check" in command and "ruff format --check" in command and "torch==2.13.0" in command


def test_layout_names_every_module() -> None:
    page = (REPO / "docs" / "layout.md").read_text()
    layout = page[page.index("# Layout of the repository") :]
    layout = layout[: layout.index("```", layout.index("```") + 3)]
    package = REPO / "converter"
    modules = {p.name for p in package.rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts}
    missing = sorted(m for m in modules if m not in layout)
    assert missing == []
    assert (package / "py.typed").is_file()


# the README and the pages that hold what left it (issue 39); they name paths from the repository root
README_PAGES = (
    "README.md",
    *(f"docs/{p}.md" for p in ("install", "convert", "verify", "model", "artifact", "gpu", "layout")),
)


def test_every_file_the_readme_cites_is_in_the_repository() -> None:
    """Paths into the repository that the README (and the docs pages moved from it) name
    exist (the format specs it cites included: docs/spec/), and it cites no spec that lives
    outside the repository."""
    top = r"(?:converter|docs|schemas|scripts|tests|kernels)"
    pattern = rf"(?<![\w./-])({top}/[\w./-]*\w\.(?:py|md|json|sh|cu|cuh|tinyloop))"
    texts = {page: (REPO / page).read_text() for page in README_PAGES}
    assert {"docs/spec/checkpoint-formats.md", "docs/spec/tinyloop-v1.md"} <= set(
        re.findall(pattern, texts["README.md"])
    )
    for page, text in texts.items():
        cited = set(re.findall(pattern, text))
        assert sorted(c for c in cited if not (REPO / c).is_file()) == [], page
        assert "shared/spec" not in text, page


def test_the_license_pyproject_names_is_in_the_repository() -> None:
    """issue 43: pyproject.toml says Apache-2.0, and the LICENSE file holds that license's
    full text; the description names every input format."""
    import hashlib

    pyproject = (REPO / "pyproject.toml").read_text("utf-8")  # (tomllib: Python 3.11+)
    meta = dict(re.findall(r'^(license|description) = "(.*)"$', pyproject, flags=re.M))
    assert meta["license"] == "Apache-2.0"
    text = (REPO / "LICENSE").read_text("utf-8")
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    # the text as the Apache Software Foundation publishes it (LICENSE-2.0.txt)
    assert hashlib.md5((REPO / "LICENSE").read_bytes()).hexdigest() == "3b83ef96387f14655fc854ddc3c6bd57"
    for fmt in ("GPTQ", "AWQ", "compressed-tensors", ".tinyloop"):
        assert fmt in meta["description"], fmt


def test_every_link_in_the_readme_and_the_docs_resolves() -> None:
    """issue 39: the README links to docs/ for everything else; every relative link of the
    README and of docs/ (notes included) names a file that exists."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    broken = [
        f"{page.relative_to(REPO)}: {target}"
        for page in pages
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text("utf-8"))
        if not target.startswith(("http://", "https://", "#", "mailto:"))
        and target.split("#")[0]
        and not (page.parent / target.split("#")[0]).exists()
    ]
    assert broken == []

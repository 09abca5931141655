"""The repository keeps its promises: CI runs what the README says, and the README's map
of the repository names every module of the package."""

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


def test_readme_layout_names_every_module() -> None:
    readme = (REPO / "README.md").read_text()
    layout = readme[readme.index("## Layout of the repository") :]
    layout = layout[: layout.index("```", layout.index("```") + 3)]
    package = REPO / "converter"
    modules = {p.name for p in package.rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts}
    missing = sorted(m for m in modules if m not in layout)
    assert missing == []
    assert (package / "py.typed").is_file()

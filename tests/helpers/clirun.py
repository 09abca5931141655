"""Run the CLIs as a user would: a fresh process, real exit code, separate streams."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from .paths import REPO


def run_cli(tool: str, *args: object, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``marlin-convert`` or ``marlin-verify`` with ``args``; returns the finished process."""
    entry = {"marlin-convert": "main_convert", "marlin-verify": "main_verify"}[tool]
    code = f"import sys; sys.argv[0] = {tool!r}; from converter.cli import {entry}; {entry}()"
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "COLUMNS": "200", "HOME": str(Path.home())},
    )


def assert_one_line_error(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit 2 with exactly one ``error: ...`` line on stderr holding every needle, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in r.stderr + r.stdout
    for n in needles:
        assert n in lines[0], (n, lines[0])

"""Run the CLIs as a user would: a fresh process, real exit code, separate streams."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_cli(tool: str, *args: object, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``marlin-convert`` or ``marlin-verify`` with ``args``; returns the finished process."""
    entry = {"marlin-convert": "main_convert", "marlin-verify": "main_verify"}[tool]
    code = f"import sys; sys.argv[0] = {tool!r}; from converter.cli import {entry}; {entry}()"
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True, text=True, timeout=timeout, cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "COLUMNS": "200", "HOME": str(Path.home())},
    )

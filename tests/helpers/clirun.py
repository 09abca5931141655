"""Run the CLIs as a user would: a fresh process, real exit code, separate streams."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .paths import REPO


def _command(tool: str, args: tuple[object, ...]) -> list[str]:
    entry = {"marlin-convert": "main_convert", "marlin-verify": "main_verify"}[tool]
    code = f"import sys; sys.argv[0] = {tool!r}; from converter.cli import {entry}; {entry}()"
    return [sys.executable, "-c", code, *map(str, args)]


def _env() -> dict[str, str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "COLUMNS": "200", "HOME": str(Path.home())}
    if "MARLIN_NATIVE" in os.environ:  # a run that switched the compiled loops off keeps them off
        env["MARLIN_NATIVE"] = os.environ["MARLIN_NATIVE"]
    return env


def run_cli(tool: str, *args: object, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``marlin-convert`` or ``marlin-verify`` with ``args``; returns the finished process."""
    return subprocess.run(_command(tool, args), capture_output=True, text=True, timeout=timeout, cwd=REPO, env=_env())


#: A small process that runs the tool as its child and reports the child's peak RSS.  The
#: tool must not be started from the test process itself: Linux carries a parent's RSS
#: high-water mark into a child forked (or vforked) from it, so a 900 MB pytest would set
#: a 900 MB floor under every measurement.
_MEASURE = r"""
import json, resource, subprocess, sys
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(json.dumps({"rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr,
                  "maxrss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def run_cli_rss(tool: str, *args: object) -> tuple[subprocess.CompletedProcess[str], int]:
    """:func:`run_cli`, plus the tool's peak RSS in bytes: its own ``ru_maxrss``, which
    counts the file-backed pages it has mapped too (Linux reports KiB)."""
    r = subprocess.run(
        [sys.executable, "-c", _MEASURE, *_command(tool, args)], capture_output=True, text=True, cwd=REPO, env=_env()
    )
    res = json.loads(r.stdout)
    return subprocess.CompletedProcess(_command(tool, args), res["rc"], res["stdout"], res["stderr"]), res["maxrss"]


def assert_one_line_error(r: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Exit 2 with exactly one ``error: ...`` line on stderr holding every needle, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in r.stderr + r.stdout
    for n in needles:
        assert n in lines[0], (n, lines[0])


def invoke(tool: str, *args: object):
    """Run a command in this process (typer's CliRunner, stdout and stderr apart): faster
    than :func:`run_cli` for the many bad-input cases; signals and imports need run_cli."""
    from typer.testing import CliRunner

    from converter.cli import convert_app, verify_app

    app = {"marlin-convert": convert_app, "marlin-verify": verify_app}[tool]
    return CliRunner().invoke(app, [str(a) for a in args])


def assert_refused(res, *needles: str) -> str:
    """An :func:`invoke` result: exit 2, nothing on stdout, exactly one ``error: ...``
    line on stderr holding every needle, no traceback.  Returns the line."""
    assert res.exit_code == 2, (res.exit_code, res.stdout, res.stderr, res.exception)
    assert res.stdout == "", res.stdout
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def snapshot(root: Path) -> dict[str, str]:
    """Every entry below ``root``, hidden ones included: a file's sha256, a link's
    target, a folder's mark.  Equal snapshots mean nothing was written, changed or
    deleted there (links are not followed, so a link's target is never read)."""
    import hashlib
    import os

    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            key = str(p.relative_to(root))
            if p.is_symlink():
                out[key] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[key] = "dir"
            elif p.is_file():
                out[key] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[key] = "special"
    return out

"""Hatch build hook: compile the optional C extension ``converter._native``.

hatchling builds no C extensions by itself; this hook runs the C compiler Python was
built with (``sysconfig``'s ``CC``/``LDSHARED``) on ``converter/_native.c``.  Why a hook
and not setuptools: the rest of the build (the wheel's package list and the CUDA
kernels and schemas it force-includes) stays as it is, and the extension stays optional
with no second build system.

* ``pip install -e .`` (editable): the module is written next to its source,
  ``converter/_native<EXT_SUFFIX>`` (git ignores it), where the editable import finds it.
* ``pip wheel .``: it is compiled in a temporary folder and added to the wheel, which
  then gets the platform tag of this interpreter.

Without a working compiler (or with ``MARLIN_NO_NATIVE=1``) the hook prints one warning
(pip shows a build's output with ``-v``) and builds a pure-Python package:
``converter.native`` then reports why the module is missing and every caller uses the
NumPy code (same results, slower).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

SOURCE = Path("converter") / "_native.c"
#: -O3 for the vector loops; no -march: the module picks AVX2 or AVX-512 code at run time.
FLAGS = ["-O3", "-std=gnu11", "-fvisibility=hidden", "-Wall", "-Wno-unused-function"]


def compile_native(root: Path, out: Path) -> str | None:
    """Compile ``converter/_native.c`` into ``out``; returns None, or why it failed."""
    if os.environ.get("MARLIN_NO_NATIVE") == "1":
        return "MARLIN_NO_NATIVE=1 is set"
    if os.name == "nt":
        return "no build recipe for Windows compilers (the module needs GCC or Clang)"
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    ldshared = sysconfig.get_config_var("LDSHARED") or f"{cc} -shared"
    if os.environ.get("CC"):  # a user's compiler wins; keep the platform's link flags
        ldshared = " ".join([os.environ["CC"], *shlex.split(ldshared)[1:]])
    if shutil.which(shlex.split(ldshared)[0]) is None:
        return f"no C compiler found ({shlex.split(ldshared)[0]!r} is not on PATH)"
    include = sysconfig.get_paths()["include"]
    cmd = [*shlex.split(ldshared), *shlex.split(sysconfig.get_config_var("CCSHARED") or "-fPIC"), *FLAGS]
    cmd += [f"-I{include}", str(root / SOURCE), "-o", str(out)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{shlex.join(cmd)}: {exc}"
    if run.returncode:
        tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
        return f"{shlex.join(cmd)} failed: {' / '.join(tail)}"
    return None


class NativeBuildHook(BuildHookInterface):
    """Adds ``converter/_native<EXT_SUFFIX>`` to the wheel (see the module docstring)."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        root = Path(self.root)
        name = "_native" + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
        if version == "editable":
            out = root / "converter" / name
            out.unlink(missing_ok=True)  # a failed build must not leave an older module behind
            why = compile_native(root, out)
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="marlin-native-")
            out = Path(self._tmp.name) / name
            why = compile_native(root, out)
            if why is None:
                build_data["force_include"][str(out)] = f"converter/{name}"
                build_data["pure_python"] = False
                build_data["infer_tag"] = True
        if why is not None:
            message = (
                f"marlin-convert: the C extension converter._native was not built ({why}); "
                "the NumPy code is used instead (same results, slower)"
            )
            self.app.display_warning(message)

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        tmp = getattr(self, "_tmp", None)
        if tmp is not None:
            tmp.cleanup()

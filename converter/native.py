"""The optional compiled loops (``converter._native``, C) and whether they are there.

The build hook (``hatch_build.py``) compiles ``converter/_native.c`` when the package is
installed with a C compiler present.  Without the module, or with ``MARLIN_NATIVE=0`` in
the environment, :func:`lib` returns None and every caller runs its NumPy twin, which is
also the reference the tests compare the C loops with, bit for bit (packers, unpackers)
or to fp32 rounding (numerics).  The C functions release the GIL, so threads run them on
several cores.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

#: The ABI the Python side expects; ``_native.c`` defines the same number.
ABI_VERSION = 3


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get("MARLIN_NATIVE") == "0":
        return None, "disabled by MARLIN_NATIVE=0"
    try:
        _native = importlib.import_module(f"{__package__}._native")
    except ModuleNotFoundError:
        return None, "not built (no compiled converter._native); reinstall with a C compiler present: pip install -e ."
    except ImportError as exc:  # built, but for another interpreter or platform
        return None, f"cannot be loaded ({exc}); reinstall: pip install -e ."
    if getattr(_native, "ABI_VERSION", None) != ABI_VERSION:
        return None, "stale build (ABI version differs); reinstall: pip install -e ."
    return _native, f"compiled, {_native.ISA} loops"


_LIB, _WHY = _load()


def lib() -> ModuleType | None:
    """The compiled module, or None when the NumPy code is to be used (see :func:`status`)."""
    return _LIB


def status() -> str:
    """One line: which loops run (``compiled, avx512 loops``) or why the NumPy code does."""
    return _WHY

#!/usr/bin/env python3
"""Rebuild the golden artifact files in ``tests/data/golden/`` (``tests/helpers/golden.py``).

Usage: ``python scripts/make_golden.py``.  Run it only when the artifact format is meant
to change, and commit both files with the change that explains why.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a plain script from a fresh checkout
    sys.path.insert(0, str(REPO))

from converter.convert import convert  # noqa: E402
from tests.helpers.golden import GOLDEN, HEADER, SOURCE, build_source, header_bytes  # noqa: E402


def main() -> int:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    build_source(SOURCE)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tiny.marlin.safetensors"
        convert(SOURCE, out)
        HEADER.write_bytes(header_bytes(out))
    print(f"wrote {SOURCE} ({SOURCE.stat().st_size} bytes) and {HEADER} ({HEADER.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

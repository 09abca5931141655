#!/usr/bin/env python3
"""Regenerate ``tests/data/sample.tinyloop`` deterministically (``tests/helpers/sample.py``).

Usage: ``python scripts/make_sample.py [--out PATH]``.  Two runs give identical bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a plain script from a fresh checkout
    sys.path.insert(0, str(REPO))

from tests.helpers.sample import build_sample  # noqa: E402

DEFAULT_OUT = REPO / "tests" / "data" / "sample.tinyloop"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output path (default {DEFAULT_OUT})")
    args = parser.parse_args(argv)
    path = build_sample(args.out)
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

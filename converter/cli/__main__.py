"""``python -m converter.cli``: ``marlin-convert``."""

import sys

from .entry import main_convert

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_convert())

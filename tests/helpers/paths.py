"""Where the repository, the bundled data and the real third-party checkpoints are."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
SAMPLE = DATA / "sample.tinyloop"
#: The real checkpoints (``../shared/realinput``, or ``$MARLIN_SHARED/realinput``).
SHARED = Path(os.environ.get("MARLIN_SHARED", REPO.parent / "shared"))
REALINPUT = SHARED / "realinput"

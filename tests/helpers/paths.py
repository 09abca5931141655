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
#: The seven producers' files of one Llama in ``realinput/llama-tiny``.
LLAMA_TINY = (
    "autoawq-gemm-w4g128-asym",
    "autogptq-w4g128-sym",
    "autoround-gptq-w4g128-asym",
    "autoround-gptq-w4gchan-asym",
    "gptqmodel-gptq-w4g128-asym-descact",
    "gptqmodel-gptqv2-w4g128-asym",
    "llmcompressor-packq-w4g128-asym",
)

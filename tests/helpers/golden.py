"""The golden artifact: a fixed tiny ``.tinyloop`` and the exact header bytes of its artifact.

Both files live in ``tests/data/golden/`` and are rebuilt by ``python scripts/make_golden.py``
(only when the artifact format is meant to change: the test then shows the diff).  The
source holds one grouped 4-bit layer with a bias, one per-row 2-bit layer, one layer
whose N no Marlin tile divides (N = 48, padded to 64: ``padded_n``), and a plain f16 tensor.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from converter.formats.tinyloop_writer import quantize_linear_tinyloop, write_tinyloop

from .paths import DATA

GOLDEN = DATA / "golden"
SOURCE = GOLDEN / "tiny.tinyloop"
#: Bytes ``[0, 8 + header length)`` of ``marlin-convert tiny.tinyloop tiny.marlin.safetensors``.
HEADER = GOLDEN / "tiny.marlin.header"
SEED = 7


def build_source(out: Path) -> Path:
    """Write the tiny source to ``out`` (deterministic) and return it."""
    rng = np.random.default_rng(SEED)
    tensors: dict = {"norm": np.ones(64, np.float16)}
    linears: dict = {}
    for name, (k, n), bits, group, bias in (
        ("a", (64, 64), 4, 32, True),
        ("b", (32, 64), 2, 32, False),
        ("c", (32, 48), 4, 32, False),
    ):
        w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        t, entry = quantize_linear_tinyloop(name, w, bits, group, rng, bias=rng.standard_normal(n) if bias else None)
        tensors.update(t)
        linears[name] = entry
    return write_tinyloop(out, {"d_model": 64}, tensors, linears)


def header_bytes(artifact: Path) -> bytes:
    """The length prefix and the JSON header (with its padding) of a safetensors file."""
    with open(artifact, "rb") as fh:
        prefix = fh.read(8)
        return prefix + fh.read(int.from_bytes(prefix, "little"))

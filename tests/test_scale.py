"""Scale evidence (issue 11): a 70B-class layer converts and verifies in bounded memory.

A generated checkpoint holds Llama-70B's two MLP shapes, ``up_proj`` 8192 x 28672 and
``down_proj`` 28672 x 8192 (4-bit, group 128: 117 MB of ``qweight`` each, 235 MB in
all).  ``marlin-convert``, ``marlin-verify`` (CPU numerics) and ``marlin-verify
--against`` (exact comparison and CPU numerics) each run in a child process, must
succeed, and must peak at or below 3 x the largest tensor + 300 MiB (636 MiB here): a
verifier that formed one layer's fp32 weight (940 MB) or held the source's codes
(235 MB per layer) would not fit.  About 15 s on 2 cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.clirun import run_cli_rss
from tests.helpers.synthetic_gptq import largest_tensor_bytes, write_gptq_layers

MIB = 2**20
LAYERS = [("model.layers.0.mlp.up_proj", 8192, 28672), ("model.layers.0.mlp.down_proj", 28672, 8192)]


@pytest.mark.slow
def test_70b_layer_converts_and_verifies_in_bounded_memory(tmp_path: Path) -> None:
    src = write_gptq_layers(tmp_path / "src", LAYERS)
    largest = largest_tensor_bytes(src)
    assert largest == 8192 // 8 * 28672 * 4  # a qweight of either layer
    bound = 3 * largest + 300 * MIB
    out = tmp_path / "a.safetensors"
    runs = {
        "marlin-convert": ("marlin-convert", src, out, "--quiet"),
        "marlin-verify": ("marlin-verify", out, "--cpu"),
        "marlin-verify --against": ("marlin-verify", out, "--against", src, "--cpu"),
    }
    peaks = {}
    for what, (tool, *args) in runs.items():
        done, peaks[what] = run_cli_rss(tool, *args)
        assert done.returncode == 0, (what, done.stdout[-2000:], done.stderr[-2000:])
    assert "OK: 2 layers" in done.stdout and "against source, CPU numerics" in done.stdout
    over = {w: f"{p / MIB:.0f} MiB" for w, p in peaks.items() if p > bound}
    assert not over, f"peak RSS above 3 x largest tensor + 300 MiB = {bound / MIB:.0f} MiB: {over}"

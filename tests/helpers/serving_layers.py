"""Random Marlin layers covering the routes a serving model meets (the torch-op and
packed-launch GPU tests share them)."""

from __future__ import annotations

from typing import Any

import numpy as np

#: (K, N, group_size, act_order, bias, padded N): the routes a serving model meets on
#: sm_80..90: persistent Hopper kernels with B unit-major or with the stages inline,
#: the small-layer route, the decode and tile kernels, act-order, per-channel, a
#: padded head.
LAYERS = [
    (4096, 4096, 128, False, False, None),
    (4096, 1024, 128, True, False, None),
    (4096, 14336, 128, False, False, None),
    (1024, 4096, 64, True, True, None),
    (512, 192, -1, False, True, None),
    (256, 200, 128, False, False, 256),
]


def make_layer(k: int, n: int, gs: int, act: bool, bias: bool, padded: int | None, seed: int) -> Any:
    """A ``MarlinLinear`` with random codes, scales, deltas (and perm, bias) of one ``LAYERS`` row."""
    from converter.gpu.api import MarlinLinear

    rng = np.random.default_rng(seed)
    p = padded or n
    g = 1 if gs == -1 else k // gs
    B = rng.integers(-(2**31), 2**31, (k // 16, 2 * p), dtype=np.int64).astype(np.int32)
    s = rng.uniform(1e-3, 2e-2, (g, p)).astype(np.float16)
    d = rng.uniform(-0.05, 0.05, (g, p)).astype(np.float32)
    perm = rng.permutation(k).astype(np.int32) if act else None
    b = rng.standard_normal(n).astype(np.float16) if bias else None
    return MarlinLinear("layer", k, n, k if gs == -1 else gs, B, s, d, perm, b, padded_n=padded)

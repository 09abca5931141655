"""Random layers for the kernel tests and the twins' tests (fp16 and bf16).

``make_layer``: what the GPU kernel tests multiply: Marlin ``B``, permuted fp16 scales, an
fp32 delta near ``s (8 - z)``, an act-order permutation and an fp16 bias, each where asked
(the bias on a coin flip). ``make_twin_layer``: what the twins' CPU tests take apart: the
codes and natural scales too, and a delta of exactly ``s (8 - z)``."""

from __future__ import annotations

import numpy as np

from converter.marlin.layout import pack_b, permute_scales


def make_layer(rng, k, n, group_size, act_order, asym):
    gs = k if group_size in (-1, k) else group_size
    g = k // gs
    q = rng.integers(0, 16, size=(k, n), dtype=np.uint8)
    s = (rng.uniform(0.5, 2.0, size=(g, n)) * rng.choice([-1, 1], size=(g, n)) / 32).astype(np.float16)
    z = rng.integers(0, 16, size=(g, n))
    delta = (s.astype(np.float32) * (8 - z) + rng.normal(0, 1e-3, (g, n))).astype(np.float32) if asym else None
    perm = rng.permutation(k).astype(np.int32) if act_order else None
    bias = rng.standard_normal(n).astype(np.float16) if rng.random() < 0.5 else None
    return dict(B=pack_b(q), S=permute_scales(s), delta=delta, perm=perm, bias=bias)


def make_twin_layer(rng, k, n, group_size, *, asym=True, act_order=False):
    """Codes in Marlin row order, natural scales and delta, and the artifact tensors built from them."""
    gs = k if group_size in (-1, k) else group_size
    g = k // gs
    q = rng.integers(0, 16, size=(k, n), dtype=np.uint8)
    s = (rng.uniform(0.5, 2.0, size=(g, n)) * rng.choice([-1, 1], size=(g, n)) / 64).astype(np.float16)
    z = rng.integers(0, 16, size=(g, n))
    delta = (s.astype(np.float32) * (8 - z)).astype(np.float32) if asym else None
    perm = rng.permutation(k).astype(np.int32) if act_order else None
    return dict(q=q, s=s, delta=delta, perm=perm, B=pack_b(q), S=permute_scales(s), gs=gs, gsize=group_size)

"""The weight from an artifact's tensors: the fp16 weight ``kernels/dequant.cu`` forms, bit
for bit, and the exact float32 weight in source channel order.
"""

from __future__ import annotations

import numpy as np

from ..constants import MARLIN_ZERO
from ..marlin.layout import unpack_b, unpermute_scales
from ..marlin.shapes import group_count as _groups


def dequant(
    B: np.ndarray,
    scales: np.ndarray,
    *,
    size_k: int,
    size_n: int,
    group_size: int,
    delta: np.ndarray | None = None,
) -> np.ndarray:
    """Twin of ``kernels/dequant.cu``: the fp16 weight the GEMM multiplies by.

    Args:
        B: int32 ``(size_k // 16, 2 * size_n)``, Marlin tile order.
        scales: float16 ``(G, size_n)``, Marlin-permuted.
        size_k, size_n: K (in-features) and N (out-features).
        group_size: rows per group; ``-1`` or ``size_k`` for per-channel.
        delta: float32 ``(G, size_n)`` natural order, or None (symmetric).

    Returns:
        float16 ``(size_k, size_n)``, rows in Marlin order:
        ``fp16((q - 8) * s)`` or ``fp16((q - 8) * s + fp16(delta))``, single rounding.

    Raises:
        ValueError: shapes or group size inconsistent.
    """
    gs, g = _groups(size_k, group_size)
    if scales.shape != (g, size_n):
        raise ValueError(f"scales shape {scales.shape} != {(g, size_n)}")
    q = unpack_b(np.asarray(B), size_n).astype(np.float64) - MARLIN_ZERO
    s = unpermute_scales(np.asarray(scales, dtype=np.float16)).astype(np.float64)
    rows = np.arange(size_k) // gs
    w = q * s[rows]
    if delta is not None:
        if delta.shape != (g, size_n):
            raise ValueError(f"delta shape {delta.shape} != {(g, size_n)}")
        w = w + np.asarray(delta, dtype=np.float32).astype(np.float16).astype(np.float64)[rows]
    return w.astype(np.float16)


def reference_weight(
    B: np.ndarray,
    scales: np.ndarray,
    delta: np.ndarray | None,
    perm: np.ndarray | None,
    *,
    size_k: int,
    size_n: int,
    group_size: int,
) -> np.ndarray:
    """The artifact's exact weight in SOURCE input-channel order, float32 ``(K, N)``.

    ``W[perm[k], n] = (q[k, n] - 8) * s[g(k), n] + delta[g(k), n]`` formed in float64
    (no fp16 rounding) and rounded once to float32. Use it as ``w_ref_f32`` for
    :func:`converter.gpu.verify.verify_layer_gpu` when no source checkpoint is given.
    """
    gs, _ = _groups(size_k, group_size)
    q = unpack_b(np.asarray(B), size_n).astype(np.float64) - MARLIN_ZERO
    s = unpermute_scales(np.asarray(scales, dtype=np.float16)).astype(np.float64)
    rows = np.arange(size_k) // gs
    w = q * s[rows]
    if delta is not None:
        w += np.asarray(delta, dtype=np.float64)[rows]
    out = np.empty((size_k, size_n), dtype=np.float32)
    if perm is None:
        out[:] = w
    else:
        out[np.asarray(perm, dtype=np.intp)] = w
    return out

"""Twins of the two-kernel asymmetric path (``kernels/asym_correction.cu``): per-group
row sums of A, the ``xsum @ delta`` correction, and the whole path after the symmetric GEMM.
"""

from __future__ import annotations

import numpy as np

from ..marlin.shapes import group_count as _groups
from .reference_gemm import marlin_gemm
from .reference_layouts import gather_columns


def group_sums(A: np.ndarray, *, group_size: int) -> np.ndarray:
    """Twin of ``group_sums``: per-group row sums of A.

    Args:
        A: float16 ``(M, K)`` in Marlin order (after any act-order gather).
        group_size: rows per group; ``-1`` or ``K`` for one group.

    Returns:
        float32 ``(M, K // group_size)``, summed in float64 then rounded once.
    """
    a = np.asarray(A)
    m, k = a.shape
    gs, g = _groups(k, group_size)
    return a.astype(np.float64).reshape(m, g, gs).sum(axis=2).astype(np.float32)


def add_correction(C: np.ndarray, xsum: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """Twin of ``add_correction``: ``fp16(C + xsum @ delta[:, :n])`` (a new array).

    Args:
        C: float16 ``(M, n)``.
        xsum: float32 ``(M, G)`` from :func:`group_sums`.
        delta: float32 ``(G, N)`` natural column order, ``N >= n`` (a padded layer's
            delta is wider than its result).

    Returns:
        float16 ``(M, n)``, the sum formed in float64 and rounded once.
    """
    n = np.asarray(C).shape[1]
    acc = np.asarray(C).astype(np.float64) + np.asarray(xsum, np.float64) @ np.asarray(delta, np.float64)[:, :n]
    return acc.astype(np.float16)


def marlin_gemm_two_kernel(
    A: np.ndarray,
    B: np.ndarray,
    scales: np.ndarray,
    *,
    size_k: int,
    size_n: int,
    group_size: int,
    delta: np.ndarray,
    perm: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    arith: str | None = None,
    n_out: int | None = None,
) -> np.ndarray:
    """Twin of the two-kernel path: symmetric GEMM (with bias), then ``C += xsum @ delta``.

    Args and returns as :func:`marlin_gemm` (``arith`` that of the symmetric GEMM's
    kernel); ``delta`` is required.
    """
    c = marlin_gemm(
        A,
        B,
        scales,
        size_k=size_k,
        size_n=size_n,
        group_size=group_size,
        perm=perm,
        bias=bias,
        arith=arith,
        n_out=n_out,
    )
    a = gather_columns(A, perm) if perm is not None else np.asarray(A)
    return add_correction(c, group_sums(a, group_size=group_size), delta)

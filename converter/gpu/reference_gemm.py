"""Twin of the fused GEMM (``kernels.marlin_gemm``) in either arithmetic, and the bound on
how far a kernel's fp32 sums may differ from it.
"""

from __future__ import annotations

import numpy as np

from ..constants import MARLIN_ZERO
from ..marlin.layout import unpack_b, unpermute_scales
from ..marlin.shapes import group_count as _groups
from .plan import Arith, gemm_arith
from .reference_dequant import dequant
from .reference_layouts import gather_columns


def _arith(m: int, size_n: int, arith: str | None) -> Arith:
    if arith is None:
        # The sm_80..89 rule (converter.gpu.plan, no GPU needed); on sm_90 the Hopper
        # kernels and the small layers' 8-row decode chunks take other calls, so tests
        # pass the plan's own ``arith``.
        return gemm_arith(m, size_n)
    try:
        return Arith(arith)
    except ValueError:
        raise ValueError(f"arith must be 'weight' or 'group', got {arith!r}") from None


def _delta16(delta: np.ndarray | None, size_n: int) -> np.ndarray | None:
    """fp16(delta) in natural column order, float64, from either operand form."""
    if delta is None:
        return None
    d = np.asarray(delta)
    if d.dtype == np.float16:  # kernels.prepare_delta's form: permuted like the scales
        return unpermute_scales(d).astype(np.float64)
    return d.astype(np.float32).astype(np.float16).astype(np.float64)


def _decode_parts(
    B: np.ndarray, scales: np.ndarray, delta: np.ndarray | None, *, size_k: int, size_n: int, group_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """float64 ``q - 8``, ``s`` and ``fp16(delta)`` (or None), each ``(K, N)`` by row."""
    gs, g = _groups(size_k, group_size)
    if scales.shape != (g, size_n):
        raise ValueError(f"scales shape {scales.shape} != {(g, size_n)}")
    rows = np.arange(size_k) // gs
    q8 = unpack_b(np.asarray(B), size_n).astype(np.float64) - MARLIN_ZERO
    s = unpermute_scales(np.asarray(scales, dtype=np.float16)).astype(np.float64)[rows]
    d = _delta16(delta, size_n)
    if d is not None and d.shape != (g, size_n):
        raise ValueError(f"delta shape {d.shape} != {(g, size_n)}")
    return q8, s, None if d is None else d[rows]


def _decode_weight(
    B: np.ndarray, scales: np.ndarray, delta: np.ndarray | None, *, size_k: int, size_n: int, group_size: int
) -> np.ndarray:
    """float64 ``(q - 8) * s + fp16(delta)`` without any rounding (the decode kernel's weight)."""
    q8, s, d = _decode_parts(B, scales, delta, size_k=size_k, size_n=size_n, group_size=group_size)
    return q8 * s if d is None else q8 * s + d


def marlin_gemm(
    A: np.ndarray,
    B: np.ndarray,
    scales: np.ndarray,
    *,
    size_k: int,
    size_n: int,
    group_size: int,
    delta: np.ndarray | None = None,
    perm: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    arith: str | None = None,
    n_out: int | None = None,
) -> np.ndarray:
    """Twin of ``kernels.marlin_gemm`` (symmetric, or fused-asymmetric when ``delta`` is given).

    Args:
        A: float16 ``(M, size_k)``, source channel order (gathered by ``perm`` first).
        B, scales, size_k, size_n, group_size: as :func:`dequant`.
        delta: float32 ``(G, size_n)`` natural order, or float16 from
            ``kernels.prepare_delta`` (permuted like the scales), or None.
        perm: int32 ``(size_k,)`` or None.
        bias: float16 ``(n_out,)`` or None, added before the final rounding.
        arith: "weight" or "group" (``plan.Arith``); None picks the arithmetic of
            the kernel the launcher picks for (M, N) (``plan.gemm_arith``).
        n_out: columns of the result, at most ``size_n`` (default ``size_n``): the
            first ``n_out`` of a padded layer's ``size_n``, as the launcher stores them.

    Returns:
        float16 ``(M, n_out)``, the product in float64 and one rounding:
        "weight": ``fp16(A @ W16 + bias)`` with W16 the fp16 weight of :func:`dequant`;
        "group": ``fp16(A @ ((q - 8) s + fp16(delta)) + bias)``, the weight unrounded
        (the kernel applies s and delta per group in fp32).
    """
    a = gather_columns(A, perm) if perm is not None else np.asarray(A)
    w = _weight(a.shape[0], B, scales, delta, size_k=size_k, size_n=size_n, group_size=group_size, arith=arith)
    acc = a.astype(np.float64) @ w[:, : size_n if n_out is None else n_out]
    if bias is not None:
        acc = acc + np.asarray(bias, dtype=np.float16).astype(np.float64)
    return acc.astype(np.float16)


def _weight(
    m: int,
    B: np.ndarray,
    scales: np.ndarray,
    delta: np.ndarray | None,
    *,
    size_k: int,
    size_n: int,
    group_size: int,
    arith: str | None,
) -> np.ndarray:
    if _arith(m, size_n, arith) is Arith.GROUP:
        return _decode_weight(B, scales, delta, size_k=size_k, size_n=size_n, group_size=group_size)
    d = _delta16(delta, size_n)
    return dequant(
        B,
        scales,
        size_k=size_k,
        size_n=size_n,
        group_size=group_size,
        delta=None if d is None else d.astype(np.float32),
    ).astype(np.float64)


def gemm_error_bound(
    A: np.ndarray,
    B: np.ndarray,
    scales: np.ndarray,
    *,
    size_k: int,
    size_n: int,
    group_size: int,
    delta: np.ndarray | None = None,
    perm: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    splits: int = 1,
    arith: str | None = None,
) -> np.ndarray:
    """Elementwise bound on ``|kernel - twin|`` for :func:`marlin_gemm`, float64 ``(M, N)``.

    Both sides use the same weights and exact products; they differ only in the fp32
    summation and the final fp16 rounding:

    * "weight": fp32 sums of K products (in any order, ``splits`` partial sums added
      last): ``|err| <= (K + splits + 1) * 2**-24 * (|A| @ |W| + |bias|)`` (Higham's
      recursive-summation bound with unit roundoff 2**-24, first order);
    * "group": the same for the per-group sums of ``A (q - 8)`` and of A, plus two
      fp32 fma per close (scale, delta; a kernel closes once per group, or more often:
      the decode kernel per step when per-channel, the persistent kernel's per-group
      form every 8 k-tiles; at most every 4, so C = max(G, K / 64) closes), so
      ``K + 2 C + splits + 4`` roundings of at most
      ``|A| @ (|q - 8| |s| + |fp16(delta)|)``; with a delta the kernel sums ``A (q - 8)``
      as two offset sums that cancel (``A (q + 1024 | 64)`` and ``-A (1032 | 72)``,
      ``offset_codes`` in kernels/marlin_common.cuh), each rounded at every one of a
      group's ``gs / 16`` mma steps (at most 8 per-channel, where the kernel closes every
      step; counted twice: a tensor core may truncate) at up to ``1040 |A|`` per weight,
      so ``4 (steps + 1) 2**-23 1040 (|A| @ |s|)`` more;
    * both results are rounded to fp16: up to one fp16 ulp of the larger magnitude
      (``2**-10 * |x|``, and ``2**-24`` for subnormals).

    Tensor cores may truncate rather than round while accumulating (about 2**-23 per
    step), but one mma step adds 16 products, so the real depth is about K / 16 (+ 2G)
    steps; counting K roundings of 2**-24 covers it.

    Returns:
        The bound, to compare with ``abs(kernel.astype(f64) - twin.astype(f64))``.
    """
    a = gather_columns(A, perm) if perm is not None else np.asarray(A)
    m = a.shape[0]
    a64 = a.astype(np.float64)
    offset_err: np.ndarray | float = 0.0
    if _arith(m, size_n, arith) is Arith.GROUP:
        _, g = _groups(size_k, group_size)
        q8, sc, d = _decode_parts(B, scales, delta, size_k=size_k, size_n=size_n, group_size=group_size)
        wmag = np.abs(q8 * sc) + (0.0 if d is None else np.abs(d))
        exact = a64 @ (q8 * sc if d is None else q8 * sc + d)
        terms = size_k + 2 * max(g, size_k // 64) + splits + 4
        if d is not None:
            steps = 8 if g == 1 else size_k // g // 16
            offset_err = 4 * (steps + 1) * 2.0**-23 * 1040 * (np.abs(a64) @ np.abs(sc))
    else:
        w = _weight(m, B, scales, delta, size_k=size_k, size_n=size_n, group_size=group_size, arith="weight")
        wmag = np.abs(w)
        exact = a64 @ w
        terms = size_k + splits + 1
    mag = np.abs(a64) @ wmag
    if bias is not None:
        b = np.asarray(bias, dtype=np.float16).astype(np.float64)
        mag = mag + np.abs(b)
        exact = exact + b
    sum_err = terms * 2.0**-24 * mag + offset_err
    return sum_err + 2.0**-10 * (np.abs(exact) + sum_err) + 2.0**-24

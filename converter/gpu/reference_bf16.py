"""NumPy twin of the fused GEMM with bf16 activations and outputs (the reference the bf16
kernels are to be compared against), and the bound on how far a kernel's fp32 sums may
be from it.

The arithmetic is argued in docs/notes/bf16.md (issue 40). ``A`` and ``C`` are bf16 held
as raw uint16 bits (CuPy has no bf16 dtype), read exactly by ``converter.dtypes.bf16_to_f32``.
The artifact's operands are the fp16 path's (``scales`` fp16, Marlin-permuted; ``delta``
fp32, or the fp16 operand of ``kernels.prepare_delta``), so the weights come from the fp16
twin's helpers in :mod:`.reference_gemm`:

* "group" (decode kernel, ``hopper_skg``): ``A (q - 8)`` and ``A`` summed per group and
  closed with ``s`` and ``fp16(delta)`` in fp32, so the weight multiplied is
  ``(q - 8) s + fp16(delta)`` unrounded, as in the fp16 twin;
* "weight" (tile kernel, ``decode_w``, ``hopper_sk``): the bf16 weight, the fp32 fma of
  ``(q - 8) s + fp16(delta)`` (as ``(1024 + q) s + fp32(d - 1032 s)``, or
  ``(64 + q) s + fp32(d - 72 s)`` on half the rows) rounded to bf16:
  the notes' option 2 (:func:`dequant`).

Either product is taken in float64 (every product of a bf16 ``A`` with these weights is
exact) and rounded once to bf16, to nearest, ties to even (:func:`round_bf16`).
"""

from __future__ import annotations

import numpy as np

from ..dtypes import bf16_to_f32, f32_to_bf16
from ..marlin.shapes import group_count as _groups
from .plan import Arith
from .reference_gemm import _arith, _decode_parts, _decode_weight
from .reference_layouts import gather_columns


def round_bf16(x: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) of float64 ``x``, rounded once: to nearest, ties to even.

    ``f32_to_bf16(x.astype(float32))`` would round twice, and the float32 rounding can make
    a tie that is not one (``1 + 2**-8 + 2**-30`` would go to 1, not ``1 + 2**-7``). So
    ``x`` is first rounded to float32 to odd (truncated, and the last bit set when anything
    was dropped), which keeps the rounding direction because float32 has more than two
    bits beyond bf16's 8 everywhere (the two share their exponent range), and then
    ``f32_to_bf16`` rounds once. Beyond bf16's range gives inf; NaN stays NaN.
    """
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        f = x.astype(np.float32)
        # float32's round-to-nearest went away from zero (or to inf): step back one ulp
        f = np.where(np.abs(f.astype(np.float64)) > np.abs(x), np.nextafter(f, np.float32(0)), f)
        inexact = f.astype(np.float64) != x
    bits = np.where(inexact, f.view(np.uint32) | np.uint32(1), f.view(np.uint32))
    return f32_to_bf16(bits.astype(np.uint32).view(np.float32))


def _activations(A_bits: np.ndarray, perm: np.ndarray | None, size_k: int) -> np.ndarray:
    """float64 ``(M, K)`` values of bf16 bits, in Marlin order."""
    a = np.asarray(A_bits)
    if a.dtype != np.uint16 or a.ndim != 2:
        raise TypeError(f"A_bits must be uint16 bf16 bits (M, K), got {a.dtype} {a.shape}")
    if a.shape[1] != size_k:
        raise ValueError(f"A has {a.shape[1]} columns, size_k is {size_k}")
    if perm is not None:
        a = gather_columns(a, perm)
    return bf16_to_f32(a).astype(np.float64)


def _bias64(bias: np.ndarray, cols: int) -> np.ndarray:
    """float64 bias from bf16 bits (uint16) or float16, both exact in fp32."""
    b = np.asarray(bias)
    if b.dtype == np.uint16:
        v = bf16_to_f32(b)
    elif b.dtype == np.float16:
        v = b
    else:
        raise TypeError(f"bias must be uint16 bf16 bits or float16, got {b.dtype}")
    if v.shape != (cols,):
        raise ValueError(f"bias shape {v.shape} != {(cols,)}")
    return v.astype(np.float64)


def dequant(
    B: np.ndarray,
    scales: np.ndarray,
    *,
    size_k: int,
    size_n: int,
    group_size: int,
    delta: np.ndarray | None = None,
) -> np.ndarray:
    """The bf16 weight the "weight" kernels form in registers, bit for bit
    (``kernels/marlin_common.cuh``, ``word_weights``).

    The kernel makes each code an fp16 ``1024 + q`` (rows 0-7 of each 16-row k-tile) or
    ``1024 + 16 q`` (rows 8-15), converts it to fp32 exactly and feeds it to an fp32 fma
    with the column's ``s`` and ``c = fp32(d - 1032 s)``, or ``s / 16`` (exact) and
    ``c = fp32(d - 72 s)``: the products ``(1024 + q) s`` and ``(64 + q) s`` (``d =
    fp16(delta)``, 0 without one); then it rounds the fp32 result to bf16. That is
    ``(q - 8) s + d`` rounded once to fp32 whenever ``c`` is exact (so for the converter's
    ``delta = s (8 - z)``); the twin rounds ``c`` as the kernel does either way. ``x s``
    (at most 22 bits) and ``c`` (a float32) add exactly in float64 unless their exponents
    are more than 28 apart, and then the smaller is under half an fp32 ulp of the larger,
    which both roundings return: casting the sum to float32 is the fma's one rounding.

    Args:
        B, scales, size_k, size_n, group_size: as ``reference_dequant.dequant``.
        delta: float32 ``(G, size_n)`` natural order, or float16 from
            ``kernels.prepare_delta`` (permuted like the scales), or None.

    Returns:
        uint16 bf16 bits ``(size_k, size_n)``, rows in Marlin order.
    """
    q8, s, d = _decode_parts(B, scales, delta, size_k=size_k, size_n=size_n, group_size=group_size)
    d = np.zeros_like(s) if d is None else d
    base = np.where((np.arange(size_k) % 16 >= 8)[:, None], 64.0, 1024.0)  # (1024 + 16 q) / 16 on rows 8-15
    const = (d - (base + 8.0) * s).astype(np.float32).astype(np.float64)
    return f32_to_bf16(((base + 8.0 + q8) * s + const).astype(np.float32))


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
    """float64 ``(K, N)``: the weight the chosen arithmetic multiplies by."""
    kw = dict(size_k=size_k, size_n=size_n, group_size=group_size)
    if _arith(m, size_n, arith) is Arith.GROUP:
        return _decode_weight(B, scales, delta, **kw)
    return bf16_to_f32(dequant(B, scales, delta=delta, **kw)).astype(np.float64)


def marlin_gemm(
    A_bits: np.ndarray,
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
    """Twin of the bf16 fused GEMM (symmetric, or fused-asymmetric when ``delta`` is given).

    Args:
        A_bits: uint16 bf16 bits ``(M, size_k)``, source channel order (gathered by
            ``perm`` first).
        B, scales, size_k, size_n, group_size: as ``reference_dequant.dequant``.
        delta: float32 ``(G, size_n)`` natural order, or float16 from
            ``kernels.prepare_delta``, or None; the kernels read ``fp16(delta)`` either way.
        perm: int32 ``(size_k,)`` or None.
        bias: ``(n_out,)`` uint16 bf16 bits or float16 (the notes leave its dtype open;
            both are exact in fp32), or None; added before the final rounding.
        arith: "weight" or "group" (``plan.Arith``); None picks as the fp16 twin does
            (``plan.gemm_arith``).
        n_out: columns of the result, at most ``size_n`` (default ``size_n``).

    Returns:
        uint16 bf16 bits ``(M, n_out)``, the product in float64 and one rounding:
        "weight": ``bf16(A @ W + bias)`` with W the bf16 weight of :func:`dequant`;
        "group": ``bf16(A @ ((q - 8) s + fp16(delta)) + bias)``, the weight unrounded.

    Raises:
        TypeError: ``A_bits`` not uint16, or ``bias`` neither uint16 nor float16.
        ValueError: shapes inconsistent.
    """
    a = _activations(A_bits, perm, size_k)
    cols = size_n if n_out is None else n_out
    w = _weight(a.shape[0], B, scales, delta, size_k=size_k, size_n=size_n, group_size=group_size, arith=arith)
    acc = a @ w[:, :cols]
    if bias is not None:
        acc = acc + _bias64(bias, cols)
    return round_bf16(acc)


def gemm_error_bound(
    A_bits: np.ndarray,
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
    n_out: int | None = None,
) -> np.ndarray:
    """Elementwise bound on ``|kernel - twin|`` for :func:`marlin_gemm`, float64 ``(M, n_out)``.

    Both sides multiply the same weights with exact products; they differ in the kernel's
    fp32 sums (any order, ``splits`` split-K partials added last) and in that each rounds
    to bf16 once, the kernel from its fp32 sum. The terms are those of
    ``reference_gemm.gemm_error_bound`` with bf16's offset codes (``128 + q`` against one
    offset 136, so at most 144 ``|A|`` per weight instead of 1040) and bf16's unit
    roundoff ``2**-8`` for the final rounding, plus fp32 underflow, which bf16's range can
    reach.

    Returns:
        The bound, to compare with ``abs(bf16_to_f32(kernel) - bf16_to_f32(twin))`` in float64.
    """
    a = _activations(A_bits, perm, size_k)
    m = a.shape[0]
    cols = size_n if n_out is None else n_out
    kw = dict(size_k=size_k, size_n=size_n, group_size=group_size)
    offset_err: np.ndarray | float = 0.0
    if _arith(m, size_n, arith) is Arith.GROUP:
        _, g = _groups(size_k, group_size)
        q8, sc, d = _decode_parts(B, scales, delta, **kw)
        q8, sc, d = q8[:, :cols], sc[:, :cols], None if d is None else d[:, :cols]
        w = q8 * sc if d is None else q8 * sc + d
        wmag = np.abs(q8 * sc) + (0.0 if d is None else np.abs(d))
        # K exact products summed in fp32, two fma per close (at most every 64 rows), the
        # split partials, the offset sums' sum, the bias
        terms = size_k + 2 * max(g, size_k // 64) + splits + 4
        if d is not None:
            steps = 8 if g == 1 else size_k // g // 16
            # the offset sums A (128 + q) and -136 A cancel only after each was rounded at
            # every mma step of a close (counted twice: a tensor core may truncate)
            offset_err = 4 * (steps + 1) * 2.0**-23 * 144 * (np.abs(a) @ np.abs(sc))
    else:
        w = _weight(m, B, scales, delta, arith="weight", **kw)[:, :cols]
        wmag = np.abs(w)
        # K exact products summed in fp32 in any order, the split partials, the bias
        terms = size_k + splits + 1
    exact = a @ w
    mag = np.abs(a) @ wmag
    if bias is not None:
        b = _bias64(bias, cols)
        mag = mag + np.abs(b)
        exact = exact + b
    # Higham's recursive-summation bound (first order) on those fp32 roundings
    sum_err = terms * 2.0**-24 * mag + offset_err
    # an fp32 product or close below 2**-126 rounds to a multiple of 2**-149, which no relative term covers
    sum_err = sum_err + terms * 2.0**-149
    # the twin rounds the exact value and the kernel its fp32 sum, each by up to 2**-8 relative
    bound = sum_err + 2.0**-7 * (np.abs(exact) + sum_err)
    # each side's half ulp in bf16's subnormal range (2**-134), where the relative term fails
    return bound + 2.0**-133

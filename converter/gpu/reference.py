"""NumPy twins of the GPU kernels, with the launchers' signatures (no GPU needed).

Each twin computes what its kernel computes, from the same artifact tensors:

* :func:`dequant` reproduces ``kernels/dequant.cu`` bit for bit. The kernel forms
  ``q - 8`` exactly (fp16 exponent trick) and then does one fp16 ``mul.rn`` (or
  ``fma.rn`` with ``fp16(delta)``); in float64 that product-plus-addend is exact
  (at most 4 + 11 significant bits over an exponent span under 53 bits), so one
  round-to-nearest-even to float16 gives the same bits.
* :func:`marlin_gemm` follows the launcher's kernels: with the "weight" arithmetic
  (tile kernel, per-weight decode variant) it uses that same fp16 weight; with
  "group" (decode kernel, small M: scale and delta applied per group in fp32) the
  unrounded ``(q - 8) * s + fp16(delta)``; ``plan.gemm_arith`` says which for
  (M, N). It multiplies in float64 and rounds once to float16; the kernels accumulate exact products in fp32 in
  another order, so the two differ by at most the bound in :func:`gemm_error_bound`.
* :func:`group_sums`, :func:`add_correction`, :func:`gather_columns` mirror
  ``kernels/asym_correction.cu`` and the gather in ``kernels/marlin_gemm.cu``.

Conventions (checkpoint-formats.md section 4): ``B`` int32 ``(K/16, 2N)`` Marlin tile
order; ``scales`` float16 ``(G, N)`` Marlin-permuted (8x8 transpose per 64 columns, or
the 32-entry list when ``G == 1``); ``delta`` float32 ``(G, N)`` natural order; ``perm``
int32 ``(K,)`` with Marlin row k = source channel ``perm[k]``; A rows are ``(M, K)``
float16 in SOURCE channel order for :func:`marlin_gemm` (it gathers), Marlin order for
:func:`group_sums`.
"""

from __future__ import annotations

import numpy as np

from ..constants import MARLIN_ZERO
from ..marlin.layout import unpack_b, unpermute_scales
from ..marlin.shapes import group_count as _groups
from .plan import Arith, gemm_arith


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


def b_units(B: np.ndarray, size_n: int) -> np.ndarray:
    """Twin of ``kernels.prepare_b_units``: ``B``'s 2 KB pieces unit-major.

    Marlin's ``B`` has one row per k-tile (16 rows of K), and in it the 256 features of
    unit u (4 column blocks of 64) as the 512 int32 at ``512 u``. The persistent Hopper
    kernel streams each unit's k-tiles in order, so in Marlin's order a block reads a
    2 KB strip down rows ``2 N`` int32 apart; unit-major, its whole run is one stretch.

    Args:
        B: int32 ``(size_k // 16, 2 * size_n)``, Marlin tile order.
        size_n: N, a multiple of 64.

    Returns:
        int32 ``(ceil(N / 256), size_k // 16, 512)``: unit u's k-tile t is ``B[t, 512 u :
        512 (u + 1)]``, the last unit zero-padded when N / 64 is not a multiple of 4.

    Raises:
        ValueError: ``B`` is not ``(K / 16, 2 N)``.
    """
    B = np.asarray(B)
    if B.ndim != 2 or B.shape[1] != 2 * size_n or size_n % 64:
        raise ValueError(f"B must be (K / 16, 2 N) with N = {size_n} a multiple of 64, got {B.shape}")
    kt, units = B.shape[0], -(-size_n // 256)
    rows = np.zeros((kt, units * 512), dtype=B.dtype)
    rows[:, : 2 * size_n] = B
    return np.ascontiguousarray(rows.reshape(kt, units, 512).transpose(1, 0, 2))


def b_stages(B: np.ndarray, scales: np.ndarray, delta: np.ndarray | None, size_n: int) -> np.ndarray:
    """Twin of ``kernels.prepare_b_stages``: ``B`` with each stage's scales and deltas inline.

    Per unit u (256 features) and group g (128 rows of K, 8 k-tiles): the unit's k-tile
    pieces ``b_units(B)[u, 8 g : 8 g + 8]`` (8 x 512 int32), then the scales
    ``scales[g, 256 u : 256 u + 256]`` and the deltas ``delta[g, 256 u : 256 u + 256]``,
    each 256 float16 read as 128 int32, zero past N (and for ``delta`` None).

    Args:
        B: int32 ``(K / 16, 2 N)``, Marlin tile order, K a multiple of 128.
        scales: float16 ``(K / 128, N)``, Marlin's permuted scale order.
        delta: float16 ``(K / 128, N)`` in the same order (``kernels.prepare_delta``), or None.
        size_n: N, a multiple of 64.

    Returns:
        int32 ``(ceil(N / 256), K / 128, 4352)``.

    Raises:
        ValueError: a shape above is not met.
    """
    units = b_units(B, size_n)
    n_units, kt = units.shape[0], units.shape[1]
    if kt % 8:
        raise ValueError(f"K / 16 = {kt} must be a multiple of 8 (groups of 128)")
    g = kt // 8

    def rows(x: np.ndarray | None) -> np.ndarray:
        full = np.zeros((g, n_units * 256), dtype=np.float16)
        if x is not None:
            x = np.asarray(x)
            if x.shape != (g, size_n):
                raise ValueError(f"scale and delta rows must be ({g}, {size_n}), got {x.shape}")
            full[:, :size_n] = x
        return full.view(np.int32).reshape(g, n_units, 128).transpose(1, 0, 2)

    parts = (units.reshape(n_units, g, 8 * 512), rows(scales), rows(delta))
    return np.ascontiguousarray(np.concatenate(parts, axis=2))


def gather_columns(A: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """Twin of ``gather_columns``: ``A[:, perm]`` (exact).

    Args:
        A: float16 ``(M, K)``, source channel order.
        perm: int32 ``(K,)``, Marlin row k = source channel ``perm[k]``.

    Returns:
        float16 ``(M, K)`` in Marlin order.
    """
    return np.ascontiguousarray(np.asarray(A)[:, np.asarray(perm, dtype=np.intp)])


def hopper_activations(
    A: np.ndarray, perm: np.ndarray | None, m_pad: int, tok: int | None = None, *, swizzle: bool = False
) -> np.ndarray:
    """Twin of ``hopper_activations`` (``kernels/marlin_wgmma.cu``): A in 16-byte pieces,
    chunk-major in blocks of ``tok`` token rows, exactly.

    Args:
        A: float16 ``(M, K)``, source channel order; K % 8 == 0 (K % 64 with ``swizzle``).
        perm: int32 ``(K,)`` act-order permutation, or None.
        m_pad: rows of the result (>= M), a whole number of the kernel's token chunks.
        tok: token rows per block (divides ``m_pad``); None: ``m_pad`` (one block, the
            layout of ``marlin_wgmma``).
        swizzle: each block as ``marlin_streamk``'s swizzled slots instead
            (:func:`streamk_x_slot`, every box of 64 values of K in order).

    Returns:
        float16 ``(m_pad // tok, K // 8, tok, 8)``: ``[b, c, r, :] = A[b tok + r, 8 c : 8 c + 8]``
        after the gather, zero for rows ``>= M``; with ``tok`` None, ``(K // 8, m_pad, 8)``;
        with ``swizzle``, ``(m_pad // tok, K // 64, tok, 64)``.
    """
    a = np.asarray(A, dtype=np.float16)
    if perm is not None:
        a = gather_columns(a, perm)
    m, k = a.shape
    if swizzle:
        if tok is None or m_pad % tok:
            raise ValueError(f"m_pad={m_pad} is not a whole number of {tok}-token blocks")
        return np.stack([streamk_x_slot(a, tok, k // 16, b, 0) for b in range(m_pad // tok)])
    rows = np.zeros((m_pad, k // 8, 8), dtype=np.float16)
    rows[:m] = a.reshape(m, k // 8, 8)
    if tok is None:
        return np.ascontiguousarray(rows.transpose(1, 0, 2))
    if m_pad % tok:
        raise ValueError(f"m_pad={m_pad} is not a whole number of {tok}-token blocks")
    return np.ascontiguousarray(rows.reshape(m_pad // tok, tok, k // 8, 8).transpose(0, 2, 1, 3))


def streamk_x_slot(A: np.ndarray, tok: int, u: int, chunk: int, k_tile: int) -> np.ndarray:
    """Twin of one stage's activation slot of the persistent Hopper kernel
    (``kernels/marlin_streamk.cu``, slot X, filled from ``converter.gpu.tensormap``'s map):
    tokens ``chunk tok ..`` and k-tiles ``k_tile .. k_tile + u - 1``, exactly.

    The slot is ``u / 4`` boxes of ``tok`` rows of 128 bytes (64 values of K), each box
    128-byte swizzled: 16-byte chunk ``j`` of row ``r`` is stored at chunk ``j ^ r % 8``
    of that row (CUDA's CU_TENSOR_MAP_SWIZZLE_128B, the layout of wgmma's swizzle mode 1).

    Args:
        A: float16 ``(M, K)`` in Marlin order (gathered under act-order).
        tok: T, tokens per chunk (a multiple of 8). u: k-tiles per stage (a multiple of 4).
        chunk: token chunk index. k_tile: the stage's first k-tile.

    Returns:
        float16 ``(u // 4, tok, 64)``: the slot in shared-memory order, zeros for tokens
        ``>= M``.
    """
    a = np.asarray(A, dtype=np.float16)
    m = a.shape[0]
    rows = np.zeros((tok, 16 * u), dtype=np.float16)
    live = max(0, min(tok, m - chunk * tok))
    rows[:live] = a[chunk * tok : chunk * tok + live, 16 * k_tile : 16 * (k_tile + u)]
    boxes = rows.reshape(tok, u // 4, 8, 8).transpose(1, 0, 2, 3)  # (box, row, chunk j, value)
    out = np.empty_like(boxes)
    r = np.arange(tok)[:, None]
    out[:, r, np.arange(8)[None, :] ^ (r % 8)] = boxes
    return np.ascontiguousarray(out.reshape(u // 4, tok, 64))


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

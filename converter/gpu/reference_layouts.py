"""Twins of the operand layouts the kernels read, all exact: ``B`` unit-major and with its
stages' scales inline, the act-order gather, and the Hopper kernels' activation layouts.
"""

from __future__ import annotations

import numpy as np


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

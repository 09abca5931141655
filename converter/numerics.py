"""``x @ W`` for ``marlin-verify``'s CPU check, from codes, without an fp32 ``[K, N]`` weight.

``W`` is never formed whole: per row of a layer chunk, ``w[r, n]`` comes from the uint8
code ``q[r, n]`` and per-group float32 parameters of row ``r``'s group ``g`` in one of
two forms (:func:`accumulate`):

* elementwise, ``w = (q - c[g]) * a[g] + b[g]``, evaluated per weight: a source formula
  (``s * (q - z)`` is ``a = s, c = z, b = 0``; ``.tinyloop``'s ``q * s + zero`` is
  ``a = s, c = 0, b = zero``; the artifact's own ``(q - 8) * s + delta`` is
  ``a = s, c = 8, b = delta``);
* factored, per group ``a * (sum_r x q - c * sum_r x) + b * sum_r x``: what our GPU
  decode kernel does (``A (q - 8)`` summed per group, ``s`` and ``delta`` applied once
  per group; ``converter.gpu.reference.marlin_gemm`` with ``arith="group"``).

The compiled loop (``converter._native.gemv8``: weights in registers, 8 or 16 columns at
a time) runs when it is built, else NumPy in column blocks of at most
:data:`BLOCK_BYTES` of float32 weights.  Both are fp32 throughout; they differ from each
other only by summation order (about 1e-7 relative).
"""

from __future__ import annotations

import numpy as np

from .native import lib as native_lib

#: Rows of ``x`` (the check's activations); the compiled loop is written for exactly 8.
ROWS = 8
#: float32 bytes of ``W`` the NumPy path forms at a time.
BLOCK_BYTES = 8 << 20


def accumulate(
    y: np.ndarray,
    x: np.ndarray,
    q: np.ndarray,
    group: int,
    a: np.ndarray,
    c: np.ndarray | float,
    b: np.ndarray | None,
    *,
    factored: bool,
) -> None:
    """``y += x @ W`` for one layer chunk (see the module docstring for ``W``).

    Args:
        y: float32 ``(8, N)``, C-contiguous, accumulated in place.
        x: float32 ``(8, rows)``: the activations of the chunk's rows (already gathered
            in the chunk's row order for act-order layers).
        q: uint8 ``(rows, N)`` codes.
        group: rows per group; the chunk starts on a group boundary.  A chunk of a
            per-channel layer passes ``rows`` (or more): its one group.
        a: float32 ``(G, N)``, ``G = ceil(rows / group)``.
        c: float32 ``(G, N)`` or a constant.
        b: float32 ``(G, N)`` or None (zero).
        factored: the factored form instead of the elementwise one.

    Raises:
        ValueError: shapes that do not fit together, ``N % 64 != 0``, or ``x`` not 8 rows.
    """
    rows, size_n = q.shape
    groups = -(-rows // group) if rows else 0
    if x.shape != (ROWS, rows) or y.shape != (ROWS, size_n) or size_n % 64 or q.dtype != np.uint8:
        raise ValueError(f"accumulate: x {x.shape}, q {q.dtype} {q.shape}, y {y.shape} do not fit (N % 64 == 0)")
    if y.dtype != np.float32 or not y.flags.c_contiguous:
        raise ValueError("accumulate: y must be C-contiguous float32")
    params = [a, b] + ([c] if isinstance(c, np.ndarray) else [])
    if any(p is not None and p.shape != (groups, size_n) for p in params):
        raise ValueError(f"accumulate: parameters must be ({groups}, {size_n})")
    if not rows:
        return
    nat = native_lib()
    a32, b32 = _f32(a), _f32(b)
    c32, c0 = (_f32(c), 0.0) if isinstance(c, np.ndarray) else (None, float(c))
    if nat is not None:
        xt = np.ascontiguousarray(x.T, dtype=np.float32)
        nat.gemv8(xt, np.ascontiguousarray(q), y, rows, size_n, group, a32, c32, c0, b32, factored, 0, size_n)
        return
    _accumulate_numpy(y, np.asarray(x, dtype=np.float32), q, group, a32, c32 if c32 is not None else c0, b32, factored)


def _f32(p: np.ndarray | None) -> np.ndarray | None:
    return None if p is None else np.ascontiguousarray(p, dtype=np.float32)


def _accumulate_numpy(
    y: np.ndarray,
    x: np.ndarray,
    q: np.ndarray,
    group: int,
    a: np.ndarray,
    c: np.ndarray | float,
    b: np.ndarray | None,
    factored: bool,
) -> None:
    rows, size_n = q.shape
    span = min(group, rows)
    groups = -(-rows // span)
    g_of_row = np.arange(rows) // span
    width = max(64, BLOCK_BYTES // (4 * rows) // 64 * 64)
    cc = c if isinstance(c, np.ndarray) else np.full((groups, size_n), c, dtype=np.float32)
    # Row sums of x per group: (groups, 8); a short last group is padded with zeros.
    pad = groups * span - rows
    xg = np.pad(x, ((0, 0), (0, pad))).reshape(ROWS, groups, span)
    xs = xg.sum(axis=2).T
    for n0 in range(0, size_n, width):
        n1 = min(n0 + width, size_n)
        qb = q[:, n0:n1].astype(np.float32)
        if factored:
            qg = np.pad(qb, ((0, pad), (0, 0))).reshape(groups, span, n1 - n0)
            part = np.matmul(xg.transpose(1, 0, 2), qg)  # (groups, 8, width): sum of x q per group
            part -= cc[:, None, n0:n1] * xs[:, :, None]
            part *= a[:, None, n0:n1]
            if b is not None:
                part += b[:, None, n0:n1] * xs[:, :, None]
            y[:, n0:n1] += part.sum(axis=0)
        else:
            qb -= cc[g_of_row, n0:n1]
            qb *= a[g_of_row, n0:n1]
            if b is not None:
                qb += b[g_of_row, n0:n1]
            y[:, n0:n1] += x @ qb


def relative_error(y: np.ndarray, y_ref: np.ndarray) -> float:
    """``||y - y_ref|| / ||y_ref||`` (Frobenius), in float64; 1 stands in for a zero norm."""
    # Plain reductions, not np.linalg.norm: its BLAS call wakes OpenBLAS's worker
    # threads, which then spin on the cores the products need (measured: seconds of
    # CPU over 98 layers on 2 cores).
    ref = y_ref.astype(np.float64)
    denom = float(np.sqrt(np.square(ref).sum())) or 1.0
    return float(np.sqrt(np.square(y.astype(np.float64) - ref).sum())) / denom

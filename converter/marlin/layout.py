"""Marlin's pre-permuted ``B`` and scale layouts, integer-only and vectorised.

The closed form (docs/spec/checkpoint-formats.md section 4.3) for code ``q[k, n]``::

    row    = k // 16
    r, c   = k % 16, n % 16
    j      = (n % 64) // 16
    t      = 4 * (c % 8) + (r % 8) // 2
    col    = 128 * (n // 64) + 4 * t + j
    nibble = 4 * (r % 2) + 2 * (c // 8) + (r // 8)

Writing ``r = 8*rh + 2*rp + rl`` and ``n % 64 = 16*j + 8*ch + cl`` turns this into
``col = 128*nb + 16*cl + 4*rp + j`` and ``nibble = 4*rl + 2*ch + rh``: a pure axis
transpose of ``q`` viewed as ``(kt, rh, rp, rl, nb, j, ch, cl)``.  That is all
:func:`pack_b` does, so the codes go in bit-exactly with no float round trip.

Worked example (also a test): with ``q[k, n] = 1`` only at ``(k, n) = (8, 0)``, the
nibble is ``4*0 + 2*0 + 1 = 1`` of ``B[0, 0]``, so ``B[0, 0] == 0b1_0000 == 16``.

:func:`pack_b`, :func:`pack_b_from_gptq4` and :func:`unpack_b` run the compiled loops of
:mod:`converter.native` when they are built, else their NumPy twins ``*_numpy``, which
are the reference: the tests require both to give the same bits.
"""

from __future__ import annotations

import numpy as np

from ..constants import (
    CONVERT_N_MULTIPLE,
    MARLIN_PACK_FACTOR,
    MARLIN_TILE,
    SCALE_PERM_GROUPED_CHUNK,
    SCALE_PERM_SINGLE,
)
from ..native import lib as native_lib
from .shapes import tile_error

# Axis order of q viewed as (kt, rh, rp, rl, nb, j, ch, cl) that yields
# (kt, nb, cl, rp, j | rl, ch, rh): word index first, then nibble index.
_PACK_AXES = (0, 4, 7, 2, 5, 3, 6, 1)
_UNPACK_AXES = tuple(int(i) for i in np.argsort(_PACK_AXES))
_NIBBLE_SHIFTS = np.arange(MARLIN_PACK_FACTOR, dtype=np.uint32) * 4
_SCALE_PERM_SINGLE = np.asarray(SCALE_PERM_SINGLE, dtype=np.intp)
_SCALE_UNPERM_SINGLE = np.argsort(_SCALE_PERM_SINGLE)
#: Columns per chunk of the per-channel scale permutation.
_SINGLE_CHUNK = len(SCALE_PERM_SINGLE)
#: Columns of one block of ``B``'s tile order: 4 tiles of 16 (the ``j`` and ``nb`` axes).
_N_BLOCK = CONVERT_N_MULTIPLE


def _check_codes_shape(size_k: int, size_n: int) -> None:
    # An empty layer packs to an empty B: only the divisibility part of the rule applies.
    if size_k % MARLIN_TILE or size_n % _N_BLOCK:
        raise ValueError(tile_error(size_k, size_n))


def pack_b(q: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
    """Pack 4-bit codes into Marlin's ``B``.

    Args:
        q: uint8 ``(size_k, size_n)``, values in ``[0, 15]``, rows in Marlin order.
            ``size_k % 16 == 0`` and ``size_n % 64 == 0``.
        out: optional int32 ``(size_k // 16, 2 * size_n)`` array to write into (reusing
            a buffer saves the page faults of a fresh one).

    Returns:
        int32 ``(size_k // 16, 2 * size_n)`` in upstream Marlin's tile order
        (IST-DASLab ``marlin.Layer.pack``; closed form in the module docstring); ``out``
        when given.

    Raises:
        ValueError: wrong dtype, shape, or a code above 15.
    """
    if q.dtype != np.uint8 or q.ndim != 2:
        raise ValueError(f"codes must be uint8 (size_k, size_n), got {q.dtype} {q.shape}")
    size_k, size_n = q.shape
    _check_codes_shape(size_k, size_n)
    out = _out_b(out, size_k, size_n)
    nat = native_lib()
    if nat is None:
        np.copyto(out, pack_b_numpy(q))
    else:
        nat.pack_codes(np.ascontiguousarray(q), out, size_k, size_n)
    return out


def pack_b_numpy(q: np.ndarray) -> np.ndarray:
    """:func:`pack_b` in NumPy: the reference the compiled loop is tested against (same
    arguments, result and errors)."""
    if q.dtype != np.uint8 or q.ndim != 2:
        raise ValueError(f"codes must be uint8 (size_k, size_n), got {q.dtype} {q.shape}")
    size_k, size_n = q.shape
    _check_codes_shape(size_k, size_n)
    if q.size and int(q.max()) > 15:
        raise ValueError(f"codes must be in [0, 15], found {int(q.max())}")
    kt, nb = size_k // MARLIN_TILE, size_n // _N_BLOCK
    # Nibble = 4*rl + 2*ch + rh: byte 2*rl + ch of the little-endian word holds rh=0
    # in its low and rh=1 in its high nibble.  Combine the two rh halves bytewise in
    # source order, then one byte transpose to (kt, nb, cl, rp, j | rl, ch); this is
    # ~10x faster than widening to uint32 and OR-reducing, and the same bits.
    v = q.reshape(kt, 2, 4, 2, nb, 4, 2, 8)
    both = v[:, 0] | (v[:, 1] << np.uint8(4))  # (kt, rp, rl, nb, j, ch, cl)
    out = np.ascontiguousarray(both.transpose(0, 3, 6, 1, 4, 2, 5))
    return out.reshape(kt, 2 * size_n * 4).view("<i4").astype(np.int32, copy=False)


def pack_b_from_gptq4(words: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
    """Marlin ``B`` straight from 4-bit GPTQ ``qweight`` words, without unpacking codes.

    Equal, bit for bit, to ``pack_b(unpack_words(words, 4, axis=0))`` (tests check
    it): it never materialises the uint8 codes and works on whole words.  A GPTQ word at
    (row ``2*kt + rh``, column ``n``) holds rows ``16*kt + 8*rh + 2*rp + rl`` in byte
    ``rp``, low nibble ``rl = 0``.  Marlin's word byte ``2*rl + ch`` holds ``rh = 0`` low
    and ``rh = 1`` high (see the module docstring): mask-and-shift merges the two ``rh``
    words, a 4x4 byte transpose (SWAR) regroups bytes by ``rp``, and a word copy puts
    words in tile order.

    Args:
        words: int32 ``(size_k // 8, size_n)``, codes LSB-first down K (GPTQ
            ``qweight``, no act-order gather); ``size_k % 16 == 0``, ``size_n % 64 == 0``.
        out: optional int32 ``(size_k // 16, 2 * size_n)`` array to write into.

    Returns:
        int32 ``(size_k // 16, 2 * size_n)``; ``out`` when given.

    Raises:
        ValueError: not 2-D 32-bit, or a shape Marlin cannot tile.
    """
    if words.ndim != 2 or words.dtype.itemsize != 4 or words.dtype.kind not in "iu":
        raise ValueError(f"qweight must be 2-D int32, got {words.dtype} {words.shape}")
    rows, size_n = words.shape
    _check_codes_shape(rows * MARLIN_PACK_FACTOR, size_n)
    out = _out_b(out, rows * MARLIN_PACK_FACTOR, size_n)
    nat = native_lib()
    if nat is None:
        np.copyto(out, pack_b_from_gptq4_numpy(words))
    else:
        nat.pack_gptq4(np.ascontiguousarray(words).view(np.uint32), out, rows * MARLIN_PACK_FACTOR, size_n)
    return out


def _out_b(out: np.ndarray | None, size_k: int, size_n: int) -> np.ndarray:
    shape = (size_k // MARLIN_TILE, 2 * size_n)
    if out is None:
        return np.empty(shape, dtype=np.int32)
    if out.dtype != np.int32 or out.shape != shape or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous int32 array of shape {shape}, got {out.dtype} {out.shape}")
    return out


def pack_b_from_gptq4_numpy(words: np.ndarray) -> np.ndarray:
    """:func:`pack_b_from_gptq4` in NumPy (~0.8 GB/s of words against 4-7 GB/s compiled):
    the reference the compiled loop is tested against."""
    if words.ndim != 2 or words.dtype.itemsize != 4 or words.dtype.kind not in "iu":
        raise ValueError(f"qweight must be 2-D int32, got {words.dtype} {words.shape}")
    rows, size_n = words.shape
    _check_codes_shape(rows * MARLIN_PACK_FACTOR, size_n)
    kt, nb = rows // 2, size_n // _N_BLOCK
    u = np.ascontiguousarray(words).view(np.uint32).reshape(kt, 2, nb, 4, 2, 8)  # kt rh nb j ch cl
    out = np.empty((kt, nb, 8, 4, 4), dtype=np.uint32)  # kt nb cl rp j
    # Blocks of ~512 KB of input keep the temporaries in cache.  (Two packing threads
    # were tried: no gain end to end, the write-behind thread already uses core 2.)
    step = max(1, min(kt, (1 << 19) // max(8 * size_n, 1)))
    _gptq4_blocks(u, out, [(t0, min(t0 + step, kt)) for t0 in range(0, kt, step)])
    return out.reshape(kt, 2 * size_n).view(np.int32)


def _gptq4_blocks(u: np.ndarray, out: np.ndarray, blocks: list[tuple[int, int]]) -> None:
    """pack_b_from_gptq4's kernel over row-tile ranges ``[t0, t1)``."""
    m = np.uint32
    for t0, t1 in blocks:
        a, b = u[t0:t1, 0], u[t0:t1, 1]  # rh = 0, 1: (t, nb, j, ch, cl)
        # Byte rp of x (y) = output byte for rl = 0 (1): rh=0's nibble low, rh=1's high.
        x = (a & m(0x0F0F0F0F)) | ((b & m(0x0F0F0F0F)) << m(4))
        y = ((a >> m(4)) & m(0x0F0F0F0F)) | (b & m(0xF0F0F0F0))
        # 4x4 byte transpose of (x[ch0], x[ch1], y[ch0], y[ch1]) -> one word per rp,
        # byte 2*rl + ch; SWAR on whole words, then a uint32 (j, cl) -> (cl, j) copy.
        w0, w1, w2, w3 = x[:, :, :, 0], x[:, :, :, 1], y[:, :, :, 0], y[:, :, :, 1]
        lo0, hi0 = (w0 & m(0xFFFF)) | (w2 << m(16)), (w0 >> m(16)) | (w2 & m(0xFFFF0000))
        lo1, hi1 = (w1 & m(0xFFFF)) | (w3 << m(16)), (w1 >> m(16)) | (w3 & m(0xFFFF0000))
        o = out[t0:t1]
        o[:, :, :, 0, :] = ((lo0 & m(0x00FF00FF)) | ((lo1 & m(0x00FF00FF)) << m(8))).transpose(0, 1, 3, 2)
        o[:, :, :, 1, :] = (((lo0 >> m(8)) & m(0x00FF00FF)) | (lo1 & m(0xFF00FF00))).transpose(0, 1, 3, 2)
        o[:, :, :, 2, :] = ((hi0 & m(0x00FF00FF)) | ((hi1 & m(0x00FF00FF)) << m(8))).transpose(0, 1, 3, 2)
        o[:, :, :, 3, :] = (((hi0 >> m(8)) & m(0x00FF00FF)) | (hi1 & m(0xFF00FF00))).transpose(0, 1, 3, 2)


def unpack_b(b: np.ndarray, size_n: int | None = None, *, out: np.ndarray | None = None) -> np.ndarray:
    """Exact inverse of :func:`pack_b`.

    Args:
        b: int32 (or uint32) ``(size_k // 16, 2 * size_n)``, Marlin tile order.
        size_n: expected out-features; inferred from ``b`` when None.
        out: optional uint8 ``(size_k, size_n)`` array to write into.

    Returns:
        uint8 ``(size_k, size_n)`` codes in ``[0, 15]``, rows in Marlin order; ``out``
        when given.

    Raises:
        ValueError: ``b`` is not 2-D 32-bit or its width is not ``2 * size_n``.
    """
    if b.ndim != 2 or b.dtype.itemsize != 4 or b.dtype.kind not in "iu":
        raise ValueError(f"B must be 2-D int32, got {b.dtype} {b.shape}")
    kt, width = b.shape
    n = width // 2 if size_n is None else size_n
    if width != 2 * n or n % _N_BLOCK:
        raise ValueError(f"B width {width} != 2 * size_n with size_n % {_N_BLOCK} == 0 (size_n={n})")
    shape = (kt * MARLIN_TILE, n)
    if out is None:
        out = np.empty(shape, dtype=np.uint8)
    elif out.dtype != np.uint8 or out.shape != shape or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous uint8 array of shape {shape}, got {out.dtype} {out.shape}")
    nat = native_lib()
    if nat is None:
        np.copyto(out, unpack_b_numpy(b, n))
    else:
        nat.unpack_b(np.ascontiguousarray(b).view(np.uint32), out, kt * MARLIN_TILE, n)
    return out


def unpack_b_numpy(b: np.ndarray, size_n: int | None = None) -> np.ndarray:
    """:func:`unpack_b` in NumPy: the reference the compiled loop is tested against."""
    if b.ndim != 2 or b.dtype.itemsize != 4 or b.dtype.kind not in "iu":
        raise ValueError(f"B must be 2-D int32, got {b.dtype} {b.shape}")
    kt, width = b.shape
    n = width // 2 if size_n is None else size_n
    if width != 2 * n or n % _N_BLOCK:
        raise ValueError(f"B width {width} != 2 * size_n with size_n % {_N_BLOCK} == 0 (size_n={n})")
    words = np.ascontiguousarray(b).view(np.uint32)
    nib = ((words[..., None] >> _NIBBLE_SHIFTS) & 0xF).astype(np.uint8)
    nib = nib.reshape(kt, n // _N_BLOCK, 8, 4, 4, 2, 2, 2).transpose(_UNPACK_AXES)
    return np.ascontiguousarray(nib).reshape(kt * MARLIN_TILE, n)


def permute_scales(s: np.ndarray, *, single: bool | None = None) -> np.ndarray:
    """Apply Marlin's scale permutation (checkpoint-formats.md section 4.4).

    Args:
        s: ``(num_groups, size_n)`` any dtype (normally float16), natural column order,
            ``size_n % 64 == 0``.
        single: use the per-channel permutation; defaults to ``num_groups == 1``.
            Pass False when permuting a one-row slice of a grouped layer.

    Returns:
        Same shape and dtype.  ``num_groups > 1``: an 8x8 transpose inside every
        64-column chunk (``new[8i+j] = old[8j+i]``).  ``num_groups == 1``
        (per-channel, or one group spanning K): the 32-entry ``SCALE_PERM_SINGLE``
        inside every 32-column chunk, because the kernel treats a 1-row ``s`` as
        per-channel.

    Raises:
        ValueError: ``s`` is not 2-D or ``size_n % 64 != 0``.
    """
    g, n = _check_scales(s)
    if single if single is not None else g == 1:
        return np.ascontiguousarray(
            s.reshape(g, n // _SINGLE_CHUNK, _SINGLE_CHUNK)[:, :, _SCALE_PERM_SINGLE].reshape(g, n)
        )
    c = SCALE_PERM_GROUPED_CHUNK
    return np.ascontiguousarray(s.reshape(g, n // c, 8, 8).transpose(0, 1, 3, 2).reshape(g, n))


def unpermute_scales(s: np.ndarray, *, single: bool | None = None) -> np.ndarray:
    """Exact inverse of :func:`permute_scales` (same arguments, shapes, dtypes and errors)."""
    g, n = _check_scales(s)
    if single if single is not None else g == 1:
        return np.ascontiguousarray(
            s.reshape(g, n // _SINGLE_CHUNK, _SINGLE_CHUNK)[:, :, _SCALE_UNPERM_SINGLE].reshape(g, n)
        )
    # The 8x8 transpose is its own inverse.
    return permute_scales(s, single=False)


def _check_scales(s: np.ndarray) -> tuple[int, int]:
    if s.ndim != 2 or s.shape[1] % SCALE_PERM_GROUPED_CHUNK:
        raise ValueError(
            f"scales must be (num_groups, size_n) with size_n % {SCALE_PERM_GROUPED_CHUNK} == 0, got {s.shape}"
        )
    return int(s.shape[0]), int(s.shape[1])

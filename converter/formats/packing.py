"""Bit unpacking of producer int32 words (GPTQ, AWQ, compressed-tensors).

Convention (checkpoint-formats.md 1.2-1.3): for ``b`` in {2, 4, 8}, word ``w`` holds
``32 // b`` codes LSB-first, code ``i`` in bits ``[b*i, b*i + b)``.  All bit work is
done on the uint32 view of the signed int32 storage.
"""

from __future__ import annotations

import numpy as np

WORD_BITS = 32


def codes_per_word(bits: int) -> int:
    """Codes held by one int32 word for ``bits`` in {2, 4, 8}."""
    if bits not in (2, 4, 8):
        raise ValueError(f"no whole-word packing for {bits}-bit codes")
    return WORD_BITS // bits


def unpack_words(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Unpack int32 words along ``axis`` into uint8 codes.

    Args:
        words: int32 or uint32 array, 2-D.
        bits: 2, 4 or 8.
        axis: 0 to unpack down the rows (GPTQ ``qweight``: ``(K*b/32, N)`` ->
            ``(K, N)``), 1 along the columns (``qzeros``: ``(G, N*b/32)`` -> ``(G, N)``).

    Returns:
        uint8 codes, the packed axis multiplied by ``32 // bits``.
    """
    per = codes_per_word(bits)
    u = np.ascontiguousarray(words).view(np.uint32)
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    mask = np.uint32((1 << bits) - 1)
    if axis == 0:
        out = (u[:, None, :] >> shifts[None, :, None]) & mask
        return out.astype(np.uint8).reshape(u.shape[0] * per, u.shape[1])
    out = (u[:, :, None] >> shifts) & mask
    return out.astype(np.uint8).reshape(u.shape[0], u.shape[1] * per)


def pack_words(codes: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Inverse of :func:`unpack_words`: uint8 codes -> int32 words (writers, fixtures)."""
    per = codes_per_word(bits)
    c = np.ascontiguousarray(codes).astype(np.uint32)
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    if axis == 0:
        c = c.reshape(c.shape[0] // per, per, c.shape[1]) << shifts[None, :, None]
        return np.bitwise_or.reduce(c, axis=1).view(np.int32)
    c = c.reshape(c.shape[0], c.shape[1] // per, per) << shifts
    return np.bitwise_or.reduce(c, axis=2).view(np.int32)


def field_ones(bits: int) -> np.uint32:
    """The per-field "1" constant of a word: 0x11111111 for 4-bit, 0x55555555 for 2-bit.

    GPTQModel writes v1 zeros by subtracting this from whole words, with borrows, and
    reads them back by adding it (checkpoint-formats.md 1.5).
    """
    per = codes_per_word(bits)
    return np.uint32(sum(1 << (bits * i) for i in range(per)))

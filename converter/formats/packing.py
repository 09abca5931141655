"""Bit unpacking of producer int32 words (GPTQ, AWQ, compressed-tensors), and the
act-order permutation shared by the readers that carry a ``g_idx``.

Conventions (docs/spec/checkpoint-formats.md 1.2-1.3):

* ``b`` in {2, 4, 8}: word ``w`` holds ``32 // b`` codes LSB-first, code ``i`` in
  bits ``[b*i, b*i + b)``.
* ``b == 3``: every 3 consecutive words form one little-endian 96-bit string
  (word0 = bits 0..31, word1 = 32..63, word2 = 64..95) holding 32 codes, code ``j``
  in bits ``[3j, 3j + 3)``; codes 10 and 21 straddle word boundaries.

All bit work is done on the uint32 view of the signed int32 storage (or on uint64
for the 3-bit word pairs), never through floats.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import SourceFormatError
from ..native import lib as native_lib

WORD_BITS = 32
#: Bit widths with a known int32 packing.
PACKED_BITS = (2, 3, 4, 8)
#: 3-bit: 32 codes per block of 3 words.
_B3_CODES, _B3_WORDS = 32, 3
# Code j of a 3-bit block read from a 64-bit pair: j <= 10 from (word0 | word1 << 32),
# j >= 11 from (word1 | word2 << 32); both windows hold the whole 3-bit field.
_B3_PAIR = np.array([0 if j <= 10 else 1 for j in range(_B3_CODES)], dtype=np.intp)
_B3_PAIR_SHIFT = np.array([3 * j if j <= 10 else 3 * j - 32 for j in range(_B3_CODES)], dtype=np.uint64)
# Packing: bit offset of code j relative to word w is 3j - 32w; a code contributes to
# word w when that offset lies in (-3, 32) (partly, for the two straddling codes).
_B3_OFF = np.array([[3 * j - 32 * w for w in range(_B3_WORDS)] for j in range(_B3_CODES)], dtype=np.int64)
_B3_LSHIFT = np.where(_B3_OFF >= 0, _B3_OFF, 0).astype(np.uint64)
_B3_RSHIFT = np.where(_B3_OFF < 0, -_B3_OFF, 0).astype(np.uint64)
_B3_VALID = ((_B3_OFF > -3) & (_B3_OFF < 32)).astype(np.uint64)


def codes_per_word(bits: int) -> int:
    """Codes held by one int32 word for ``bits`` in {2, 4, 8} (3-bit has no whole-word packing).

    Raises:
        ValueError: any other bit width.
    """
    if bits not in (2, 4, 8):
        raise ValueError(f"no whole-word packing for {bits}-bit codes")
    return WORD_BITS // bits


def packed_len(n_codes: int, bits: int) -> int | None:
    """Number of int32 words holding ``n_codes`` codes of ``bits`` bits, or None if they
    do not fill whole words (whole 3-word blocks for 3-bit)."""
    if bits == 3:
        return n_codes // _B3_CODES * _B3_WORDS if n_codes % _B3_CODES == 0 else None
    per = codes_per_word(bits)
    return n_codes // per if n_codes % per == 0 else None


def unpacked_len(n_words: int, bits: int) -> int | None:
    """Number of codes in ``n_words`` int32 words, or None when 3-bit words are not whole blocks."""
    if bits == 3:
        return n_words // _B3_WORDS * _B3_CODES if n_words % _B3_WORDS == 0 else None
    return n_words * codes_per_word(bits)


def _unpack_last(u: np.ndarray, bits: int) -> np.ndarray:
    """Unpack along the last axis of a 2-D uint32 array."""
    rows, width = u.shape
    if bits == 3:
        if width % _B3_WORDS:
            raise ValueError(f"3-bit packing needs whole 3-word blocks, found {width} words")
        blk = u.reshape(rows, width // _B3_WORDS, _B3_WORDS).astype(np.uint64)
        pairs = np.stack(
            (blk[..., 0] | (blk[..., 1] << np.uint64(32)), blk[..., 1] | (blk[..., 2] << np.uint64(32))), axis=-1
        )
        out = (pairs[..., _B3_PAIR] >> _B3_PAIR_SHIFT) & np.uint64(7)
        return out.astype(np.uint8).reshape(rows, width // _B3_WORDS * _B3_CODES)
    per = codes_per_word(bits)
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    out = (u[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)
    return out.astype(np.uint8).reshape(rows, width * per)


def _pack_last(c: np.ndarray, bits: int) -> np.ndarray:
    """Pack uint codes along the last axis of a 2-D array into uint32 words."""
    rows, width = c.shape
    if bits == 3:
        if width % _B3_CODES:
            raise ValueError(f"3-bit packing needs multiples of 32 codes, found {width}")
        blk = c.reshape(rows, width // _B3_CODES, _B3_CODES, 1).astype(np.uint64)
        parts = ((blk << _B3_LSHIFT) >> _B3_RSHIFT) & np.uint64(0xFFFFFFFF) * _B3_VALID
        words = np.bitwise_or.reduce(parts, axis=2)  # (rows, blocks, 3)
        return words.astype(np.uint32).reshape(rows, width // _B3_CODES * _B3_WORDS)
    per = codes_per_word(bits)
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    v = c.astype(np.uint32).reshape(rows, width // per, per) << shifts
    return np.bitwise_or.reduce(v, axis=2)


def unpack_words(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Unpack int32 words along ``axis`` into uint8 codes.

    Args:
        words: int32 or uint32 array, 2-D.
        bits: 2, 3, 4 or 8 (layouts in the module docstring; spec 1.2).
        axis: 0 to unpack down the rows (GPTQ ``qweight``: ``(K*b/32, N)`` ->
            ``(K, N)``), 1 along the columns (``qzeros``: ``(G, N*b/32)`` -> ``(G, N)``).

    Returns:
        uint8 codes in ``[0, 2**bits)``; the packed axis grows by ``32 / bits``.
        With 2, 4 or 8 bits this runs the compiled loops of :mod:`converter.native`
        when they are built (down the rows: the bulk of a GPTQ read; along them: its
        zeros), else :func:`unpack_words_numpy`, the reference they are tested against.

    Raises:
        ValueError: an unknown bit width, or 3-bit words that are not whole 3-word blocks.
    """
    nat = native_lib()
    if nat is not None and axis in (0, 1) and bits in (2, 4, 8) and words.ndim == 2 and words.dtype.itemsize == 4:
        u = np.ascontiguousarray(words).view(np.uint32)
        rows, width = u.shape
        if axis == 0:
            out = np.empty((rows * (WORD_BITS // bits), width), dtype=np.uint8)
            nat.unpack_rows(u, out, rows, width, bits)
        else:  # qzeros: small, but read per layer and per chunk
            out = np.empty((rows, width * (WORD_BITS // bits)), dtype=np.uint8)
            nat.unpack_cols(u, out, rows, width, bits)
        return out
    return unpack_words_numpy(words, bits, axis)


def unpack_words_numpy(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """:func:`unpack_words` in NumPy (same arguments, result and errors)."""
    u = np.ascontiguousarray(words).view(np.uint32)
    if axis == 0:
        return np.ascontiguousarray(_unpack_last(np.ascontiguousarray(u.T), bits).T)
    return _unpack_last(u, bits)


def first_code_diff(words: np.ndarray, codes: np.ndarray, bits: int) -> int:
    """Where ``codes`` first differs from ``unpack_words(words, bits, axis=0)``.

    ``marlin-verify --against`` compares a GPTQ ``qweight`` chunk with the artifact's
    unpacked codes this way: the compiled loop packs the codes back per word and compares
    (nothing written), instead of unpacking the source into a second code array and
    comparing the two.

    Args:
        words: int32 or uint32 ``(R, N)``, packed down the rows.
        codes: uint8 ``(R * 32 / bits, N)``, C-contiguous.
        bits: 2, 4 or 8.

    Returns:
        The flat (row-major) index into ``codes`` of the first code that differs, or -1
        when all agree.  A code above ``2**bits - 1`` differs.  Runs the compiled loop when
        built, else :func:`first_code_diff_numpy`, the reference it is tested against.

    Raises:
        ValueError: an unknown bit width, or shapes that do not match.
    """
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits}")
    if words.ndim != 2 or codes.shape != (words.shape[0] * (WORD_BITS // bits), words.shape[1]):
        raise ValueError(f"codes {codes.shape} do not unpack from words {words.shape} at {bits} bits")
    nat = native_lib()
    if nat is not None and words.dtype.itemsize == 4 and codes.dtype == np.uint8 and codes.flags.c_contiguous:
        u = np.ascontiguousarray(words).view(np.uint32)
        return int(nat.diff_rows(u, codes, u.shape[0], u.shape[1], bits))
    return first_code_diff_numpy(words, codes, bits)


def first_code_diff_numpy(words: np.ndarray, codes: np.ndarray, bits: int) -> int:
    """:func:`first_code_diff` in NumPy (same arguments and result)."""
    ref = unpack_words_numpy(words, bits, axis=0)
    if ref.shape != codes.shape:
        raise ValueError(f"codes {codes.shape} do not unpack from words {words.shape} at {bits} bits")
    bad = np.flatnonzero(ref.reshape(-1) != np.asarray(codes).reshape(-1))
    return int(bad[0]) if bad.size else -1


def pack_words(codes: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Inverse of :func:`unpack_words`: uint8 codes -> int32 words (writers, fixtures).

    Raises:
        ValueError: an unknown bit width or a packed axis that does not fill whole words.
    """
    c = np.ascontiguousarray(codes)
    if axis == 0:
        return np.ascontiguousarray(_pack_last(np.ascontiguousarray(c.T), bits).T).view(np.int32)
    return _pack_last(c, bits).view(np.int32)


def field_ones(bits: int) -> np.uint32:
    """The per-field "1" constant of a word: 0x11111111 (4-bit), 0x55555555 (2-bit), 0x01010101 (8-bit).

    GPTQModel writes v1 zeros by subtracting this from whole words, with borrows, and
    reads them back by adding it (checkpoint-formats.md 1.5).
    """
    per = codes_per_word(bits)
    return np.uint32(sum(1 << (bits * i) for i in range(per)))


def symmetric_zero(bits: int) -> int:
    """The symmetric zero point ``2**(bits-1)`` (checkpoint-formats.md 1.6)."""
    return 1 << (bits - 1)


def decode_gptq_zeros(words: np.ndarray, bits: int, *, v1: bool) -> np.ndarray:
    """True zero points from GPTQ ``qzeros`` words.

    Args:
        words: int32 ``(G, N*b/32)`` as stored (packed along N).
        bits: 2, 3, 4 or 8.
        v1: True for ``checkpoint_format`` gptq (stored = z - 1), False for gptq_v2.

    Returns:
        uint8 ``(G, N)`` zeros ``z`` with ``W = s * (q - z)``.

    Conventions (checkpoint-formats.md 1.4-1.5): for 2/4/8-bit v1 the "+1" is a
    whole-word add of :func:`field_ones` modulo 2**32, which undoes GPTQModel's
    whole-word subtract with borrows exactly and equals "+1 per field" wherever no
    borrow happened.  3-bit fields straddle words, so GPTQModel corrects them per
    logical field, ``(stored + 1) & 7``; we do the same.
    """
    u = np.ascontiguousarray(words).view(np.uint32)
    if not v1:
        return unpack_words(u, bits, axis=1)
    if bits == 3:
        return ((unpack_words(u, bits, axis=1) + np.uint8(1)) & np.uint8(7)).astype(np.uint8)
    return unpack_words(u + field_ones(bits), bits, axis=1)


def act_order_perm(
    g_idx: np.ndarray, group_size: int, num_groups: int, *, path: Path | str, tensor: str
) -> np.ndarray | None:
    """The act-order permutation implied by a ``g_idx``, or None when it is trivial.

    Args:
        g_idx: int ``(K,)``: the group of each source input channel.
        group_size: rows per group (``K`` for per-channel).
        num_groups: ``ceil(K / group_size)``, the number of scale rows.
        path, tensor: named in errors.

    Returns:
        None when ``g_idx[k] == k // group_size`` for every k (no act-order; this
        includes ``static_groups`` files that say ``desc_act: true``, spec section 2:
        the data decides, not the flag).  Otherwise int32 ``perm`` ``(K,)`` = the
        stable argsort of ``g_idx``: Marlin row ``k`` holds source input channel
        ``perm[k]`` (vLLM ``marlin_sort_g_idx``; spec section 2 "Converter
        implication").

    Raises:
        SourceFormatError: a value outside ``[0, num_groups)``, or a group that does
            not have exactly ``group_size`` members (the last group may be short when
            ``K % group_size``, as GPTQ makes it), so sorted groups would not be
            contiguous blocks on group boundaries (a short last group is regrouped
            afterwards; a short group elsewhere is refused here).
    """
    g_idx = np.asarray(g_idx)
    size_k = int(g_idx.size)
    if size_k and (int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups):
        raise SourceFormatError(
            f"values must lie in [0, {num_groups}), found [{int(g_idx.min())}, {int(g_idx.max())}]",
            path=path,
            tensor=tensor,
        )
    if np.array_equal(g_idx, np.arange(size_k) // group_size):
        return None
    counts = np.bincount(g_idx.astype(np.int64), minlength=num_groups)
    full = np.full(num_groups, group_size)
    full[-1] = size_k - group_size * (num_groups - 1)
    if not np.array_equal(counts, full):
        bad = int(np.flatnonzero(counts != full)[0])
        tail = int(full[-1])
        short = (
            f" (only the last, group {num_groups - 1}, may be short: {tail} when K = {size_k})"
            if tail != group_size
            else ""
        )
        raise SourceFormatError(
            f"act-order groups must each have group_size={group_size} members{short}; "
            f"group {bad} has {int(counts[bad])} (expected {int(full[bad])})",
            path=path,
            tensor=tensor,
        )
    return np.argsort(g_idx, kind="stable").astype(np.int32)


def gather_rows(packed: np.ndarray, rows: np.ndarray, bits: int) -> np.ndarray:
    """Codes of selected input channels from words packed down axis 0 (GPTQ ``qweight``).

    Args:
        packed: int32 ``(K*b/32, N)`` (a memory map is fine: only the words holding
            ``rows`` are read).
        rows: int ``(R,)`` source input channels, any order (act-order gathers).
        bits: 2, 3, 4 or 8.

    Returns:
        uint8 ``(R, N)``: row ``i`` holds the codes of channel ``rows[i]``.
    """
    rows = np.asarray(rows, dtype=np.int64)
    if bits == 3:
        j = rows % _B3_CODES
        src = _B3_PAIR[j]
        w_lo = (rows // _B3_CODES) * _B3_WORDS + src
        lo = np.asarray(packed[w_lo]).view(np.uint32).astype(np.uint64)
        hi = np.asarray(packed[w_lo + 1]).view(np.uint32).astype(np.uint64)
        pair = lo | (hi << np.uint64(32))
        return ((pair >> _B3_PAIR_SHIFT[j][:, None]) & np.uint64(7)).astype(np.uint8)
    per = codes_per_word(bits)
    words = np.asarray(packed[rows // per]).view(np.uint32)
    shift = (rows % per).astype(np.uint32)[:, None] * np.uint32(bits)
    return ((words >> shift) & np.uint32((1 << bits) - 1)).astype(np.uint8)


#: AutoAWQ GEMM interleave: nibble i of word c holds output column 8c + AWQ_ORDER[i]
#: (``awq/utils/packing_utils.py AWQ_ORDER``; spec section 3).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
#: Column 8c + j lives in nibble AWQ_REVERSE_ORDER[j].
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
_AWQ_REV = np.asarray(AWQ_REVERSE_ORDER, dtype=np.intp)
_AWQ_ORD = np.asarray(AWQ_ORDER, dtype=np.intp)


def unpack_awq(words: np.ndarray) -> np.ndarray:
    """Unpack AutoAWQ GEMM words, packed along N with the interleave, into codes.

    Args:
        words: int32 ``(R, N/8)`` (``qweight`` with R = K, or ``qzeros`` with R = G).

    Returns:
        uint8 ``(R, N)`` in natural column order: ``out[r, 8c + AWQ_ORDER[i]]`` is
        nibble i of ``words[r, c]``.
    """
    nib = unpack_words(words, 4, axis=1)
    rows, n = nib.shape
    return np.ascontiguousarray(nib.reshape(rows, n // 8, 8)[:, :, _AWQ_REV].reshape(rows, n))


def pack_awq(codes: np.ndarray) -> np.ndarray:
    """Inverse of :func:`unpack_awq`: uint8 ``(R, N)`` -> int32 ``(R, N/8)`` (writers, fixtures)."""
    rows, n = codes.shape
    inter = np.ascontiguousarray(codes.reshape(rows, n // 8, 8)[:, :, _AWQ_ORD].reshape(rows, n))
    return pack_words(inter, 4, axis=1)

"""Marlin layout: spec test vectors, a slow per-element oracle, exact inverses."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from converter.constants import SCALE_PERM_SINGLE
from converter.formats.packing import unpack_words
from converter.marlin.layout import pack_b, pack_b_from_gptq4, permute_scales, unpack_b, unpermute_scales


def slow_pack_b(q: np.ndarray) -> np.ndarray:
    """Obviously-correct oracle: the spec's closed form (section 4.3), one element at a time."""
    size_k, size_n = q.shape
    b = np.zeros((size_k // 16, 2 * size_n), dtype=np.uint64)
    for k in range(size_k):
        for n in range(size_n):
            r, c = k % 16, n % 16
            j = (n % 64) // 16
            t = 4 * (c % 8) + (r % 8) // 2
            col = 128 * (n // 64) + 4 * t + j
            nibble = 4 * (r % 2) + 2 * (c // 8) + (r // 8)
            b[k // 16, col] |= int(q[k, n]) << (4 * nibble)
    return b.astype(np.uint32).view(np.int32)


def nibbles_at(b: np.ndarray, row: int, col: int) -> list[int]:
    word = int(b[row, col]) & 0xFFFFFFFF
    return [(word >> (4 * i)) & 0xF for i in range(8)]


# Spec section 4.3 test vectors: (k, n) for nibbles 0..7 of B[row, col].
SPEC_VECTORS = {
    (0, 0): [(0, 0), (8, 0), (0, 8), (8, 8), (1, 0), (9, 0), (1, 8), (9, 8)],
    (0, 1): [(0, 16), (8, 16), (0, 24), (8, 24), (1, 16), (9, 16), (1, 24), (9, 24)],
    (0, 4): [(2, 0), (10, 0), (2, 8), (10, 8), (3, 0), (11, 0), (3, 8), (11, 8)],
    (0, 16): [(0, 1), (8, 1), (0, 9), (8, 9), (1, 1), (9, 1), (1, 9), (9, 9)],
}


@pytest.mark.parametrize("pos", list(SPEC_VECTORS), ids=lambda p: f"B{list(p)}")
def test_spec_vectors(pos: tuple[int, int]) -> None:
    # Give every (k, n) of a 16x64 tile a distinct 4-bit label per position: probe
    # one nibble at a time so each (k, n) is identified exactly.
    for i, (k, n) in enumerate(SPEC_VECTORS[pos]):
        q = np.zeros((16, 64), dtype=np.uint8)
        q[k, n] = 0xA
        got = nibbles_at(pack_b(q), *pos)
        assert got == [0xA if j == i else 0 for j in range(8)], (k, n, got)


def test_docstring_worked_example() -> None:
    q = np.zeros((16, 64), dtype=np.uint8)
    q[8, 0] = 1
    b = pack_b(q)
    assert b[0, 0] == 0b1_0000
    assert np.count_nonzero(b) == 1


@pytest.mark.parametrize("size_k,size_n", [(16, 64), (32, 128), (48, 192), (128, 256), (64, 320)])
def test_vectorised_matches_slow_oracle(size_k: int, size_n: int) -> None:
    rng = np.random.default_rng(size_k * 1000 + size_n)
    q = rng.integers(0, 16, (size_k, size_n), dtype=np.uint8)
    b = pack_b(q)
    assert b.dtype == np.int32 and b.shape == (size_k // 16, 2 * size_n)
    np.testing.assert_array_equal(b, slow_pack_b(q))


@settings(max_examples=40, deadline=None)
@given(kt=st.integers(1, 6), nb=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_unpack_inverts_pack(kt: int, nb: int, seed: int) -> None:
    q = np.random.default_rng(seed).integers(0, 16, (16 * kt, 64 * nb), dtype=np.uint8)
    np.testing.assert_array_equal(unpack_b(pack_b(q)), q)


def test_pack_is_integer_exact_at_extremes() -> None:
    q = np.full((16, 64), 15, dtype=np.uint8)
    assert (pack_b(q).view(np.uint32) == 0xFFFFFFFF).all()
    assert (pack_b(np.zeros((16, 64), np.uint8)) == 0).all()


@pytest.mark.parametrize(
    "q,match",
    [
        (np.zeros((16, 64), np.int32), "uint8"),
        (np.zeros((15, 64), np.uint8), "size_k % 16"),
        (np.zeros((16, 96), np.uint8), "size_n % 64"),
        (np.full((16, 64), 16, np.uint8), r"\[0, 15\], found 16"),
    ],
)
def test_pack_rejects(q: np.ndarray, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        pack_b(q)


def test_grouped_scale_perm_is_8x8_transpose_per_64() -> None:
    s = np.arange(2 * 128, dtype=np.float32).reshape(2, 128).astype(np.float16)
    p = permute_scales(s)
    for g in range(2):
        for chunk in range(2):
            for i in range(8):
                for j in range(8):
                    assert p[g, 64 * chunk + 8 * i + j] == s[g, 64 * chunk + 8 * j + i]
    np.testing.assert_array_equal(unpermute_scales(p), s)


def test_single_scale_perm_matches_spec_list() -> None:
    s = np.arange(128, dtype=np.float16)[None]
    p = permute_scales(s)
    expected = np.concatenate([np.asarray(SCALE_PERM_SINGLE) + 32 * c for c in range(4)])
    np.testing.assert_array_equal(p[0], expected.astype(np.float16))
    assert list(p[0, :8]) == [0, 1, 8, 9, 16, 17, 24, 25]
    np.testing.assert_array_equal(unpermute_scales(p), s)


def test_one_row_slice_of_grouped_layer_uses_grouped_perm() -> None:
    s = np.arange(64, dtype=np.float16)[None]
    assert permute_scales(s, single=False)[0, 1] == 8
    assert permute_scales(s)[0, 1] == 1


@pytest.mark.parametrize("k,n", [(16, 64), (32, 128), (256, 192), (128, 4096)])
def test_pack_b_from_gptq4_matches_pack_b(k: int, n: int) -> None:
    rng = np.random.default_rng(k * n)
    words = rng.integers(-(2**31), 2**31, (k // 8, n), dtype=np.int64).astype(np.int32)
    assert np.array_equal(pack_b_from_gptq4(words), pack_b(unpack_words(words, 4, axis=0)))


def test_pack_b_from_gptq4_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"size_k % 16 == 0 and size_n % 64 == 0"):
        pack_b_from_gptq4(np.zeros((1, 64), np.int32))
    with pytest.raises(ValueError, match=r"qweight must be 2-D int32"):
        pack_b_from_gptq4(np.zeros((2, 64), np.float32))

"""The float16 shortcuts of ``converter.formats.scales``: the readers' per-chunk check of
float16 scales (:func:`fp16_scales`) and the range bound's integer maximum give exactly
what the float32 round trip and NumPy's float16 reductions give."""

from __future__ import annotations

import numpy as np
import pytest

from converter.errors import SourceFormatError
from converter.formats.scales import _bounded, fp16_scales, scales_to_fp16


def _awkward_f16(seed: int) -> np.ndarray:
    """Random float16 of every sign and magnitude, with zeros, -0.0, subnormals and the maximum."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 0x7C00, (16, 64), dtype=np.uint16) | (rng.integers(0, 2, (16, 64), dtype=np.uint16) << 15)
    s = bits.view(np.float16)
    s[0, :6] = [0.0, -0.0, 6e-8, -6e-8, 65504.0, -65504.0]
    return s


@pytest.mark.parametrize("seed", range(4))
def test_fp16_scales_is_the_float32_round_trip(seed: int) -> None:
    s16 = _awkward_f16(seed)
    got = fp16_scales(s16.copy(), path="p", tensor="t")
    want = scales_to_fp16(s16.astype(np.float32), path="p", tensor="t")
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_fp16_scales_refuses_what_the_round_trip_refuses(bad: float) -> None:
    s16 = _awkward_f16(9)
    s16[3, 4] = s16[5, 6] = bad
    with pytest.raises(SourceFormatError) as fast:
        fp16_scales(s16, path="p", tensor="t")
    with pytest.raises(SourceFormatError) as slow:
        scales_to_fp16(s16.astype(np.float32), path="p", tensor="t")
    assert str(fast.value) == str(slow.value)
    assert "2 NaN or Inf scales" in str(fast.value)


@pytest.mark.parametrize("seed", range(4))
def test_bound_on_float16_matches_float32(seed: int) -> None:
    """The integer maximum of float16 magnitudes decides like the float maximum, also at
    the limit (reach 7, with the bound's margin: 9336 passes, 9352 does not)."""
    s16 = _awkward_f16(seed) / np.float16(8)
    delta = np.random.default_rng(seed).standard_normal(s16.shape).astype(np.float32)
    assert _bounded(s16, delta, 7) == _bounded(s16.astype(np.float32), delta, 7)
    for top, expect in ((9336.0, True), (9352.0, False)):
        edge = np.full((2, 64), 0.5, np.float16)
        edge[1, 3] = -top
        zero = np.zeros((2, 64), np.float32)
        assert _bounded(edge, zero, 7) is expect
        assert _bounded(edge.astype(np.float32), zero, 7) is expect
    for bad in (np.inf, np.nan):
        edge = np.full((2, 64), 0.5, np.float16)
        edge[0, 0] = bad
        assert _bounded(edge, np.zeros((2, 64), np.float32), 7) is False

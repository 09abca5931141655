"""converter.dtypes.f32_to_bf16: round to nearest, ties to even, the bf16 rounding the
GPU kernels' cvt.rn.bf16x2.f32 does; checked bit for bit against torch's conversion."""

from __future__ import annotations

import numpy as np
import pytest

from converter.dtypes import bf16_to_f32, f32_to_bf16

torch = pytest.importorskip("torch")


def _torch_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_every_bf16_value_round_trips_exactly() -> None:
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    x = bf16_to_f32(bits)
    finite = ~np.isnan(x)
    assert np.array_equal(f32_to_bf16(x)[finite], bits[finite])


def test_random_floats_round_as_torch_does() -> None:
    rng = np.random.default_rng(3)
    u = rng.integers(0, 2**32, 500_000, dtype=np.uint64).astype(np.uint32)
    x = u.view(np.float32)
    x = x[~np.isnan(x)]
    assert np.array_equal(f32_to_bf16(x), _torch_bits(x))


def test_ties_go_to_even_and_overflow_goes_to_inf() -> None:
    one = np.float32(1.0).view(np.uint32)
    # 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: even is 1; 1 + 3 * 2^-8 halfway to 1 + 2^-6
    ties = np.array([one + 0x8000, one + 0x18000], dtype=np.uint32).view(np.float32)
    assert bf16_to_f32(f32_to_bf16(ties)).tolist() == [1.0, 1.0 + 2.0**-6]
    just_above = np.array([one + 0x8001], dtype=np.uint32).view(np.float32)
    assert bf16_to_f32(f32_to_bf16(just_above)).tolist() == [1.0 + 2.0**-7]
    big = np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max, np.inf], dtype=np.float32)
    assert bf16_to_f32(f32_to_bf16(big)).tolist() == [np.inf, -np.inf, np.inf]
    sub = np.array([2.0**-133, -(2.0**-149), 0.0, -0.0], dtype=np.float32)  # subnormals and zeros
    assert np.array_equal(f32_to_bf16(sub), _torch_bits(sub))


def test_nan_stays_nan_with_its_sign() -> None:
    x = np.array([0x7F800001, 0xFFC00000], dtype=np.uint32).view(np.float32)  # a signalling and a negative NaN
    out = bf16_to_f32(f32_to_bf16(x))
    assert np.isnan(out).all() and np.signbit(out).tolist() == [False, True]


def test_an_fp16_scale_splits_into_two_bf16_whose_products_with_codes_are_exact() -> None:
    """The fact docs/notes/bf16.md's per-weight lead rests on: for every finite fp16 ``s``,
    ``s_lo = s - bf16(s)`` is a bf16 and so is ``(q - 8) s_lo`` for every 4-bit code, so
    ``fma.rn.bf16x2(q - 8, bf16(s), (q - 8) s_lo)`` rounds ``(q - 8) s`` once, with no fp32."""
    s = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    s = np.concatenate([s, -s])
    s_hi = bf16_to_f32(f32_to_bf16(s.astype(np.float32))).astype(np.float64)
    s_lo = s - s_hi
    assert np.abs(s_lo).max() > 0  # not vacuous: most fp16 scales have bits below bf16's
    for q in range(16):
        t = (q - 8) * s_lo
        assert np.array_equal(bf16_to_f32(f32_to_bf16(t.astype(np.float32))).astype(np.float64), t), q

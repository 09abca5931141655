"""CPU tests of the bf16 GEMM twin (converter.gpu.reference_bf16): its rounding, its weight,
exact layers, and a float32 evaluation of each kernel arithmetic inside its bound (no GPU,
no CuPy; no marker)."""

from __future__ import annotations

import numpy as np
import pytest

from converter.dtypes import bf16_to_f32, f32_to_bf16
from converter.gpu import reference_bf16 as rb
from converter.gpu import reference_gemm as fp16_twin
from converter.gpu.plan import gemm_arith
from converter.marlin.layout import pack_b, permute_scales
from tests.helpers.kernel_layers import make_twin_layer as make_layer

ARITHS = ("weight", "group")


def _kw(L, k, n, **extra):
    return dict(size_k=k, size_n=n, group_size=L["gsize"], delta=L["delta"], perm=L["perm"], **extra)


def _bf16(x) -> np.ndarray:
    return f32_to_bf16(np.asarray(x, dtype=np.float32))


def _val(bits) -> np.ndarray:
    return bf16_to_f32(bits).astype(np.float64)


def _fma32(a, b, c):
    """fp32 fma: the float64 product-plus-addend of these operands is exact or nearly so."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def _rows(L, k):
    """Natural q - 8, s and fp16(delta) (or None), float64, one row per row of K (Marlin order)."""
    r = np.arange(k) // L["gs"]
    d = None if L["delta"] is None else L["delta"].astype(np.float16).astype(np.float64)[r]
    return L["q"].astype(np.float64) - 8, L["s"].astype(np.float64)[r], d


def _reference64(a_bits, L, k, arith, bias=None):
    """The twin's formula written out independently: float64 product in source order."""
    q8, s, d = _rows(L, k)
    w = q8 * s if d is None else q8 * s + d
    if arith == "weight":
        w = _val(_bf16(w.astype(np.float32)))
    w_src = w if L["perm"] is None else np.empty_like(w)
    if L["perm"] is not None:
        w_src[L["perm"]] = w
    out = _val(a_bits) @ w_src
    return out if bias is None else out + _val(bias)


def _kernel_f32(a_bits, L, k, arith, *, splits=1, bias=None):
    """A kernel's arithmetic in float32: Marlin-order activations, chunks of up to 128 rows
    split over ``splits`` partials; "weight" sums products with the bf16 weight, "group"
    sums per 16-row mma step (with a delta as the kernel's offset sums of A (128 + q) and
    -136 A) and closes each chunk with two fma; partials and bias added in fp32, then one
    bf16 rounding."""
    a = bf16_to_f32(a_bits if L["perm"] is None else a_bits[:, L["perm"]])
    q8, s, d = (None if x is None else x.astype(np.float32) for x in _rows(L, k))
    m, n, chunk = a.shape[0], q8.shape[1], min(L["gs"], 128)
    total = np.zeros((m, n), np.float32)
    for piece in np.array_split(np.arange(k // chunk), splits):
        acc = np.zeros((m, n), np.float32)
        for c in piece:
            r = slice(c * chunk, (c + 1) * chunk)
            if arith == "weight":
                w = q8[r] * s[r] if d is None else _fma32(q8[r], s[r], d[r])
                acc += a[:, r] @ bf16_to_f32(f32_to_bf16(w))
                continue
            p, off, x = (np.zeros((m, n), np.float32) for _ in range(3))
            for t in range(r.start, r.stop, 16):
                at = a[:, t : t + 16]
                xs = at.sum(1, keepdims=True, dtype=np.float32)
                if d is None:
                    p += at @ q8[t : t + 16]
                else:
                    p += at @ (q8[t : t + 16] + np.float32(136))
                    off += np.float32(-136) * xs
                x += xs
            acc = _fma32(s[r.start], p + off if d is not None else p, acc)
            if d is not None:
                acc = _fma32(d[r.start], x, acc)
        total += acc
    if bias is not None:
        total += bf16_to_f32(bias)
    return f32_to_bf16(total)


# ---- the one rounding -------------------------------------------------------------------


def test_round_bf16_rounds_float64_once():
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    with np.errstate(invalid="ignore"):  # signalling NaNs
        x = bf16_to_f32(bits).astype(np.float64)
    finite = np.isfinite(x)
    assert np.array_equal(rb.round_bf16(x)[finite], bits[finite])
    assert np.isnan(bf16_to_f32(rb.round_bf16(np.array([np.nan])))).all()
    # float32 first would make these ties (and round them to even); once, the tail decides
    for x, once in ((1 + 2.0**-8 + 2.0**-30, 1 + 2.0**-7), (2.0**-134 + 2.0**-160, 2.0**-133)):
        assert _val(rb.round_bf16(np.array([x, -x]))).tolist() == [once, -once]
        assert _val(f32_to_bf16(np.array([x], np.float32)))[0] != once
    big = rb.round_bf16(np.array([3.3e38, 1e39, -1e300, np.inf]))
    assert _val(big).tolist() == [float(_val(_bf16([3.3e38]))[0]), np.inf, -np.inf, np.inf]
    # random normal-range values, exact midpoints and near-midpoints, against a direct
    # round to 8 significant bits on the float64 bit pattern
    rng = np.random.default_rng(1)
    mids = _val(rng.integers(0x0080, 0x7F00, 3000).astype(np.uint16)) * (1 + 2.0**-8)
    near = mids * (1 + rng.choice([-1, 1], 3000) * 2.0 ** rng.integers(-50, -20, 3000))
    x = np.concatenate([rng.standard_normal(20000) * 2.0 ** rng.integers(-100, 100, 20000), mids, near])
    u = x.view(np.uint64)
    direct = ((u + np.uint64(2**44 - 1) + ((u >> np.uint64(45)) & np.uint64(1))) >> np.uint64(45)) << np.uint64(45)
    assert np.array_equal(rb.round_bf16(x), f32_to_bf16(direct.view(np.float64).astype(np.float32)))


# ---- the weight -------------------------------------------------------------------------


@pytest.mark.parametrize("group_size,asym", [(128, True), (64, True), (-1, True), (128, False)])
def test_weight_is_the_kernels_fp32_fma_rounded_to_bf16(group_size, asym):
    """Every weight is f32_to_bf16 of the kernel's fp32 fma, written out here in float32:
    fma(1024 + q, s, fp32(d - 1032 s)) on rows 0-7 of each 16-row k-tile and
    fma(1024 + 16 q, s / 16, fp32(d - 72 s)) on rows 8-15, d = fp16(delta); bit for bit,
    from either delta operand. With the layer's delta = s (8 - z) the constants are exact
    and this is the exact weight rounded to fp32 once, then to bf16."""
    k, n = 256, 128
    rng = np.random.default_rng([2, group_size % 97, asym])
    L = make_layer(rng, k, n, group_size, asym=asym)
    q8, s, d = (None if x is None else x.astype(np.float32) for x in _rows(L, k))
    d = np.zeros_like(s) if d is None else d
    upper = np.arange(k)[:, None] % 16 >= 8
    code = np.where(upper, np.float32(1024) + 16 * (q8 + 8), q8 + np.float32(1032))  # the fp16 codes, exact
    scale = np.where(upper, s / np.float32(16), s)  # exact: a power of two
    c = d - np.where(upper, np.float32(72), np.float32(1032)) * s  # float32: 72 s and 1032 s exact, one rounding
    expect = f32_to_bf16(_fma32(code, scale, c))
    kw = dict(size_k=k, size_n=n, group_size=group_size)
    w = rb.dequant(L["B"], L["S"], delta=L["delta"], **kw)
    assert w.dtype == np.uint16 and w.shape == (k, n) and np.array_equal(w, expect)
    # every constant exact here: one fp32 rounding of the exact weight
    # (equal values: a zero weight may come out +0 where the exact product is -0)
    exact = q8.astype(np.float64) * s + d
    assert np.array_equal(_val(w), _val(f32_to_bf16(exact.astype(np.float32))))
    if asym:
        prepared = permute_scales(L["delta"].astype(np.float16))
        assert np.array_equal(rb.dequant(L["B"], L["S"], delta=prepared, **kw), expect)


def test_weight_rounds_the_constant_as_the_kernel_does():
    """A delta far below the scale (here fp16(delta) = 2**-20 against s = 1.5): d - 1032 s
    and d - 72 s are not fp32 numbers, and the twin rounds them as the kernel's wcol
    does. With q = 8 the kernel's weight is 1032 s + fp32(d - 1032 s) = 0 on rows 0-7 and
    72 s + fp32(d - 72 s) = 0 on rows 8-15 (the constants lost d); a twin that kept them
    unrounded would give d = 2**-20."""
    q = np.full((16, 64), 8, np.uint8)
    s = np.full((1, 64), 1.5, np.float16)
    delta = np.full((1, 64), 2.0**-20, np.float32)
    w = rb.dequant(pack_b(q), permute_scales(s), size_k=16, size_n=64, group_size=-1, delta=delta)
    c = np.float32(np.float32(2.0**-20) - np.float32(1032 * 1.5))
    assert float(c) != 2.0**-20 - 1548  # the constant is rounded
    kernel = f32_to_bf16(np.float32(1032 * 1.5 + float(c)))
    assert (w == kernel).all() and (_val(w) == 0).all()


def test_rows_8_to_15_take_the_second_constant():
    """Which constant a row gets is visible where only one of them is exact: with q = 8,
    s = 1 and fp16(delta) = 2**-14, d - 72 = -71.99993896484375 needs 21 bits (exact in
    fp32), d - 1032 would need 25 and rounds to -1032. So the kernel's weight is 0 on rows
    0-7 of every 16-row k-tile and 2**-14 on rows 8-15."""
    k = 64
    q = np.full((k, 64), 8, np.uint8)
    s = np.ones((1, 64), np.float16)
    delta = np.full((1, 64), 2.0**-14, np.float32)
    w = _val(rb.dequant(pack_b(q), permute_scales(s), size_k=k, size_n=64, group_size=-1, delta=delta))
    upper = np.arange(k) % 16 >= 8
    assert (w[~upper] == 0).all() and (w[upper] == 2.0**-14).all()


def test_codes_are_fp16_pairs_of_1024_plus_q_and_1024_plus_16q():
    """The kernel's word_weights: a word, and the word shifted right by 8, OR-ed into
    0x64006400 (1024.0 in each fp16 half) under the mask 0x000F000F give the fp16 pair
    1024 + q of nibbles 0 and 4 (2 and 6), under 0x00F000F0 the pair 1024 + 16 q of
    nibbles 1 and 5 (3 and 7): low half first, each nibble in the mantissa's unit 1 or
    16, so every value is exact. Nibble i is fragment register i % 4's low (i < 4) or
    high half; the odd nibbles (a fragment's rows 8-15) carry 16 q."""
    rng = np.random.default_rng(9)
    words = rng.integers(0, 2**32, 64, dtype=np.uint64)
    for i in range(8):
        src = words >> 8 if i % 4 >= 2 else words
        mask = 0x00F000F0 if i % 2 else 0x000F000F
        bits = ((src & mask) | 0x64006400).astype(np.uint32)
        half = (bits >> 16 if i >= 4 else bits & 0xFFFF).astype(np.uint16).view(np.float16)
        q = ((words >> (4 * i)) & 15).astype(np.float64)
        assert np.array_equal(half.astype(np.float64), 1024 + (16 * q if i % 2 else q)), i
    assert np.float16(1024 + 16 * 15) == 1264  # 16 q still below 2048: no carry into the exponent


def test_weight_constants_are_exact_for_integer_zeros():
    """For the converter's delta = s (8 - z), given to the kernel as d = fp16(delta), both
    constants d - 1032 s and d - 72 s are exact in fp32 (at most 22 bits), so every row's
    weight is the exact (q - 8) s + d rounded once to bf16."""
    rng = np.random.default_rng(11)
    k, n = 64, 64
    q = rng.integers(0, 16, (k, n), dtype=np.uint8)
    z = rng.integers(0, 16, (1, n))
    s = rng.uniform(2.0**-12, 2.0**4, (1, n)).astype(np.float16)
    delta = (s.astype(np.float32) * (8 - z)).astype(np.float32)
    w = rb.dequant(pack_b(q), permute_scales(s), size_k=k, size_n=n, group_size=-1, delta=delta)
    exact = (q.astype(np.float64) - 8) * s.astype(np.float64) + delta.astype(np.float16).astype(np.float64)
    assert np.array_equal(_val(w), _val(rb.round_bf16(exact)))


def test_weight_is_the_fma_then_the_conversion():
    """The weight path rounds twice when the fp32 fma is inexact: with s = 32896 (a bf16
    midpoint) and fp16(delta) = 2**-24, the exact weight 32896 + 2**-24 rounds once to
    33024, but the fma gives 32896 and cvt.rn ties it to 32768, as the kernel will."""
    q = np.full((16, 64), 9, np.uint8)
    s = np.full((1, 64), 32896, np.float16)
    delta = np.full((1, 64), 2.0**-24, np.float32)
    kw = dict(size_k=16, size_n=64, group_size=-1, delta=delta)
    w = rb.dequant(pack_b(q), permute_scales(s), **kw)
    assert (_val(w) == 32768).all() and _val(rb.round_bf16(np.array([32896 + 2.0**-24])))[0] == 33024
    a = _bf16(np.eye(1, 16))
    assert (_val(rb.marlin_gemm(a, pack_b(q), permute_scales(s), arith="weight", **kw)) == 32768).all()
    assert (_val(rb.marlin_gemm(a, pack_b(q), permute_scales(s), arith="group", **kw)) == 33024).all()


def test_offset_codes_of_the_notes():
    """The bound's 144: codes 0x4300 | q are 128 + q (at most 143), the offset 0x4308 is
    136 and their difference q - 8 exactly; a nibble at bits 4-7 reaches the exponent."""
    q = np.arange(16, dtype=np.uint16)
    assert np.array_equal(bf16_to_f32(q | 0x4300), 128 + q) and bf16_to_f32(np.uint16(0x4308)) == 136
    assert np.array_equal(bf16_to_f32(q | 0x4300) - bf16_to_f32(np.uint16(0x4308)), q.astype(np.float32) - 8)
    assert bf16_to_f32(np.uint16(0x4300 | 0x80)) == 256


# ---- exact layers -----------------------------------------------------------------------


@pytest.mark.parametrize("arith", ARITHS)
def test_exact_layer_gives_the_exact_bf16_result(arith):
    """Integer activations and power-of-two scales: every product and sum is exact (in fp32
    too), so the twin, and any fp32 evaluation, is f32_to_bf16 of the exact result."""
    k, n, m = 256, 128, 17
    rng = np.random.default_rng(4)
    q = rng.integers(0, 16, (k, n), dtype=np.uint8)
    s = (2.0 ** rng.integers(-4, -1, (2, n)) * rng.choice([-1, 1], (2, n))).astype(np.float16)
    z = rng.integers(0, 16, (2, n))
    L = dict(q=q, s=s, delta=(s * (8 - z)).astype(np.float32), perm=rng.permutation(k).astype(np.int32), gs=128)
    L.update(B=pack_b(q), S=permute_scales(s), gsize=128)
    a_int = rng.integers(-4, 5, (m, k))
    bias16 = rng.integers(-64, 65, n)  # bias in sixteenths
    # the exact result in sixteenths, in integers: W = (q - z) s, s a power of two >= 2**-4
    w16 = (q.astype(np.int64) - np.repeat(z, 128, 0)) * np.repeat((s * 16).astype(np.int64), 128, 0)
    w16_src = np.empty_like(w16)
    w16_src[L["perm"]] = w16
    exact = (a_int @ w16_src + bias16) / 16
    assert np.abs(exact).max() < 2**20  # fp32 holds every partial sum
    expect = _bf16(exact)
    a, bias = _bf16(a_int), _bf16(bias16 / 16)
    got = rb.marlin_gemm(a, L["B"], L["S"], bias=bias, arith=arith, **_kw(L, k, n))
    assert np.array_equal(got, expect)
    assert not np.array_equal(_val(expect), exact)  # the final rounding did round
    assert np.array_equal(_kernel_f32(a, L, k, arith, splits=2, bias=bias), expect)


def test_output_beyond_fp16_is_exact_in_bf16():
    """Activations 256 (fp16 and bf16 alike) times weights 7 over K = 256: the fp16 twin
    overflows, the bf16 twin gives 458752 exactly."""
    k, n = 256, 64
    q = np.full((k, n), 15, np.uint8)
    s = np.ones((1, n), np.float16)
    kw = dict(size_k=k, size_n=n, group_size=-1)
    B, S = pack_b(q), permute_scales(s)
    for arith in ARITHS:
        got = rb.marlin_gemm(_bf16(np.full((2, k), 256)), B, S, arith=arith, **kw)
        assert (_val(got) == 256 * 256 * 7).all()
        with np.errstate(over="ignore"):
            c16 = fp16_twin.marlin_gemm(np.full((2, k), 256, np.float16), B, S, arith=arith, **kw)
        assert np.isinf(c16).all()


# ---- random layers: the twin against float64, a float32 evaluation within the bound -----


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("asym", [True, False])
@pytest.mark.parametrize("group_size", [128, -1])
@pytest.mark.parametrize("m", [1, 16, 17, 64])
def test_twin_within_the_bound(m, group_size, asym, act_order):
    k, n = 256, 128
    rng = np.random.default_rng([m, group_size % 97, asym, act_order])
    L = make_layer(rng, k, n, group_size, asym=asym, act_order=act_order)
    a = _bf16(rng.standard_normal((m, k)))
    bias = _bf16(rng.standard_normal(n))
    for arith in ARITHS:
        kw = _kw(L, k, n, bias=bias, arith=arith)
        got = rb.marlin_gemm(a, L["B"], L["S"], **kw)
        assert got.dtype == np.uint16 and got.shape == (m, n)
        ref = _reference64(a, L, k, arith, bias)
        # one rounding of the float64 product
        assert np.array_equal(got, rb.round_bf16(ref))
        for splits in (1, 3):
            bound = rb.gemm_error_bound(a, L["B"], L["S"], splits=splits, **kw)
            kern = _val(_kernel_f32(a, L, k, arith, splits=splits, bias=bias))
            assert np.all(np.abs(kern - _val(got)) <= bound)
            assert np.all(np.abs(ref - _val(got)) <= bound)
        assert np.median(bound / np.abs(ref)) < 2.0**-5  # not vacuous
    auto = rb.marlin_gemm(a, L["B"], L["S"], **_kw(L, k, n, bias=bias))
    picked = rb.marlin_gemm(a, L["B"], L["S"], **_kw(L, k, n, bias=bias, arith=gemm_arith(m, n)))
    assert np.array_equal(auto, picked)


@pytest.mark.parametrize("arith", ARITHS)
def test_activation_beyond_fp16_range_stays_finite(arith):
    """A row holding 1e5: finite, one rounding from float64, a float32 evaluation inside the
    bound; the fp16 twin, given the same activations, is not finite."""
    k, n, m = 256, 128, 4
    rng = np.random.default_rng(6)
    L = make_layer(rng, k, n, 128, act_order=True)
    x = rng.standard_normal((m, k))
    x[1, ::3] = 1e5
    a = _bf16(x)
    kw = _kw(L, k, n, arith=arith)
    got = rb.marlin_gemm(a, L["B"], L["S"], **kw)
    ref = _reference64(a, L, k, arith)
    assert np.isfinite(_val(got)).all() and np.abs(_val(got[1])).max() > 65504
    assert np.array_equal(got, rb.round_bf16(ref))
    bound = rb.gemm_error_bound(a, L["B"], L["S"], splits=2, **kw)
    assert np.all(np.abs(_val(_kernel_f32(a, L, k, arith, splits=2)) - _val(got)) <= bound)
    with np.errstate(over="ignore", invalid="ignore"):
        c16 = fp16_twin.marlin_gemm(_val(a).astype(np.float16), L["B"], L["S"], **kw)
    assert not np.isfinite(c16[1]).all() and np.isfinite(c16[[0, 2, 3]]).all()
    assert np.abs(c16[0].astype(np.float64) - _val(got[0])).max() > 0  # fp16 and bf16 round apart


# ---- operands ---------------------------------------------------------------------------


def test_operand_forms():
    """fp32 and prepared fp16 delta agree; bias as bf16 bits or fp16 agree; n_out takes the
    first columns; float activations or a float32 bias are refused."""
    k, n = 128, 64
    rng = np.random.default_rng(8)
    L = make_layer(rng, k, n, 64)
    a = _bf16(rng.standard_normal((3, k)))
    b_int = rng.integers(-8, 9, n).astype(np.float64) / 8
    kw = dict(size_k=k, size_n=n, group_size=64)
    prepared = permute_scales(L["delta"].astype(np.float16))
    for arith in ARITHS:
        one = rb.marlin_gemm(a, L["B"], L["S"], delta=L["delta"], bias=_bf16(b_int), arith=arith, **kw)
        two = rb.marlin_gemm(a, L["B"], L["S"], delta=prepared, bias=b_int.astype(np.float16), arith=arith, **kw)
        assert np.array_equal(one, two)
        part = rb.marlin_gemm(a, L["B"], L["S"], delta=L["delta"], bias=_bf16(b_int[:50]), arith=arith, n_out=50, **kw)
        assert np.array_equal(part, one[:, :50])
        bound = rb.gemm_error_bound(
            a, L["B"], L["S"], delta=L["delta"], bias=_bf16(b_int[:50]), arith=arith, n_out=50, **kw
        )
        assert bound.shape == (3, 50)
    with pytest.raises(TypeError, match="uint16"):
        rb.marlin_gemm(_val(a).astype(np.float16), L["B"], L["S"], **kw)
    with pytest.raises(TypeError, match="bias"):
        rb.marlin_gemm(a, L["B"], L["S"], bias=b_int.astype(np.float32), **kw)
    with pytest.raises(ValueError, match="size_k"):
        rb.marlin_gemm(a[:, :64], L["B"], L["S"], **kw)


def test_split_scale_bf16x2_weight_rounds_once():
    """The lead in docs/notes/bf16.md (docs/notes/streamk_variants/bf16_weight_bf16x2.patch):
    with s_hi = bf16(s) and s_lo = s - s_hi, three bf16x2 fmas give (q - z) s rounded once
    to bf16 for every code, integer zero and fp16 scale, each step exact but the last."""
    rng = np.random.default_rng(12)

    def fma(a, b, c):  # fma.rn.bf16x2 on bf16 bits: the exact a b + c rounded once
        return rb.round_bf16(_val(a) * _val(b) + _val(c))

    s16 = np.concatenate([rng.uniform(-(2.0**15), 2.0**15, 4000), rng.uniform(-1, 1, 4000) * 2.0**-14])
    s16 = s16.astype(np.float16)
    s16 = s16[np.isfinite(s16) & (s16 != 0)][:, None, None]
    q = np.arange(16, dtype=np.float64)[None, :, None]
    z = np.arange(-16, 33, dtype=np.float64)[None, None, :]
    s = s16.astype(np.float64)
    hi = rb.round_bf16(s)
    lo = rb.round_bf16(s - _val(hi))
    assert np.array_equal(_val(hi) + _val(lo), s)  # the split is exact
    qz = fma(rb.round_bf16(128 + q), rb.round_bf16(np.ones(1)), rb.round_bf16(-(128 + z)))
    assert np.array_equal(_val(qz), np.broadcast_to(q - z, qz.shape))
    p = fma(qz, lo, rb.round_bf16(np.full(1, -0.0)))
    assert np.array_equal(_val(p), (q - z) * _val(lo))  # exact
    w = fma(qz, hi, p)
    want = rb.round_bf16((q - z) * s)
    assert np.array_equal(_val(w), _val(want))  # equal values (q = z gives a zero of either sign)
    assert np.array_equal(w[_val(want) != 0], want[_val(want) != 0])


def test_both_constants_are_exact_for_every_fp16_scale_and_integer_zero():
    """marlin_common.cuh's claim, checked for every finite positive fp16 scale and every
    4-bit zero: with d = fp16(fp32((8 - z) s)), as the kernel reads it, d - 1032 s and
    d - 72 s are fp32 numbers, so wcol's fmaf rounds nothing and the weight is the exact
    (q - 8) s + d rounded once. (Where d overflows fp16 the converter refuses the layer.)"""
    s = np.arange(1, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    for z in range(16):
        with np.errstate(over="ignore"):
            d = (s * (8 - z)).astype(np.float32).astype(np.float16)
        keep = np.isfinite(d)
        for base in (1032, 72):
            c = d[keep].astype(np.float64) - base * s[keep]
            assert np.array_equal(c.astype(np.float32).astype(np.float64), c), (z, base)

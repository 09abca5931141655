"""The fp16 range rule (``converter.formats.scales.kernel_range_error``, which both
``marlin-convert`` and ``marlin-verify --shapes`` apply) is where the kernels' fp16
lives: a layer it accepts dequantizes to finite fp16 weights, and a layer it refuses
has an infinite one, in the NumPy twin (everywhere) and in ``kernels/dequant.cu``
(marker ``gpu``), which is bit-identical to the weight the GEMMs multiply by."""

from __future__ import annotations

import numpy as np
import pytest

from converter.formats.scales import kernel_range_error
from converter.gpu import reference as ref
from converter.marlin.layout import pack_b, permute_scales

K, N, GROUP = 128, 64, 64

#: (scale, delta, codes): at the edge of fp16 and just past it, in both directions.
CASES = {
    "max weight 65504": (8188.0, 0.0, "extremes", True),
    "-8 * 8192 = -65536": (8192.0, 0.0, "extremes", False),
    "-65504 - 16 rounds to -inf": (8188.0, -16.0, "extremes", False),
    "-65504 - 15 rounds to -65504": (8188.0, -15.0, "extremes", True),
    "delta 70000 is inf in fp16": (1e-3, 70000.0, "extremes", False),
    "delta 65519 rounds to 65504": (1e-3, 65519.0, "extremes", True),
    "7 * 9360 = 65520 only with code 15": (9360.0, 0.0, "mid", True),
    "7 * 9360 = 65520 with code 15": (9360.0, 0.0, "extremes", False),
}


def _layer(scale: float, delta: float, codes: str) -> dict:
    g = K // GROUP
    q = np.full((K, N), 8, dtype=np.uint8)
    if codes == "extremes":
        q[0, :] = 0
        q[1, :] = 15
    s = np.full((g, N), scale, dtype=np.float16)
    d = np.full((g, N), delta, dtype=np.float32)
    return dict(B=pack_b(q), S=permute_scales(s), s=s, delta=d, codes=codes)


def _accepted(layer: dict) -> bool:
    # "mid" codes never reach 0 or 15, but the rule covers every code the bits allow.
    return kernel_range_error(layer["s"], layer["delta"], 0, 4) is None


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_rule_is_the_twins_fp16(case: str) -> None:
    scale, delta, codes, finite = CASES[case]
    layer = _layer(scale, delta, codes)
    with np.errstate(over="ignore"):  # the overflow is the point
        w = ref.dequant(layer["B"], layer["S"], size_k=K, size_n=N, group_size=GROUP, delta=layer["delta"])
    assert bool(np.isfinite(w).all()) is finite
    if codes == "extremes":  # every code the bits allow occurs: the rule is exact
        assert _accepted(layer) is finite
    else:  # codes that stay in the middle: the rule (every code) is stricter than these weights
        assert finite and not _accepted(layer)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_rule_is_the_kernels_fp16(cp, case: str) -> None:
    from converter.gpu import kernels

    scale, delta, codes, finite = CASES[case]
    layer = _layer(scale, delta, codes)
    w = kernels.dequant(
        cp.asarray(layer["B"]),
        cp.asarray(layer["S"]),
        size_k=K,
        size_n=N,
        group_size=GROUP,
        delta=cp.asarray(layer["delta"]),
    )
    kernels.synchronize()
    got = cp.asnumpy(w)
    assert bool(np.isfinite(got).all()) is finite
    with np.errstate(over="ignore"):
        twin = ref.dequant(layer["B"], layer["S"], size_k=K, size_n=N, group_size=GROUP, delta=layer["delta"])
    np.testing.assert_array_equal(got.view(np.uint16), twin.view(np.uint16))
    if codes == "extremes":
        assert _accepted(layer) is finite


def _exact_rule(s16: np.ndarray, delta: np.ndarray, reach_lo: int, reach_hi: int) -> bool:
    """The rule elementwise in float64, no shortcut: fp16(delta) finite and every
    fp16((q - 8) * s + fp16(delta)) finite."""
    with np.errstate(over="ignore", invalid="ignore"):
        d16 = delta.astype(np.float16)
        s = s16.astype(np.float16).astype(np.float64)
        d = d16.astype(np.float64)
        worst = np.maximum(np.abs(reach_lo * s + d), np.abs(reach_hi * s + d))
        return bool(np.all(np.isfinite(d16)) and np.all(np.isfinite(worst.astype(np.float16))))


@pytest.mark.parametrize("seed", range(12))
def test_the_bound_shortcut_agrees_with_the_exact_rule_near_the_limit(seed: int) -> None:
    """kernel_range_error skips the float64 pass when max|s| and max|delta| prove the
    layer safe; near the limit it must still agree with the elementwise rule, for
    float16 scales and for float32 ones it rounds."""
    rng = np.random.default_rng(seed)
    top = 65504.0 / 8 * rng.uniform(0.97, 1.01)
    s16 = (rng.uniform(-1, 1, (4, 64)) * top).astype(np.float16)
    delta = (rng.uniform(-1, 1, (4, 64)) * rng.choice([0.0, 30.0, 600.0])).astype(np.float32)
    expect = _exact_rule(s16, delta, -8, 7)
    assert (kernel_range_error(s16, delta, 0, 4) is None) == expect
    assert (kernel_range_error(s16.astype(np.float32), delta, 0, 4) is None) == expect


def test_ordinary_layers_pass_by_the_bound() -> None:
    rng = np.random.default_rng(0)
    s16 = (rng.uniform(0.001, 0.05, (64, 4096))).astype(np.float16)
    delta = rng.standard_normal((64, 4096)).astype(np.float32)
    assert kernel_range_error(s16, delta, 0, 4) is None and kernel_range_error(s16, delta, 6, 2) is None

"""The decode kernel's zero-point operand (kernels.zero_point_operand) and its twin, without a GPU.

The operand exists only where ``delta == (8 - z) * s`` bit for bit in fp32 for integer
``z``; there the twin's weight ``(q - z) s`` must be the artifact's ``(q - 8) s + delta``
exactly, so the two twins agree bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from converter.constants import Suffix
from converter.convert import convert
from converter.errors import KernelError
from converter.gpu import reference as ref
from converter.gpu.kernels import ZERO_POINT_LIMIT, zero_point_operand
from converter.marlin.layout import pack_b, permute_scales, unpermute_scales
from tests.helpers.paths import SAMPLE


def _layer(rng: np.random.Generator, g: int, n: int, zlo: int = 0, zhi: int = 16):
    s = (rng.uniform(0.5, 2.0, size=(g, n)) * rng.choice([-1, 1], size=(g, n)) / 32).astype(np.float16)
    z = rng.integers(zlo, zhi, size=(g, n))
    # As QuantWeight.marlin_delta forms it: one fp32 step from the integer zero point.
    delta = (np.float32(8) - z.astype(np.float32)) * s.astype(np.float32)
    return s, z, delta


@pytest.mark.parametrize("g,n", [(4, 128), (1, 64), (1, 256), (16, 192)])
def test_integer_zero_points_are_found_exactly(g: int, n: int) -> None:
    s, z, delta = _layer(np.random.default_rng([g, n]), g, n)
    got = zero_point_operand(delta, permute_scales(s))
    assert got is not None and got.dtype == np.float16
    assert np.array_equal(unpermute_scales(got).astype(np.float64), 1024.0 + z)


def test_narrow_codes_zero_points_carry_the_code_offset() -> None:
    # a 2-bit layer: Marlin codes are q + 6, so z' = z + 6 lies in 6..9
    s, z, _ = _layer(np.random.default_rng(1), 3, 64, 0, 4)
    delta = (np.float32(2) - z.astype(np.float32)) * s.astype(np.float32)
    got = zero_point_operand(delta, permute_scales(s))
    assert got is not None
    assert np.array_equal(unpermute_scales(got).astype(np.float64), 1024.0 + 6 + z)


def test_zero_scale_columns() -> None:
    s, z, delta = _layer(np.random.default_rng(2), 2, 64)
    s[0, 5] = 0
    delta[0, 5] = 0
    got = zero_point_operand(delta, permute_scales(s))
    assert got is not None and unpermute_scales(got)[0, 5] == 1024 + 8
    delta[0, 5] = 1e-3  # a weight that is not (q - z) * 0
    assert zero_point_operand(delta, permute_scales(s)) is None


@pytest.mark.parametrize(
    "case",
    ["noise", "tinyloop", "bf16-scales", "far-zero", "nan", "inf"],
)
def test_no_operand_without_exact_integer_zero_points(case: str) -> None:
    rng = np.random.default_rng(3)
    s, z, delta = _layer(rng, 4, 128)
    if case == "noise":
        delta[2, 7] = np.nextafter(delta[2, 7], np.float32(np.inf))
    elif case == "tinyloop":  # W = q s + zero: delta = zero + 8 s, zero a float
        delta = rng.normal(0, 0.05, size=s.shape).astype(np.float32) + 8 * s.astype(np.float32)
    elif case == "bf16-scales":  # delta from the source's bf16 scale, s its fp16 rounding
        s_src = (s.astype(np.float32) * np.float32(1 + 2**-9)).astype(np.float32)
        delta = (np.float32(8) - z.astype(np.float32)) * s_src
    elif case == "far-zero":
        delta[0, 0] = np.float32(8 - (ZERO_POINT_LIMIT + 1)) * np.float32(s[0, 0])
    elif case == "nan":
        delta[1, 1] = np.nan
    else:
        delta[1, 1] = np.inf
    assert zero_point_operand(delta, permute_scales(s)) is None


def test_shape_mismatch_is_a_kernel_error() -> None:
    s, _, delta = _layer(np.random.default_rng(4), 2, 128)
    with pytest.raises(KernelError, match=r"delta \(2, 64\) and scales \(2, 128\) must be one \(G, N\) shape"):
        zero_point_operand(delta[:, :64], permute_scales(s))
    with pytest.raises(KernelError, match=r"N % 64 == 0"):
        zero_point_operand(np.zeros((2, 96), np.float32), np.zeros((2, 96), np.float16))


@pytest.mark.parametrize("m,k,n,group_size", [(1, 256, 64, 64), (7, 512, 128, 128), (16, 256, 192, -1)])
def test_twin_with_zero_points_is_the_exact_asymmetric_weight(m: int, k: int, n: int, group_size: int) -> None:
    rng = np.random.default_rng([m, k, n])
    gs = k if group_size == -1 else group_size
    s, _, delta = _layer(rng, k // gs, n)
    q = rng.integers(0, 16, size=(k, n), dtype=np.uint8)
    B, S = pack_b(q), permute_scales(s)
    zp = zero_point_operand(delta, S)
    a = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)
    kw = dict(size_k=k, size_n=n, group_size=group_size, arith="group")
    got = ref.marlin_gemm(a, B, S, delta=delta, zero_points=zp, **kw)
    rows = np.arange(k) // gs
    w = (q.astype(np.float64) - 8) * s.astype(np.float64)[rows] + delta.astype(np.float64)[rows]
    assert np.array_equal(got.view(np.uint16), (a.astype(np.float64) @ w).astype(np.float16).view(np.uint16))
    # the delta form rounds delta to fp16: a different (and less exact) weight
    delta_form = ref.marlin_gemm(a, B, S, delta=delta, **kw)
    assert not np.array_equal(got.view(np.uint16), delta_form.view(np.uint16))
    # the "weight" arithmetic has no zero-point form: the operand is ignored there
    kw["arith"] = "weight"
    assert np.array_equal(
        ref.marlin_gemm(a, B, S, delta=delta, zero_points=zp, **kw).view(np.uint16),
        ref.marlin_gemm(a, B, S, delta=delta, **kw).view(np.uint16),
    )


def test_tinyloop_artifact_has_no_zero_point_operand(tmp_path: Path) -> None:
    from converter.artifact.reader import open_artifact

    out = tmp_path / "s.safetensors"
    convert(SAMPLE, out)
    with open_artifact(out) as art:
        found = {}
        for name in art.layers:
            delta = art.tensor(f"{name}.{Suffix.DELTA.value}")
            found[name] = (bool(np.any(delta)), zero_point_operand(delta, art.tensor(f"{name}.{Suffix.SCALES.value}")))
    # float additive zeros: no asymmetric layer has an integer zero point; the symmetric
    # one (delta all zero, which MarlinLinear drops) is z = 8 everywhere
    assert sum(asym for asym, _ in found.values()) == 14
    assert all(z is None for asym, z in found.values() if asym)
    ((_, z_sym),) = [v for v in found.values() if not v[0]]
    assert z_sym is not None and (z_sym == 1032).all()

"""The GEMM planner (converter/gpu/plan.py) is pure: every input is an argument, so it is
tested here without CuPy or a GPU, against a made-up device."""

from __future__ import annotations

import dataclasses

import pytest

from converter.errors import KernelError
from converter.gpu import build
from converter.gpu.plan import (
    ARITH,
    DEFAULT_TUNING,
    GEMM_GPIS,
    GEMM_PIPES,
    KINDS,
    Arith,
    GemmPlan,
    KernelKind,
    Pipe,
    Tuning,
    default_pipe,
    gemm_path,
    kernel_variant,
    plan_gemm,
    resident_blocks,
)


@dataclasses.dataclass(frozen=True)
class H200:
    sm_count: int = 132
    smem_per_block_optin: int = 227 * 1024
    smem_per_sm: int = 228 * 1024


def _plan(m: int, k: int, n: int, g: int, *, regs: int = 96, tuning: Tuning = DEFAULT_TUNING, pipe=None) -> GemmPlan:
    gs = k if g == -1 else g
    pipe = pipe or default_pipe(m, k, n, gs // 16, H200.smem_per_block_optin, tuning)
    variant = kernel_variant(k, n, g, pipe, smem_limit=H200.smem_per_block_optin, arch="sm_90")
    return plan_gemm(m, k, n, variant, regs=regs, device=H200(), tuning=tuning)


def test_tuning_defaults_are_the_measured_values() -> None:
    assert DEFAULT_TUNING == Tuning(
        group_max_m=16,
        decode_max_m=32,
        wide_n=8192,
        waves=1,
        latency_tiles=6,
        reduce_tiles=2.5,
        a_weight=0.5,
        force_wk=None,
        occupancy_cap=(),
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_TUNING.waves = 2  # type: ignore[misc]


def test_routing_follows_the_tuning() -> None:
    assert gemm_path(12, 4096) is KernelKind.TILE
    assert gemm_path(12, 4096, Tuning(wide_n=4096)) is KernelKind.DECODE
    assert gemm_path(24, 16384, Tuning(decode_max_m=16)) is KernelKind.TILE


def test_plan_is_deterministic_and_consistent() -> None:
    a, b = _plan(1, 4096, 4096, 128), _plan(1, 4096, 4096, 128)
    assert a == b and a.kind is KernelKind.DECODE
    assert a.splits * a.tiles_per_split >= 4096 // 16 > (a.splits - 1) * a.tiles_per_split
    assert a.warps == 4 * a.blocks and a.resident_warps == 4 * 132 * resident_blocks(96, a.smem, H200.smem_per_sm)
    assert a.pipe in GEMM_PIPES and a.rows == KINDS[a.kind].tile_rows * a.r


@pytest.mark.parametrize("wk", [1, 4])
def test_force_wk_is_a_tuning_field(wk: int) -> None:
    assert _plan(17, 512, 192, 32, tuning=Tuning(force_wk=wk)).wk == wk


def test_occupancy_cap_shrinks_the_resident_set() -> None:
    free = _plan(1, 4096, 4096, 128, regs=64)
    capped = _plan(1, 4096, 4096, 128, regs=64, tuning=Tuning(occupancy_cap=((KernelKind.DECODE, 1),)))
    assert capped.resident_warps == 4 * 132 < free.resident_warps


def test_variant_checks_name_the_rule() -> None:
    with pytest.raises(KernelError, match=r"unknown GEMM variant \('tile', 3, 4, 3\); built: \(\('tile', 1, 4, 3\)"):
        _plan(1, 256, 64, 64, pipe=("tile", 3, 4, 3))
    with pytest.raises(KernelError, match=r"group_size 48 is not supported by GEMM variant \('decode', 1, 8, 3\)"):
        _plan(5, 768, 256, 48, pipe=("decode", 1, 8, 3))
    with pytest.raises(KernelError, match=r"size_k=192: K must be a multiple of 128 for this kernel"):
        _plan(1, 192, 64, 64, pipe=("tile", 1, 8, 3))
    with pytest.raises(KernelError, match=r"needs \d+ bytes of shared memory per block; sm_80 allows 1024"):
        kernel_variant(256, 64, 64, ("tile", 1, 4, 3), smem_limit=1024, arch="sm_80")


def test_kind_table() -> None:
    assert set(KINDS) == set(KernelKind) == {p.kind for p in GEMM_PIPES}
    assert dict(ARITH) == {
        KernelKind.TILE: Arith.WEIGHT,
        KernelKind.DECODE: Arith.GROUP,
        KernelKind.DECODE_W: Arith.WEIGHT,
    }
    assert Pipe.of(("tile", 1, 4, 3)) == ("tile", 1, 4, 3) and repr(Pipe.of(("tile", 1, 4, 3))) == "('tile', 1, 4, 3)"
    assert Pipe.of(("decode", 2, 8, 3)).name(1, True) == "marlin_decode<2, 8, 1, 3, true, true>"
    assert Pipe.of(("decode_w", 4, 4, 3)).name(2, False) == "marlin_decode<4, 4, 2, 3, false, false>"
    # Every variant is built for every GPI of its U, with and without delta.
    n_gemm = sum(2 * len(GEMM_GPIS[p.u]) for p in GEMM_PIPES)
    assert len(build.NAMES["marlin_gemm.cu"]) + len(build.NAMES["marlin_decode.cu"]) == n_gemm + 1  # + gather_columns

"""The GEMM planner (converter/gpu/plan/) is pure: every input is an argument, so it is
tested here without CuPy or a GPU, against a made-up device."""

from __future__ import annotations

import dataclasses

import pytest

from converter.errors import KernelError
from converter.gpu import build
from converter.gpu.plan import (
    ARITH,
    DEFAULT_TUNING,
    EVERY_M_CHECKED,
    GEMM_GPIS,
    GEMM_PIPES,
    KINDS,
    Arith,
    GemmPlan,
    KernelKind,
    Pipe,
    Tuning,
    default_pipe,
    gemm_arith,
    gemm_path,
    kernel_variant,
    persistent_every_m,
    plan_gemm,
    resident_blocks,
    small_chunk,
    streamk_pieces,
)

#: The persistent Hopper kind switched off: the routes it took over from 17 rows (9 on
#: the mid-sized layers).
NO_SK = Tuning(
    hopper_sk_min_m=10**9,
    hopper_sk_small_min_m=10**9,
    hopper_skg_min_m=10**9,
    hopper_small_min_m=10**9,
    hopper_thin_k_min_m=10**9,
)
#: The rules without the small layers' persistent route (Tuning.hopper_small_*).
NO_SMALL = Tuning(hopper_small_min_m=10**9)


@dataclasses.dataclass(frozen=True)
class H200:
    sm_count: int = 132
    smem_per_block_optin: int = 227 * 1024
    smem_per_sm: int = 228 * 1024


def _plan(
    m: int, k: int, n: int, g: int, *, regs: int = 96, tuning: Tuning = DEFAULT_TUNING, pipe=None, hopper: bool = False
) -> GemmPlan:
    gs = k if g == -1 else g
    pipe = pipe or default_pipe(m, k, n, gs // 16, H200.smem_per_block_optin, tuning, hopper=hopper)
    variant = kernel_variant(k, n, g, pipe, smem_limit=H200.smem_per_block_optin, arch="sm_90")
    return plan_gemm(m, k, n, variant, regs=regs, device=H200(), tuning=tuning)


def test_tuning_is_frozen_and_every_knob_is_read() -> None:
    """The knobs are one value per launch (hashable, frozen), and none is dead: each is
    read by the planner or the launcher (``cap`` and ``saturates_at`` read the two tables,
    ``for_act`` the bf16 overrides)."""
    from pathlib import Path

    with pytest.raises(dataclasses.FrozenInstanceError):
        DEFAULT_TUNING.waves = 2  # type: ignore[misc]
    gpu = Path(__file__).resolve().parents[2] / "converter" / "gpu"
    text = "".join(p.read_text() for p in gpu.rglob("*.py") if p.name != "tuning.py")
    text += "occupancy_cap saturation bf16_knobs"  # read through Tuning.cap, .saturates_at, .for_act
    assert [f.name for f in dataclasses.fields(Tuning) if f.name not in text] == []


def _grid_plans():
    """(device, K, N, group, M, plan) over the snapshot grid's shapes at the routes' edges."""
    from tests.gpu import plan_grid

    for dev, k, n, g in plan_grid.keys():
        gs = k if g == -1 else g
        for m in plan_grid.PLAN_MS:
            pipe = default_pipe(m, k, n, gs // 16, dev.smem_per_block_optin, hopper=dev.hopper)
            variant = kernel_variant(k, n, g, pipe, smem_limit=dev.smem_per_block_optin, arch=dev.arch)
            yield dev, k, n, g, m, variant, plan_gemm(m, k, n, variant, regs=plan_grid.REGS, device=dev)


def test_every_real_layer_gets_a_kernel_that_runs_it() -> None:
    """Every layer of the seven models, every group size, on sm_80..90: the routed variant
    is built, fits the device's shared memory, runs on that architecture, holds M, and its
    K split covers K exactly once in whole steps; a persistent launch has at most one block
    per multiprocessor, a split-K one at least one resident block."""
    from converter.constants import MARLIN_TILE

    seen = 0
    for dev, k, n, g, m, variant, plan in _grid_plans():
        seen += 1
        spec, kt = plan.pipe.spec, k // MARLIN_TILE
        assert plan.pipe in GEMM_PIPES and variant.smem <= dev.smem_per_block_optin >= plan.smem
        assert dev.hopper or not spec.wgmma, (dev.arch, k, n, g, m, plan.pipe)
        assert plan.m_chunks * plan.rows >= m > (plan.m_chunks - 1) * plan.rows
        assert plan.tiles_per_split % plan.u == 0 and kt % plan.u == 0
        if spec.persistent:
            stages = kt // plan.u
            units = plan.m_chunks * -(-n // 256)
            iters = plan.tiles_per_split // plan.u
            assert plan.blocks <= dev.sm_count and (plan.blocks - 1) * iters < units * stages <= plan.blocks * iters
            assert plan.kind is not KernelKind.HOPPER_SKG or variant.per_channel or variant.group_tiles % 8 == 0
        else:
            assert plan.splits * plan.tiles_per_split >= kt > (plan.splits - 1) * plan.tiles_per_split
            assert plan.resident_warps >= plan.threads // 32 and plan.tiles_per_split % (plan.u * plan.wk) == 0
    assert seen == 368 * 18


def test_the_route_map_in_the_docs_is_current() -> None:
    """docs/routing-map.md is what the route tables give (regenerate:
    ``python -m tests.gpu.plan_grid --write-map``)."""
    from tests.gpu import plan_grid

    assert plan_grid.ROUTE_MAP.read_text() == plan_grid.route_map()


def test_route_tables_end_in_a_catch_all_and_name_their_evidence() -> None:
    """Every call gets a row (the last one of each table holds always), every row's
    kind is a built kind, and its evidence is a section of docs/notes/routing.md."""
    from pathlib import Path

    from converter.gpu.plan import ROUTES_SM80, ROUTES_SM90, GemmProblem

    notes = (Path(__file__).resolve().parents[2] / "docs" / "notes" / "routing.md").read_text()
    for table in (ROUTES_SM80, ROUTES_SM90):
        assert table[-1].when(GemmProblem.of(10**6, 16, 64, 1))
        for row in table:
            assert row.kind in KINDS and f'<a id="{row.evidence}"></a>' in notes, row.name


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


def test_force_splits_takes_a_feasible_count_and_ignores_others() -> None:
    # 8192 x 57344 at M = 24 on the Hopper kernel: K = 512 k-tiles in steps of 4.
    free = _plan(24, 8192, 57344, 128, hopper=True, regs=168, tuning=NO_SK)
    assert (free.kind, free.splits, free.tiles_per_split) == (KernelKind.HOPPER, 5, 104)
    three = _plan(24, 8192, 57344, 128, hopper=True, regs=168, tuning=dataclasses.replace(NO_SK, force_splits=3))
    assert (three.splits, three.tiles_per_split) == (3, 172)
    # 129 splits would leave a split without k-tiles: not feasible, so the cost model chooses
    never = dataclasses.replace(NO_SK, force_splits=129)
    assert _plan(24, 8192, 57344, 128, hopper=True, regs=168, tuning=never) == free


def test_occupancy_cap_shrinks_the_resident_set() -> None:
    free = _plan(1, 4096, 4096, 128, regs=64)
    capped = _plan(1, 4096, 4096, 128, regs=64, tuning=Tuning(occupancy_cap=((KernelKind.DECODE, 1),)))
    assert capped.resident_warps == 4 * 132 < free.resident_warps


@pytest.mark.parametrize(
    ("k", "n", "m", "best", "blocks"),
    [
        # the fastest split count of the H200 sweep (bench_gemm.py --sweep-splits 16
        # --sweep-kinds decode, fused, 2026-12-01, us): 3 blocks per SM of 64.5 KB fit,
        # but the third adds no speed, so whole waves of 3 are the wrong unit
        (4096, 14336, 16, 4, 224),  # 21.4; 25.1 at 7 (392 blocks, one wave of 3 per SM)
        (4096, 14336, 12, 4, 224),  # 19.9; 22.7 at 7
        (8192, 57344, 16, 4, 896),  # 94.9; 99.3 at 5
        (8192, 57344, 12, 4, 896),  # 91.3; 95.2 at 5
        (28672, 8192, 16, 8, 256),  # 54.0; 56.6 at 12
        (28672, 8192, 12, 8, 256),  # 51.5; 52.5 at 12
    ],
)
def test_decode_split_follows_the_h200_sweep(k: int, n: int, m: int, best: int, blocks: int) -> None:
    plan = _plan(m, k, n, 128, regs=168)
    assert (plan.kind, plan.r, plan.u, plan.wk) == (KernelKind.DECODE, 2, 8, 1)
    assert (plan.splits, plan.blocks, plan.smem, plan.resident_warps) == (best, blocks, 64512, 4 * 3 * 132)
    # without the saturation entry, the waves of 3 blocks choose the slower counts
    waves = _plan(m, k, n, 128, regs=168, tuning=Tuning(saturation=()))
    assert waves.splits != best


@pytest.mark.parametrize(
    ("k", "n", "m", "wk", "splits", "if_saturated"),
    [
        # the benchmark's plans at 1 and 8 rows (H200, 2026-12-01); charged per SM as
        # from 9 rows, the 8-row plans moved 4096 x 14336 from 18.2 to 17.7 us,
        # 14336 x 4096 from 18.4 to 16.9, but 28672 x 8192 from 44.2 to 46.9: not taken
        (4096, 14336, 8, 4, 2, (1, 4)),
        (14336, 4096, 8, 4, 8, (4, 4)),
        (28672, 8192, 8, 4, 4, (1, 8)),
        (8192, 57344, 8, 1, 7, (1, 4)),
        (28672, 8192, 1, 4, 4, (4, 2)),  # 37.2 us at 4 splits, 43.8 at 2
        (14336, 4096, 1, 4, 8, (4, 4)),  # 14.7 at 8, 15.0 at 4
    ],
)
def test_decode_8_rows_keep_the_waves_model(k: int, n: int, m: int, wk: int, splits: int, if_saturated) -> None:
    plan = _plan(m, k, n, 128, regs=117)
    assert (plan.kind, plan.r, plan.wk, plan.splits) == (KernelKind.DECODE, 1, wk, splits)
    saturated = _plan(m, k, n, 128, regs=117, tuning=Tuning(saturation=((KernelKind.DECODE, 1, 2),)))
    assert (saturated.wk, saturated.splits) == if_saturated


def test_forced_split_count_skips_block_shapes_that_cannot_run_it() -> None:
    # 4096 x 14336 at M = 16: 5, 6 and 7 splits exist only for wk = 1 (K = 256 k-tiles,
    # wk = 4 needs multiples of 32); before, the wk = 4 shape fell back to its own choice
    for sp in (5, 6, 7):
        plan = _plan(16, 4096, 14336, 128, regs=168, tuning=Tuning(force_splits=sp))
        assert (plan.splits, plan.wk) == (sp, 1)


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
        KernelKind.HOPPER: Arith.WEIGHT,
        KernelKind.HOPPER_FS: Arith.WEIGHT,
        KernelKind.HOPPER_SK: Arith.WEIGHT,
        KernelKind.HOPPER_SKG: Arith.GROUP,
    }
    assert Pipe.of(("tile", 1, 4, 3)) == ("tile", 1, 4, 3) and repr(Pipe.of(("tile", 1, 4, 3))) == "('tile', 1, 4, 3)"
    assert Pipe.of(("decode", 2, 8, 3)).name(1, True) == "marlin_decode<2, 8, 1, 3, true, true>"
    assert Pipe.of(("decode_w", 4, 4, 3)).name(2, False) == "marlin_decode<4, 4, 2, 3, false, false>"
    # Every variant is built for every GPI of its U, with and without delta.
    n_gemm = sum(2 * len(GEMM_GPIS[p.u]) for p in GEMM_PIPES)
    built = sum(
        len(build.NAMES[f]) for f in ("marlin_gemm.cu", "marlin_decode.cu", "marlin_wgmma.cu", "marlin_streamk.cu")
    )
    assert built == n_gemm + 2  # + gather_columns, hopper_activations
    assert Pipe.of(("hopper", 16, 4, 6)).name(2, True) == "marlin_wgmma<64, 2, 4, 2, 6, true>"
    assert Pipe.of(("hopper", 4, 4, 4)).name(1, False) == "marlin_wgmma<32, 1, 4, 1, 4, false>"
    assert [Pipe.of(("hopper", r, 4, 4)).threads for r in (1, 8, 16)] == [128, 128, 256]
    assert Pipe.of(("hopper_fs", 16, 4, 4)).name(1, True) == "marlin_wgmma<128, 4, 4, 1, 4, true, 1>"
    assert [Pipe.of(("hopper_fs", r, 4, 6)).threads for r in (4, 8)] == [512, 512]
    assert Pipe.of(("hopper_sk", 16, 4, 8)).name(4, True) == "marlin_streamk<128, 4, 4, 8, true>"
    assert Pipe.of(("hopper_sk", 1, 4, 8)).threads == 384 and KINDS[KernelKind.HOPPER_SK].persistent
    assert Pipe.of(("hopper_skg", 4, 8, 6)).name(1, False) == "marlin_streamk<32, 8, 1, 6, false, true>"
    assert Pipe.of(("hopper_skg", 1, 8, 6)).threads == 384 and KINDS[KernelKind.HOPPER_SKG].persistent
    # 4 stages of 4 x 2 KB weights, 4 x 128 x 32 B activations, 2 x 512 B scale/delta rows
    assert Pipe.of(("hopper_fs", 16, 4, 4)).smem(1) == 4 * (4 * 2048 + 4 * 128 * 32 + 2 * 512)


def test_hopper_routing() -> None:
    """sm_90 only, where the H200 sweep had it ahead: wide N and big layers from 17 rows,
    N >= 8192 from 64, anything but small layers beyond 128; never at M <= 16."""
    for m in (1, 8, 16):
        assert gemm_path(m, 57344, NO_SK, hopper=True, size_k=8192) is KernelKind.DECODE
    assert gemm_path(17, 57344, NO_SK, hopper=True, size_k=8192) is KernelKind.HOPPER
    assert gemm_path(17, 14336, NO_SK, hopper=True, size_k=4096) is KernelKind.HOPPER
    assert gemm_path(16, 8192, NO_SK, hopper=True, size_k=28672) is KernelKind.DECODE
    assert gemm_path(17, 8192, NO_SK, hopper=True, size_k=28672) is KernelKind.HOPPER
    assert gemm_path(24, 8192, NO_SK, hopper=True, size_k=14336) is KernelKind.TILE  # 2^26.8 weights
    assert gemm_path(32, 8192, NO_SK, hopper=True, size_k=28672) is KernelKind.HOPPER
    assert gemm_path(63, 8192, NO_SK, hopper=True, size_k=8192) is KernelKind.TILE
    assert gemm_path(64, 8192, NO_SK, hopper=True, size_k=8192) is KernelKind.HOPPER
    assert gemm_path(32, 4096, NO_SK, hopper=True, size_k=14336) is KernelKind.TILE
    assert gemm_path(256, 512, NO_SK, hopper=True, size_k=65536) is KernelKind.TILE  # narrow
    assert gemm_path(32, 1024, NO_SK, hopper=True, size_k=8192) is KernelKind.TILE  # thin, below 33 rows
    assert gemm_path(64, 57344, size_k=8192) is KernelKind.TILE  # not on sm_80..89
    assert gemm_path(128, 57344, size_k=8192) is KernelKind.TILE
    assert gemm_path(64, 57344, Tuning(hopper=False), hopper=True, size_k=8192) is KernelKind.TILE


@pytest.mark.parametrize(
    ("m", "k", "n", "pipe"),
    [
        # The thin layers' persistent route replaced the feature-split wgmma kernel, which the
        # persistent kind beat on every row it served (H100, fused us, hopper_fs / hopper_sk in
        # 4-tile stages, benchmarks/results/h100/wgmma_retire_h100.json): 8192 x 1024 at 512
        # rows 44.3 / 30.8, 18944 x 3584 at 33 / 128 / 2048 rows 68.7 / 26.1, 124.0 / 48.5,
        # 992.0 / 578.4, 3584² at 1024 108.7 / 50.7
        (32, 8192, 1024, ("tile", 2, 4, 3)),
        (33, 8192, 1024, ("hopper_sk", 6, 4, 8)),
        (128, 8192, 1024, ("hopper_sk", 16, 4, 8)),
        (129, 8192, 1024, ("hopper_sk", 16, 4, 8)),
        (256, 8192, 2048, ("hopper_sk", 16, 4, 8)),
        (64, 4096, 1024, ("tile", 4, 2, 3)),  # fewer weights than the sweep's layer: not measured
        (64, 8192, 512, ("tile", 4, 2, 3)),
        (64, 16384, 4032, ("hopper_sk", 8, 4, 8)),  # just under N = 4096
        (64, 2048, 4096 - 64, ("tile", 4, 2, 3)),  # K N just under 2^23
    ],
)
def test_thin_layers_take_the_persistent_kernel(m: int, k: int, n: int, pipe) -> None:
    """With the small layers' persistent route off (the rule below it)."""
    assert default_pipe(m, k, n, 8, H200.smem_per_block_optin, NO_SMALL, hopper=True) == pipe
    assert default_pipe(m, k, n, 8, H200.smem_per_block_optin, hopper=False)[0] == "tile"


@pytest.mark.parametrize(
    ("m", "k", "n", "pipe"),
    [
        # H100 2026-12-06 (docs/notes/routing.md#thin-k): the persistent kind in 4-tile
        # stages beat the token-split kind (and the tile kernel) on every row of these layers
        (16, 1024, 8192, ("decode", 2, 8, 3)),  # not timed: the decode kernel stays
        (17, 1024, 8192, ("hopper_sk", 3, 4, 8)),
        (32, 512, 14336, ("hopper_sk", 4, 4, 8)),
        (64, 1024, 14336, ("hopper_sk", 8, 4, 8)),
        (65, 1024, 14336, ("hopper_sk", 8, 8, 6)),  # two 64-token chunks at 65-128 rows
        (128, 1024, 8192, ("hopper_sk", 8, 8, 6)),
        (129, 1024, 8192, ("hopper_sk", 16, 4, 8)),
        (1024, 512, 14336, ("hopper_sk", 16, 4, 8)),
        (64, 2048, 8192, ("hopper_sk", 8, 8, 6)),  # 4096² weights: the large layers' route
        (64, 1024, 4096, ("tile", 4, 2, 3)),  # N < 8192: not this route
    ],
)
def test_wide_layers_of_a_short_k_take_the_persistent_kernel(m: int, k: int, n: int, pipe) -> None:
    assert default_pipe(m, k, n, 8, H200.smem_per_block_optin, hopper=True) == pipe
    if pipe[0] == "hopper_sk" and k < 2048:  # held back: the token-split kind, as before
        held = default_pipe(m, k, n, 8, H200.smem_per_block_optin, NO_SK, hopper=True)
        assert held[0] == ("hopper" if m >= 64 or n >= 14336 else "tile")


@pytest.mark.parametrize(
    ("m", "k", "n", "pipe"),
    [
        # H200 sweep 2026-12-02 (symmetric us, 8-row decode chunks against the tile
        # kernel): 4096² 11.8 / 12.6 at 12 rows, 11.6 / 13.2 at 16; 8192 x 1024 10.5 /
        # 11.4 and 10.6 / 11.4; 14336 x 4096 even at 16 (21.4 / 21.5): the tile kernel stays
        (8, 4096, 4096, ("decode", 1, 4, 3)),
        (9, 4096, 4096, ("decode", 1, 4, 3)),
        (16, 4096, 4096, ("decode", 1, 4, 3)),
        (17, 4096, 4096, ("hopper_sk", 3, 8, 6)),  # the persistent kernel from 17 rows
        (16, 8192, 1024, ("decode", 1, 4, 3)),
        (12, 8192, 2048, ("decode", 1, 4, 3)),
        # more weights than 4096²: the persistent kernel's per-group form (from 1 row)
        # (14336 x 4096 at 16 rows: 18.3 against hopper_sk's 20.3, fused, 2026-12-02)
        (16, 8192, 4096, ("hopper_skg", 2, 8, 6)),
        (16, 14336, 4096, ("hopper_skg", 2, 8, 6)),
        (16, 2048, 8192, ("decode", 2, 8, 3)),  # N > 4096: the wide rule's 16-row chunks
    ],
)
def test_small_layers_take_8_row_decode_chunks_at_9_to_16_rows(m: int, k: int, n: int, pipe) -> None:
    """With the small layers' persistent route off (the rule below it)."""
    assert default_pipe(m, k, n, 8, H200.smem_per_block_optin, NO_SMALL, hopper=True) == pipe
    if 8 < m <= 16 and n <= 4096:  # the sm_80..89 rule is unchanged
        assert default_pipe(m, k, n, 8, H200.smem_per_block_optin, hopper=False)[0] == "tile"
    off = dataclasses.replace(NO_SMALL, hopper_decode_small_kn=0)
    if pipe == ("decode", 1, 4, 3) and m > 8:
        assert default_pipe(m, k, n, 8, H200.smem_per_block_optin, off, hopper=True)[0] == "tile"


@pytest.mark.parametrize(
    ("m", "k", "n", "group_tiles", "pipe"),
    [
        # H200, benchmarks/results/h200/bench_gemm_h200_small_chunks.json (Tuning.hopper_small_*,
        # plan.small_chunk): 16 units of 256 features x one chunk, even chunks of <= 32
        (7, 8192, 1024, 8, ("decode", 1, 4, 3)),
        (8, 8192, 1024, 8, ("hopper_sk", 1, 4, 8)),
        (16, 8192, 1024, 8, ("hopper_sk", 1, 4, 8)),  # 4 column blocks: two 8-token chunks
        (17, 8192, 1024, 8, ("hopper_skg", 1, 8, 6)),  # the per-group form from 17 rows, <= 16 tokens
        (32, 8192, 1024, 8, ("hopper_skg", 1, 8, 6)),
        (40, 8192, 1024, 8, ("hopper_skg", 2, 8, 6)),  # 10 tokens wanted: 16, three chunks
        (64, 8192, 1024, 8, ("hopper_skg", 2, 8, 6)),
        (80, 8192, 1024, 8, ("hopper_sk", 3, 4, 8)),  # 20 wanted: 24-token chunks, per weight
        (256, 8192, 1024, 8, ("hopper_sk", 4, 4, 8)),  # N < 4096: up to 256 rows
        (257, 8192, 1024, 8, ("hopper_sk", 16, 4, 8)),  # beyond, the thin layers' route
        (8, 4096, 4096, 8, ("hopper_sk", 1, 4, 8)),
        (16, 4096, 4096, 8, ("hopper_sk", 2, 4, 8)),  # 16 column blocks: one chunk up to 32
        (24, 4096, 4096, 8, ("hopper_sk", 3, 4, 8)),  # 4-tile stages, not the large layers' 8
        (40, 4096, 4096, 8, ("hopper_sk", 3, 4, 8)),  # two even chunks of 20: 24 tokens, not 32
        (128, 4096, 4096, 8, ("hopper_sk", 4, 4, 8)),
        (129, 4096, 4096, 8, ("hopper_sk", 16, 4, 8)),  # N = 4096 past 128 rows: the large layers' rule
        (24, 4096, 2048, 8, ("hopper_skg", 2, 8, 6)),  # 8 column blocks: 16 tokens
        (64, 2048, 4096, 8, ("hopper_sk", 4, 4, 8)),  # 2^23 weights: the class's least
        # group 64 (4 tiles): no 8-tile stage holds it; hopper_sk at the same chunk
        (40, 8192, 1024, 4, ("hopper_sk", 2, 4, 8)),
        (64, 4096, 4096, 4, ("hopper_sk", 4, 4, 8)),
        # outside the class: too few weights, N < 1024, or more than 4096² weights
        (16, 2048, 2048, 8, ("decode", 1, 4, 3)),
        (64, 16384, 512, 8, ("tile", 4, 2, 3)),
        (8, 8192, 4096, 8, ("hopper_skg", 1, 8, 6)),
        (48, 8192, 4096, 8, ("hopper_sk", 6, 8, 6)),
    ],
)
def test_small_layers_take_the_persistent_kernel_in_small_units(m: int, k: int, n: int, group_tiles: int, pipe) -> None:
    limit = H200.smem_per_block_optin
    assert default_pipe(m, k, n, group_tiles, limit, hopper=True) == pipe
    assert default_pipe(m, k, n, group_tiles, limit, hopper=False)[0] in ("decode", "tile")


@pytest.mark.parametrize(
    ("k", "n", "m", "best", "was"),
    [
        # the planner's split count on the H200 sweep of the tile kernel's 32-row chunks
        # (benchmarks/results/h200/bench_gemm_h200_tile_splits.json, fused us; the fastest count unless
        # noted); "was": the waves model's
        (14336, 4096, 16, 4, 6),  # 22.8; 25.0 at 6 (one wave of 3 blocks per SM)
        (14336, 4096, 24, 4, 6),  # 26.8; 28.8 at 6
        (14336, 4096, 32, 4, 6),  # 28.9; 32.8 at 6
        (8192, 8192, 24, 2, 3),  # 26.9; 30.0 at 3
        (8192, 8192, 32, 2, 3),  # 31.4; 34.2 at 3; the fastest, 30.1, at 1
        (4096, 4096, 16, 4, 4),  # 13.0; the fastest, 12.7, at 2
    ],
)
def test_tile_split_charges_saturated_multiprocessors(k: int, n: int, m: int, best: int, was: int) -> None:
    plan = _plan(m, k, n, 128, regs=168)
    assert (plan.kind, plan.r, plan.wk, plan.splits) == (KernelKind.TILE, 2, 4, best)
    waves = _plan(m, k, n, 128, regs=168, tuning=Tuning(saturation=((KernelKind.DECODE, 9, 2),)))
    assert waves.splits == was


@dataclasses.dataclass(frozen=True)
class A100:
    sm_count: int = 108
    smem_per_block_optin: int = 163 * 1024
    smem_per_sm: int = 164 * 1024


@pytest.mark.parametrize(
    ("m", "k", "n", "regs", "device"),
    [
        (48, 11008, 4096, 228, H200()),  # 64-row chunks: 2 blocks per SM fit, none saturates
        (48, 8192, 8192, 228, H200()),
        (24, 14336, 4096, 168, A100()),  # 32-row chunks, 2 blocks per SM by shared memory
        (48, 8192, 57344, 228, A100()),
    ],
)
def test_tile_saturation_leaves_plans_of_two_resident_blocks_alone(m, k, n, regs, device) -> None:
    pipe = default_pipe(m, k, n, 8, device.smem_per_block_optin)
    variant = kernel_variant(k, n, 128, pipe, smem_limit=device.smem_per_block_optin, arch="sm_80")
    waves = Tuning(saturation=((KernelKind.DECODE, 9, 2),))
    a = plan_gemm(m, k, n, variant, regs=regs, device=device)
    b = plan_gemm(m, k, n, variant, regs=regs, device=device, tuning=waves)
    assert a.kind is KernelKind.TILE and (a.wk, a.splits) == (b.wk, b.splits)
    assert a.resident_warps == 4 * 2 * device.sm_count


def test_feature_split_routing() -> None:
    """The feature-split kernel (H200 sweep, docs/notes/perf_notes.md): every layer of at
    least 4096 x 4096 weights from 65 rows, N = 4096 layers from 33; below that the
    token-split kernel or the tile kernel."""
    fs = KernelKind.HOPPER_FS
    for k, n in ((8192, 57344), (28672, 8192), (4096, 14336), (8192, 8192), (14336, 4096), (4096, 4096)):
        assert gemm_path(65, n, NO_SK, hopper=True, size_k=k) is fs
        assert gemm_path(300, n, NO_SK, hopper=True, size_k=k) is fs
    assert gemm_path(64, 57344, NO_SK, hopper=True, size_k=8192) is KernelKind.HOPPER
    assert gemm_path(64, 8192, NO_SK, hopper=True, size_k=28672) is KernelKind.HOPPER
    assert gemm_path(33, 4096, NO_SK, hopper=True, size_k=14336) is fs
    assert gemm_path(33, 4096, NO_SK, hopper=True, size_k=4096) is fs
    assert gemm_path(32, 4096, NO_SK, hopper=True, size_k=4096) is KernelKind.TILE
    assert gemm_path(256, 4096, NO_SK, hopper=True, size_k=2048) is KernelKind.TILE  # below 4096 x 4096
    pipes = [
        default_pipe(m, 4096, 4096, 8, H200.smem_per_block_optin, NO_SK, hopper=True)
        for m in (33, 48, 49, 64, 65, 96, 97, 256)
    ]
    assert pipes == [
        (fs, 6, 4, 6),
        (fs, 6, 4, 6),
        (fs, 8, 4, 6),
        (fs, 8, 4, 6),
        (fs, 12, 4, 4),
        (fs, 12, 4, 4),
        (fs, 16, 4, 4),
        (fs, 16, 4, 4),
    ]
    assert all(p in GEMM_PIPES for p in pipes)
    p = _plan(128, 8192, 57344, 128, regs=127, hopper=True, tuning=NO_SK)
    assert (p.kind, p.r, p.threads, p.splits, p.blocks, p.resident_warps) == (fs, 16, 512, 1, 224, 16 * 132)


@pytest.mark.parametrize(
    "m,r,ns",
    [
        (17, 3, 4),
        (24, 3, 4),
        (25, 4, 4),
        (32, 4, 4),
        (33, 6, 6),
        (48, 6, 6),
        (49, 8, 6),
        (64, 8, 6),
    ],
)
def test_hopper_pipe_holds_m(m: int, r: int, ns: int) -> None:
    pipe = default_pipe(m, 8192, 57344, 8, H200.smem_per_block_optin, NO_SK, hopper=True)
    assert pipe == ("hopper", r, 4, ns)


@pytest.mark.parametrize("m,r", [(65, 12), (96, 12), (97, 16), (300, 16)])
def test_beyond_64_rows_the_feature_split_block_holds_m(m: int, r: int) -> None:
    """The feature-split kernel from 65 rows, its 96- or 128-token block (128-token
    chunks beyond); with it switched off, the token-split blocks of 96 and 128 tokens
    (two warpgroups), which also serve the layers of fewer than 4096^2 weights."""
    limit = H200.smem_per_block_optin
    assert default_pipe(m, 8192, 57344, 8, limit, NO_SK, hopper=True) == ("hopper_fs", r, 4, 4)
    assert default_pipe(m, 8192, 57344, 8, limit, dataclasses.replace(NO_SK, hopper_fs_min_m=10**9), hopper=True) == (
        "hopper",
        r,
        4,
        6,
    )
    assert default_pipe(m, 1024, 14336, 8, limit, NO_SK, hopper=True) == ("hopper", r, 4, 6)


def test_persistent_every_m_names_the_layers_that_never_leave_the_persistent_kernel() -> None:
    """Layers of N >= 4096 above 4096² weights whose groups 8-tile stages hold go to a
    persistent kind at every M (so they may keep B unit-major only); small, thin and
    4096² layers, and groups of 32 or 64 (the decode kernel below 9 rows), do not."""
    for k, n in ((8192, 57344), (28672, 8192), (4096, 14336), (14336, 4096), (8192, 8192), (4608, 4096)):
        assert persistent_every_m(k, n, 8) and persistent_every_m(k, n, k // 16)  # group 128, per-channel
        assert not persistent_every_m(k, n, 4) and not persistent_every_m(k, n, 2)
        for m in (1, 7, 16, 17, 64, 128, 256, 1000):
            assert KINDS[gemm_path(m, n, hopper=True, size_k=k, group_tiles=8)].persistent, (k, n, m)
    for k, n in ((4096, 4096), (8192, 1024), (2048, 8192), (16384, 512)):
        assert not persistent_every_m(k, n, 8)
    assert not persistent_every_m(8192, 57344, 8, Tuning(hopper=False))
    # a threshold moved past what is checked row by row: B stays in Marlin's order (and
    # the answer comes at once, not after 10**9 rows)
    assert not persistent_every_m(8192, 57344, 8, NO_SK)
    assert not persistent_every_m(8192, 57344, 8, Tuning(hopper_sk_min_m=EVERY_M_CHECKED + 1))
    assert persistent_every_m(8192, 57344, 8, Tuning(hopper_sk_min_m=9))  # rows 9-16 per weight: still persistent


@pytest.mark.parametrize("k", [1024, 4096, 4608, 8192, 14336, 28672])
def test_persistent_every_m_agrees_with_the_router_at_every_m(k: int) -> None:
    """Where persistent_every_m says yes, default_pipe gives a persistent kind at every M
    (1..299 one by one, then up to 65536); where it says no, some M goes elsewhere. Every
    group size the kernels take, per-channel included."""
    ms = [*range(1, 300), 384, 512, 1000, 4096, 65536]
    for n in (1024, 2048, 4096, 8192, 14336, 57344):
        for gt in (1, 2, 3, 4, 8, 16, 64, k // 16):
            if k % (16 * gt):
                continue
            persistent = all(
                KINDS[default_pipe(m, k, n, gt, H200.smem_per_block_optin, hopper=True)[0]].persistent for m in ms
            )
            assert persistent_every_m(k, n, gt) == persistent, (k, n, gt)


def test_every_routed_pipe_is_built() -> None:
    """default_pipe never names a variant that was not compiled, on any shape or M, on
    sm_90 or sm_80..89; and kernel_variant accepts it for the layer's group (every group
    size, per-channel, K not a multiple of 128, ragged N)."""
    shapes = [(k, n) for k in (64, 1024, 4096, 8192, 14336, 28672) for n in (64, 1024, 4096, 8192, 14336, 57344)]
    for k, n in shapes:
        for m in range(1, 300):
            for hopper in (False, True):
                pipe = default_pipe(m, k, n, 8, H200.smem_per_block_optin, hopper=hopper)
                assert pipe in GEMM_PIPES, (k, n, m, hopper, pipe)
    limit = H200.smem_per_block_optin
    ms = (*range(1, 40), 47, 48, 63, 64, 65, 80, 96, 97, 112, 128, 129, 192, 256, 257, 300, 512)
    for k in (192, 1088, 4096, 4160, 8192, 28672):
        for n in (320, 1024, 3008, 4096, 8192, 14336, 57344):
            for gs in (16, 32, 48, 64, 128, 256, -1):
                if gs != -1 and k % gs:
                    continue
                gt = k // 16 if gs == -1 else gs // 16
                for m in ms:
                    for hopper in (False, True):
                        pipe = default_pipe(m, k, n, gt, limit, hopper=hopper)
                        kernel_variant(k, n, gs, pipe, smem_limit=limit)  # raises if it cannot run


@pytest.mark.parametrize(
    ("k", "n", "m", "regs", "best"),
    [
        # the fastest split count of the H200 sweep (bench_gemm.py --sweep-splits 8, fused,
        # 2026-12-01, us); "was": the plan of the once-per-call reduction charge
        (8192, 57344, 24, 143, 5),  # 135.6; was 3 (143.9)
        (8192, 57344, 96, 254, 1),  # 353.1; 377.6 at 4
        (4096, 14336, 24, 143, 7),  # 28.4; was 4 (30.7)
        (4096, 14336, 48, 254, 4),  # 35.6; was 3 (41.4)
        (8192, 8192, 96, 254, 4),  # 60.8; was 3 (72.7)
        (28672, 8192, 96, 254, 4),  # 168.5; 215.3 at 3, 263.8 at 5
        (8192, 57344, 256, 254, 2),  # 674.8; 707.1 at 1
    ],
)
def test_hopper_split_follows_the_h200_sweep(k: int, n: int, m: int, regs: int, best: int) -> None:
    # the sweep ran the 32-, 64- and 128-token blocks (before the 24- and 48-token ones)
    r = 4 if m <= 32 else 8 if m <= 64 else 16
    pipe = Pipe.of(("hopper", r, 4, 4 if r < 8 else 6))
    assert _plan(m, k, n, 128, regs=regs, hopper=True, pipe=pipe).splits == best


def test_hopper_plan_occupancy_and_split() -> None:
    """The split fills the device once (28672 x 8192 at 32 rows: 32 units of 256
    columns, 3 blocks per SM); the wide 70B layer needs none at 64 and 128 rows (224
    units; the H200 sweep's best, docs/notes/perf_notes.md); a two-warpgroup block holds
    one multiprocessor."""
    p32 = _plan(32, 28672, 8192, 128, regs=150, hopper=True, tuning=NO_SK)
    assert (p32.kind, p32.r, p32.threads) == (KernelKind.HOPPER, 4, 128)
    assert p32.blocks == 32 * p32.splits and p32.resident_warps == 4 * 3 * 132 and p32.blocks <= 3 * 132
    p64 = _plan(64, 8192, 57344, 128, regs=254, hopper=True, tuning=NO_SK)
    assert (p64.splits, p64.blocks, p64.m_chunks) == (1, 224, 1)
    p128 = _plan(128, 8192, 57344, 128, regs=254, hopper=True, pipe=Pipe.of(("hopper", 16, 4, 6)))
    assert (p128.threads, p128.splits, p128.resident_warps) == (256, 1, 8 * 132)
    p300 = _plan(300, 8192, 57344, 128, regs=127, hopper=True, tuning=NO_SK)
    assert (p300.kind, p300.m_chunks, p300.rows) == (KernelKind.HOPPER_FS, 3, 128)
    assert resident_blocks(254, Pipe.of(("hopper", 16, 4, 6)).smem(1), H200.smem_per_sm, 8) == 1


def _units_of(plan: GemmPlan, n: int) -> int:
    return plan.m_chunks * -(-(n // 64) // 4)


@pytest.mark.parametrize(
    ("m", "k", "n"), [(1, 8192, 57344), (64, 8192, 57344), (128, 28672, 8192), (200, 4096, 14336), (1, 8192, 1024)]
)
def test_streamk_plan_covers_the_work_once_on_at_most_one_block_per_sm(m: int, k: int, n: int) -> None:
    """Every (unit, stage) belongs to exactly one block's run; the grid never exceeds the
    multiprocessors (one run each, so every multiprocessor streams the same bytes); the
    reported pieces are the most blocks any unit is cut into."""
    r = next(r for r in (1, 2, 3, 4, 6, 8, 12, 16) if 8 * r >= min(m, 128))
    plan = _plan(m, k, n, 128, regs=168, hopper=True, pipe=("hopper_sk", r, 4, 8))
    stages = k // 16 // 4
    units = _units_of(plan, n)
    iters = plan.tiles_per_split // plan.u
    assert plan.blocks <= H200.sm_count and plan.threads == 384 and plan.wk == 1
    assert (plan.blocks - 1) * iters < units * stages <= plan.blocks * iters
    assert plan.m_chunks == -(-m // (8 * r)) and plan.rows == 8 * r
    pieces = [0] * units
    for b in range(plan.blocks):
        for i in range(b * iters, min((b + 1) * iters, units * stages), 1):
            if i == b * iters or i % stages == 0:
                pieces[i // stages] += 1
    assert max(pieces) == plan.splits == streamk_pieces(units, stages, iters)


def test_streamk_plan_trades_run_length_for_fewer_pieces() -> None:
    """A big layer fills every multiprocessor (runs of ~1.7 units, at most 3 pieces a
    unit); a thin one (4 units) is not cut into 32 pieces of 4 stages but into fewer,
    longer runs; a forced run length is taken as given (at least the fewest stages
    that fit the grid)."""
    big = _plan(64, 8192, 57344, 128, regs=168, hopper=True, pipe=("hopper_sk", 8, 4, 8))
    assert big.blocks == 132 and big.splits <= 3
    thin = _plan(1, 8192, 1024, 128, regs=168, hopper=True, pipe=("hopper_sk", 1, 4, 8))
    assert streamk_pieces(4, 128, 4) == 32 and thin.splits < 32 and thin.tiles_per_split > 16
    forced = _plan(
        1, 8192, 1024, 128, regs=168, hopper=True, pipe=("hopper_sk", 1, 4, 8), tuning=Tuning(streamk_iters=8)
    )
    assert (forced.tiles_per_split, forced.blocks, forced.splits) == (32, 64, 16)
    floor = _plan(
        1, 8192, 1024, 128, regs=168, hopper=True, pipe=("hopper_sk", 1, 4, 8), tuning=Tuning(streamk_iters=1)
    )
    assert floor.tiles_per_split == 16 and floor.blocks == 128


def test_persistent_kernel_routing() -> None:
    """sm_90: the persistent kernel's per-group form at 1-16 rows on every layer of
    N >= 4096 and more than 4096 x 4096 weights whose groups its 8-tile stages serve;
    the per-weight form from 17 rows on every layer of N >= 4096 and at least
    4096 x 4096 weights (from 9 up to 8192 x 8192 weights where the per-group form
    cannot serve); the decode (or tile) kernel below; thin, narrow and small layers and
    sm_80..89 keep their kernels (4096² with the small layers' own route off:
    test_small_layers_take_the_persistent_kernel_in_small_units has it on)."""
    sk, skg = KernelKind.HOPPER_SK, KernelKind.HOPPER_SKG
    decode, tile, decode_w = KernelKind.DECODE, KernelKind.TILE, KernelKind.DECODE_W
    limit = H200.smem_per_block_optin
    for k, n in ((8192, 57344), (28672, 8192), (4096, 14336), (8192, 8192), (14336, 4096), (28672, 4096), (4096, 4096)):
        small = k * n <= 4096 * 4096
        on = NO_SMALL if small else Tuning()
        for m in (1, 2, 7, 8, 9, 16, 17, 32):
            want = sk if m > 16 else decode if small else skg
            assert gemm_path(m, n, on, hopper=True, size_k=k) is want, (k, n, m)
        # group 32: no 8-tile stage holds it, so the decode kernel below 8 rows (9 on small layers)
        assert gemm_path(7, n, hopper=True, size_k=k, group_tiles=2) is decode
        assert gemm_path(16, n, NO_SK, hopper=True, size_k=k) is (tile if n == 4096 and k > 4096 else decode)
        for m in (33, 64, 128, 300):
            assert gemm_path(m, n, on, hopper=True, size_k=k) is sk
            # sm_80..89: the decode kernel's per-weight variant up to 32 rows on N > 8192, else the tile kernel
            assert gemm_path(m, n, size_k=k) is (decode_w if m <= 32 and n > 8192 else tile)
        # group 64: no 8-tile stage holds one group; the rules without the per-group form
        no_skg = Tuning(hopper_skg_min_m=10**9, hopper_small_skg_min_m=10**9)
        for m in (8, 16, 24):
            want = default_pipe(m, k, n, 4, limit, no_skg, hopper=True)
            assert default_pipe(m, k, n, 4, limit, hopper=True) == want and want.kind is not skg
            assert want.u == 4 or want.kind is not sk
    assert gemm_path(64, 8192, hopper=True, size_k=1024) is KernelKind.HOPPER_SK  # below 4096 x 4096: thin-k
    assert gemm_path(64, 8192, NO_SK, hopper=True, size_k=1024) is KernelKind.HOPPER  # ... held back
    assert gemm_path(64, 1024, NO_SMALL, hopper=True, size_k=8192) is KernelKind.HOPPER_SK  # thin
    ms = (8, 16, 17, 24, 25, 32, 33, 40, 64, 65, 100, 128, 129, 999)
    pipes = [default_pipe(m, 8192, 57344, 8, limit, hopper=True) for m in ms]
    assert [(p.kind, p.r, p.u, p.ns) for p in pipes] == [
        (skg, 1, 8, 6),
        (skg, 2, 8, 6),
        (sk, 3, 8, 6),
        (sk, 3, 8, 6),
        (sk, 4, 8, 6),
        (sk, 4, 8, 6),
        (sk, 6, 8, 6),
        (sk, 6, 8, 6),
        (sk, 8, 8, 6),
        (sk, 12, 4, 8),
        (sk, 16, 4, 8),
        (sk, 16, 4, 8),
        (sk, 16, 4, 8),
        (sk, 16, 4, 8),
    ]
    assert all(p in GEMM_PIPES for p in pipes)
    # per-channel (group tiles = K / 16) takes 8-tile stages too; K % 128 != 0 does not
    assert default_pipe(16, 8192, 57344, 512, limit, hopper=True) == ("hopper_skg", 2, 8, 6)
    assert default_pipe(24, 8192, 57344, 512, limit, hopper=True) == ("hopper_sk", 3, 8, 6)
    assert default_pipe(16, 8256, 57344, 516, limit, hopper=True)[0] != "hopper_skg"
    assert default_pipe(24, 8256, 57344, 516, limit, hopper=True) == ("hopper_sk", 3, 4, 8)
    # the group decides the form, in gemm_path and gemm_arith too (group 64: per-weight)
    assert gemm_path(12, 4096, hopper=True, size_k=14336, group_tiles=8) is skg
    assert gemm_path(12, 4096, hopper=True, size_k=14336, group_tiles=4) is sk
    assert gemm_arith(12, 4096, hopper=True, size_k=14336, group_tiles=4) == "weight"
    assert gemm_arith(12, 4096, hopper=True, size_k=14336, group_tiles=896) == "group"
    # a per-group range past its largest chunk (32 tokens) ends there
    wide = Tuning(hopper_skg_max_m=64)
    assert default_pipe(32, 8192, 57344, 8, limit, wide, hopper=True) == ("hopper_skg", 4, 8, 6)
    assert default_pipe(48, 8192, 57344, 8, limit, wide, hopper=True) == ("hopper_sk", 6, 8, 6)


def test_streamk_pieces_closed_form_matches_counting() -> None:
    """The closed form against counting every unit's pieces, over random deals."""
    import random

    rnd = random.Random(7)
    for _ in range(3000):
        units, stages, iters = rnd.randint(1, 300), rnd.randint(1, 200), rnd.randint(1, 2000)
        counted = max((u * stages + stages - 1) // iters - (u * stages) // iters + 1 for u in range(units))
        assert streamk_pieces(units, stages, iters) == counted, (units, stages, iters)
    # large M: many units, runs far longer than a unit (the counting path of the closed form)
    for _ in range(200):
        units, stages = rnd.randint(1000, 20000), rnd.randint(8, 256)
        iters = rnd.randint(stages, units * stages // 100 + stages)
        counted = max((u * stages + stages - 1) // iters - (u * stages) // iters + 1 for u in range(units))
        assert streamk_pieces(units, stages, iters) == counted, (units, stages, iters)


def test_floor_sum_matches_the_sum() -> None:
    import random

    from converter.gpu.plan.streamk import _floor_sum

    rnd = random.Random(11)
    for _ in range(2000):
        n, m, a, b = rnd.randint(1, 200), rnd.randint(1, 500), rnd.randint(0, 1000), rnd.randint(0, 1000)
        assert _floor_sum(n, m, a, b) == sum((a * i + b) // m for i in range(n)), (n, m, a, b)


@pytest.mark.parametrize(
    ("m", "k", "n", "blocks", "iters"),
    [
        # H200 (Tuning.streamk_misalign): runs that divide the unit's stages keep the
        # device's blocks on the same rows of B
        (1, 28672, 8192, 128, 56),  # 224 stages a unit: 4 pieces; the shortest run, 55, cut 6
        (16, 28672, 8192, 128, 56),
        (1, 4096, 14336, 112, 16),  # 32 stages; 14 the shortest
        (1, 8192, 57344, 132, 109),  # 64 stages; 128 (two whole units, 112 blocks) lost
        (1, 8192, 8192, 128, 16),  # already aligned
        (128, 28672, 8192, 128, 112),  # beyond 64 tokens the piece count alone picks it
    ],
)
def test_streamk_runs_align_with_the_units_stages(m: int, k: int, n: int, blocks: int, iters: int) -> None:
    plan = _plan(m, k, n, 128, regs=168, hopper=True)
    assert plan.kind in (KernelKind.HOPPER_SK, KernelKind.HOPPER_SKG)
    assert (plan.blocks, plan.tiles_per_split // plan.u) == (blocks, iters)
    if (k, n) == (4096, 14336):  # 14 + 3 pieces ties 16 + 1 piece: the misalignment cost decides
        free = _plan(m, k, n, 128, regs=168, hopper=True, tuning=Tuning(streamk_misalign=0.0))
        assert free.tiles_per_split // free.u == 14


def test_small_chunk_makes_sixteen_units_in_even_chunks() -> None:
    """plan.small_chunk: the fewest tokens (8-token tiles, at most 32) that make 16 units
    of 256 features x one chunk, then M cut evenly into that many chunks; the knobs move
    it."""
    got = [small_chunk(m, 1024) for m in (1, 16, 17, 32, 33, 64, 65, 96, 97, 128, 256)]
    assert got == [8, 8, 8, 8, 16, 16, 24, 24, 32, 32, 32]
    got = [small_chunk(m, 4096) for m in (8, 9, 17, 32, 33, 40, 48, 49, 64, 65, 128)]
    assert got == [8, 16, 24, 32, 24, 24, 24, 32, 32, 24, 32]
    assert small_chunk(64, 1024, Tuning(hopper_small_units=4)) == 32
    assert small_chunk(128, 4096, Tuning(hopper_small_max_tok=16)) == 16


def test_mid_layers_take_two_64_token_chunks_at_97_to_128_rows() -> None:
    """hopper_sk on layers above 4096² and up to 8192² weights at 97-128 rows, where
    8-tile stages hold the group: two even chunks of at most 64 tokens (one 96-token chunk
    below, one 128-token chunk on the larger layers and for other groups)."""
    limit = H200.smem_per_block_optin
    for k, n in ((4096, 14336), (14336, 4096), (8192, 8192)):
        assert default_pipe(96, k, n, 8, limit, hopper=True) == ("hopper_sk", 12, 4, 8)
        assert default_pipe(97, k, n, 8, limit, hopper=True) == ("hopper_sk", 8, 8, 6)
        assert default_pipe(128, k, n, 8, limit, hopper=True) == ("hopper_sk", 8, 8, 6)
        assert default_pipe(129, k, n, 8, limit, hopper=True) == ("hopper_sk", 16, 4, 8)
        # group 64: 8-tile stages do not hold it, and two 64-token chunks in 4-tile stages
        # ran slower than one of 128 (bench_gemm_h200_mid_sweep.json): one chunk
        assert default_pipe(128, k, n, 4, limit, hopper=True) == ("hopper_sk", 16, 4, 8)
        off = Tuning(hopper_sk_mid_min_m=10**9)
        assert default_pipe(128, k, n, 8, limit, off, hopper=True) == ("hopper_sk", 16, 4, 8)
    assert default_pipe(128, 28672, 8192, 8, limit, hopper=True) == ("hopper_sk", 16, 4, 8)
    assert default_pipe(128, 8192, 8192, 8, limit, hopper=False)[0] == "tile"


def test_bf16_knobs_take_the_small_layers_per_group_from_8_rows() -> None:
    """On the small layers the bf16 per-group kind, in the variants these routes take,
    beat the bf16 per-weight kind on every row where it was timed (docs/notes/routing.md#bf16
    lists the rows routed but not timed), so bf16 takes it from 8 rows (1-4 rows stay on
    the decode kernel); fp16's routes are unchanged."""
    from converter.gpu.plan import DEFAULT_TUNING, KernelKind, default_pipe

    bf16 = DEFAULT_TUNING.for_act("bfloat16")
    assert (bf16.hopper_small_skg_min_m, bf16.hopper_small_skg_max_tok) == (8, 32)
    # (K, N, M): the bf16 variant; fp16 takes hopper_sk on each of these rows
    want = {
        **{(k, k, m): r for k in (4096, 3584) for m, r in ((8, 1), (16, 2), (24, 3), (64, 4), (128, 4))},
        **{(8192, 1024, m): r for m, r in ((8, 1), (16, 1), (96, 3), (128, 4))},
    }
    for (k, n, m), r in want.items():
        assert default_pipe(m, k, n, 8, tuning=DEFAULT_TUNING, hopper=True).kind == KernelKind.HOPPER_SK, (k, n, m)
        assert default_pipe(m, k, n, 8, tuning=bf16, hopper=True) == ("hopper_skg", r, 8, 6), (k, n, m)
    for k, n in ((4096, 4096), (8192, 1024)):  # 1-4 rows: the decode kernel in both types
        assert default_pipe(4, k, n, 8, tuning=bf16, hopper=True).kind == KernelKind.DECODE
    # the large layers keep the per-weight kind beyond 32 rows
    assert default_pipe(64, 8192, 8192, 8, tuning=bf16, hopper=True).kind == KernelKind.HOPPER_SK


def test_bf16_knobs_take_the_per_group_kind_to_32_rows_on_large_layers() -> None:
    """The bf16 per-weight path costs more ALU than fp16's; measured on an H100
    (docs/notes/routing.md#bf16) the per-group kind is faster at 17-32 rows, so the bf16
    knobs take it there; fp16's routes are unchanged."""
    from converter.gpu.plan import DEFAULT_TUNING, KernelKind, default_pipe

    bf16 = DEFAULT_TUNING.for_act("bfloat16")
    assert bf16.hopper_skg_max_m == 32 and bf16.bf16_knobs == () and bf16.for_act("bfloat16") == bf16
    assert DEFAULT_TUNING.for_act("float16") is DEFAULT_TUNING
    for k, n in ((8192, 57344), (28672, 8192), (4096, 14336), (8192, 8192)):
        for m, fp16_kind, bf16_kind in (
            (16, "hopper_skg", "hopper_skg"),
            (17, "hopper_sk", "hopper_skg"),
            (32, "hopper_sk", "hopper_skg"),
            (33, "hopper_sk", "hopper_sk"),
        ):
            for tuning, want in ((DEFAULT_TUNING, fp16_kind), (bf16, bf16_kind)):
                pipe = default_pipe(m, k, n, 8, tuning=tuning, hopper=True)
                assert pipe.kind == KernelKind(want), (k, n, m, tuning is bf16, pipe)

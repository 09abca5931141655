"""Split-K for the ring kernels and the Hopper wgmma kinds: how many contiguous K
ranges each output unit is cut into, and the block shape, by a cost model of waves
of resident blocks (:func:`plan_gemm`). The persistent kinds are planned by
:mod:`converter.gpu.plan.streamk`.
"""

from __future__ import annotations

import functools

from ...constants import KERNEL_N_MULTIPLE, MARLIN_TILE
from .catalog import BLOCK_WARPS, GemmPlan, Variant
from .streamk import plan_streamk
from .tuning import DEFAULT_TUNING, DeviceLimits, Tuning


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=1024)
def _feasible_splits(kt: int, quantum: int) -> tuple[tuple[int, int], ...]:
    """``(splits, tiles_per_split)`` for every split count of ``kt`` k-tiles whose
    ranges are whole multiples of ``quantum`` (a warp's share is whole steps) and all
    non-empty (cached: it depends on K and the pipe only, not on M)."""
    return tuple(
        (splits, tps)
        for splits in range(1, -(-kt // quantum) + 1)
        for tps in [_ceil_div(_ceil_div(kt, splits), quantum) * quantum]
        if _ceil_div(kt, tps) == splits
    )


def resident_blocks(regs: int, smem: int, smem_per_sm: int, warps: int = BLOCK_WARPS) -> int:
    """Blocks of ``warps`` warps (a multiple of 4) one multiprocessor holds (sm_80..sm_90
    allocation rules).

    Each of the 4 sub-partitions has 16 K registers, given to a warp in units of 256
    (so 102 registers per thread cost 3328 per warp: 4 warps per sub-partition, not
    5); a block takes ``warps / 4`` warp slots in every sub-partition. Shared memory:
    1 KB is reserved per block. At most 64 warps.
    """
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    per_sub = warps // BLOCK_WARPS
    return max(1, min(16384 // (per_warp * per_sub), smem_per_sm // (smem + 1024), 64 // warps))


def plan_gemm(
    m: int,
    size_k: int,
    size_n: int,
    variant: Variant,
    *,
    regs: int,
    device: DeviceLimits,
    tuning: Tuning = DEFAULT_TUNING,
) -> GemmPlan:
    """The K split of one call of ``variant``.

    The work is ``m_chunks x N/64`` units (the variant's rows x 64 columns each), each
    split into ``splits`` contiguous K ranges; a 4-warp block takes either 4 units with
    the whole range (``wk = 1``) or one unit with a quarter of the range per warp
    (``wk = 4``). With ``R`` blocks resident on the device (from the variant's
    registers and the block shape's shared memory), the plan minimises
    ``ceil(blocks / R) * (tiles per warp + latency_tiles)`` (the slowest wave plus its
    pipeline fill) plus a small charge per split for the partial-sum reduction; a pipe
    with a ``tuning.saturation`` entry is charged per multiprocessor instead (see there).

    Args:
        m, size_k, size_n: the problem (the variant already checked the sizes).
        variant: from :func:`kernel_variant`.
        regs: registers per thread of the variant's compiled function.
        device: the device's multiprocessors and shared memory.
        tuning: the knobs.
    """
    pipe, spec = variant.pipe, variant.pipe.spec
    if spec.persistent:
        return plan_streamk(m, size_k, size_n, variant, regs=regs, device=device, tuning=tuning)
    kt = size_k // MARLIN_TILE
    warps_per_block = pipe.threads // 32
    cap = tuning.cap(pipe.kind)
    chunk_rows = spec.tile_rows * pipe.r
    m_chunks = -(-m // chunk_rows)
    nblk = size_n // KERNEL_N_MULTIPLE
    rows = min(m, chunk_rows)
    sat = tuning.saturates_at(pipe.kind, rows)
    best = None
    shapes = (tuning.force_wk,) if tuning.force_wk and tuning.force_wk in spec.block_shapes else spec.block_shapes
    feasible_by_wk = {wk: _feasible_splits(kt, wk * pipe.u) for wk in shapes}
    if any(tuning.force_splits in {sp for sp, _ in f} for f in feasible_by_wk.values()):
        # a forced count some block shape can run: only those shapes, at that count
        feasible_by_wk = {
            wk: [(sp, tps) for sp, tps in f if sp == tuning.force_splits] for wk, f in feasible_by_wk.items()
        }
    for wk in shapes:
        smem = pipe.smem(variant.gpi, wk)
        blocks_per_sm = resident_blocks(regs, smem, device.smem_per_sm, warps_per_block)
        if cap:
            blocks_per_sm = min(blocks_per_sm, cap)
        resident = device.sm_count * blocks_per_sm
        blocks_n = m_chunks * -(-nblk // (BLOCK_WARPS // wk))
        for splits, tps in feasible_by_wk[wk]:
            waves = -(-blocks_n * splits // (resident * tuning.waves))
            # slowest wave: per-warp tiles (each also moving its A rows, rows / 16 of a
            # B tile's bytes, once per block in the decode kernel's wk = 1 form) plus
            # the pipeline fill, then the final reduction (per extra split and 8 rows:
            # partial writes, the counter, reads)
            a_share = BLOCK_WARPS if (spec.shares_a and wk == 1) else 1
            tile_cost = 1 + tuning.a_weight * rows / MARLIN_TILE / a_share
            red_rows = chunk_rows if spec.reduces_chunk else rows
            reduce = spec.reduce_weight * tuning.reduce_tiles * (splits - 1) * -(-red_rows // 8)
            if spec.reduces_per_wave:
                reduce *= waves
            if sat and blocks_per_sm > sat:  # past `sat` resident blocks only (see Tuning.saturation)
                per_sm = -(-blocks_n * splits // device.sm_count)
                at_once = min(blocks_per_sm, sat, per_sm)
                rounds = -(-per_sm // blocks_per_sm)
                cost = per_sm / at_once * (tps // wk) * tile_cost + rounds * tuning.latency_tiles + reduce
            else:
                cost = waves * (tps // wk * tile_cost + tuning.latency_tiles) + reduce
            if best is None or cost < best[0]:
                best = (cost, wk, splits, tps, blocks_n * splits, smem, resident)
    assert best is not None
    _, wk, splits, tps, blocks, smem, resident = best
    return GemmPlan(
        kind=pipe.kind,
        r=pipe.r,
        u=pipe.u,
        gpi=variant.gpi,
        ns=pipe.ns,
        smem=smem,
        regs=regs,
        rows=chunk_rows,
        m_chunks=m_chunks,
        wk=wk,
        splits=splits,
        tiles_per_split=tps,
        warps=warps_per_block * blocks,
        blocks=blocks,
        resident_warps=warps_per_block * resident,
    )

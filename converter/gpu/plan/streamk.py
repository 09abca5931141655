"""Stream-K for the persistent Hopper kinds (``kernels/marlin_streamk.cu``): the run of
stages each block takes, by a cost model of the longest run and the pieces a unit is
cut into (:func:`plan_streamk`).
"""

from __future__ import annotations

from ...constants import KERNEL_N_MULTIPLE, MARLIN_TILE
from .catalog import BLOCK_WARPS, GemmPlan, Variant
from .tuning import DEFAULT_TUNING, DeviceLimits, Tuning


def streamk_pieces(units: int, stages: int, iters: int) -> int:
    """The most blocks any unit is cut into when each of ``units`` units of ``stages``
    stages, numbered unit-major, is dealt out in runs of ``iters`` stages.

    Unit u starts ``r = u stages mod iters`` stages into a run and is cut into
    ``(r + stages - 1) // iters + 1`` pieces: ``p0 = ceil(stages / iters)`` when r is
    below ``t = p0 iters - stages + 1``, one more from t. The units whose offset reaches
    t are counted without listing them (:func:`_floor_sum`), in logarithmic time for any
    M (listing them took 0.4 s per plan at M = 65536).
    """
    p0 = -(-stages // iters)
    t = p0 * iters - stages + 1  # 1 <= t <= iters
    # u stages mod iters >= t exactly when floor((u stages + iters - t) / iters) steps
    # past floor(u stages / iters)
    reach = _floor_sum(units, iters, stages, iters - t) - _floor_sum(units, iters, stages, 0)
    return p0 + (reach > 0)


def _floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``sum(floor((a i + b) / m) for i in range(n))`` for n, m >= 1 and a, b >= 0, by the
    Euclid-like reduction (swap the roles of a and m while the line stays under m)."""
    total = 0
    while True:
        if a >= m:
            total += (n - 1) * n // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        y_max = a * n + b
        if y_max < m:
            return total
        n, b = divmod(y_max, m)
        m, a = a, m


def plan_streamk(
    m: int,
    size_k: int,
    size_n: int,
    variant: Variant,
    *,
    regs: int,
    device: DeviceLimits,
    tuning: Tuning = DEFAULT_TUNING,
) -> GemmPlan:
    """The run of the persistent kind (``kernels/marlin_streamk.cu``): stages per block.

    The work is ``m_chunks x ceil(N / 256)`` units of ``K / 16 / U`` stages; block b
    takes stages ``[b iters, (b + 1) iters)`` of them numbered unit-major, one block per
    multiprocessor at most. Every piece of a unit cut by block boundaries is parked,
    and the last to arrive adds them one after another, so the plan minimises
    ``iters + fix * (pieces - 1)``: the longest run plus the most pieces a unit has,
    each charged ``tuning.streamk_fix`` stage times per 32 tokens (a piece's partial
    sums are T x 256 floats), plus ``tuning.streamk_misalign * iters`` for a run that
    neither divides nor is a multiple of the unit's stages (chunks of up to 64 tokens).
    Candidates: the shortest run and up to 4x it, in steps and at every such aligned
    length.

    Returns:
        A :class:`GemmPlan` with ``blocks`` the grid, ``tiles_per_split`` the k-tiles of
        one run (``iters * U``) and ``splits`` the most pieces of a unit (the count of
        partial sums added, for the error bound).
    """
    pipe = variant.pipe
    tokens = 8 * pipe.r
    m_chunks = -(-m // tokens)
    stages = size_k // MARLIN_TILE // pipe.u
    units = m_chunks * -(-(size_n // KERNEL_N_MULTIPLE) // BLOCK_WARPS)
    total = units * stages
    least = -(-total // device.sm_count)
    if tuning.streamk_iters:
        best = min(max(tuning.streamk_iters, least), total)
    else:
        fix = tuning.streamk_fix * max(1.0, tokens / 32)
        top = min(total, 4 * least)
        aligned = {d for d in range(least, min(stages, top) + 1) if stages % d == 0}
        first = -(-least // stages) * stages
        aligned |= set(range(first, min(top, first + 16 * stages) + 1, stages))
        cands = sorted({least, *range(least, top + 1, max(1, least // 16)), *aligned, stages, total})
        cands = [c for c in cands if least <= c <= total]

        def cost(it: int) -> float:
            in_step = stages % it == 0 or it % stages == 0
            off = 0.0 if in_step or tokens > 64 else tuning.streamk_misalign * it
            return it + fix * (streamk_pieces(units, stages, it) - 1) + off

        best = min(cands, key=lambda it: (cost(it), it))
    blocks = -(-total // best)
    warps = pipe.threads // 32
    return GemmPlan(
        kind=pipe.kind,
        r=pipe.r,
        u=pipe.u,
        gpi=variant.gpi,
        ns=pipe.ns,
        smem=pipe.smem(variant.gpi),
        regs=regs,
        rows=tokens,
        m_chunks=m_chunks,
        wk=1,
        splits=streamk_pieces(units, stages, best),
        tiles_per_split=best * pipe.u,
        warps=warps * blocks,
        blocks=blocks,
        resident_warps=warps * device.sm_count,
    )

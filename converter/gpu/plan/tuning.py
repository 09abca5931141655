"""The planner's knobs (:class:`Tuning`): the thresholds of the route tables and the
weights of the split-K and stream-K cost models. The defaults are what every launch
uses; a test or the benchmark passes others to try a change. Why each default is what
it is (the timings behind it) is in docs/notes/routing.md, by knob.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from .catalog import KernelKind


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The planner's knobs (measured on an H200: docs/notes/routing.md).

    Attributes:
        group_max_m, decode_max_m, wide_n: sm_80 routing: the per-group decode kernel
            takes up to 8 rows, and up to group_max_m where N >= wide_n; the per-weight
            decode kernel up to decode_max_m where N > wide_n; the tile kernel the rest.
        waves, latency_tiles, reduce_tiles, a_weight: the split-K cost model
            (:func:`~converter.gpu.plan.splitk.plan_gemm`): target waves, a block's
            pipeline fill and a split's reduction in k-tile times, and the cost of an
            A row relative to a B tile.
        force_wk, force_splits: force the block shape / split count (sweeps); None: the
            cost model chooses.
        occupancy_cap: ``((kind, blocks per SM), ...)``: resident blocks a kind's split
            is planned on at most.
        saturation: ``((kind, rows, blocks), ...)``: from ``rows`` rows a chunk, a
            multiprocessor's throughput on ``kind`` saturates at ``blocks`` resident
            blocks; the split model then charges each multiprocessor its share.
        hopper: use the Hopper kinds where the device has them (sm_90).
        hopper_*: the thresholds of :data:`~converter.gpu.plan.routing.ROUTES_SM90`
            (M bounds ``*_min_m`` / ``*_max_m``, layer sizes ``*_kn`` in weights,
            ``*_n``, chunk sizes ``*_tok`` in tokens); each row of the table names the
            knobs it reads.
        hopper_xmap_max_tok: the persistent kinds read A through a tensor map up to this
            many tokens a chunk (``hopper_activations`` re-lays it out beyond).
        bf16_knobs: ``((field, value), ...)`` that replace these knobs for bf16
            activations (:meth:`for_act`).
        streamk_fix, streamk_misalign, streamk_iters: the stream-K cost model
            (:func:`~converter.gpu.plan.streamk.plan_streamk`): a cut piece's cost in
            stage times per 32 tokens, the cost of a run misaligned with the unit's
            stages as a fraction of the run, and a forced run length (sweeps).
    """

    group_max_m: int = 16
    decode_max_m: int = 32
    wide_n: int = 8192
    waves: int = 1
    latency_tiles: float = 6
    reduce_tiles: float = 2.5
    a_weight: float = 0.5
    force_wk: int | None = None
    force_splits: int | None = None
    occupancy_cap: tuple[tuple[KernelKind, int], ...] = ()
    saturation: tuple[tuple[KernelKind, int, int], ...] = ((KernelKind.DECODE, 9, 2), (KernelKind.TILE, 9, 2))
    hopper: bool = True
    hopper_wide_n: int = 14336
    hopper_wide_min_m: int = 17
    hopper_big_kn: int = 2**27
    hopper_big_min_m: int = 17
    hopper_large_m: int = 64
    hopper_huge_m: int = 129
    hopper_small_kn: int = 4096 * 4096
    hopper_fs_min_m: int = 65
    hopper_fs_narrow_min_m: int = 33
    hopper_thin_min_m: int = 33
    hopper_thin_kn: int = 8192 * 1024
    hopper_thin_k_min_m: int = 17
    hopper_thin_k_tok64_m: tuple[int, int] = (65, 128)
    hopper_decode_small_kn: int = 4096 * 4096
    hopper_sk_min_m: int = 17
    hopper_sk_small_min_m: int = 9
    hopper_sk_small_kn: int = 8192 * 8192
    hopper_sk_mid_tok: int = 64
    hopper_sk_mid_min_m: int = 97
    hopper_sk_mid_max_m: int = 128
    hopper_skg_min_m: int = 1
    hopper_skg_max_m: int = 16
    hopper_xmap_max_tok: int = 128
    hopper_small_lo_kn: int = 8192 * 1024
    hopper_small_min_m: int = 8
    hopper_small_max_m: int = 256
    hopper_small_n4096_max_m: int = 128
    hopper_small_units: int = 16
    hopper_small_max_tok: int = 32
    hopper_small_skg_min_m: int = 17
    hopper_small_skg_max_tok: int = 16
    streamk_fix: float = 1.0
    streamk_misalign: float = 0.05
    streamk_iters: int | None = None
    bf16_knobs: tuple[tuple[str, int], ...] = (
        ("hopper_skg_max_m", 32),
        ("hopper_small_skg_min_m", 8),
        ("hopper_small_skg_max_tok", 32),
    )

    def for_act(self, act: str) -> Tuning:
        """The knobs for activations of type ``act``: ``bf16_knobs`` replace their
        fields for ``"bfloat16"`` (the bf16 per-weight path costs more ALU than fp16's, so
        the per-group kind serves more rows: docs/notes/routing.md#bf16)."""
        if act != "bfloat16" or not self.bf16_knobs:
            return self
        return dataclasses.replace(self, **dict(self.bf16_knobs), bf16_knobs=())

    def cap(self, kind: KernelKind) -> int | None:
        """The occupancy cap of ``kind``, or None."""
        return dict(self.occupancy_cap).get(kind)

    def saturates_at(self, kind: KernelKind, rows: int) -> int | None:
        """The blocks per multiprocessor at which ``kind`` saturates with chunks of
        ``rows`` rows of A, or None (see ``saturation``)."""
        return next((b for k, least, b in self.saturation if k == kind and rows >= least), None)


DEFAULT_TUNING = Tuning()


class DeviceLimits(Protocol):
    """What the planner needs of a device (:class:`converter.gpu.runtime.DeviceInfo` has it)."""

    sm_count: int
    smem_per_block_optin: int
    smem_per_sm: int

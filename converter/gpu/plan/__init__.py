"""GEMM planning: which kernel serves a call, which compiled variant, and how K is split.

Pure Python, no CuPy and no module state: everything a plan depends on is an argument
(the problem, the device's limits, the variant's register count, and the
:class:`Tuning` knobs), so the same inputs always give the same :class:`GemmPlan`, on
any machine, GPU or not. One module a job:

- :mod:`.catalog`: the kernel kinds, the variants compiled, what a variant needs.
- :mod:`.tuning`: the knobs (the measurements behind them: docs/notes/routing.md).
- :mod:`.routing`: the route tables (:data:`ROUTES_SM90`, :data:`ROUTES_SM80`), read
  first-match for one :class:`GemmProblem`.
- :mod:`.splitk`: the K split of the ring and wgmma kinds (:func:`plan_gemm`).
- :mod:`.streamk`: the run of the persistent kinds (:func:`plan_streamk`).
"""

from __future__ import annotations

from .catalog import (
    ARITH,
    BLOCK_WARPS,
    GEMM_GPIS,
    GEMM_PIPES,
    HOPPER_FS_RS,
    HOPPER_MAX_T,
    HOPPER_RS,
    HOPPER_SK8_RS,
    HOPPER_SK_RS,
    HOPPER_SKG_RS,
    KINDS,
    STREAMK_THREADS,
    SWIZZLE_ATOM,
    Arith,
    GemmPlan,
    KernelKind,
    KindSpec,
    Pipe,
    Variant,
    group_slots,
    hopper_smem,
    hopper_split,
    kernel_names,
    kernel_variant,
    layer_groups,
    ring_smem,
    streamk_smem,
)
from .routing import (
    EVERY_M_CHECKED,
    ROUTES_SM80,
    ROUTES_SM90,
    GemmProblem,
    Route,
    default_pipe,
    gemm_arith,
    gemm_path,
    persistent_every_m,
    route,
    routes,
    small_chunk,
)
from .splitk import plan_gemm, resident_blocks
from .streamk import plan_streamk, streamk_pieces
from .tuning import DEFAULT_TUNING, DeviceLimits, Tuning

__all__ = [
    "ARITH",
    "BLOCK_WARPS",
    "DEFAULT_TUNING",
    "EVERY_M_CHECKED",
    "GEMM_GPIS",
    "GEMM_PIPES",
    "HOPPER_FS_RS",
    "HOPPER_MAX_T",
    "HOPPER_RS",
    "HOPPER_SK8_RS",
    "HOPPER_SKG_RS",
    "HOPPER_SK_RS",
    "KINDS",
    "ROUTES_SM80",
    "ROUTES_SM90",
    "STREAMK_THREADS",
    "SWIZZLE_ATOM",
    "Arith",
    "DeviceLimits",
    "GemmPlan",
    "GemmProblem",
    "KernelKind",
    "KindSpec",
    "Pipe",
    "Route",
    "Tuning",
    "Variant",
    "default_pipe",
    "gemm_arith",
    "gemm_path",
    "group_slots",
    "hopper_smem",
    "hopper_split",
    "kernel_names",
    "kernel_variant",
    "layer_groups",
    "persistent_every_m",
    "plan_gemm",
    "plan_streamk",
    "resident_blocks",
    "ring_smem",
    "route",
    "routes",
    "small_chunk",
    "streamk_pieces",
    "streamk_smem",
]

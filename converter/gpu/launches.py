"""One GEMM launch worked out once per layer and ``M`` (:class:`GemmLaunch`: the plan,
the kernel, how A reaches it, the scratch it needs), and each launch as a
:class:`KernelCall`, so that the checked launchers and the torch op's packed launch
pass the kernels the same arguments."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import numpy as np

from ..constants import KERNEL_N_MULTIPLE, MARLIN_TILE
from ..errors import KernelError
from . import build, runtime, tensormap
from .checks import _NULL, _ptr_or_null
from .operands import STAGE_GROUP
from .plan import (
    DEFAULT_TUNING,
    GemmPlan,
    Pipe,
    Tuning,
    default_pipe,
    kernel_variant,
    layer_groups,
    plan_gemm,
)

#: Threads per block of every kernel but the gather (4 warps; ``kernels/*.cu`` launch geometry).
BLOCK_THREADS = 128
#: Threads per block of ``gather_columns`` and ``hopper_activations``.
GATHER_THREADS = 256
#: Bytes of At (``hopper_activations``) per 16-byte piece: 8 fp16 values of one row.
AT_PIECE = 8


def hopper_device() -> bool:
    """The current device runs the Hopper kernel (sm_90: wgmma, built for sm_90a)."""
    return runtime.device_info().compute_capability == 90


# ----------------------------------------------------------------------------- launch plans


def gemm_plan(
    m: int,
    size_k: int,
    size_n: int,
    group_size: int,
    *,
    delta: bool = False,
    pipe: tuple[str, int, int, int] | None = None,
    tuning: Tuning = DEFAULT_TUNING,
    act: str = "float16",
) -> GemmPlan:
    """Kernel variant and K split the GEMM launcher uses for one call on this device
    (:func:`converter.gpu.plan.plan_gemm`, with the variant's compiled register count).

    Args:
        m, size_k, size_n, group_size: the problem (group_size -1 / size_k: per-channel).
        delta: fused asymmetric variant.
        pipe: ``(kind, R, U, NS)`` override of :func:`~converter.gpu.plan.default_pipe`
            (benchmarking).
        tuning: the planner's knobs.
        act: the activation type (``build.ACTS``): the route table is the same for both,
            read with ``tuning.for_act(act)``; the register count (and so the occupancy
            the plan assumes) is the type's build's.

    Raises:
        KernelError: K not a multiple of 16 U (64 always works), an unknown pipe, a
            pipe whose file has no form for ``act``, or too little shared memory.
        GpuUnavailableError: no CuPy / GPU.
    """
    _, group_tiles, _ = layer_groups(size_k, size_n, group_size)
    info = runtime.device_info()
    tuning = tuning.for_act(act)
    if pipe is None:
        pipe = default_pipe(m, size_k, size_n, group_tiles, info.smem_per_block_optin, tuning, hopper=hopper_device())
    pipe = Pipe.of(pipe)
    if pipe.spec.wgmma and not hopper_device():
        raise KernelError(f"GEMM variant {pipe} needs sm_90 (wgmma); this device is {info.arch}")
    if act not in build.ACT_SOURCES[pipe.spec.source]:
        raise KernelError(f"GEMM variant {pipe} ({pipe.spec.source}) has no {act} form")
    return _plan(m, size_k, size_n, group_size, delta, pipe, tuning, info, act)


@functools.lru_cache(maxsize=4096)
def _plan(
    m: int,
    size_k: int,
    size_n: int,
    group_size: int,
    delta: bool,
    pipe: Pipe,
    tuning: Tuning,
    info: runtime.DeviceInfo,
    act: str = "float16",
) -> GemmPlan:
    variant = kernel_variant(size_k, size_n, group_size, pipe, smem_limit=info.smem_per_block_optin, arch=info.arch)
    regs = int(build.function(pipe.spec.source, variant.name(delta), act).num_regs)
    return plan_gemm(m, size_k, size_n, variant, regs=regs, device=info, tuning=tuning)


# ----------------------------------------------------------------------------- launches


@dataclasses.dataclass(frozen=True)
class GemmLaunch:
    """Everything about one GEMM launch that the problem's sizes fix: the same for every
    call of a layer at one M, so a serving loop works it out once (:func:`gemm_launch`).

    Attributes:
        plan: the planner's :class:`~converter.gpu.plan.GemmPlan`.
        fn: the kernel (CuPy ``RawKernel``), its shared-memory opt-in already raised.
        lead: how A reaches the kernel: ``"xmap"`` (read in place through a tensor map),
            ``"at"`` (re-laid out by ``hopper_activations`` into the ``at`` buffer,
            swizzled), ``"wgmma"`` (likewise, unswizzled) or ``"a"`` (A itself).
        gather: A must be gathered by ``perm`` (``gather_columns``) first: the ``"xmap"``
            and ``"a"`` leads (``hopper_activations`` gathers as it re-lays out).
        units: the kernel streams ``B`` unit-major (``b_units``), not Marlin's ``B``.
        ws_floats, n_locks, at_halves: sizes of the fp32 partial sums, the zeroed lock
            counters and the fp16 activation buffer the launch needs.
        m_pad: A's rows padded to whole chunks (``at`` leads).
        m, size_k: A's shape (the tensor map encodes it).
        scalars: the kernel's int32 arguments, ``M`` first.
    """

    plan: GemmPlan
    fn: Any
    lead: str
    gather: bool
    units: bool
    ws_floats: int
    n_locks: int
    at_halves: int
    m_pad: int
    m: int
    size_k: int
    scalars: tuple[Any, ...]


def gemm_launch(
    m: int,
    size_k: int,
    size_n: int,
    group_size: int,
    *,
    delta: bool,
    act_order: bool,
    units_mode: int,
    n_out: int,
    has_b: bool = True,
    pipe: tuple[str, int, int, int] | None = None,
    tuning: Tuning = DEFAULT_TUNING,
    act: str = "float16",
) -> GemmLaunch:
    """The :class:`GemmLaunch` of one call on the current device (cached per device and
    arguments). ``units_mode``: 0 no ``b_units``, 1 unit-major, 2 with the scales and
    deltas inline; ``has_b``: Marlin's ``B`` is there too; ``act``: the activation type.

    Raises:
        KernelError: as :func:`marlin_gemm` for the sizes, the pipe, the inline copy, or
            no ``B`` where the kernel that serves ``m`` reads it.
    """
    info = runtime.device_info()
    return _gemm_launch(
        info, m, size_k, size_n, group_size, delta, act_order, units_mode, n_out, has_b, pipe, tuning, act
    )


@functools.lru_cache(maxsize=8192)
def _gemm_launch(
    info: runtime.DeviceInfo,
    m: int,
    size_k: int,
    size_n: int,
    group_size: int,
    delta: bool,
    act_order: bool,
    units_mode: int,
    n_out: int,
    has_b: bool,
    pipe: tuple[str, int, int, int] | None,
    tuning: Tuning,
    act: str = "float16",
) -> GemmLaunch:
    _, gt, per_channel = layer_groups(size_k, size_n, group_size)
    plan = gemm_plan(m, size_k, size_n, group_size, delta=delta, pipe=pipe, tuning=tuning, act=act)
    units = units_mode > 0 and plan.pipe.spec.persistent
    if not has_b and not units:
        raise KernelError(f"the {plan.kind} kernel that serves M={m} reads B in Marlin's order: pass B", tensor="B")
    fn = build.function(plan.pipe.spec.source, plan.pipe.name(plan.gpi, delta), act)
    if fn.max_dynamic_shared_size_bytes < plan.smem:
        # Opt in above the default (48 KB less the kernel's static shared memory).
        fn.max_dynamic_shared_size_bytes = plan.smem
    if units_mode == 2 and units and (per_channel or gt * MARLIN_TILE != STAGE_GROUP or plan.gpi != 1):
        # the kernel's inline runs are one group of 128 per 8 k-tiles; anything else would read it wrongly
        raise KernelError(
            f"b_units with the scales inline needs groups of {STAGE_GROUP} (K={size_k} is one group, or the "
            f"{plan.kind} variant holds {plan.gpi} group slots a stage)",
            tensor="b_units",
        )
    m_pad = plan.m_chunks * plan.rows
    # Every GEMM kernel: (activation operands..., B, S, D, bias, C, ws, locks, M, scalars...).
    if plan.pipe.spec.persistent:
        # Stream-K over the multiprocessors: two slots of T x 256 partial sums per block
        # (the piece that starts its run, the one that ends it), one counter per block
        # (the cut unit starting there). A read in place through a swizzled tensor map,
        # or re-laid out first (Tuning.hopper_xmap_max_tok; without cuda-bindings).
        ws_floats = 2 * plan.blocks * plan.rows * 256 if plan.splits > 1 else 0
        xmap = plan.rows <= tuning.hopper_xmap_max_tok and tensormap.available()
        lead, n_locks, at_halves = ("xmap", plan.blocks, 0) if xmap else ("at", plan.blocks, m_pad * size_k)
        scalars = (size_k, size_n, n_out, gt, int(per_channel), plan.tiles_per_split // plan.u, units_mode * units)
    elif plan.pipe.spec.wgmma:
        # The unit is 256 columns x one m-chunk; partials are kept in register order.
        n_locks = plan.m_chunks * -(-(size_n // KERNEL_N_MULTIPLE) // 4)
        ws_floats = plan.splits * n_locks * plan.rows * 256 if plan.splits > 1 else 0
        lead, at_halves = "wgmma", m_pad * size_k
        scalars = (m_pad, size_k, size_n, n_out, gt, int(per_channel), plan.splits, plan.tiles_per_split)
    else:
        lead, at_halves = "a", 0
        ws_floats = plan.splits * m * size_n if plan.splits > 1 else 0
        n_locks = plan.m_chunks * (size_n // KERNEL_N_MULTIPLE)
        scalars = (size_k, size_n, n_out, gt, int(per_channel), plan.splits, plan.tiles_per_split, plan.wk)
    return GemmLaunch(
        plan=plan,
        fn=fn,
        lead=lead,
        gather=act_order and lead in ("xmap", "a"),
        units=units,
        ws_floats=ws_floats,
        n_locks=n_locks,
        at_halves=at_halves,
        m_pad=m_pad,
        m=m,
        size_k=size_k,
        scalars=(np.int32(m), *(np.int32(v) for v in scalars)),
    )


def emit_gemm(
    run: GemmLaunch,
    A: Any,
    a_ptr: int,
    perm: Any,
    b: Any,
    scales: Any,
    delta: Any,
    bias: Any,
    out: Any,
    ws: Any,
    locks: Any,
    at: Any,
    stream: Any = None,
) -> None:
    """Launch ``run`` (no checks: :func:`marlin_gemm` and the torch op check first).

    Every array argument is a CuPy array or a device address (``np.uint64``; None for
    an absent operand). ``A`` is already gathered where ``run.gather``; ``a_ptr`` is its
    address (the tensor map encodes it). ``stream``: anything with a ``ptr`` (CuPy's
    current stream when None).
    """
    xmap = None
    if run.lead == "xmap":
        xmap = tensormap.activation_map_at(a_ptr, run.m, run.size_k, run.plan.rows, run.plan.u).arg
    first = gemm_prologue_call(run, A, perm, at)
    if first is not None:
        first.launch(stream)
    gemm_call(run, A, xmap, b, scales, delta, bias, out, ws, locks, at).launch(stream)


class KernelCall(NamedTuple):
    """One kernel launch as CuPy's ``RawKernel`` call takes it: the kernel, grid and
    block shapes, the argument tuple and the dynamic shared memory. Built by the
    ``*_call`` helpers, which :func:`emit_gemm` launches and the torch op's packed
    launcher (:mod:`converter.gpu.torch_op`) lays out once, so both pass the same
    arguments."""

    fn: Any
    grid: tuple[int, ...]
    block: tuple[int, ...]
    args: tuple[Any, ...]
    shared_mem: int = 0

    def launch(self, stream: Any = None) -> None:
        """Launch through CuPy on ``stream`` (CuPy's current stream when None)."""
        self.fn(self.grid, self.block, self.args, shared_mem=self.shared_mem, stream=stream)


def gemm_prologue_call(run: GemmLaunch, A: Any, perm: Any, at: Any) -> KernelCall | None:
    """The launch that must precede ``run``'s GEMM: ``hopper_activations`` (A gathered by
    ``perm`` into ``at``) for the ``"at"`` and ``"wgmma"`` leads, else None."""
    if run.lead not in ("at", "wgmma"):
        return None
    tok = run.plan.rows if run.lead == "at" else run.m_pad
    return activations_call(A, perm, at, run.m, run.size_k, run.m_pad, tok, swizzle=run.lead == "at")


def gemm_call(
    run: GemmLaunch,
    A: Any,
    xmap: Any,
    b: Any,
    scales: Any,
    delta: Any,
    bias: Any,
    out: Any,
    ws: Any,
    locks: Any,
    at: Any,
) -> KernelCall:
    """``run``'s GEMM launch (arguments as :func:`emit_gemm`'s; ``xmap``: A's tensor-map
    argument, read for the ``"xmap"`` lead only)."""
    if run.lead == "xmap":
        lead = (xmap, _NULL)
    elif run.lead == "a":
        lead = (A,)
    else:
        lead = (at,) if run.lead == "wgmma" else (tensormap.unused().arg, at)
    args = (*lead, b, scales, _ptr_or_null(delta), _ptr_or_null(bias), out, ws, locks, *run.scalars)
    return KernelCall(run.fn, (run.plan.blocks,), (run.plan.threads,), args, run.plan.smem)


def _activations(
    A: Any, perm: Any, at: Any, m: int, size_k: int, m_pad: int, tok: int, *, swizzle: bool = False, stream: Any = None
) -> None:
    """``hopper_activations``: A (gathered by ``perm``) into ``at`` in blocks of ``tok``
    token rows, swizzled as the persistent kernel's slots with ``swizzle``
    (``kernels/marlin_wgmma.cu``; twin ``reference.hopper_activations``)."""
    activations_call(A, perm, at, m, size_k, m_pad, tok, swizzle=swizzle).launch(stream)


def activations_call(
    A: Any, perm: Any, at: Any, m: int, size_k: int, m_pad: int, tok: int, *, swizzle: bool = False
) -> KernelCall:
    """:func:`_activations`'s launch, as a :class:`KernelCall`."""
    pieces = size_k // AT_PIECE * m_pad
    return KernelCall(
        build.function("marlin_wgmma.cu", "hopper_activations"),
        (-(-pieces // GATHER_THREADS),),
        (GATHER_THREADS,),
        (A, _ptr_or_null(perm), at, np.int32(m), np.int32(size_k), np.int32(m_pad), np.int32(tok), np.int32(swizzle)),
    )


def emit_gather(A: Any, perm: Any, out: Any, m: int, k: int, stream: Any = None) -> None:
    """Launch ``gather_columns`` with no checks (arrays or ``np.uint64`` addresses, as
    :func:`emit_gemm`)."""
    if m * k:
        gather_call(A, perm, out, m, k).launch(stream)


def gather_call(A: Any, perm: Any, out: Any, m: int, k: int) -> KernelCall:
    """:func:`emit_gather`'s launch (``m * k`` > 0), as a :class:`KernelCall`."""
    fn = build.function("marlin_gemm.cu", "gather_columns")
    return KernelCall(fn, (-(-m * k // GATHER_THREADS),), (GATHER_THREADS,), (A, perm, out, np.int32(m), np.int32(k)))

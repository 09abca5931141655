"""Checked launchers of our CUDA kernels (``kernels/*.cu``).

Every launcher checks dtype, shape, contiguity and alignment of its arguments before
it launches anything, and raises :class:`KernelError` naming the argument. Launchers
take CuPy arrays (NumPy arrays are copied to the device; dtypes are never converted
silently) and run on CuPy's current stream. Their NumPy twins, with the same
signatures, are in :mod:`converter.gpu.reference`.

Which GEMM variant runs and how K is split is :mod:`converter.gpu.plan` (pure; its
knobs are a :class:`~converter.gpu.plan.Tuning` passed explicitly); the modules are
built by :mod:`converter.gpu.build`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import numpy as np

from ..constants import KERNEL_N_MULTIPLE, MARLIN_TILE
from ..errors import GpuUnavailableError, KernelError
from ..marlin.layout import permute_scales
from ..marlin.shapes import kernel_layer_sizes, resolve_group_size
from . import build, runtime, tensormap
from .plan import (
    DEFAULT_TUNING,
    GemmPlan,
    Pipe,
    Tuning,
    default_pipe,
    kernel_variant,
    layer_groups,
    persistent_every_m,
    plan_gemm,
)

#: Threads per block of every kernel but the gather (4 warps; ``kernels/*.cu`` launch geometry).
BLOCK_THREADS = 128
#: Threads per block of ``gather_columns`` and ``hopper_activations``.
GATHER_THREADS = 256
#: Bytes of At (``hopper_activations``) per 16-byte piece: 8 fp16 values of one row.
AT_PIECE = 8


# ----------------------------------------------------------------------------- checks


def _dev(x: Any, name: str, dtype: Any, shape: tuple[int, ...] | None) -> Any:
    """Check one argument (before any launch) and return it as a CuPy array."""
    cp = runtime.cupy_module()
    if x is None:
        raise KernelError(f"{name} is required", tensor=name)
    if isinstance(x, np.ndarray):
        if x.dtype != np.dtype(dtype):
            raise KernelError(f"{name} must be {np.dtype(dtype)}, got {x.dtype}", tensor=name)
        x = cp.asarray(np.ascontiguousarray(x))
    elif not isinstance(x, cp.ndarray):
        if hasattr(x, "__dlpack__"):
            x = cp.from_dlpack(x)
        else:
            raise KernelError(f"{name} must be a CuPy/NumPy/DLPack array, got {type(x).__name__}", tensor=name)
    if x.dtype != np.dtype(dtype):
        raise KernelError(f"{name} must be {np.dtype(dtype)}, got {x.dtype}", tensor=name)
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise KernelError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}", tensor=name)
    if not x.flags.c_contiguous:
        raise KernelError(f"{name} must be C-contiguous", tensor=name)
    if x.data.ptr % 16 and x.size:
        raise KernelError(f"{name} must be 16-byte aligned (got address {x.data.ptr:#x})", tensor=name)
    if x.data.device_id != runtime.device_info().index:
        raise KernelError(f"{name} is on device {x.data.device_id}, not the current device", tensor=name)
    return x


def _layer_sizes(size_k: int, size_n: int, group_size: int) -> tuple[int, int, bool]:
    """(group_size, num_groups, per_channel) after checking the kernels' limits."""
    return kernel_layer_sizes(size_k, size_n, group_size, error=KernelError)


_NULL = np.uint64(0)


def _ptr_or_null(x: Any) -> Any:
    return _NULL if x is None else x


# ----------------------------------------------------------------------------- workspace


_workspaces: dict[tuple[int, int], dict[str, Any]] = {}


def _workspace(ws_floats: int, n_locks: int, at_halves: int = 0) -> tuple[Any, Any, Any]:
    """Per (device, stream) fp32 partials, zeroed lock counters and the Hopper kernel's
    activation buffer (fp16), grown on demand.

    The GEMM's last warp per output tile resets its counter, so the counters are zero
    again after every completed launch; launches on one stream never overlap.
    """
    cp = runtime.cupy_module()
    key = (runtime.device_info().index, cp.cuda.get_current_stream().ptr)
    ws = _workspaces.setdefault(key, {})
    if ws.get("ws") is None or ws["ws"].size < ws_floats:
        ws["ws"] = cp.empty(max(ws_floats, 1), dtype=cp.float32)
    if ws.get("locks") is None or ws["locks"].size < n_locks:
        ws["locks"] = cp.zeros(max(n_locks, 1), dtype=cp.int32)
    if ws.get("at") is None or ws["at"].size < at_halves:
        ws["at"] = cp.empty(max(at_halves, 1), dtype=cp.float16)
    return ws["ws"], ws["locks"], ws["at"]


def hopper_device() -> bool:
    """The current device runs the Hopper kernel (sm_90: wgmma, built for sm_90a)."""
    return runtime.device_info().compute_capability == 90


#: The group size of :func:`prepare_b_stages`'s copy: one group per 8-tile stage.
STAGE_GROUP = 128
#: int32 per (unit, group) run of that copy: 8 k-tile pieces of 512, a scale and a delta row of 128.
STAGE_RUN_INT32 = 8 * 512 + 2 * 128


def keeps_b_stages(size_k: int, size_n: int, group_size: int, delta: bool, tuning: Tuning = DEFAULT_TUNING) -> bool:
    """Whether a layer keeps ``B`` with its scales and deltas inline (:func:`prepare_b_stages`)
    instead of unit-major: a layer that :func:`keeps_b_units`, with groups of 128 and a
    delta (the symmetric layer would stream zero rows).

    Args: as :func:`keeps_b_units`; ``delta``: the layer has a nonzero delta.
    """
    return delta and group_size == STAGE_GROUP and keeps_b_units(size_k, size_n, group_size, tuning)


def keeps_b_units(size_k: int, size_n: int, group_size: int, tuning: Tuning = DEFAULT_TUNING) -> bool:
    """Whether a layer keeps ``B`` unit-major only (:func:`prepare_b_units`): on sm_90,
    where a persistent kind serves every M (:func:`~converter.gpu.plan.persistent_every_m`).
    ``MarlinLinear`` stores the layer so (or, where :func:`keeps_b_stages` holds, with the
    scales and deltas inline), ``verify_layer_gpu`` proves that copy, and the benchmark
    times it.

    Args:
        size_k, size_n: K and N as the kernels see them (``padded_n``).
        group_size: a multiple of 16 dividing K, or -1 / ``size_k`` for per-channel.
        tuning: the planner's knobs.

    Raises:
        KernelError: sizes the kernels do not take. GpuUnavailableError: no GPU.
    """
    _, group_tiles, _ = layer_groups(size_k, size_n, group_size)
    return hopper_device() and persistent_every_m(size_k, size_n, group_tiles, tuning)


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
) -> GemmPlan:
    """Kernel variant and K split the GEMM launcher uses for one call on this device
    (:func:`converter.gpu.plan.plan_gemm`, with the variant's compiled register count).

    Args:
        m, size_k, size_n, group_size: the problem (group_size -1 / size_k: per-channel).
        delta: fused asymmetric variant.
        pipe: ``(kind, R, U, NS)`` override of :func:`~converter.gpu.plan.default_pipe`
            (benchmarking).
        tuning: the planner's knobs.

    Raises:
        KernelError: K not a multiple of 16 U (64 always works), an unknown pipe, or
            too little shared memory.
        GpuUnavailableError: no CuPy / GPU.
    """
    _, group_tiles, _ = layer_groups(size_k, size_n, group_size)
    info = runtime.device_info()
    if pipe is None:
        pipe = default_pipe(m, size_k, size_n, group_tiles, info.smem_per_block_optin, tuning, hopper=hopper_device())
    pipe = Pipe.of(pipe)
    if pipe.spec.wgmma and not hopper_device():
        raise KernelError(f"GEMM variant {pipe} needs sm_90 (wgmma); this device is {info.arch}")
    return _plan(m, size_k, size_n, group_size, delta, pipe, tuning, info)


@functools.lru_cache(maxsize=4096)
def _plan(
    m: int, size_k: int, size_n: int, group_size: int, delta: bool, pipe: Pipe, tuning: Tuning, info: runtime.DeviceInfo
) -> GemmPlan:
    variant = kernel_variant(size_k, size_n, group_size, pipe, smem_limit=info.smem_per_block_optin, arch=info.arch)
    regs = int(build.function(pipe.spec.source, variant.name(delta)).num_regs)
    return plan_gemm(m, size_k, size_n, variant, regs=regs, device=info, tuning=tuning)


# ----------------------------------------------------------------------------- launchers


def gather_columns(A: Any, perm: Any, *, out: Any = None) -> Any:
    """``A[:, perm]`` on the GPU (act-order gather). Twin: ``reference.gather_columns``.

    Args:
        A: float16 ``(M, K)``, source channel order.
        perm: int32 ``(K,)``, Marlin row k = source channel ``perm[k]``.
        out: optional float16 ``(M, K)`` destination.

    Returns:
        float16 ``(M, K)`` CuPy array in Marlin order.

    Raises:
        KernelError: bad dtype/shape/contiguity. GpuUnavailableError: no GPU.
    """
    cp = runtime.cupy_module()
    if A is None or getattr(A, "ndim", 0) != 2:
        raise KernelError("A must be 2-D (M, K)", tensor="A")
    m, k = A.shape
    A = _dev(A, "A", np.float16, (m, k))
    perm = _dev(perm, "perm", np.int32, (k,))
    out = cp.empty((m, k), dtype=cp.float16) if out is None else _dev(out, "out", np.float16, (m, k))
    emit_gather(A, perm, out, m, k)
    return out


def emit_gather(A: Any, perm: Any, out: Any, m: int, k: int, stream: Any = None) -> None:
    """Launch ``gather_columns`` with no checks (arrays or ``np.uint64`` addresses, as
    :func:`emit_gemm`)."""
    if m * k:
        gather_call(A, perm, out, m, k).launch(stream)


def gather_call(A: Any, perm: Any, out: Any, m: int, k: int) -> KernelCall:
    """:func:`emit_gather`'s launch (``m * k`` > 0), as a :class:`KernelCall`."""
    fn = build.function("marlin_gemm.cu", "gather_columns")
    return KernelCall(fn, (-(-m * k // GATHER_THREADS),), (GATHER_THREADS,), (A, perm, out, np.int32(m), np.int32(k)))


def prepare_b_units(B: Any, size_k: int, size_n: int) -> Any:
    """``B`` re-laid out unit-major for the persistent Hopper kinds (``b_units`` of
    :func:`marlin_gemm`): each unit's (256 features') 2 KB k-tile pieces one after
    another, so that a block's run of the weight stream is one contiguous stretch
    (twin: :func:`converter.gpu.reference.b_units`). The artifact's ``marlin_B`` is not
    changed; this is a load-time operand, as :func:`prepare_delta` is.

    Args:
        B: int32 ``(size_k // 16, 2 * size_n)``, Marlin tile order (artifact ``marlin_B``).
        size_k, size_n: K and N (N a multiple of 64).

    Returns:
        int32 ``(ceil(N / 256), size_k // 16, 512)`` CuPy array (the last unit padded
        with zero codes when N / 64 is not a multiple of 4).

    Raises:
        KernelError: ``B`` is not that shape or dtype. GpuUnavailableError: no GPU.
    """
    cp = runtime.cupy_module()
    if size_n % KERNEL_N_MULTIPLE or size_k % MARLIN_TILE:
        raise KernelError(f"K={size_k}, N={size_n}: K must be a multiple of 16 and N of 64", tensor="B")
    B = _dev(B, "B", np.int32, (size_k // MARLIN_TILE, 2 * size_n))
    kt, units = size_k // MARLIN_TILE, -(-size_n // 256)
    rows = cp.zeros((kt, units * 512), dtype=cp.int32)
    rows[:, : 2 * size_n] = B
    return cp.ascontiguousarray(rows.reshape(kt, units, 512).transpose(1, 0, 2))


def prepare_b_stages(B: Any, scales: Any, delta: Any, size_k: int, size_n: int) -> Any:
    """``B`` with each stage's scales and deltas inline, for the persistent Hopper kinds
    on group-128 layers (``b_units`` of :func:`marlin_gemm`): per unit (256 features) and
    group, the group's 8 k-tile pieces of 2 KB, then its 512-byte scale row and its
    512-byte delta row of the unit's features, as the kernels read them (Marlin's scale
    order, zero past N). An 8-tile stage is then one bulk copy of all three
    (``kernels/marlin_streamk.cu``); twin: :func:`converter.gpu.reference.b_stages`. A
    load-time operand, as :func:`prepare_delta` is; the artifact is not changed.

    Args:
        B: int32 ``(size_k // 16, 2 * size_n)``, Marlin tile order (artifact ``marlin_B``).
        scales: float16 ``(size_k // 128, size_n)``, permuted (artifact ``marlin_s``).
        delta: float16 ``(size_k // 128, size_n)`` from :func:`prepare_delta`, or None
            (zero rows: a symmetric layer is better served by :func:`prepare_b_units`,
            which does not stream them).
        size_k, size_n: K (a multiple of 128) and N (a multiple of 64).

    Returns:
        int32 ``(ceil(N / 256), size_k // 128, STAGE_RUN_INT32)`` CuPy array.

    Raises:
        KernelError: a shape, dtype or size above is not met. GpuUnavailableError: no GPU.
    """
    cp = runtime.cupy_module()
    if size_n % KERNEL_N_MULTIPLE or size_k % STAGE_GROUP:
        raise KernelError(f"K={size_k}, N={size_n}: K must be a multiple of {STAGE_GROUP} and N of 64", tensor="B")
    g = size_k // STAGE_GROUP
    units = prepare_b_units(B, size_k, size_n)
    n_units = units.shape[0]

    def rows(x: Any, name: str) -> Any:
        full = cp.zeros((g, n_units * 256), dtype=cp.float16)
        if x is not None:
            full[:, :size_n] = _dev(x, name, np.float16, (g, size_n))
        return full.view(cp.int32).reshape(g, n_units, 128).transpose(1, 0, 2)

    parts = (units.reshape(n_units, g, 8 * 512), rows(scales, "scales"), rows(delta, "delta"))
    return cp.ascontiguousarray(cp.concatenate(parts, axis=2))


def prepare_delta(delta: Any) -> Any:
    """The artifact's ``marlin_delta`` as the fused GEMM's delta operand.

    Both GEMM kernels multiply by ``fp16(delta)``, and they read it at the offsets where
    they read the scales, so the operand is ``fp16(delta)`` in Marlin's scale order
    (checkpoint-formats.md 4.4; the per-channel list when ``G == 1``). Convert once at
    load time (``MarlinLinear`` does); :func:`marlin_gemm` converts an fp32 ``delta``
    on every call.

    Args:
        delta: float32 ``(G, N)``, natural column order (artifact ``marlin_delta``),
            N % 64 == 0.

    Returns:
        float16 ``(G, N)`` CuPy array, round-to-nearest-even (overflow gives inf, as the
        kernels' own conversion did).

    Raises:
        KernelError: not a 2-D float32 array with N % 64 == 0.
        GpuUnavailableError: no CuPy / GPU.
    """
    cp = runtime.cupy_module()
    if getattr(delta, "ndim", 0) != 2:
        raise KernelError(f"delta must be 2-D (G, N), got {getattr(delta, 'shape', None)}", tensor="delta")
    g, n = (int(v) for v in delta.shape)
    if n % KERNEL_N_MULTIPLE:
        raise KernelError(f"delta: N={n} must be a multiple of {KERNEL_N_MULTIPLE}", tensor="delta")
    d = _dev(delta, "delta", np.float32, (g, n))
    order = cp.asarray(_scale_order(n, g == 1))
    return cp.ascontiguousarray(d.astype(cp.float16)[:, order])


@functools.lru_cache(maxsize=64)
def _scale_order(size_n: int, single: bool) -> np.ndarray:
    """Source column of each position of a permuted scale row (layout.permute_scales)."""
    return permute_scales(np.arange(size_n, dtype=np.int64)[None, :], single=single)[0]


def marlin_gemm(
    A: Any,
    B: Any,
    scales: Any,
    *,
    size_k: int,
    size_n: int,
    group_size: int,
    delta: Any = None,
    perm: Any = None,
    bias: Any = None,
    out: Any = None,
    n_out: int | None = None,
    pipe: tuple[str, int, int, int] | None = None,
    tuning: Tuning = DEFAULT_TUNING,
    b_units: Any = None,
) -> Any:
    """INT4 x FP16 GEMM on Marlin tensors; fused asymmetric correction when ``delta`` given.

    Computes ``C = A[:, perm] @ W (+ bias)`` for ``W = (q - 8) * s (+ d)``,
    ``d = fp16(delta)``, fp32 accumulation, one fp16 rounding. The kernels share the
    work (:func:`converter.gpu.plan.gemm_path` picks by M, N and the device): for small
    M the decode kernel (``kernels/marlin_decode.cu``) sums ``A (q - 8)`` and A per
    group in fp32 and applies ``s`` and ``d`` once per group; on sm_90 the persistent
    Hopper kernel (``kernels/marlin_streamk.cu``) serves 1-16 rows in its per-group form
    (``hopper_skg``, the decode kernel's arithmetic) on every layer of N >= 4096 above
    4096 x 4096 weights whose groups allow, and M >= 17 in its per-weight form
    (``hopper_sk``) on every layer of N >= 4096 and at least 4096 x 4096 weights (M >= 9
    above 4096 x 4096 and up to 8192 x 8192 weights); on small layers (1024 <= N <=
    4096, 2^23 to 4096 x 4096 weights) from 8 rows in chunks of 8-32 tokens that make 16
    units (``plan.small_chunk``), ``hopper_skg`` from 17 rows in chunks of up to 16
    tokens where the groups allow, else ``hopper_sk``; reading A in place through a
    128-byte-swizzled tensor map (``converter.gpu.tensormap``; without cuda-bindings A
    re-laid out the same way by ``hopper_activations`` first); the other Hopper
    kinds (``kernels/marlin_wgmma.cu``) the larger M of smaller and thin layers; the
    decode kernel's "decode_w" variant and the tile kernel (``kernels/marlin_gemm.cu``)
    serve the rest, and everything on sm_80..89. Every kernel but the decode kernel and
    ``hopper_skg`` multiplies by the fp16 weight ``fp16((q - 8) * s (+ d))``. No kernel's blocks wait
    for each other (split and stream-K sums are added by the last block to arrive), so
    calls may run concurrently on several streams; each (device, stream) has its own
    workspace. Twin: ``reference.marlin_gemm`` with the plan's ``arith``.

    Args:
        A: float16 ``(M, size_k)``, M >= 1, SOURCE channel order.
        B: int32 ``(size_k // 16, 2 * size_n)``, Marlin tile order (artifact ``marlin_B``);
            may be None when ``b_units`` is given and the call's kernel is persistent.
        scales: float16 ``(G, size_n)``, Marlin-permuted (artifact ``marlin_scales``).
        size_k, size_n: K (multiple of 64) and N (multiple of 64).
        group_size: any multiple of 16 dividing K (32, 64, 128, ...), or -1 / size_k
            for per-channel.
        delta: float32 ``(G, size_n)`` natural order (artifact ``marlin_delta``,
            converted on every call), float16 ``(G, size_n)`` from
            :func:`prepare_delta`, or None.
        perm: int32 ``(size_k,)`` act-order permutation (artifact ``marlin_perm``) or None.
        bias: float16 ``(n_out,)`` or None.
        out: optional float16 ``(M, n_out)`` destination.
        n_out: columns of the result, at most ``size_n`` (default ``size_n``): a layer
            whose N was padded to a multiple of 64 (artifact ``padded_n``) computes
            ``size_n`` columns and stores its first ``n_out``, with no extra copy.
        pipe: ``(kind, R, U, NS)`` variant override (benchmarking); default
            :func:`~converter.gpu.plan.default_pipe`.
        tuning: the planner's knobs (:class:`~converter.gpu.plan.Tuning`).
        b_units: ``B`` unit-major from :func:`prepare_b_units` (int32 ``(ceil(size_n /
            256), size_k // 16, 512)``) or, with ``group_size`` 128, with the scales and
            deltas inline from :func:`prepare_b_stages` (int32 ``(ceil(size_n / 256),
            size_k // 128, STAGE_RUN_INT32)``: the kernel reads the scales and deltas from
            that copy, not from ``scales`` and ``delta``, so it must be built from the same
            ones, with the delta when the call passes one);
            or None. The persistent kinds then stream it (the same bits); the other kinds
            need ``B`` itself, which may be None when every call of the layer goes to a
            persistent kind.

    Returns:
        float16 ``(M, n_out)`` CuPy array. Bitwise deterministic for fixed inputs
        and a fixed device (the K split depends on the multiprocessor count).

    Raises:
        KernelError: wrong dtype/shape/contiguity/alignment, unsupported sizes, NVRTC
            failure, or ``B`` None where the call's kernel reads it in Marlin's order.
            GpuUnavailableError: no CuPy / GPU / sm_80+ (without cuda-bindings
            the persistent kernel re-lays A out instead: converter.gpu.tensormap.available).
    """
    cp = runtime.cupy_module()
    _, g, _ = _layer_sizes(size_k, size_n, group_size)
    if A is None or getattr(A, "ndim", 0) != 2 or A.shape[1] != size_k or A.shape[0] < 1:
        raise KernelError(f"A must be (M >= 1, {size_k}), got {getattr(A, 'shape', None)}", tensor="A")
    m = int(A.shape[0])
    A = _dev(A, "A", np.float16, (m, size_k))
    units_mode = 0  # the kernels' b_units: 1 unit-major, 2 with the scales and deltas inline
    if b_units is not None:
        n_units = -(-size_n // 256)
        stages = getattr(b_units, "shape", (0, 0, 0))[-1:] == (STAGE_RUN_INT32,)
        if stages and group_size != STAGE_GROUP:
            raise KernelError(
                f"b_units with the scales inline is for group_size {STAGE_GROUP}, not {group_size}", tensor="b_units"
            )
        want = (n_units, size_k // STAGE_GROUP, STAGE_RUN_INT32) if stages else (n_units, size_k // MARLIN_TILE, 512)
        b_units = _dev(b_units, "b_units", np.int32, want)
        units_mode = 2 if stages else 1
    if B is not None or b_units is None:
        B = _dev(B, "B", np.int32, (size_k // MARLIN_TILE, 2 * size_n))
    scales = _dev(scales, "scales", np.float16, (g, size_n))
    if delta is not None:
        if getattr(delta, "dtype", None) == np.float16:
            delta = _dev(delta, "delta", np.float16, (g, size_n))
        else:
            delta = prepare_delta(_dev(delta, "delta", np.float32, (g, size_n)))
    n_out = _n_out(n_out, size_n)
    if bias is not None:
        bias = _dev(bias, "bias", np.float16, (n_out,))
    if perm is not None:
        perm = _dev(perm, "perm", np.int32, (size_k,))
    out = cp.empty((m, n_out), dtype=cp.float16) if out is None else _dev(out, "out", np.float16, (m, n_out))
    run = gemm_launch(
        m,
        size_k,
        size_n,
        group_size,
        delta=delta is not None,
        act_order=perm is not None,
        units_mode=units_mode,
        n_out=n_out,
        has_b=B is not None,
        pipe=pipe,
        tuning=tuning,
    )
    ws, locks, at = _workspace(run.ws_floats, run.n_locks, run.at_halves)
    a_ptr = int(A.data.ptr)
    if run.gather:
        A = gather_columns(A, perm)
        a_ptr = int(A.data.ptr)
    emit_gemm(run, A, a_ptr, perm, b_units if run.units else B, scales, delta, bias, out, ws, locks, at)
    return out


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
) -> GemmLaunch:
    """The :class:`GemmLaunch` of one call on the current device (cached per device and
    arguments). ``units_mode``: 0 no ``b_units``, 1 unit-major, 2 with the scales and
    deltas inline; ``has_b``: Marlin's ``B`` is there too.

    Raises:
        KernelError: as :func:`marlin_gemm` for the sizes, the pipe, the inline copy, or
            no ``B`` where the kernel that serves ``m`` reads it.
    """
    info = runtime.device_info()
    return _gemm_launch(info, m, size_k, size_n, group_size, delta, act_order, units_mode, n_out, has_b, pipe, tuning)


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
) -> GemmLaunch:
    _, gt, per_channel = layer_groups(size_k, size_n, group_size)
    plan = gemm_plan(m, size_k, size_n, group_size, delta=delta, pipe=pipe, tuning=tuning)
    units = units_mode > 0 and plan.pipe.spec.persistent
    if not has_b and not units:
        raise KernelError(f"the {plan.kind} kernel that serves M={m} reads B in Marlin's order: pass B", tensor="B")
    fn = build.function(plan.pipe.spec.source, plan.pipe.name(plan.gpi, delta))
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


def _n_out(n_out: int | None, size_n: int) -> int:
    """The result's columns: ``size_n``, or fewer for a padded layer."""
    if n_out is None:
        return size_n
    if not 0 < int(n_out) <= size_n:
        raise KernelError(f"n_out={n_out} must be in 1..size_n={size_n}", tensor="n_out")
    return int(n_out)


def dequant(
    B: Any,
    scales: Any,
    *,
    size_k: int,
    size_n: int,
    group_size: int,
    delta: Any = None,
    out: Any = None,
) -> Any:
    """Marlin tensors to the fp16 weight ``(size_k, size_n)`` (``kernels/dequant.cu``).

    Args:
        B, scales, size_k, size_n, group_size, delta: as :func:`marlin_gemm`.
        out: optional float16 ``(size_k, size_n)`` destination.

    Returns:
        float16 ``(size_k, size_n)`` CuPy array, rows in Marlin order, bit-identical to
        ``reference.dequant`` and to the weight the GEMM multiplies by.

    Raises:
        KernelError, GpuUnavailableError: as :func:`marlin_gemm`.
    """
    cp = runtime.cupy_module()
    gs, g, per_channel = _layer_sizes(size_k, size_n, group_size)
    B = _dev(B, "B", np.int32, (size_k // MARLIN_TILE, 2 * size_n))
    scales = _dev(scales, "scales", np.float16, (g, size_n))
    if delta is not None:
        delta = _dev(delta, "delta", np.float32, (g, size_n))
    if size_k // MARLIN_TILE > 65535:
        raise KernelError(f"size_k={size_k} too large for dequant's grid (K/16 <= 65535)")
    out = (
        cp.empty((size_k, size_n), dtype=cp.float16) if out is None else _dev(out, "out", np.float16, (size_k, size_n))
    )
    name = "marlin_dequant<true>" if delta is not None else "marlin_dequant<false>"
    build.function("dequant.cu", name)(
        (size_n // KERNEL_N_MULTIPLE, size_k // MARLIN_TILE),
        (BLOCK_THREADS,),
        (
            B,
            scales,
            _ptr_or_null(delta),
            out,
            np.int32(size_k),
            np.int32(size_n),
            np.int32(gs),
            np.int32(1 if per_channel else 0),
        ),
    )
    return out


def group_sums(A: Any, *, group_size: int, out: Any = None) -> Any:
    """Per-group row sums ``xsum[m, g]`` (fp32) of A in Marlin order (``asym_correction.cu``).

    Args:
        A: float16 ``(M, K)`` after any act-order gather.
        group_size: rows per group (even), or -1 / K for one group.
        out: optional float32 ``(M, K // group_size)`` destination.

    Returns:
        float32 ``(M, G)`` CuPy array (deterministic lane order).

    Raises:
        KernelError, GpuUnavailableError.
    """
    cp = runtime.cupy_module()
    if A is None or getattr(A, "ndim", 0) != 2:
        raise KernelError("A must be 2-D (M, K)", tensor="A")
    m, k = (int(s) for s in A.shape)
    gs = resolve_group_size(k, group_size)
    if gs <= 0 or gs % 2 or k % gs:
        raise KernelError(f"group_size {group_size} must be even and divide K={k}")
    A = _dev(A, "A", np.float16, (m, k))
    g = k // gs
    out = cp.empty((m, g), dtype=cp.float32) if out is None else _dev(out, "out", np.float32, (m, g))
    if m * g:
        build.function("asym_correction.cu", "group_sums")(
            (-(-m * g // 4),), (BLOCK_THREADS,), (A, out, np.int32(m), np.int32(k), np.int32(gs))
        )
    return out


def add_correction(C: Any, xsum: Any, delta: Any) -> Any:
    """In place ``C = fp16(C + xsum @ delta[:, :n])`` (``asym_correction.cu``); returns ``C``.

    Args:
        C: float16 ``(M, n)``, updated in place.
        xsum: float32 ``(M, G)``.
        delta: float32 ``(G, N)``, natural column order, N % 64 == 0 and N >= n (a
            padded layer's delta is wider than its result).

    Raises:
        KernelError, GpuUnavailableError.
    """
    if C is None or getattr(C, "ndim", 0) != 2 or getattr(xsum, "ndim", 0) != 2 or getattr(delta, "ndim", 0) != 2:
        raise KernelError("C, xsum and delta must be 2-D")
    m, n = (int(s) for s in C.shape)
    g, ld = int(xsum.shape[1]), int(delta.shape[1])
    C = _dev(C, "C", np.float16, (m, n))
    xsum = _dev(xsum, "xsum", np.float32, (m, g))
    delta = _dev(delta, "delta", np.float32, (g, ld))
    if ld % KERNEL_N_MULTIPLE or ld < n:
        raise KernelError(
            f"delta has {ld} columns; need a multiple of {KERNEL_N_MULTIPLE} and at least C's {n}", tensor="delta"
        )
    if m:
        build.function("asym_correction.cu", "add_correction")(
            (-(-n // 128), -(-m // 8)),
            (BLOCK_THREADS,),
            (C, xsum, delta, np.int32(m), np.int32(n), np.int32(g), np.int32(ld)),
        )
    return C


def marlin_gemm_two_kernel(
    A: Any,
    B: Any,
    scales: Any,
    *,
    size_k: int,
    size_n: int,
    group_size: int,
    delta: Any,
    perm: Any = None,
    bias: Any = None,
    out: Any = None,
    n_out: int | None = None,
    tuning: Tuning = DEFAULT_TUNING,
    b_units: Any = None,
) -> Any:
    """The two-kernel asymmetric path: symmetric GEMM, ``group_sums``, ``add_correction``.

    Same arguments and result shape as :func:`marlin_gemm` (``delta`` required); one
    more rounding to fp16 than the fused path. Twin: ``reference.marlin_gemm_two_kernel``.
    """
    runtime.cupy_module()  # raises GpuUnavailableError before any argument check
    if delta is None:
        raise KernelError("delta is required for the two-kernel path", tensor="delta")
    gs, g, _ = _layer_sizes(size_k, size_n, group_size)
    delta = _dev(delta, "delta", np.float32, (g, size_n))
    a = _dev(A, "A", np.float16, (int(A.shape[0]), size_k)) if getattr(A, "ndim", 0) == 2 else A
    if perm is not None:
        a = gather_columns(a, perm)
    c = marlin_gemm(
        a,
        B,
        scales,
        size_k=size_k,
        size_n=size_n,
        group_size=group_size,
        bias=bias,
        out=out,
        n_out=n_out,
        tuning=tuning,
        b_units=b_units,
    )
    return add_correction(c, group_sums(a, group_size=gs), delta)


def synchronize() -> None:
    """Wait for the current stream; surfaces asynchronous launch errors as KernelError."""
    cp = runtime.cupy_module()
    try:
        cp.cuda.get_current_stream().synchronize()
    except GpuUnavailableError:
        raise
    except Exception as exc:
        raise KernelError(f"CUDA error after launch: {exc}") from None


# ----------------------------------------------------------------------------- packed launches


#: Alignment of a tensor-map argument (the driver's CUtensorMap is 64-byte aligned).
_MAP_ALIGN = 64


class Slot(NamedTuple):
    """A placeholder in a :class:`KernelCall`'s arguments for a value that changes from
    call to call (:func:`pack_args`): a device address patched into the packed buffer,
    or, with ``by_ref``, an argument whose ``kernelParams`` pointer itself is patched to
    point at bytes held elsewhere (a tensor map)."""

    name: str
    by_ref: bool = False


@dataclasses.dataclass(frozen=True)
class PackedArgs:
    """Kernel arguments laid out for ``cuLaunchKernel``'s ``kernelParams``.

    Attributes:
        buf: every argument's value at its natural alignment (uint8; 64-byte aligned
            start, a whole number of 8-byte words).
        words: ``buf`` as uint64, where an address slot is patched (``words[offset // 8]``).
        params: one uint64 address per argument, into ``buf`` (what ``kernelParams``
            points at); a ``by_ref`` slot's entry is patched instead.
        slots: slot name -> (argument index, byte offset in ``buf``).
    """

    buf: np.ndarray
    words: np.ndarray
    params: np.ndarray
    slots: dict[str, tuple[int, int]]

    @property
    def params_ptr(self) -> int:
        """The host address to pass as ``kernelParams``."""
        return int(self.params.ctypes.data)


def pack_args(args: tuple[Any, ...], maps: tuple[Any, ...] = ()) -> PackedArgs:
    """Lay out a :class:`KernelCall`'s arguments once, for launches that only patch
    their :class:`Slot` values (pure host work; no GPU).

    The driver copies each argument's bytes from where ``kernelParams`` points when the
    launch call is made, so the buffers may be patched again as soon as it returns.

    Args:
        args: NumPy scalars (``np.uint64`` addresses, ``np.int32`` sizes), :class:`Slot`
            placeholders, and tensor-map arguments (the ``arg`` of one of ``maps``).
        maps: the :class:`~converter.gpu.tensormap.TensorMapArg` objects whose ``arg``
            may appear in ``args``; their 128 bytes are copied in.

    Returns:
        The :class:`PackedArgs` (slots zero until patched).

    Raises:
        KernelError: an argument of another kind (a CuPy array, a Python int, None).
    """
    raws = {id(m.arg): m.raw for m in maps}
    pieces: list[tuple[int, np.ndarray]] = []
    slots: dict[str, tuple[int, int]] = {}
    end = 0
    for i, a in enumerate(args):
        if isinstance(a, Slot):
            raw, align = np.zeros(8, dtype=np.uint8), 8
        elif isinstance(a, np.generic):
            raw, align = np.frombuffer(a.tobytes(), dtype=np.uint8), a.itemsize
        elif id(a) in raws:
            raw, align = raws[id(a)].view(np.uint8), _MAP_ALIGN
        else:
            raise KernelError(f"argument {i} ({type(a).__name__}) cannot be packed", tensor="args")
        off = -(-end // align) * align
        pieces.append((off, raw))
        if isinstance(a, Slot):
            slots[a.name] = (i, off)
        end = off + raw.size
    total = -(-max(end, 8) // 8) * 8
    base = np.zeros(total + _MAP_ALIGN, dtype=np.uint8)
    shift = -base.ctypes.data % _MAP_ALIGN
    buf = base[shift : shift + total]  # keeps base alive
    for off, raw in pieces:
        buf[off : off + raw.size] = raw
    params = np.array([buf.ctypes.data + off for off, _ in pieces], dtype=np.uint64)
    return PackedArgs(buf=buf, words=buf.view(np.uint64), params=params, slots=slots)

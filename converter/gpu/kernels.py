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

from typing import Any

import numpy as np

from ..constants import KERNEL_N_MULTIPLE, MARLIN_TILE
from ..errors import GpuUnavailableError, KernelError
from ..marlin.shapes import resolve_group_size
from . import build, runtime
from .checks import _NULL, _dev, _layer_sizes, _n_out, _ptr_or_null
from .launches import (
    AT_PIECE,
    BLOCK_THREADS,
    GATHER_THREADS,
    GemmLaunch,
    KernelCall,
    _activations,
    _gemm_launch,
    _plan,
    activations_call,
    emit_gather,
    emit_gemm,
    gather_call,
    gemm_call,
    gemm_launch,
    gemm_plan,
    gemm_prologue_call,
    hopper_device,
)
from .operands import STAGE_GROUP, STAGE_RUN_INT32, _scale_order, prepare_b_stages, prepare_b_units, prepare_delta
from .packed_args import PackedArgs, Slot, pack_args
from .plan import DEFAULT_TUNING, Tuning, layer_groups, persistent_every_m

# The launchers' helpers live in checks / operands / launches / packed_args; callers and
# tests reach them here as before.
__all__ = [
    "AT_PIECE",
    "BLOCK_THREADS",
    "GATHER_THREADS",
    "STAGE_GROUP",
    "STAGE_RUN_INT32",
    "GemmLaunch",
    "KernelCall",
    "PackedArgs",
    "Slot",
    "_NULL",
    "_activations",
    "_dev",
    "_gemm_launch",
    "_layer_sizes",
    "_n_out",
    "_plan",
    "_ptr_or_null",
    "_scale_order",
    "activations_call",
    "add_correction",
    "dequant",
    "emit_gather",
    "emit_gemm",
    "gather_call",
    "gather_columns",
    "gemm_call",
    "gemm_launch",
    "gemm_plan",
    "gemm_prologue_call",
    "group_sums",
    "hopper_device",
    "keeps_b_stages",
    "keeps_b_units",
    "marlin_gemm",
    "marlin_gemm_two_kernel",
    "pack_args",
    "prepare_b_stages",
    "prepare_b_units",
    "prepare_delta",
    "synchronize",
]


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


# ----------------------------------------------------------------------------- launchers

#: Activation type -> the array dtype holding it (bf16 as its bits: CuPy has no bf16).
ACT_ARRAY_DTYPES = {"float16": np.float16, "bfloat16": np.uint16}


def _act_dtype(act: str) -> Any:
    try:
        return ACT_ARRAY_DTYPES[act]
    except KeyError:
        raise KernelError(f"act must be one of {', '.join(ACT_ARRAY_DTYPES)}, got {act!r}") from None


def gather_columns(A: Any, perm: Any, *, out: Any = None, act: str = "float16") -> Any:
    """``A[:, perm]`` on the GPU (act-order gather). Twin: ``reference.gather_columns``.

    Args:
        A: ``(M, K)`` of ``act`` (as :func:`marlin_gemm`), source channel order.
        perm: int32 ``(K,)``, Marlin row k = source channel ``perm[k]``.
        out: optional ``(M, K)`` destination of A's dtype.
        act: the activation type (the gather moves 16-bit values: one kernel for both).

    Returns:
        ``(M, K)`` CuPy array of A's dtype in Marlin order.

    Raises:
        KernelError: bad dtype/shape/contiguity. GpuUnavailableError: no GPU.
    """
    cp = runtime.cupy_module()
    if A is None or getattr(A, "ndim", 0) != 2:
        raise KernelError("A must be 2-D (M, K)", tensor="A")
    m, k = A.shape
    act_np = _act_dtype(act)
    A = _dev(A, "A", act_np, (m, k))
    perm = _dev(perm, "perm", np.int32, (k,))
    out = cp.empty((m, k), dtype=act_np) if out is None else _dev(out, "out", act_np, (m, k))
    emit_gather(A, perm, out, m, k)
    return out


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
    act: str = "float16",
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
        act: ``"float16"``, or ``"bfloat16"``: ``A``, ``out`` and the result then hold
            bf16 bits as uint16 (CuPy has no bf16 dtype); the same routes, with the bf16
            forms of the kernels (docs/notes/bf16.md; twin ``reference_bf16.marlin_gemm``).
            The other operands are the same for both.

    Returns:
        ``(M, n_out)`` CuPy array of ``act`` (uint16 bits for bf16). Bitwise
        deterministic for fixed inputs and a fixed device (the K split depends on the
        multiprocessor count).

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
    act_np = _act_dtype(act)
    A = _dev(A, "A", act_np, (m, size_k))
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
    out = cp.empty((m, n_out), dtype=act_np) if out is None else _dev(out, "out", act_np, (m, n_out))
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
        act=act,
    )
    ws, locks, at = _workspace(run.ws_floats, run.n_locks, run.at_halves)
    a_ptr = int(A.data.ptr)
    if run.gather:
        A = gather_columns(A, perm, act=act)
        a_ptr = int(A.data.ptr)
    emit_gemm(run, A, a_ptr, perm, b_units if run.units else B, scales, delta, bias, out, ws, locks, at)
    return out


def dequant(
    B: Any,
    scales: Any,
    *,
    size_k: int,
    size_n: int,
    group_size: int,
    delta: Any = None,
    out: Any = None,
    act: str = "float16",
) -> Any:
    """Marlin tensors to the fp16 weight ``(size_k, size_n)`` (``kernels/dequant.cu``),
    or with ``act="bfloat16"`` the bf16 weight the bf16 kernels' per-weight paths form.

    Args:
        B, scales, size_k, size_n, group_size, delta, act: as :func:`marlin_gemm`.
        out: optional ``(size_k, size_n)`` destination of ``act``'s array dtype.

    Returns:
        ``(size_k, size_n)`` CuPy array (float16, or uint16 bf16 bits), rows in Marlin
        order, bit-identical to ``reference.dequant`` (``reference_bf16.dequant``) and to
        the weight the GEMM multiplies by.

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
    act_np = _act_dtype(act)
    out = cp.empty((size_k, size_n), dtype=act_np) if out is None else _dev(out, "out", act_np, (size_k, size_n))
    name = "marlin_dequant<true>" if delta is not None else "marlin_dequant<false>"
    build.function("dequant.cu", name, act)(
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

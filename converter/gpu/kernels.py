"""NVRTC modules for ``kernels/*.cu`` and their checked launchers.

One CuPy ``RawModule`` per ``.cu`` file and device architecture, built on first use and
kept for the life of the process (CuPy also caches the cubin on disk). Templates are
reached through ``name_expressions``. A compile failure is raised as
:class:`KernelError` carrying NVRTC's log (``err.nvrtc_log``) and the same error object
is raised again on later calls instead of recompiling.

Every launcher checks dtype, shape, contiguity and alignment of its arguments before it
launches anything, and raises :class:`KernelError` naming the argument. Launchers take
CuPy arrays (NumPy arrays are copied to the device; dtypes are never converted
silently) and run on CuPy's current stream. Their NumPy twins, with the same
signatures, are in :mod:`converter.gpu.reference`.

Kernel sources are found by :func:`kernel_dir`: ``converter/_kernels`` inside an
installed wheel, else the repository's top-level ``kernels/``.
"""

from __future__ import annotations

import functools
import math
import threading
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import GpuUnavailableError, KernelError
from ..marlin.layout import permute_scales
from . import runtime

_SOURCES = ("marlin_gemm.cu", "marlin_decode.cu", "dequant.cu", "asym_correction.cu", "marlin_common.cuh",
            "marlin_stream.cuh")

#: GEMM instantiations, as pipes ``(kind, R, U, NS)``: ``kind`` "tile"
#: (``kernels/marlin_gemm.cu``, R = MT 16-row m-tiles per warp), "decode"
#: (``kernels/marlin_decode.cu`` with per-group fp32 scaling, R = NT 8-row activation
#: tiles per warp) or "decode_w" (the same kernel with the tile kernel's per-weight fp16
#: scaling); U k-tiles per step; NS shared-memory ring stages. Each is built for every
#: GPI (group slots per step) in GEMM_GPIS[U], with and without the fused delta.
GEMM_PIPES = (("tile", 1, 4, 3), ("tile", 1, 8, 3), ("tile", 2, 4, 3), ("tile", 4, 2, 3),
              ("decode", 1, 4, 3), ("decode", 1, 8, 3), ("decode", 2, 4, 3), ("decode", 2, 8, 3),
              ("decode", 4, 4, 3), ("decode_w", 2, 8, 3), ("decode_w", 4, 4, 3))
GEMM_GPIS = {8: (1,), 4: (1, 2, 4), 2: (1, 2)}
#: The arithmetic of each kind, as the twin (``reference.marlin_gemm``) names it:
#: "weight" multiplies by the fp16 weight ``fp16((q - 8) s + fp16(delta))``, "group"
#: sums ``A (q - 8)`` and A per group in fp32 and applies ``s`` and ``fp16(delta)`` there.
ARITH = {"tile": "weight", "decode": "group", "decode_w": "weight"}
#: Routing (gemm_path), measured on an H200 (scripts/perf_notes.md): the decode kernel
#: with per-group scaling up to GROUP_MAX_M rows (up to 8 rows always; 9..16 rows when
#: N >= WIDE_N, where enough column blocks keep the device busy without deep K splits),
#: the per-weight decode variant for 17..DECODE_MAX_M rows when N > WIDE_N, and the
#: tile kernel otherwise.
GROUP_MAX_M = 16
DECODE_MAX_M = 32
WIDE_N = 8192
#: Target number of full waves of resident warps for the K split (tuned on an H200).
WAVES = 1
#: A block's pipeline fill, in k-tile times, charged per wave by the split's cost model.
LATENCY_TILES = 6
#: The split's reduction cost per extra split and 8 rows, in k-tile times (tuned on an
#: H200: 4096 x 4096 at M = 1 ran 7.5 us with 4 splits against 8.5 us with 8).
REDUCE_TILES = 2.5
#: Cost of staging one A row of a k-tile, in B-tile units per 16 rows (the split's
#: cost model; A comes from L2, B from DRAM).
A_WEIGHT = 0.5
#: Tests set this to 1 or 4 to force a block shape; None lets the cost model choose.
FORCE_WK: int | None = None
#: Blocks per multiprocessor the split may count on, per GEMM kind (None: as many as
#: fit). Fewer resident warps stream the weights faster at small M on an H200
#: (scripts/perf_notes.md), so the split is sized for this many.
OCC_CAP: dict[str, int | None] = {"tile": None, "decode": None, "decode_w": None}


Pipe = tuple[str, int, int, int]


def gemm_path(m: int, size_n: int) -> str:
    """The GEMM kind that serves an (M, N) call: "decode", "decode_w" or "tile" (see WIDE_N)."""
    if m <= 8 or (m <= GROUP_MAX_M and size_n >= WIDE_N):
        return "decode"
    if m <= DECODE_MAX_M and size_n > WIDE_N:
        return "decode_w"
    return "tile"


def gemm_arith(m: int, size_n: int) -> str:
    """The arithmetic (``ARITH``) of the kernel that serves (M, N): "group" or "weight"."""
    return ARITH[gemm_path(m, size_n)]


def default_pipe(m: int, size_k: int, size_n: int, group_tiles: int, smem_limit: int = 227 * 1024) -> Pipe:
    """The GEMM variant for batch size m (measured on an H200, scripts/perf_notes.md).

    The kind from :func:`gemm_path`; the decode kernels with the fewest 8-row activation
    tiles that hold M, the tile kernel with 2 (M <= 32) or 4 m-tiles per warp.

    Args:
        m: rows of A. size_k, size_n: K, N. group_tiles: group size / 16 (K / 16
            per-channel).
        smem_limit: the device's opt-in shared memory per block, bytes.

    Returns:
        ``(kind, R, U, NS)``, one of GEMM_PIPES.
    """
    kind = gemm_path(m, size_n)
    if kind == "tile":
        return ("tile", 2, 4, 3) if m <= 32 else ("tile", 4, 2, 3)
    if kind == "decode_w":
        return ("decode_w", 4, 4, 3)
    if m <= 8:
        return ("decode", 1, 4, 3)
    # 8-tile steps when every step holds one group slot (group size >= 128, per-channel)
    u8 = (size_k // 16) % 8 == 0 and group_tiles % 8 == 0 and _gemm_smem(("decode", 2, 8, 3), 1) <= smem_limit
    return ("decode", 2, 8 if u8 else 4, 3)


def _gemm_name(pipe: Pipe, gpi: int, delta: bool) -> str:
    kind, r, u, ns = pipe
    d = "true" if delta else "false"
    if kind == "tile":
        return f"marlin_gemm<{r}, {u}, {gpi}, {ns}, {d}>"
    return f"marlin_decode<{r}, {u}, {gpi}, {ns}, {d}, {'true' if kind == 'decode' else 'false'}>"


def _gemm_source(pipe: Pipe) -> str:
    return "marlin_gemm.cu" if pipe[0] == "tile" else "marlin_decode.cu"


def _gemm_smem(pipe: Pipe, gpi: int) -> int:
    """Dynamic shared memory of one 4-warp block: 4 rings (``kernels/marlin_stream.cuh``,
    struct Ring, AR rows of A per tile), each padded to hold the warp's fp32 sums."""
    kind, r, u, ns = pipe
    rows, sums = (16 * r, 4096 * r) if kind == "tile" else (8 * r, 2048 * r)
    stage = u * 512 + u * rows * 32 + gpi * 128 + gpi * 128
    return 4 * max(ns * stage, sums)


_NAMES = {
    "marlin_gemm.cu": [_gemm_name(p, gpi, d) for p in GEMM_PIPES if p[0] == "tile" for gpi in GEMM_GPIS[p[2]]
                       for d in (False, True)] + ["gather_columns"],
    "marlin_decode.cu": [_gemm_name(p, gpi, d) for p in GEMM_PIPES if p[0] != "tile"
                         for gpi in GEMM_GPIS[p[2]] for d in (False, True)],
    "dequant.cu": ["marlin_dequant<false>", "marlin_dequant<true>"],
    "asym_correction.cu": ["group_sums", "add_correction"],
}


def kernel_dir() -> Path:
    """Folder holding the ``.cu`` sources.

    Looks first at ``converter/_kernels`` (where the wheel's force-include puts them),
    then at ``<repo>/kernels`` (a source checkout).

    Raises:
        KernelError: neither folder holds ``marlin_gemm.cu``.
    """
    here = Path(__file__).resolve().parent
    candidates = (here.parent / "_kernels", here.parents[1] / "kernels")
    for c in candidates:
        if all((c / s).is_file() for s in _SOURCES):
            return c
    raise KernelError(
        "kernel sources not found; looked in " + ", ".join(str(c) for c in candidates)
    )


_lock = threading.Lock()
_modules: dict[tuple[str, int], Any] = {}
_failures: dict[tuple[str, int], KernelError] = {}


def module(source: str) -> Any:
    """The compiled ``RawModule`` for ``source`` (e.g. ``"marlin_gemm.cu"``) on this device.

    Raises:
        GpuUnavailableError: no CuPy / GPU / sm_80+.
        KernelError: NVRTC failed; ``err.nvrtc_log`` holds the full log. Raised once
            per process per file and device, then re-raised without recompiling.
    """
    cp = runtime.cupy_module()
    info = runtime.device_info()
    key = (source, info.index)
    with _lock:
        if key in _modules:
            return _modules[key]
        if key in _failures:
            raise _failures[key]
        folder = kernel_dir()
        code = (folder / source).read_text(encoding="utf-8")
        options = ("-std=c++17", f"--gpu-architecture={info.arch}", f"-I{folder}")
        try:
            mod = cp.RawModule(code=code, options=options, name_expressions=_NAMES[source])
            for name in _NAMES[source]:
                mod.get_function(name)  # forces the compile now, not at first launch
        except Exception as exc:  # cupy.cuda.compiler.CompileException and driver errors
            log = str(exc)
            first = next((ln.strip() for ln in log.splitlines() if "error" in ln), log.strip()[:200])
            err = KernelError(f"NVRTC could not build {source} for {info.arch}: {first}",
                              path=folder / source)
            err.nvrtc_log = log  # type: ignore[attr-defined]
            _failures[key] = err
            raise err from None
        _modules[key] = mod
        return mod


def _fn(source: str, name: str) -> Any:
    return module(source).get_function(name)


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
            raise KernelError(f"{name} must be a CuPy/NumPy/DLPack array, got {type(x).__name__}",
                              tensor=name)
    if x.dtype != np.dtype(dtype):
        raise KernelError(f"{name} must be {np.dtype(dtype)}, got {x.dtype}", tensor=name)
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise KernelError(f"{name} must have shape {tuple(shape)}, got {tuple(x.shape)}", tensor=name)
    if not x.flags.c_contiguous:
        raise KernelError(f"{name} must be C-contiguous", tensor=name)
    if x.data.ptr % 16 and x.size:
        raise KernelError(f"{name} must be 16-byte aligned (got address {x.data.ptr:#x})", tensor=name)
    if x.data.device_id != runtime.device_info().index:
        raise KernelError(f"{name} is on device {x.data.device_id}, not the current device",
                          tensor=name)
    return x


def _layer_sizes(size_k: int, size_n: int, group_size: int) -> tuple[int, int, bool]:
    """(group_size, num_groups, per_channel) after checking the kernel's limits."""
    if size_k <= 0 or size_n <= 0 or size_k % 16 or size_n % 64:
        raise KernelError(f"need size_k % 16 == 0 and size_n % 64 == 0, got K={size_k}, N={size_n}")
    per_channel = group_size in (-1, size_k)
    gs = size_k if per_channel else group_size
    if gs <= 0 or gs % 16 or size_k % gs:
        raise KernelError(f"group_size {group_size} must be a multiple of 16 dividing K={size_k}")
    return gs, size_k // gs, per_channel


_NULL = np.uint64(0)


def _ptr_or_null(x: Any) -> Any:
    return _NULL if x is None else x


# ----------------------------------------------------------------------------- workspace


_workspaces: dict[tuple[int, int], dict[str, Any]] = {}


def _workspace(ws_floats: int, n_locks: int) -> tuple[Any, Any]:
    """Per (device, stream) fp32 partials and zeroed lock counters, grown on demand.

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
    return ws["ws"], ws["locks"]


# ----------------------------------------------------------------------------- launch plans


def gemm_plan(m: int, size_k: int, size_n: int, group_size: int, *, delta: bool = False,
              pipe: Pipe | None = None) -> dict[str, Any]:
    """Kernel variant and K split the GEMM launcher uses for one call.

    The work is ``m_chunks x N/64`` units (the variant's rows x 64 columns each), each
    split into ``splits`` contiguous K ranges; a 4-warp block takes either 4 units with
    the whole range (``wk = 1``) or one unit with a quarter of the range per warp
    (``wk = 4``). With ``R`` blocks resident on the device (from the variant's
    registers and shared memory), the plan minimises
    ``ceil(blocks / R) * (tiles per warp + LATENCY_TILES)`` (the slowest wave plus its
    pipeline fill) plus a small charge per split for the partial-sum reduction.

    Args:
        m, size_k, size_n, group_size: the problem (group_size -1 / size_k: per-channel).
        delta: fused asymmetric variant.
        pipe: ``(kind, R, U, NS)`` override of :func:`default_pipe` (benchmarking).

    Returns:
        dict with ``kind, r, u, gpi, ns, smem, regs, rows, m_chunks, wk, splits,
        tiles_per_split, warps, blocks, resident_warps`` (``rows``: A rows per chunk).

    Raises:
        KernelError: K not a multiple of 16 U (64 always works), an unknown pipe, or
            too little shared memory.
        GpuUnavailableError: no CuPy / GPU.
    """
    gs, _, _ = _layer_sizes(size_k, size_n, group_size)
    info = runtime.device_info()
    pipe = pipe or default_pipe(m, size_k, size_n, gs // 16, info.smem_per_block_optin)
    return dict(_plan(m, size_k, size_n, group_size, delta, tuple(pipe), WAVES, FORCE_WK,
                      OCC_CAP.get(pipe[0]), info))


def _resident_blocks(regs: int, smem: int, smem_per_sm: int) -> int:
    """4-warp blocks one multiprocessor holds (sm_80..sm_90 allocation rules).

    Each of the 4 sub-partitions has 16 K registers, given to a warp in units of 256
    (so 102 registers per thread cost 3328 per warp: 4 warps per sub-partition, not
    5); a block's 4 warps take one warp slot in every sub-partition. Shared memory:
    1 KB is reserved per block. At most 16 such blocks (64 warps).
    """
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    return max(1, min(16384 // per_warp, smem_per_sm // (smem + 1024), 16))


@functools.lru_cache(maxsize=4096)
def _plan(m: int, size_k: int, size_n: int, group_size: int, delta: bool, pipe: Pipe,
          waves_target: int, force_wk: int | None, occ_cap: int | None,
          info: runtime.DeviceInfo) -> dict[str, Any]:
    gs, _, per_channel = _layer_sizes(size_k, size_n, group_size)
    kt = size_k // 16
    if pipe not in GEMM_PIPES:
        raise KernelError(f"unknown GEMM variant {pipe}; built: {GEMM_PIPES}")
    kind, r, u, ns = pipe
    if kt % u:
        raise KernelError(f"size_k={size_k}: K must be a multiple of {16 * u} for this kernel")
    gt = kt if per_channel else gs // 16
    gpi = 1 if per_channel else u // math.gcd(gt, u)
    if gpi not in GEMM_GPIS[u]:
        raise KernelError(f"group_size {group_size} is not supported by GEMM variant {pipe}")
    smem = _gemm_smem(pipe, gpi)
    if smem > info.smem_per_block_optin:
        raise KernelError(f"GEMM variant {pipe} needs {smem} bytes of shared memory per block; "
                          f"{info.arch} allows {info.smem_per_block_optin}")
    regs = int(_fn(_gemm_source(pipe), _gemm_name(pipe, gpi, delta)).num_regs)
    blocks_per_sm = _resident_blocks(regs, smem, info.smem_per_sm)
    if occ_cap:
        blocks_per_sm = min(blocks_per_sm, occ_cap)
    resident = info.sm_count * blocks_per_sm
    chunk_rows = 16 * r if kind == "tile" else 8 * r
    m_chunks = -(-m // chunk_rows)
    nblk = size_n // 64
    rows = min(m, chunk_rows)
    best = None
    for wk in (force_wk,) if force_wk else (1, 4):
        blocks_n = m_chunks * -(-nblk // (4 // wk))
        quantum = wk * u  # each warp's share of a K split is whole steps
        for splits in range(1, -(-kt // quantum) + 1):
            tps = -(-(-(-kt // splits)) // quantum) * quantum
            if -(-kt // tps) != splits:
                continue
            waves = -(-blocks_n * splits // (resident * waves_target))
            # slowest wave: per-warp tiles (each also moving its A rows, rows / 16 of a
            # B tile's bytes, once per block in the decode kernel's wk = 1 form) plus
            # the pipeline fill (about LATENCY_TILES), then the final reduction (about
            # REDUCE_TILES per extra split and 8 rows: partial writes, the counter, reads)
            a_share = 4 if (kind != "tile" and wk == 1) else 1
            tile_cost = 1 + A_WEIGHT * rows / 16 / a_share
            cost = waves * (tps // wk * tile_cost + LATENCY_TILES) + REDUCE_TILES * (splits - 1) * -(-rows // 8)
            if best is None or cost < best[0]:
                best = (cost, wk, splits, tps, blocks_n * splits)
    _, wk, splits, tps, blocks = best
    return {"kind": kind, "r": r, "u": u, "gpi": gpi, "ns": ns, "smem": smem, "regs": regs,
            "rows": chunk_rows, "m_chunks": m_chunks, "wk": wk, "splits": splits, "tiles_per_split": tps,
            "warps": 4 * blocks, "blocks": blocks, "resident_warps": 4 * resident}


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
    total = m * k
    if total:
        _fn("marlin_gemm.cu", "gather_columns")(((total + 255) // 256,), (256,),
                                                (A, perm, out, np.int32(m), np.int32(k)))
    return out


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
    if n % 64:
        raise KernelError(f"delta: N={n} must be a multiple of 64", tensor="delta")
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
    pipe: Pipe | None = None,
) -> Any:
    """INT4 x FP16 GEMM on Marlin tensors; fused asymmetric correction when ``delta`` given.

    Computes ``C = A[:, perm] @ W (+ bias)`` for ``W = (q - 8) * s (+ d)``,
    ``d = fp16(delta)``, in one launch, fp32 accumulation, one fp16 rounding. Two
    kernels share the work (:func:`gemm_path` picks by M and N): for small M the decode
    kernel (``kernels/marlin_decode.cu``) sums ``A (q - 8)`` and A per group in fp32
    and applies ``s`` and ``d`` once per group (its "decode_w" variant, and the tile
    kernel ``kernels/marlin_gemm.cu`` for larger M, multiply by the fp16 weight
    ``fp16((q - 8) * s (+ d))``). Twin: ``reference.marlin_gemm`` (same rule).

    Args:
        A: float16 ``(M, size_k)``, M >= 1, SOURCE channel order.
        B: int32 ``(size_k // 16, 2 * size_n)``, Marlin tile order (artifact ``marlin_B``).
        scales: float16 ``(G, size_n)``, Marlin-permuted (artifact ``marlin_scales``).
        size_k, size_n: K (multiple of 64) and N (multiple of 64).
        group_size: any multiple of 16 dividing K (32, 64, 128, ...), or -1 / size_k
            for per-channel.
        delta: float32 ``(G, size_n)`` natural order (artifact ``marlin_delta``,
            converted on every call), float16 ``(G, size_n)`` from
            :func:`prepare_delta`, or None.
        perm: int32 ``(size_k,)`` act-order permutation (artifact ``marlin_perm``) or None.
        bias: float16 ``(size_n,)`` or None.
        out: optional float16 ``(M, size_n)`` destination.
        pipe: ``(kind, R, U, NS)`` variant override (benchmarking); default
            :func:`default_pipe`.

    Returns:
        float16 ``(M, size_n)`` CuPy array. Bitwise deterministic for fixed inputs
        and a fixed device (the K split depends on the multiprocessor count).

    Raises:
        KernelError: wrong dtype/shape/contiguity/alignment, unsupported sizes, or NVRTC
            failure. GpuUnavailableError: no CuPy / GPU / sm_80+.
    """
    cp = runtime.cupy_module()
    gs, g, per_channel = _layer_sizes(size_k, size_n, group_size)
    if A is None or getattr(A, "ndim", 0) != 2 or A.shape[1] != size_k or A.shape[0] < 1:
        raise KernelError(f"A must be (M >= 1, {size_k}), got {getattr(A, 'shape', None)}", tensor="A")
    m = int(A.shape[0])
    A = _dev(A, "A", np.float16, (m, size_k))
    B = _dev(B, "B", np.int32, (size_k // 16, 2 * size_n))
    scales = _dev(scales, "scales", np.float16, (g, size_n))
    if delta is not None:
        if getattr(delta, "dtype", None) == np.float16:
            delta = _dev(delta, "delta", np.float16, (g, size_n))
        else:
            delta = prepare_delta(_dev(delta, "delta", np.float32, (g, size_n)))
    if bias is not None:
        bias = _dev(bias, "bias", np.float16, (size_n,))
    if perm is not None:
        perm = _dev(perm, "perm", np.int32, (size_k,))
    out = cp.empty((m, size_n), dtype=cp.float16) if out is None else _dev(out, "out", np.float16, (m, size_n))
    plan = gemm_plan(m, size_k, size_n, group_size, delta=delta is not None, pipe=pipe)
    if perm is not None:
        A = gather_columns(A, perm)
    ws, locks = _workspace(plan["splits"] * m * size_n if plan["splits"] > 1 else 0,
                           plan["m_chunks"] * (size_n // 64))
    variant = (plan["kind"], plan["r"], plan["u"], plan["ns"])
    fn = _fn(_gemm_source(variant), _gemm_name(variant, plan["gpi"], delta is not None))
    if plan["smem"] > 48 * 1024 and fn.max_dynamic_shared_size_bytes < plan["smem"]:
        fn.max_dynamic_shared_size_bytes = plan["smem"]  # opt in above the 48 KB default
    gt = size_k // 16 if per_channel else gs // 16
    fn((plan["blocks"],), (128,), (
        A, B, scales, _ptr_or_null(delta), _ptr_or_null(bias), out, ws, locks,
        np.int32(m), np.int32(size_k), np.int32(size_n), np.int32(gt),
        np.int32(1 if per_channel else 0), np.int32(plan["splits"]),
        np.int32(plan["tiles_per_split"]), np.int32(plan["wk"]),
    ), shared_mem=plan["smem"])
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
    B = _dev(B, "B", np.int32, (size_k // 16, 2 * size_n))
    scales = _dev(scales, "scales", np.float16, (g, size_n))
    if delta is not None:
        delta = _dev(delta, "delta", np.float32, (g, size_n))
    if size_k // 16 > 65535:
        raise KernelError(f"size_k={size_k} too large for dequant's grid (K/16 <= 65535)")
    out = cp.empty((size_k, size_n), dtype=cp.float16) if out is None else _dev(
        out, "out", np.float16, (size_k, size_n))
    name = "marlin_dequant<true>" if delta is not None else "marlin_dequant<false>"
    _fn("dequant.cu", name)((size_n // 64, size_k // 16), (128,), (
        B, scales, _ptr_or_null(delta), out, np.int32(size_k), np.int32(size_n),
        np.int32(gs), np.int32(1 if per_channel else 0)))
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
    gs = k if group_size in (-1, k) else group_size
    if gs <= 0 or gs % 2 or k % gs:
        raise KernelError(f"group_size {group_size} must be even and divide K={k}")
    A = _dev(A, "A", np.float16, (m, k))
    g = k // gs
    out = cp.empty((m, g), dtype=cp.float32) if out is None else _dev(out, "out", np.float32, (m, g))
    if m * g:
        _fn("asym_correction.cu", "group_sums")((-(-m * g // 4),), (128,),
                                                (A, out, np.int32(m), np.int32(k), np.int32(gs)))
    return out


def add_correction(C: Any, xsum: Any, delta: Any) -> Any:
    """In place ``C = fp16(C + xsum @ delta)`` (``asym_correction.cu``); returns ``C``.

    Args:
        C: float16 ``(M, N)``, N % 64 == 0, updated in place.
        xsum: float32 ``(M, G)``.
        delta: float32 ``(G, N)``, natural column order.

    Raises:
        KernelError, GpuUnavailableError.
    """
    if C is None or getattr(C, "ndim", 0) != 2 or getattr(xsum, "ndim", 0) != 2:
        raise KernelError("C and xsum must be 2-D")
    m, n = (int(s) for s in C.shape)
    g = int(xsum.shape[1])
    C = _dev(C, "C", np.float16, (m, n))
    xsum = _dev(xsum, "xsum", np.float32, (m, g))
    delta = _dev(delta, "delta", np.float32, (g, n))
    if n % 64:
        raise KernelError(f"N={n} must be a multiple of 64", tensor="C")
    if m:
        _fn("asym_correction.cu", "add_correction")((-(-n // 128), -(-m // 8)), (128,),
                                                    (C, xsum, delta, np.int32(m), np.int32(n), np.int32(g)))
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
    c = marlin_gemm(a, B, scales, size_k=size_k, size_n=size_n, group_size=group_size,
                    bias=bias, out=out)
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

"""Tensor maps for the Hopper bulk tensor copy (``cp.async.bulk.tensor``).

The persistent Hopper kernel (``kernels/marlin_streamk.cu``) reads the activations A
straight from the caller's row-major fp16 ``(M, K)`` array, so no re-layout kernel runs
first. The map is A as it is, 2-D (innermost first: K values, M tokens at a stride of
2 K bytes), and one box is 64 values of K x T tokens: T rows of 128 bytes, which the
copy engine writes with the 128-byte swizzle (16-byte chunk j of row r at chunk
``j ^ r % 8`` of its row, in atoms of 8 rows) and fills with zeros past M. That is
``wgmma``'s 128-byte-swizzled K-major operand, read through the kernel's swizzled
descriptor; a stage of U k-tiles takes U / 4 boxes. (The first map, of 16-byte rows
laid out as the no-swizzle operand, lost 5-13 % to re-laying A out first from 48
tokens: its boxes had 768+ rows. See docs/notes/perf_notes.md.)

The map is encoded on the host by the driver (``cuTensorMapEncodeTiled``, through
NVIDIA's ``cuda-bindings``) and passed to the kernel by value (128 bytes, a
``__grid_constant__`` parameter). The layout's twin is
``converter.gpu.reference.streamk_x_slot``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import numpy as np

from ..errors import GpuUnavailableError, KernelError

#: fp16 values of K per box row: one 128-byte swizzle span.
BOX_VALUES = 64
#: k-tiles (16 values of K) per box.
BOX_TILES = BOX_VALUES // 16
#: Bytes of the driver's CUtensorMap.
TENSOR_MAP_BYTES = 128
#: The hardware's largest box extent in any dimension (cuTensorMapEncodeTiled).
MAX_BOX = 256


@dataclasses.dataclass(frozen=True)
class ActivationBox:
    """The tensor-map geometry of A for one (M, K, T, U).

    Attributes:
        dims: global extents, innermost first: ``(K, M)``.
        strides: byte stride of dimension 1: ``(2 K,)``.
        box: box extents: ``(64, T)``, 128-byte swizzled.
        boxes: boxes per pipeline stage: ``U / 4`` (at K offsets 0, 64, ...).
        swizzle: bytes of the shared-memory swizzle span the copy writes: 128
            (``CU_TENSOR_MAP_SWIZZLE_128B``; the kernel's descriptor says the same).
        stage_bytes: bytes one stage's boxes deliver, zero-filled tokens included:
            ``32 T U``.
    """

    dims: tuple[int, int]
    strides: tuple[int]
    box: tuple[int, int]
    boxes: int
    stage_bytes: int
    swizzle: int = BOX_VALUES * 2


def activation_box(m: int, size_k: int, tok: int, u: int) -> ActivationBox:
    """The geometry of :func:`activation_map` (pure; no GPU).

    Args:
        m: rows of A (tokens), >= 1.
        size_k: K, a multiple of 16 u.
        tok: T, tokens per chunk of the kernel (8 .. 128, a multiple of 8).
        u: U, k-tiles (16 values of K) per pipeline stage, a multiple of 4.

    Returns:
        The :class:`ActivationBox`.

    Raises:
        KernelError: a size the kernel's stage or the hardware's box rules exclude.
    """
    rules = [
        (m >= 1, "M >= 1"),
        (u >= 1 and u % BOX_TILES == 0, f"U a multiple of {BOX_TILES} (whole 64-value boxes)"),
        (u >= 1 and size_k % (16 * u) == 0, f"K a multiple of 16 U = {16 * u}"),
        (tok % 8 == 0 and 0 < tok <= MAX_BOX, f"T a multiple of 8 up to {MAX_BOX} (a box extent)"),
    ]
    broken = [rule for ok, rule in rules if not ok]
    if broken:
        raise KernelError(
            f"no activation box for M={m}, K={size_k}, T={tok}, U={u}: needs {'; '.join(broken)}", tensor="A"
        )
    return ActivationBox(
        dims=(size_k, m),
        strides=(2 * size_k,),
        box=(BOX_VALUES, tok),
        boxes=u // BOX_TILES,
        stage_bytes=32 * tok * u,
    )


@dataclasses.dataclass(frozen=True)
class TensorMapArg:
    """An encoded tensor map, ready to be a kernel argument.

    Attributes:
        raw: the 128 bytes (uint8), kept alive here while a launch reads them.
        arg: what CuPy passes by value (a pointer to ``raw``, copied at launch).
    """

    raw: np.ndarray
    arg: Any


@functools.cache
def unused() -> TensorMapArg:
    """128 zero bytes: the map argument of a launch that reads re-laid-out ``At`` instead
    (kept for the process: a launch's argument must outlive the call)."""
    return _as_arg(np.zeros(TENSOR_MAP_BYTES, dtype=np.uint8))


def _as_arg(raw: np.ndarray) -> TensorMapArg:
    from cupy.cuda.function import CPointer

    return TensorMapArg(raw=raw, arg=CPointer(raw.ctypes.data))


@functools.cache
def available() -> bool:
    """NVIDIA's cuda-bindings imports, so :func:`activation_map` can encode maps. Without
    it the persistent kernel reads A re-laid out by ``hopper_activations`` (the same
    bits, one more kernel per call; see ``Tuning.hopper_xmap_max_tok``), and this warns
    once."""
    try:
        _driver()
    except GpuUnavailableError as exc:
        warnings.warn(f"{exc}; the Hopper GEMM re-lays A out first instead", RuntimeWarning, stacklevel=2)
        return False
    return True


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise GpuUnavailableError(
            "the Hopper GEMM's tensor maps need NVIDIA's cuda-bindings: pip install "
            f"-e '.[cuda13]' (or '.[cuda12]') from the checkout ({type(exc).__name__}: {exc})"
        ) from exc
    return driver


def activation_map(a: Any, tok: int, u: int) -> TensorMapArg:
    """The tensor map of A for the persistent Hopper kernel's producer.

    Args:
        a: CuPy float16 ``(M, K)``, C-contiguous, 16-byte aligned.
        tok, u: as :func:`activation_box`.

    Returns:
        A :class:`TensorMapArg`; pass ``.arg`` as the kernel's ``xmap`` and keep the
        object alive until the launch call returns.

    Raises:
        KernelError: a size the box rules exclude, or the driver refuses the map.
        GpuUnavailableError: cuda-bindings is not installed.
    """
    m, size_k = (int(v) for v in a.shape)
    return activation_map_at(int(a.data.ptr), m, size_k, tok, u)


@functools.lru_cache(maxsize=1024)
def activation_map_at(ptr: int, m: int, size_k: int, tok: int, u: int) -> TensorMapArg:
    """:func:`activation_map` of the ``(m, size_k)`` fp16 array at device address ``ptr``.

    Cached: a map only encodes the address and the sizes, and a serving loop's caching
    allocator hands the same few addresses back, so the driver call (tens of
    microseconds through cuda-bindings) runs once per address. The cache also keeps each
    map's bytes alive for as long as a launch may read them.
    """
    drv = _driver()
    geo = activation_box(m, size_k, tok, u)
    u64, u32 = drv.cuuint64_t, drv.cuuint32_t
    err, tmap = drv.cuTensorMapEncodeTiled(
        drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        2,
        ptr,
        [u64(v) for v in geo.dims],
        [u64(v) for v in geo.strides],
        [u32(v) for v in geo.box],
        [u32(1)] * 2,
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(drv.CUtensorMapSwizzle, f"CU_TENSOR_MAP_SWIZZLE_{geo.swizzle}B"),
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    if err != drv.CUresult.CUDA_SUCCESS:
        raise KernelError(f"cuTensorMapEncodeTiled refused A's map {geo}: {err}", tensor="A")
    return _as_arg(np.array([int(w) for w in tmap.opaque], dtype=np.uint64).view(np.uint8))

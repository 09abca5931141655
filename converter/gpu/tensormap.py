"""Tensor maps for the Hopper bulk tensor copy (``cp.async.bulk.tensor``).

The persistent Hopper kernel (``kernels/marlin_streamk.cu``) reads the activations A
straight from the caller's row-major fp16 ``(M, K)`` array: one bulk tensor copy a
pipeline stage lays a box of A out as ``wgmma``'s no-swizzle K-major operand and fills
the tokens past M with zeros, so no re-layout kernel runs first. The map views A as a
3-D tensor ``[K / 8][M][8]`` (innermost first: the 8 values of one 16-byte chunk, the
token at a stride of K values, the chunk at a stride of 16 bytes), and one box is
``(8, T, 2 U)``: U k-tiles of T tokens, chunk-major, which is the kernel's X slot
(chunk c of token r at byte ``16 (c T + r)``). Up to 32 tokens a chunk
(``Tuning.hopper_xmap_max_tok``): larger boxes, of 768 or more 16-byte rows, were slower
than re-laying A out first and copying it in one run.

The map is encoded on the host by the driver (``cuTensorMapEncodeTiled``, through
NVIDIA's ``cuda-bindings``) and passed to the kernel by value (128 bytes, a
``__grid_constant__`` parameter).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import numpy as np

from ..errors import GpuUnavailableError, KernelError

#: fp16 values per 16-byte chunk of a row of A (wgmma's core-matrix row).
CHUNK_VALUES = 8
#: Bytes of the driver's CUtensorMap.
TENSOR_MAP_BYTES = 128
#: The hardware's largest box extent in any dimension (cuTensorMapEncodeTiled).
MAX_BOX = 256


@dataclasses.dataclass(frozen=True)
class ActivationBox:
    """The tensor-map geometry of A for one (M, K, T, U).

    Attributes:
        dims: global extents, innermost first: ``(8, M, K / 8)``.
        strides: byte strides of dimensions 1 and 2: ``(2 K, 16)``.
        box: box extents: ``(8, T, 2 U)``.
        box_bytes: bytes one copy delivers, zero-filled tokens included: ``32 T U``.
    """

    dims: tuple[int, int, int]
    strides: tuple[int, int]
    box: tuple[int, int, int]
    box_bytes: int


def activation_box(m: int, size_k: int, tok: int, u: int) -> ActivationBox:
    """The geometry of :func:`activation_map` (pure; no GPU).

    Args:
        m: rows of A (tokens), >= 1.
        size_k: K, a multiple of 16 u.
        tok: T, tokens per chunk of the kernel (8 .. 128, a multiple of 8).
        u: U, k-tiles (16 values of K) per pipeline stage.

    Returns:
        The :class:`ActivationBox`.

    Raises:
        KernelError: a size the hardware's box rules exclude.
    """
    rules = [
        (m >= 1, "M >= 1"),
        (u >= 1 and size_k % (16 * u) == 0, f"K a multiple of 16 U = {16 * u}"),
        (tok % 8 == 0 and 0 < tok <= MAX_BOX, f"T a multiple of 8 up to {MAX_BOX} (a box extent)"),
        (0 < 2 * u <= MAX_BOX, f"2 U at most {MAX_BOX} (a box extent)"),
    ]
    broken = [rule for ok, rule in rules if not ok]
    if broken:
        raise KernelError(
            f"no activation box for M={m}, K={size_k}, T={tok}, U={u}: needs {'; '.join(broken)}", tensor="A"
        )
    return ActivationBox(
        dims=(CHUNK_VALUES, m, size_k // CHUNK_VALUES),
        strides=(2 * size_k, 2 * CHUNK_VALUES),
        box=(CHUNK_VALUES, tok, 2 * u),
        box_bytes=32 * tok * u,
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
    it the persistent kernel reads A re-laid out by ``hopper_activations``, as it does
    for chunks over 32 tokens (same bits; 3-11 % slower at 8-24 rows on an H200), and
    this warns once."""
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
    drv = _driver()
    m, size_k = (int(v) for v in a.shape)
    geo = activation_box(m, size_k, tok, u)
    u64, u32 = drv.cuuint64_t, drv.cuuint32_t
    err, tmap = drv.cuTensorMapEncodeTiled(
        drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        3,
        int(a.data.ptr),
        [u64(v) for v in geo.dims],
        [u64(v) for v in geo.strides],
        [u32(v) for v in geo.box],
        [u32(1)] * 3,
        drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
        drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    if err != drv.CUresult.CUDA_SUCCESS:
        raise KernelError(f"cuTensorMapEncodeTiled refused A's map {geo}: {err}", tensor="A")
    return _as_arg(np.array([int(w) for w in tmap.opaque], dtype=np.uint64).view(np.uint8))

"""Load-time operands of the GEMM kernels: ``B`` unit-major, or with each stage's scales
and deltas inline, and the fp16 delta in Marlin's scale order. The artifact never
changes; a layer builds these once when it is loaded, so no call pays for them."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..constants import KERNEL_N_MULTIPLE, MARLIN_TILE
from ..errors import KernelError
from ..marlin.layout import permute_scales
from . import runtime
from .checks import _dev

#: The group size of :func:`prepare_b_stages`'s copy: one group per 8-tile stage.
STAGE_GROUP = 128
#: int32 per (unit, group) run of that copy: 8 k-tile pieces of 512, a scale and a delta row of 128.
STAGE_RUN_INT32 = 8 * 512 + 2 * 128


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

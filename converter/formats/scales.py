"""What the kernels' fp16 can hold: scales, ``delta`` and the weights formed from them.

Marlin's scales are float16, and the kernels round ``delta`` to float16 and form the
float16 weight ``(q - 8) * s (+ delta)`` in registers (docs/gpu.md).  So a layer
converts only when

* every source scale is a float16 value, exactly: an f32 scale (or a bf16 scale below
  float16's normal range) that float16 would round changes every weight of its group
  and column, and the artifact could then not be exact, whatever ``delta`` does
  (:func:`scales_to_fp16` refuses it, with the numbers);
* float16 holds ``delta`` and every weight the layer's codes can form
  (:func:`kernel_range_error`): otherwise the kernels compute with infinities.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..constants import MARLIN_ZERO
from ..errors import SourceFormatError

FP16_MAX = float(np.finfo(np.float16).max)
#: The start of the pass-through reason of a layer the kernels' float16 cannot hold.
FP16_RANGE_REASON = "outside the kernels' float16 range"


def scales_to_fp16(s: np.ndarray, *, path: Path | str, tensor: str) -> np.ndarray:
    """Cast float32 scales to Marlin's float16, refusing any that change.

    Args:
        s: float32 ``(num_groups, size_n)`` as the source stored them (upcast, exactly).

    Returns:
        float16 of the same shape, equal to ``s`` value for value.

    Raises:
        SourceFormatError: a scale is NaN/Inf, its magnitude exceeds the fp16 maximum
            65504, or float16 would round it (names the tensor, how many change, the
            largest relative change and where).
    """
    if not np.all(np.isfinite(s)):
        raise SourceFormatError(f"{int(np.count_nonzero(~np.isfinite(s)))} NaN or Inf scales", path=path, tensor=tensor)
    big = np.abs(s) > FP16_MAX
    if np.any(big):
        raise SourceFormatError(
            f"{int(big.sum())} scales overflow float16 (largest |s| = {float(np.abs(s).max()):.6g} > {FP16_MAX:g})",
            path=path,
            tensor=tensor,
        )
    s16 = s.astype(np.float16)
    back = s16.astype(np.float32)
    changed = back != s
    if np.any(changed):
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(changed, np.abs(back - s) / np.abs(s), 0.0)
        at = _argmax(rel)
        raise SourceFormatError(
            f"{int(changed.sum())} of {s.size} scales are not float16 values and would change in Marlin's "
            f"float16 scales (largest relative change {float(rel[at]):.3g}: {float(s[at]):.9g} -> "
            f"{float(back[at]):.9g} at {list(at)}); an artifact with rounded scales would not be exact",
            path=path,
            tensor=tensor,
        )
    return s16


def fp16_scales(s16: np.ndarray, *, path: Path | str, tensor: str) -> np.ndarray:
    """:func:`scales_to_fp16` for scales the source stores as float16 (same result and
    errors): float16 holds each of them exactly, so only NaN/Inf can be refused, and no
    float32 round trip is needed (the readers call this per chunk).

    Args:
        s16: float16 ``(num_groups, size_n)`` as stored.

    Returns:
        ``s16`` itself.

    Raises:
        SourceFormatError: a scale is NaN or Inf (all exponent bits set), with the count.
    """
    special = (s16.view(np.uint16) & np.uint16(0x7C00)) == np.uint16(0x7C00)
    if np.any(special):
        raise SourceFormatError(f"{int(np.count_nonzero(special))} NaN or Inf scales", path=path, tensor=tensor)
    return s16


def kernel_range_error(s16: np.ndarray, delta: np.ndarray, code_offset: int, bits: int) -> str | None:
    """Why float16 cannot hold a layer's ``delta`` or its kernel weights, or None.

    Args:
        s16: the scales ``(G, N)``, natural column order, as float16 (or float32 that
            this rounds to float16, as the artifact does).
        delta: float32 ``marlin_delta`` ``(G, N)``.
        code_offset, bits: the layer's Marlin codes are ``code_offset .. code_offset +
            2**bits - 1``; the bound covers every one of them.

    Returns:
        One line with the count, the largest magnitude and where, or None.
    """
    lo, hi = code_offset - MARLIN_ZERO, code_offset + (1 << bits) - 1 - MARLIN_ZERO
    if _bounded(s16, delta, max(-lo, hi)):
        return None
    with np.errstate(over="ignore", invalid="ignore"):
        d16 = delta.astype(np.float16)
        bad = ~np.isfinite(d16)
        if np.any(bad):
            at = _argmax(np.abs(delta))
            return (
                f"{int(bad.sum())} delta values overflow float16, which the kernels use (largest |delta| = "
                f"{float(np.abs(delta)[at]):.6g} at [group {at[0]}, column {at[1]}] > {FP16_MAX:g})"
            )
        # The kernels' weight is fp16((q - 8) * s + fp16(delta)), one rounding
        # (converter.gpu.reference.dequant); float64 holds the unrounded value exactly.
        s = s16.astype(np.float16).astype(np.float64)
        d = d16.astype(np.float64)
        worst = np.maximum(np.abs(lo * s + d), np.abs(hi * s + d))
        bad = ~np.isfinite(worst.astype(np.float16))
    if np.any(bad):
        at = _argmax(worst)
        return (
            f"{int(bad.sum())} group columns form weights (q - 8) * s + delta that overflow float16, which the "
            f"kernels use (largest |w| = {float(worst[at]):.6g} at [group {at[0]}, column {at[1]}] > {FP16_MAX:g})"
        )
    return None


def _bounded(s16: np.ndarray, delta: np.ndarray, reach: int) -> bool:
    """True when ``reach * max|s| + max|delta|`` stays below the float16 maximum, so no
    weight or ``delta`` of the layer can overflow: two reductions instead of the exact
    elementwise bound in float64, which only layers near the limit still need (planning
    a 2.1 GB checkpoint: 0.29 s of kernel_range_error, most of it that float64 pass)."""
    if not s16.size:
        return True
    if s16.dtype == np.float16:
        # float16 magnitudes order like their bits without the sign (NaN above Inf), and
        # an integer maximum is much cheaper than NumPy's float16 comparisons.
        top = np.asarray((s16.view(np.uint16) & np.uint16(0x7FFF)).max(), dtype=np.uint16)
        amax_s = float(top.view(np.float16))
    else:
        amax_s = max(float(s16.max()), -float(s16.min()))
    amax_d = max(float(delta.max()), -float(delta.min()))
    # float32 scales may grow by half a float16 ulp (2**-11) when rounded; the sum's own
    # rounding (Python floats are float64) is far below the margin.
    bound = reach * amax_s * (1 + 2**-10) + amax_d * (1 + 2**-10)
    return bool(np.isfinite(amax_s) and np.isfinite(amax_d)) and bound < FP16_MAX * (1 - 1e-6)


def _argmax(a: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(a)), a.shape))

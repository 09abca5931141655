"""Scale dtype handling shared by the readers."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import SourceFormatError

FP16_MAX = float(np.finfo(np.float16).max)


def scales_to_fp16(s: np.ndarray, *, path: Path | str, tensor: str) -> np.ndarray:
    """Cast float32 scales to Marlin's float16 with a range check.

    Args:
        s: float32 ``(num_groups, size_n)`` as the source stored them (upcast).

    Returns:
        float16 of the same shape; exact for fp16 sources, nearest for bf16/f32.

    Raises:
        SourceFormatError: a scale is NaN/Inf or its magnitude exceeds the fp16
            maximum 65504 (names the tensor, the count and the largest value).
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
    return s.astype(np.float16)

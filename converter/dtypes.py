"""Storage dtypes: safetensors dtype codes as NumPy arrays, and widening floats to float32.

NumPy has no bfloat16, so BF16 tensors are carried as their raw ``uint16`` bits
(``SAFETENSORS_DTYPES["BF16"] == "<u2"``) and widened here, the one place that knows
how: bf16 -> f32 is exact, the bf16 bits are the top half of the f32 bits.
"""

from __future__ import annotations

import math

import numpy as np

from .constants import SAFETENSORS_DTYPES

#: Short names of torch's float dtypes, as users write them (``--dtype bf16``).
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}

#: Float dtype codes a source may store scales and biases in.
FLOAT_DTYPES = ("F16", "BF16", "F32")


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of safetensors dtype code ``dtype`` and ``shape``."""
    return math.prod(shape) * np.dtype(SAFETENSORS_DTYPES[dtype]).itemsize


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """float32 array of the same shape from bf16 raw bits (uint16), exactly."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """bf16 raw bits (uint16) of float32 ``x``, rounded to nearest, ties to even, as the
    kernels' ``cvt.rn.bf16x2.f32`` rounds (the bf16 twins' final rounding). NaN stays a
    quiet NaN of the same sign; values beyond bf16's largest finite value round to inf.
    """
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    # adding 0x7FFF plus the kept part's lowest bit rounds the dropped 16 bits to nearest,
    # ties to even; a carry into the exponent is the right next value (or inf)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    return np.where(nan, ((u >> 16) | 0x0040).astype(np.uint16), rounded)


def as_f32(arr: np.ndarray, dtype: str) -> np.ndarray:
    """float32 copy of an F16/BF16/F32 array as stored (BF16 as raw uint16 bits).

    Exact for every input: fp16 and bf16 values are all representable in float32.
    """
    if dtype == "BF16":
        return bf16_to_f32(arr)
    return np.asarray(arr, dtype=np.float32)

"""Argument checks of the kernel launchers: each runs before anything launches and
refuses with a :class:`KernelError` naming the argument, so a bad call never reaches
the GPU half-done."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import KernelError
from ..marlin.shapes import kernel_layer_sizes
from . import runtime


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


def _n_out(n_out: int | None, size_n: int) -> int:
    """The result's columns: ``size_n``, or fewer for a padded layer."""
    if n_out is None:
        return size_n
    if not 0 < int(n_out) <= size_n:
        raise KernelError(f"n_out={n_out} must be in 1..size_n={size_n}", tensor="n_out")
    return int(n_out)

"""The fused GEMM as a torch op: ``torch.ops.marlin_convert.gemm``.

Why an op and not a plain Python call: ``torch.compile(fullgraph=True)`` traces a model
through it (the fake implementation gives the result's shape, so the op is no graph
break), and a call can be captured in a CUDA graph, because after its first call at a
given ``M`` it does nothing a capture forbids:

* the result, the split-K partial sums and the re-laid-out activations come from torch's
  caching allocator (inside a capture, from the graph's private pool);
* the lock counters are the layer's own, allocated once at load time and left zeroed by
  every launch (the last block of each tile resets its counter); a call that needs more
  counters than the layer holds takes zeroed ones from torch's allocator;
* the launch goes through CuPy (``RawKernel``, NVRTC-built at the first call) onto
  torch's current stream, with device addresses as arguments: no CuPy allocation, no
  host-device copy, no synchronisation;
* the plan, the kernel and its shared-memory opt-in are worked out at the first call
  of each ``M`` and cached (:func:`converter.gpu.kernels.gemm_launch`), as is the Hopper
  kernel's tensor map per activation address.

Importing this module imports torch and registers the op (idempotent). The CuPy-array
API is :func:`converter.gpu.kernels.marlin_gemm`; both launch through
:func:`converter.gpu.kernels.emit_gemm`, so they run the same kernels with the same
arguments and give bitwise the same result.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from ..errors import KernelError
from . import kernels, runtime

NAMESPACE = "marlin_convert"
_NULL = np.uint64(0)


class _Stream:
    """What CuPy's launcher reads of a stream: its handle, ``ptr``."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


@functools.lru_cache(maxsize=256)
def _stream(ptr: int) -> _Stream:
    return _Stream(ptr)


@functools.lru_cache(maxsize=8192)
def _launch(
    device: int, m: int, size_k: int, size_n: int, group_size: int, delta: bool, act_order: bool, units: int, n_out: int
) -> kernels.GemmLaunch:
    cp = runtime.cupy_module()
    with cp.cuda.Device(device):
        return kernels.gemm_launch(
            m,
            size_k,
            size_n,
            group_size,
            delta=delta,
            act_order=act_order,
            units_mode=units,
            n_out=n_out,
            has_b=units == 0,
        )


def _ptr(t: torch.Tensor | None) -> np.uint64:
    return _NULL if t is None else np.uint64(t.data_ptr())


def units_mode(b: torch.Tensor) -> int:
    """0 for Marlin's ``B`` (2-D), 1 for ``B`` unit-major, 2 with the scales and deltas
    inline (:func:`converter.gpu.kernels.prepare_b_units` / ``prepare_b_stages``)."""
    if b.dim() == 2:
        return 0
    return 2 if b.shape[-1] == kernels.STAGE_RUN_INT32 else 1


def run_gemm(
    x: torch.Tensor,
    b: torch.Tensor,
    scales: torch.Tensor,
    delta: torch.Tensor | None,
    perm: torch.Tensor | None,
    bias: torch.Tensor | None,
    locks: torch.Tensor,
    size_k: int,
    size_n: int,
    group_size: int,
    n_out: int,
) -> torch.Tensor:
    """The op's CUDA implementation (also called directly by the module in eager mode,
    which skips the dispatcher's overhead; the result is the same).

    Args:
        x: float16 ``(M, size_k)``, C-contiguous, on a CUDA device, source channel order.
        b: int32 Marlin ``B`` ``(size_k / 16, 2 size_n)`` or its unit-major copy.
        scales: float16 ``(G, size_n)`` Marlin-permuted; delta: float16 ``(G, size_n)``
            from ``prepare_delta`` or None; perm: int32 ``(size_k,)`` or None; bias:
            float16 ``(n_out,)`` or None; locks: int32 zeroed counters (any length).
        size_k, size_n, group_size, n_out: the layer (``size_n`` padded to 64).

    Returns:
        float16 ``(M, n_out)``.

    Raises:
        KernelError: ``x`` is not float16 ``(M, size_k)`` C-contiguous CUDA, or the
            kernels cannot serve the sizes.
    """
    if x.dtype != torch.float16 or x.dim() != 2 or x.shape[1] != size_k or not x.is_cuda:
        raise KernelError(
            f"expected a float16 CUDA tensor (M, {size_k}), got {x.dtype} {tuple(x.shape)} on {x.device}", tensor="A"
        )
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    m = x.shape[0]
    dev = x.device
    out = torch.empty((m, n_out), dtype=torch.float16, device=dev)
    if m == 0:  # an empty batch: nothing to plan or launch (the planner wants M >= 1)
        return out
    run = _launch(dev.index, m, size_k, size_n, group_size, delta is not None, perm is not None, units_mode(b), n_out)
    stream = _stream(torch.cuda.current_stream(dev).cuda_stream)
    a = x
    if run.gather:
        a = torch.empty_like(x)
        kernels.emit_gather(_ptr(x), _ptr(perm), _ptr(a), m, size_k, stream)
    ws = torch.empty(run.ws_floats, dtype=torch.float32, device=dev) if run.ws_floats else None
    lk = locks if run.n_locks <= locks.numel() else torch.zeros(run.n_locks, dtype=torch.int32, device=dev)
    at = torch.empty(run.at_halves, dtype=torch.float16, device=dev) if run.at_halves else None
    a_ptr = a.data_ptr()
    kernels.emit_gemm(
        run,
        np.uint64(a_ptr),
        a_ptr,
        _ptr(perm),
        _ptr(b),
        _ptr(scales),
        _ptr(delta),
        _ptr(bias),
        _ptr(out),
        _ptr(ws),
        _ptr(lk),
        _ptr(at),
        stream,
    )
    return out


#: ``torch.ops.marlin_convert.gemm``: :func:`run_gemm` registered as a torch op (CUDA only).
gemm = torch.library.custom_op(f"{NAMESPACE}::gemm", run_gemm, mutates_args=(), device_types="cuda")


@gemm.register_fake
def _gemm_fake(x: torch.Tensor, *operands: Any) -> torch.Tensor:
    """The result's shape and dtype, for tracing: ``(M, n_out)`` float16 (operands as :func:`run_gemm`'s)."""
    size_k, n_out = operands[6], operands[9]
    torch._check(x.shape[1] == size_k)
    return x.new_empty((x.shape[0], n_out), dtype=torch.float16)

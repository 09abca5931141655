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
import os
from typing import Any

import numpy as np
import torch

from ..errors import KernelError
from . import kernels, runtime, tensormap

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


#: torch dtype of the activations -> the kernels' activation type (``build.ACTS``).
ACTS = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


@functools.lru_cache(maxsize=8192)
def _launch(
    device: int,
    m: int,
    size_k: int,
    size_n: int,
    group_size: int,
    delta: bool,
    act_order: bool,
    units: int,
    n_out: int,
    act: str = "float16",
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
            act=act,
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
        x: float16 or bfloat16 ``(M, size_k)``, C-contiguous, on a CUDA device, source
            channel order.
        b: int32 Marlin ``B`` ``(size_k / 16, 2 size_n)`` or its unit-major copy.
        scales: float16 ``(G, size_n)`` Marlin-permuted; delta: float16 ``(G, size_n)``
            from ``prepare_delta`` or None; perm: int32 ``(size_k,)`` or None; bias:
            float16 ``(n_out,)`` or None; locks: int32 zeroed counters (any length).
        size_k, size_n, group_size, n_out: the layer (``size_n`` padded to 64).

    Returns:
        ``(M, n_out)`` of ``x``'s dtype.

    Raises:
        KernelError: ``x`` is not a float16 or bfloat16 ``(M, size_k)`` CUDA tensor, or
            the kernels cannot serve the sizes.
    """
    act = ACTS.get(x.dtype)
    if act is None or x.dim() != 2 or x.shape[1] != size_k or not x.is_cuda:
        raise KernelError(
            f"expected a float16 or bfloat16 CUDA tensor (M, {size_k}), got {x.dtype} {tuple(x.shape)} on {x.device}",
            tensor="A",
        )
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    m = x.shape[0]
    dev = x.device
    if torch.cuda.current_device() != dev.index:
        # The kernels are loaded and launched in the current device's context: enter the layer's.
        with torch.cuda.device(dev):
            return run_gemm(x, b, scales, delta, perm, bias, locks, size_k, size_n, group_size, n_out)
    out = torch.empty((m, n_out), dtype=x.dtype, device=dev)
    if m == 0:  # an empty batch: nothing to plan or launch (the planner wants M >= 1)
        return out
    run = _launch(
        dev.index, m, size_k, size_n, group_size, delta is not None, perm is not None, units_mode(b), n_out, act
    )
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


# ----------------------------------------------------------------------------- fast launch

#: Environment switch of the module's packed eager launch (:class:`FastGemm`): "1" on,
#: "0" off (the launch through :func:`run_gemm`). Read at every call, so it can be flipped
#: for an A/B run.
FAST_LAUNCH_ENV = "MARLIN_FAST_LAUNCH"
#: Whether the packed launch is on when the switch is unset.
FAST_LAUNCH_DEFAULT = "1"
#: Tensor maps a :class:`FastGemm` keeps by activation address before it starts over
#: (the caching allocator hands a serving loop the same few addresses back).
_MAPS_KEPT = 64


def fast_launch_on() -> bool:
    """The packed eager launch is switched on (:data:`FAST_LAUNCH_ENV`)."""
    return os.environ.get(FAST_LAUNCH_ENV, FAST_LAUNCH_DEFAULT) != "0"


def _raw_stream_fn() -> Any:
    """``device index -> torch's current stream handle``, without building a
    ``torch.cuda.Stream`` object per call (the private binding where torch has it)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda index: torch.cuda.current_stream(index).cuda_stream


class _Packed:
    """One kernel's launch with its arguments packed (:func:`converter.gpu.kernels.pack_args`):
    the per-call values are patched into the buffers, then the driver launches it."""

    __slots__ = ("fn_ptr", "grid", "block", "smem", "args", "words", "params", "params_ptr", "slots")

    def __init__(self, call: kernels.KernelCall, maps: tuple[Any, ...] = ()) -> None:
        self.args = kernels.pack_args(call.args, maps)
        self.fn_ptr = int(call.fn.kernel.ptr)  # the CUfunction of the current device
        self.grid = (*call.grid, 1, 1)[:3]
        self.block = (*call.block, 1, 1)[:3]
        self.smem = int(call.shared_mem)
        self.words, self.params, self.params_ptr = self.args.words, self.args.params, self.args.params_ptr
        self.slots = self.args.slots

    def word(self, name: str) -> int | None:
        """Index into ``words`` of an address slot (None: the call has no such slot)."""
        hit = self.slots.get(name)
        return None if hit is None else hit[1] // 8

    def launch(self, stream: int) -> None:
        # cuLaunchKernel copies the arguments from the buffers before it returns.
        (gx, gy, gz), (bx, by, bz) = self.grid, self.block
        _launch_kernel(self.fn_ptr, gx, gy, gz, bx, by, bz, self.smem, stream, self.params_ptr, 0)


_launch_kernel: Any = None


def _driver_launch() -> Any:
    """CuPy's binding of ``cuLaunchKernel`` (imported once)."""
    global _launch_kernel
    if _launch_kernel is None:
        from cupy.cuda import driver

        _launch_kernel = driver.launchKernel
    return _launch_kernel


class FastGemm:
    """The launches of one layer at one ``M`` on one device, packed once: the same
    kernels with the same arguments as :func:`run_gemm` (they come from the same
    :class:`~converter.gpu.kernels.KernelCall` helpers :func:`~converter.gpu.kernels.emit_gemm`
    launches), but a call only allocates from torch's caching allocator, patches the
    addresses that change (A or its tensor map, the result, the partial sums, ``At``,
    the gathered A) and calls ``cuLaunchKernel``: no lookup of the plan, no stream
    object, no per-argument conversion by CuPy.

    The operands (``b`` ... ``locks``) are packed as addresses: the owner must drop the
    object when they move (``MarlinLinearModule`` does on ``_apply``). One object must
    not be called from two threads at once (the buffers are patched in place).
    """

    def __init__(
        self,
        device: int,
        m: int,
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
        dtype: torch.dtype = torch.float16,
    ) -> None:
        self.device, self.m, self.size_k, self.n_out, self.dtype = device, m, size_k, n_out, dtype
        self.dev = torch.device("cuda", device)
        act, units = ACTS[dtype], units_mode(b)
        run = _launch(device, m, size_k, size_n, group_size, delta is not None, perm is not None, units, n_out, act)
        self.run = run
        self.ws_floats, self.at_halves = run.ws_floats, run.at_halves
        # A call that needs more counters than the layer holds takes zeroed ones per call.
        self.own_locks = run.n_locks > locks.numel()
        self.stream = _raw_stream_fn()
        _driver_launch()
        slot = kernels.Slot
        a, at = slot("a"), slot("at")
        lk = slot("locks") if self.own_locks else _ptr(locks)
        maps = (tensormap.unused(),) if run.lead == "at" else ()
        with runtime.cupy_module().cuda.Device(device):
            gemm = kernels.gemm_call(
                run, a, slot("xmap", by_ref=True), _ptr(b), _ptr(scales), _ptr(delta), _ptr(bias),
                slot("out"), slot("ws") if run.ws_floats else _NULL, lk, at if run.at_halves else _NULL,
            )  # fmt: skip
            self.gemm = _Packed(gemm, maps)
            first = kernels.gemm_prologue_call(run, a, _ptr(perm), at)
            self.first = None if first is None else _Packed(first)
            gather = kernels.gather_call(a, _ptr(perm), slot("gathered"), m, size_k) if run.gather else None
            self.gather = None if gather is None else _Packed(gather)
        g = self.gemm
        self.w_a, self.w_out, self.w_ws = g.word("a"), g.word("out"), g.word("ws")
        self.w_at, self.w_locks = g.word("at"), g.word("locks")
        self.p_xmap = g.slots["xmap"][0] if "xmap" in g.slots else None
        self.maps: dict[int, tuple[Any, int]] = {}
        if self.gather is not None:
            self.wg_a, self.wg_out = self.gather.word("a"), self.gather.word("gathered")
        if self.first is not None:
            self.wf_a, self.wf_at = self.first.word("a"), self.first.word("at")

    def _map(self, a_ptr: int) -> tuple[Any, int]:
        """A's tensor map (kept alive here) and its host address."""
        hit = self.maps.get(a_ptr)
        if hit is None:
            if len(self.maps) >= _MAPS_KEPT:
                self.maps.clear()
            run = self.run
            tmap = tensormap.activation_map_at(a_ptr, run.m, run.size_k, run.plan.rows, run.plan.u)
            hit = self.maps[a_ptr] = (tmap, int(tmap.raw.ctypes.data))
        return hit

    def __call__(self, x: torch.Tensor, a_ptr: int) -> torch.Tensor:
        """``x`` ``(m, size_k)`` of the object's dtype, C-contiguous, 16-byte aligned at
        ``a_ptr``, on ``device`` (the caller checks) -> ``(m, n_out)`` of that dtype."""
        dev = self.dev
        if torch.cuda.current_device() != self.device:
            # cuLaunchKernel runs in the current context; the packed function is the layer device's.
            with torch.cuda.device(self.device):
                return self(x, a_ptr)
        out = torch.empty((self.m, self.n_out), dtype=self.dtype, device=dev)
        stream = self.stream(self.device)
        gemm, words = self.gemm, self.gemm.words
        gathered = None
        if self.gather is not None:  # act-order, A read as it is: gather it first
            gathered = torch.empty_like(x)
            g = self.gather
            g.words[self.wg_a] = a_ptr
            a_ptr = g.words[self.wg_out] = gathered.data_ptr()
            g.launch(stream)
        ws = torch.empty(self.ws_floats, dtype=torch.float32, device=dev) if self.ws_floats else None
        at = torch.empty(self.at_halves, dtype=torch.float16, device=dev) if self.at_halves else None
        if self.first is not None:  # A re-laid out (and gathered) into At first
            f = self.first
            f.words[self.wf_a] = a_ptr
            f.words[self.wf_at] = at.data_ptr()
            f.launch(stream)
        if self.p_xmap is not None:
            tmap, addr = self._map(a_ptr)  # tmap held until the launch has copied it
            gemm.params[self.p_xmap] = addr
        if self.w_a is not None:
            words[self.w_a] = a_ptr
        words[self.w_out] = out.data_ptr()
        if ws is not None:
            words[self.w_ws] = ws.data_ptr()
        if at is not None:
            words[self.w_at] = at.data_ptr()
        if self.own_locks:
            lk = torch.zeros(self.run.n_locks, dtype=torch.int32, device=dev)
            words[self.w_locks] = lk.data_ptr()
        gemm.launch(stream)
        return out


#: ``torch.ops.marlin_convert.gemm``: :func:`run_gemm` registered as a torch op (CUDA only).
gemm = torch.library.custom_op(f"{NAMESPACE}::gemm", run_gemm, mutates_args=(), device_types="cuda")


@gemm.register_fake
def _gemm_fake(x: torch.Tensor, *operands: Any) -> torch.Tensor:
    """The result's shape and dtype, for tracing: ``(M, n_out)`` of ``x``'s dtype (operands as :func:`run_gemm`'s)."""
    size_k, n_out = operands[6], operands[9]
    # what run_gemm refuses, refused while tracing too, in its words (the device is not
    # checked: a fake tensor's is the traced one's)
    if ACTS.get(x.dtype) is None or x.dim() != 2:
        raise KernelError(
            f"expected a float16 or bfloat16 CUDA tensor (M, {size_k}), got {x.dtype} {tuple(x.shape)}", tensor="A"
        )
    torch._check(
        x.shape[1] == size_k,
        lambda: f"A: expected a float16 or bfloat16 CUDA tensor (M, {size_k}), got {x.dtype} {tuple(x.shape)}",
    )
    return x.new_empty((x.shape[0], n_out))

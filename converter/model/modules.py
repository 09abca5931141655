"""The linear modules swapped into a transformers model (torch; imported lazily).

Every swapped module computes ``y = x @ W + b`` for ``x`` of shape ``(..., K)`` and
returns ``(..., N)`` in ``x``'s own dtype, so it drops into any architecture whatever
dtype its activations flow in (a bf16 embedding makes bf16 activations):

* :class:`KernelMarlinLinear`: our CUDA kernel (``converter.gpu.api.MarlinLinearModule``),
  fp16 in and out as the kernel needs; the fast path on the GPU.
* :class:`ExactMarlinLinear`: the same layer computed exactly in fp32 from the
  artifact's own tensors (``B`` unpacked, scales unpermuted, ``delta`` added, input
  gathered by ``perm``), with the kernel's fp16 input and output rounding; the CPU
  path, and the GPU fallback for a layer outside the kernel's limits.
* :class:`DenseLinear`: a dense weight in fp16 or fp32: quantized layers that passed
  through unconverted (dequantized exactly, then fp16), and the reference models.

All buffers are non-persistent: a swapped model is for inference, its ``state_dict``
holds only the pass-through tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..constants import MARLIN_ZERO
from ..formats.scales import FP16_MAX

_TORCH_DTYPES = {
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip

#: Path names in the load report (and ``module.path``).
KERNEL, EXACT, DEQUANT_FP16, DENSE_FP32 = "marlin-kernel", "exact", "dequant-fp16", "dense-fp32"


def to_torch(arr: np.ndarray, dtype: str) -> torch.Tensor:
    """A torch copy of a safetensors array in its own dtype (BF16 arrives as raw uint16).

    Raises:
        ValueError: a dtype torch cannot hold here (F8, unsigned 16/32/64-bit).
    """
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"tensors of dtype {dtype} cannot be loaded into a torch model")
    a = np.array(arr, copy=True)  # writable, owned: torch shares it
    if dtype == "BF16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def to_torch_f32(arr: np.ndarray, dtype: str) -> torch.Tensor:
    """A float32 torch tensor of a float safetensors array (F16, BF16 as raw uint16, F32,
    F64), made in one allocation; other dtypes as :func:`to_torch`. bf16 and fp16 to
    fp32 are exact."""
    if dtype == "BF16":
        return torch.from_numpy((np.asarray(arr, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32))
    if dtype in ("F16", "F32", "F64"):
        return torch.from_numpy(np.array(arr, dtype=np.float32))
    return to_torch(arr, dtype)


def dtype_code(t: torch.Tensor) -> str:
    """The safetensors dtype code of a torch tensor (``"F16"``, ``"BF16"`` ...)."""
    for code, dt in _TORCH_DTYPES.items():
        if t.dtype == dt:
            return code
    return str(t.dtype)


#: What a kernel module takes when it says nothing (``act_dtypes``): fp16 only.
_FP16_ONLY = (torch.float16,)


def _kernel_input(kernel: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``kernel`` takes it: in its own dtype where the kernel runs that dtype
    (``MarlinLinearModule``: fp16 and bf16, so a bf16 model is never cast), else cast to
    fp16; contiguous. A contiguous ``x`` of a taken dtype is returned itself, without the
    two dispatcher calls (a few microseconds of host time per layer in eager decode)."""
    if x.dtype not in getattr(kernel, "act_dtypes", _FP16_ONLY):
        x = x.to(torch.float16)
    return x if x.is_contiguous() else x.contiguous()


class _Swapped(nn.Module):
    """What the swapped modules share: ``keep_raw`` (set by ``marlin-verify --model``'s
    per-layer probe) keeps the last output before any cast to the input's dtype in
    ``raw_output`` (the kernel's own dtype: fp16, or bf16 for a bf16 input), so an fp32
    model's activations do not hide the layer's own rounding."""

    keep_raw = False
    raw_output: torch.Tensor | None = None


class _KeepsDtypes(nn.Module):
    """``model.to(dtype)`` (``.half()``, ``.float()``) moves these modules' tensors but
    keeps their dtypes: the tensors are what the layer is, in the dtypes its arithmetic
    reads (its forward takes any activation type), and a bf16 round trip would change them
    for good."""

    def _apply(self, fn: Any, *args: Any, **kw: Any) -> Any:
        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            r = fn(t)
            return r if r.dtype == t.dtype else t.to(r.device)

        return super()._apply(keep_dtype, *args, **kw)


class ExactMarlinLinear(_KeepsDtypes, _Swapped):
    """One converted layer computed exactly from the artifact: ``y = x @ W + b``.

    ``W[k] = (q[k] - 8) * s[g(k)] + delta[g(k)]`` in fp32 for Marlin row ``k`` (source
    input channel ``perm[k]``), formed in each forward (only the 4-bit codes are kept,
    as uint8); as the kernel does, a bf16 ``x`` stays bf16 (exact in fp32) and ``y`` is
    rounded to bf16, any other ``x`` is rounded to fp16 first and ``y`` to fp16 last; ``y``
    is returned in ``x``'s dtype. ``model.to(dtype)`` moves the operands but keeps their
    dtypes (the weight is the artifact's, whatever the activations are).

    Args:
        name: the layer's artifact prefix.
        q: uint8 ``(K, N)`` Marlin codes (``unpack_b(marlin_B)``), Marlin row order.
        scales: float16 ``(G, N)`` natural column order (``unpermute_scales``).
        delta: float32 ``(G, N)``.
        perm: int ``(K,)`` or None (act-order gather).
        bias: ``(N,)`` tensor in its own dtype, or None.
        group_size: rows per group (``K`` for per-channel).
    """

    def __init__(
        self,
        name: str,
        q: np.ndarray,
        scales: np.ndarray,
        delta: np.ndarray,
        perm: np.ndarray | None,
        bias: torch.Tensor | None,
        group_size: int,
    ) -> None:
        super().__init__()
        self.layer_name, self.path = name, EXACT
        self.in_features, self.out_features = int(q.shape[0]), int(q.shape[1])
        self.group_size = group_size
        self.register_buffer("q", torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8).copy()), persistent=False)
        self.register_buffer("scales", torch.from_numpy(np.array(scales, dtype=np.float16)), persistent=False)
        self.register_buffer("delta", torch.from_numpy(np.array(delta, dtype=np.float32)), persistent=False)
        groups = torch.arange(self.in_features) // group_size
        self.register_buffer("groups", groups, persistent=False)
        self.register_buffer(
            "perm",
            None if perm is None else torch.from_numpy(np.asarray(perm, dtype=np.int64).copy()),
            persistent=False,
        )
        self.register_buffer("bias", bias, persistent=False)

    def weight_f32(self) -> torch.Tensor:
        """float32 ``(K, N)`` in Marlin row order: ``(q - 8) * s + delta`` per row's group."""
        g = self.groups
        return (self.q.float() - MARLIN_ZERO) * self.scales.float()[g] + self.delta[g]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_floating_point() or x.shape[-1] != self.in_features:
            # an integer or complex x would be truncated or lose its imaginary part, quietly
            from . import ModelError

            raise ModelError(
                f"expected floating-point activations (..., {self.in_features}), got {x.dtype} {tuple(x.shape)}",
                tensor=self.layer_name,
            )
        half = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float16
        a = x.to(half).float()
        if self.perm is not None:
            a = a.index_select(-1, self.perm)
        y = a @ self.weight_f32()
        if self.bias is not None:
            y = y + self.bias.float()
        y = y.to(half)
        if self.keep_raw:
            self.raw_output = y
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.layer_name}: in_features={self.in_features}, out_features={self.out_features}, "
            f"group_size={self.group_size}"
        )


class KernelMarlinLinear(_Swapped):
    """A kernel module made dtype-agnostic: an input of a dtype the kernel takes
    (``act_dtypes``: fp16 and bf16 for ``MarlinLinearModule``) goes in as it is and the
    result comes back in it; any other is cast to fp16 and the result back.

    Args:
        name: the layer's artifact prefix.
        kernel: ``MarlinLinearModule`` (or anything with its contract: ``(..., K)`` of a
            dtype in its ``act_dtypes``, fp16 when it has none -> ``(..., N)`` of the
            same dtype, bias applied inside).
        in_features, out_features: K and N.
    """

    def __init__(self, name: str, kernel: nn.Module, in_features: int, out_features: int) -> None:
        super().__init__()
        self.layer_name, self.path = name, KERNEL
        self.in_features, self.out_features = in_features, out_features
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel(_kernel_input(self.kernel, x))
        if self.keep_raw:
            self.raw_output = y
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.layer_name}: in_features={self.in_features}, out_features={self.out_features}"


class FusedKernel(nn.Module):
    """One kernel module over sibling layers' concatenated columns (:mod:`converter.model.fuse`).

    :meth:`result` gives the whole fp16 result ``(..., sum of N)`` for ``x``; the siblings
    (:class:`FusedSlice`) each take their columns of it. The result of the last tensor is
    held until every sibling has taken it, then dropped, so the group holds nothing
    between two calls of the model (a compiled graph sees the same state each call).

    Args:
        name: the group's name.
        kernel: as :class:`KernelMarlinLinear`'s, over the concatenated columns.
        siblings: how many :class:`FusedSlice` share the result.
    """

    def __init__(self, name: str, kernel: nn.Module, siblings: int) -> None:
        super().__init__()
        self.group_name, self.kernel, self.siblings = name, kernel, siblings
        self._held: tuple[torch.Tensor, torch.Tensor, int] | None = None

    def result(self, x: torch.Tensor) -> torch.Tensor:
        held = self._held
        if held is not None and held[0] is x:
            left = held[2] - 1
            self._held = None if left == 0 else (x, held[1], left)
            return held[1]
        y = self.kernel(_kernel_input(self.kernel, x))
        self._held = (x, y, self.siblings - 1) if self.siblings > 1 else None
        return y

    def extra_repr(self) -> str:
        return f"{self.group_name}: siblings={self.siblings}"


class FusedSlice(_Swapped):
    """One converted layer of a fused group: columns ``start:stop`` of the group's result,
    in ``x``'s dtype (a view: no copy when the kernel ran that dtype).

    Args:
        name: the layer's artifact prefix.
        fused: the group's :class:`FusedKernel` (one module, shared by the siblings).
        start, stop: the layer's columns in the group's result.
        in_features: K.
    """

    def __init__(self, name: str, fused: FusedKernel, start: int, stop: int, in_features: int) -> None:
        super().__init__()
        self.layer_name, self.path = name, KERNEL
        self.in_features, self.out_features = in_features, stop - start
        self.start, self.stop = start, stop
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fused.result(x)[..., self.start : self.stop]
        if self.keep_raw:
            self.raw_output = y
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.layer_name}: in_features={self.in_features}, columns {self.start}:{self.stop} of the group"


def _dense_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` in the weight's dtype where the activations have it, else in fp32
    (the caller rounds to the activations' dtype): activations are never cast to a
    narrower type on the way in (bf16 or fp32 ones to an fp16 weight's, whose range ends
    at 65504), and an fp32 weight (a pass-through layer beyond fp16) is never rounded."""
    if x.dtype == w.dtype:
        return F.linear(x, w, None if bias is None else bias.to(w.dtype))
    return F.linear(x.float(), w.float(), None if bias is None else bias.float())


def fits_fp16(w: torch.Tensor) -> bool:
    """Whether every value of ``w`` is finite and within fp16's range (65504)."""
    return w.numel() == 0 or bool(torch.isfinite(w).all()) and float(w.abs().max()) <= FP16_MAX


def sixteen_bit(w: torch.Tensor, half: torch.dtype) -> torch.Tensor:
    """A dequantized fp32 weight as a 16-bit linear holds it: in ``half``, except that a
    weight beyond fp16's range stays fp32 (in fp16 it would be inf; the loader's
    ``dense-fp32`` rule)."""
    return w if half == torch.float16 and not fits_fp16(w) else w.to(half)


class DenseLinear(_KeepsDtypes, _Swapped):
    """``y = x @ weight.T + bias`` with a dense weight, computed in the weight's dtype
    where the activations have it, else in fp32, and returned in the activations' dtype.

    Args:
        name: the layer's name in its checkpoint.
        weight: ``(N, K)`` float16 or float32.
        bias: ``(N,)`` in any float dtype (cast to the weight's in forward), or None.
        path: label for reports (:data:`DEQUANT_FP16`, :data:`DENSE_FP32`).
    """

    def __init__(self, name: str, weight: torch.Tensor, bias: torch.Tensor | None, path: str) -> None:
        super().__init__()
        self.layer_name, self.path = name, path
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _dense_linear(x, self.weight, self.bias)
        if self.keep_raw:
            self.raw_output = y
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self) -> str:
        return (
            f"{self.layer_name}: in_features={self.in_features}, out_features={self.out_features}, "
            f"dtype={self.weight.dtype}"
        )


class LazyDenseLinear(_KeepsDtypes, _Swapped):
    """:class:`DenseLinear` whose weight is made at each call and dropped after it, so a
    reference model holds one layer's weight at a time (``marlin-verify --model
    --device-map``: a model larger than host memory in fp32). The same arithmetic as
    :class:`DenseLinear` on the same weight, so the same bits.

    Args:
        name: the layer's name in its checkpoint.
        load: makes the ``(N, K)`` weight in its final dtype (float16 or float32).
        shape: ``(N, K)``.
        bias: as :class:`DenseLinear`'s.
        path: label for reports (:data:`DEQUANT_FP16`, :data:`DENSE_FP32`).
    """

    def __init__(
        self, name: str, load: Callable[[], torch.Tensor], shape: tuple[int, int], bias: torch.Tensor | None, path: str
    ) -> None:
        super().__init__()
        self.layer_name, self.path, self._load = name, path, load
        self.out_features, self.in_features = int(shape[0]), int(shape[1])
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _dense_linear(x, self._load().to(x.device), self.bias)
        if self.keep_raw:
            self.raw_output = y
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.layer_name}: in_features={self.in_features}, out_features={self.out_features}, lazy"


def promoting_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` for weights loaded in their own dtype: computes in the
    promoted dtype of ``x``, weight and bias (an fp32 pooler on bf16 activations gives
    fp32), where plain ``F.linear`` refuses mixed dtypes."""
    dt = torch.promote_types(x.dtype, self.weight.dtype)
    if self.bias is not None:
        dt = torch.promote_types(dt, self.bias.dtype)
    w = self.weight if self.weight.dtype == dt else self.weight.to(dt)
    b = None if self.bias is None else (self.bias if self.bias.dtype == dt else self.bias.to(dt))
    return F.linear(x if x.dtype == dt else x.to(dt), w, b)


def swapped_modules(model: nn.Module) -> dict[str, Any]:
    """``{module name: module}`` of every module this package swapped in."""
    return {n: m for n, m in model.named_modules() if isinstance(m, _Swapped)}

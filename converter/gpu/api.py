"""Run converted layers on the GPU: per-layer callables and a ``torch.nn.Module``.

``load_artifact_gpu(path)`` reads an artifact through ``converter.artifact.reader``
(``open_artifact(path) -> Artifact`` with ``.layers`` and ``.tensor(name)``), copies
each layer's Marlin tensors to the current GPU once, and returns a
:class:`MarlinLinear` per layer. Nothing here imports CuPy or torch at module import.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from ..constants import Suffix
from ..dtypes import bf16_to_f32
from ..errors import KernelError
from . import kernels, runtime


def _bias_to_f16(raw: np.ndarray) -> np.ndarray:
    """Artifact bias (float16, float32, or bf16 stored as raw uint16) as float16."""
    if raw.dtype == np.uint16:
        return bf16_to_f32(raw).astype(np.float16)
    return np.asarray(raw).astype(np.float16)


class MarlinLinear:
    """One converted linear layer resident on the GPU: ``y = x @ W + bias``.

    ``W`` is the artifact's weight including the asymmetric correction (fused into the
    GEMM when ``marlin_delta`` is non-zero) and ``bias`` is added in the GEMM's epilogue.
    A padded layer's kernels compute ``padded_n`` columns and store the first ``size_n``
    into the result directly (no copy). On sm_90, a layer that the persistent kernel
    serves at every M (:func:`~converter.gpu.kernels.keeps_b_units`) keeps ``B``
    unit-major only (:func:`~converter.gpu.kernels.prepare_b_units`; the same size but a
    ragged last unit's zero padding; while it is made, ``B`` and the copy are both on the
    device); an asymmetric layer of groups of 128 keeps it with each stage's scales and
    deltas inline instead (:func:`~converter.gpu.kernels.prepare_b_stages`, 6 % larger
    than ``B``; the separate scales and deltas stay too; while it is made, ``B``, a
    unit-major temporary and the copy are on the device at once, about 3x ``B``).

    Attributes:
        name: layer prefix in the artifact.
        size_k, size_n, group_size: the layer's sizes (group_size == size_k: per-channel);
            ``size_n`` the true N, the result's columns.
        padded_n: the width of ``B``, the scales and ``delta`` (``size_n`` unless padded).
    """

    def __init__(
        self,
        name: str,
        size_k: int,
        size_n: int,
        group_size: int,
        B: np.ndarray,
        scales: np.ndarray,
        delta: np.ndarray | None,
        perm: np.ndarray | None,
        bias: np.ndarray | None,
        *,
        padded_n: int | None = None,
    ) -> None:
        """Copy the layer's tensors to the current GPU.

        Args:
            name: layer prefix.
            size_k, size_n, group_size: sizes as in the artifact's layer record.
            B: int32 ``(K/16, 2P)``; scales: float16 ``(G, P)`` Marlin-permuted;
            delta: float32 ``(G, P)`` or None; perm: int32 ``(K,)`` or None;
            bias: float16 ``(N,)`` or None; ``P`` is ``padded_n`` (default ``size_n``).
            padded_n: the record's ``padded_n`` for a padded layer, else None.

        Raises:
            GpuUnavailableError: no CuPy / GPU / sm_80+.
            KernelError: the sizes are outside what the kernels support.
        """
        cp = runtime.cupy_module()
        self.name = name
        self.size_k, self.size_n, self.group_size = size_k, size_n, group_size
        self.padded_n = size_n if padded_n is None else padded_n
        kernels.gemm_plan(1, size_k, self.padded_n, group_size)  # fail early on unsupported sizes
        if not 0 < size_n <= self.padded_n:
            raise KernelError(f"size_n={size_n} must be in 1..padded_n={self.padded_n}", tensor=name)
        self._B = cp.asarray(np.ascontiguousarray(B, dtype=np.int32))
        self._scales = cp.asarray(np.ascontiguousarray(scales, dtype=np.float16))
        use_delta = delta is not None and bool(np.any(delta))
        # The GEMM's own delta operand (fp16, scale order), converted once here.
        self._delta = kernels.prepare_delta(np.ascontiguousarray(delta, dtype=np.float32)) if use_delta else None
        self._B_units = None
        if kernels.keeps_b_stages(size_k, self.padded_n, group_size, use_delta):
            # Every call goes to the persistent kernel, groups of 128: B with each stage's
            # scales and deltas inline, one contiguous run a stage.
            self._B_units = kernels.prepare_b_stages(self._B, self._scales, self._delta, size_k, self.padded_n)
            self._B = None
        elif kernels.keeps_b_units(size_k, self.padded_n, group_size):
            # Every call goes to the persistent kernel: keep B unit-major only, so that each
            # block's run of the weight stream is one contiguous stretch.
            self._B_units = kernels.prepare_b_units(self._B, size_k, self.padded_n)
            self._B = None
        self._perm = None if perm is None else cp.asarray(np.ascontiguousarray(perm, dtype=np.int32))
        self._bias = None if bias is None else cp.asarray(np.ascontiguousarray(bias, dtype=np.float16))

    def __call__(self, x: Any) -> Any:
        """Apply the layer.

        Args:
            x: float16 ``(..., size_k)`` CuPy array or any DLPack-exporting GPU array
                (e.g. a CUDA torch tensor); leading dims are flattened into M.

        Returns:
            float16 CuPy array ``(..., size_n)`` (a padded layer's true N).

        Raises:
            KernelError: wrong dtype, shape or device. GpuUnavailableError: no GPU.
        """
        cp = runtime.cupy_module()
        if not isinstance(x, cp.ndarray):
            if not hasattr(x, "__dlpack__"):
                raise KernelError(f"{self.name}: input must be a CuPy or DLPack array", tensor=self.name)
            x = cp.from_dlpack(x)
        if x.ndim < 1 or x.shape[-1] != self.size_k:
            raise KernelError(f"input last dim must be {self.size_k}, got shape {tuple(x.shape)}", tensor=self.name)
        lead = tuple(x.shape[:-1])
        x2 = cp.ascontiguousarray(x.reshape(-1, self.size_k))
        y = kernels.marlin_gemm(
            x2,
            self._B,
            self._scales,
            b_units=self._B_units,
            size_k=self.size_k,
            size_n=self.padded_n,
            group_size=self.group_size,
            delta=self._delta,
            perm=self._perm,
            bias=self._bias,
            n_out=self.size_n,
        )
        return y.reshape(*lead, self.size_n)


def _layer_tensor(art: Any, layer: str, suffix: Suffix) -> np.ndarray:
    return art.tensor(f"{layer}.{suffix.value}")


def load_artifact_gpu(path: str | Path) -> dict[str, MarlinLinear]:
    """Load every converted layer of an artifact onto the current GPU.

    Args:
        path: the artifact file (``marlin-convert`` output).

    Returns:
        ``{layer prefix: MarlinLinear}``; each returns the record's ``size_n`` columns
        (a padded layer too: a 50257-vocabulary head gives 50257).

    Raises:
        ArtifactError (and subclasses): unreadable artifact (from the reader).
        GpuUnavailableError: no CuPy / GPU / sm_80+ (one-line message).
        ArtifactError: the artifact fails ``marlin-verify --shapes`` (structure or
            checksums): a corrupted file never reaches the GPU.
        KernelError: a layer the kernels cannot run.
    """
    runtime.cupy_module()  # fail fast, before reading gigabytes
    from ..artifact.validate import validate_artifact
    from ..errors import ArtifactError

    report, art = validate_artifact(path)
    if not report.ok:
        first = next(p for p in report.problems if p.severity == "error")
        art.close()
        raise ArtifactError(f"fails validation ({first.message}); run marlin-verify for every problem", path=path)
    layers: dict[str, MarlinLinear] = {}
    for name, rec in art.layers.items():
        t = functools.partial(_layer_tensor, art, name)
        delta = t(Suffix.DELTA)  # MarlinLinear drops an all-zero delta (from the data, not the flag)
        perm = t(Suffix.PERM) if rec.act_order else None
        bias = _bias_to_f16(t(Suffix.BIAS)) if rec.has_bias else None
        layers[name] = MarlinLinear(
            name,
            rec.size_k,
            rec.size_n,
            rec.group_size,
            t(Suffix.B),
            t(Suffix.SCALES),
            delta,
            perm,
            bias,
            padded_n=rec.padded_n,
        )
    return layers


_module_class: Any = None


def _make_module_class() -> Any:
    """Build ``MarlinLinearModule`` on first access, so torch is imported lazily."""
    global _module_class
    if _module_class is not None:
        return _module_class
    try:
        import torch
    except Exception as exc:
        from ..errors import GpuUnavailableError

        raise GpuUnavailableError(f"torch is not available ({type(exc).__name__})") from None

    from . import torch_op

    class MarlinLinearModule(torch.nn.Module):
        """``torch.nn.Module`` running a :class:`MarlinLinear` as the torch op
        ``torch.ops.marlin_convert.gemm`` (:mod:`converter.gpu.torch_op`).

        ``forward(x)``: float16 or bfloat16 CUDA tensor ``(..., K)`` -> CUDA tensor
        ``(..., N)`` of the same dtype, on torch's current stream; compiles with ``torch.compile(fullgraph=True)``
        and can be captured in a CUDA graph after a first call at each M. The layer's
        operands become the module's (non-persistent) buffers, owned by torch's allocator,
        on the layer's device; the :class:`MarlinLinear` is not kept.

        Raises (forward): KernelError for an input that is not fp16 / bf16 or not CUDA.
        """

        #: The input dtypes ``forward`` takes as they are (the swapped model modules cast
        #: any other to fp16 first).
        act_dtypes = (torch.float16, torch.bfloat16)

        #: Lock counters each layer keeps (zeroed; every launch leaves them zeroed). 4096 covers
        #: every plan up to a few thousand rows; a call that needs more takes zeroed ones from torch.
        LOCKS = 4096
        #: The buffers a packed launch holds the address of.
        _OPERANDS = frozenset(("b", "scales", "delta", "perm", "bias", "locks"))

        def __init__(self, layer: MarlinLinear) -> None:
            super().__init__()
            self.layer_name = layer.name
            self.in_features, self.out_features = layer.size_k, layer.size_n
            self.size_n, self.group_size = layer.padded_n, layer.group_size
            b = layer._B_units if layer._B_units is not None else layer._B

            def own(arr: Any) -> torch.Tensor | None:
                return None if arr is None else torch.from_dlpack(arr).clone()

            for name, arr in (
                ("b", b),
                ("scales", layer._scales),
                ("delta", layer._delta),
                ("perm", layer._perm),
                ("bias", layer._bias),
            ):
                self.register_buffer(name, own(arr), persistent=False)
            self.register_buffer(
                "locks", torch.zeros(self.LOCKS, dtype=torch.int32, device=self.b.device), persistent=False
            )
            #: (M, dtype) -> the packed launch of that M (torch_op.FastGemm), built at the first eager call.
            self._fast: dict[tuple[int, Any], Any] = {}

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            # Eager calls take the packed launch when it is on; torch.compile traces the op.
            if not torch.compiler.is_compiling() and torch_op.fast_launch_on():
                y = self._fast_forward(x)
                if y is not None:
                    return y
            return self._op_forward(x)

        def _fast_forward(self, x: torch.Tensor) -> torch.Tensor | None:
            """The packed launch (:class:`~converter.gpu.torch_op.FastGemm`) of an fp16 or
            bf16, C-contiguous, 16-byte aligned ``x`` on the layer's device, else None (the
            op's path then checks, copies or refuses it)."""
            k, nd, dt = self.in_features, x.dim(), x.dtype
            if dt not in self.act_dtypes or not nd or x.shape[-1] != k or not x.is_contiguous():
                return None
            x2 = x if nd == 2 else x.view(-1, k)
            m, a_ptr = x2.shape[0], x2.data_ptr()
            fast = self._fast.get((m, dt))
            if fast is None:
                if m == 0 or a_ptr % 16 or x2.get_device() != self.b.get_device():
                    return None
                fast = self._fast[m, dt] = torch_op.FastGemm(
                    x2.get_device(), m, self.b, self.scales, self.delta, self.perm, self.bias, self.locks,
                    k, self.size_n, self.group_size, self.out_features, dt,
                )  # fmt: skip
            elif a_ptr % 16 or x2.get_device() != fast.device:
                return None
            y = fast(x2, a_ptr)
            return y if nd == 2 else y.view(*x.shape[:-1], self.out_features)

        def _apply(self, fn: Any, *args: Any, **kw: Any) -> Any:
            # .to() / .cuda() / .half() may move the operands: the packed launches hold their addresses.
            self._fast.clear()

            def keep_dtype(t: torch.Tensor) -> torch.Tensor:
                # The operands' dtypes are the kernels' (fp16 scales and deltas, int32 codes):
                # model.to(torch.bfloat16) moves them but must not convert them, or the
                # kernels would read bf16 bits as fp16.
                r = fn(t)
                return r if r.dtype == t.dtype else t.to(r.device)

            return super()._apply(keep_dtype, *args, **kw)

        def __setattr__(self, name: str, value: Any) -> None:
            # Replacing an operand likewise drops the packed launches that hold its address.
            if name in self._OPERANDS and "_fast" in self.__dict__:
                self._fast.clear()
            super().__setattr__(name, value)

        def _op_forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.dtype not in self.act_dtypes or not x.is_cuda:
                raise KernelError(
                    f"{self.layer_name}: expected a float16 or bfloat16 CUDA tensor, got {x.dtype} on {x.device}",
                    tensor=self.layer_name,
                )
            lead = x.shape[:-1]
            x2 = x.reshape(-1, self.in_features)
            # The op is what torch.compile sees; eager calls skip the dispatcher (same result).
            fn = torch_op.gemm if torch.compiler.is_compiling() else torch_op.run_gemm
            y = fn(
                x2,
                self.b,
                self.scales,
                self.delta,
                self.perm,
                self.bias,
                self.locks,
                self.in_features,
                self.size_n,
                self.group_size,
                self.out_features,
            )
            return y.view(*lead, self.out_features)

        def extra_repr(self) -> str:
            return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"

    _module_class = MarlinLinearModule
    return _module_class


def __getattr__(name: str) -> Any:
    """``MarlinLinearModule`` is created on first access (imports torch then)."""
    if name == "MarlinLinearModule":
        return _make_module_class()
    raise AttributeError(name)

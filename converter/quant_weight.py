"""The one in-memory form every reader produces and the packer consumes.

Orientation, once for the whole package: weights are ``(size_k, size_n)`` =
``(in_features, out_features)``, as in ``y = x @ W`` and as in GPTQ ``qweight``.
Group ``g`` covers input rows ``[g * group_size, (g + 1) * group_size)`` after any
act-order permutation has been applied.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .constants import MARLIN_ZERO, ZeroConvention


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Header facts of one source tensor: name, safetensors dtype code, shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A raw tensor carried over unchanged.

    Attributes:
        name: tensor name in the source (and in the artifact).
        dtype: safetensors dtype code (``"F16"``, ``"BF16"``, ``"I32"``...).
        shape: tuple of ints.
        data: numpy array of that shape in the storage dtype (BF16 as raw ``uint16``);
            often a read-only memory map.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    def non_finite(self) -> int:
        """How many values are NaN or infinite (0 for integer dtypes); BF16's raw
        ``uint16`` counts where its 8 exponent bits are all ones."""
        if self.dtype == "BF16":
            return int(np.count_nonzero((np.asarray(self.data) & 0x7F80) == 0x7F80))
        if np.asarray(self.data).dtype.kind != "f":
            return 0
        return int(self.data.size - np.count_nonzero(np.isfinite(self.data)))


def marlin_code_offset(bits: int) -> int:
    """What is added to a ``bits``-bit source code to make its Marlin 4-bit code.

    ``8 - 2**(bits - 1)``: 0 for 4-bit, 4 for 3-bit, 6 for 2-bit.  Centering narrow
    codes on Marlin's hard-wired zero 8 keeps ``(q - 8) * s`` and ``delta`` as small as
    the weights themselves; uncentered, a 2-bit layer's ``(q - 8) * s`` and ``delta``
    are about 8 steps each and cancel, and the kernel's fp16 rounding of each costs
    ~10x more relative error (measured on the H200: 2.9e-3 against 3e-4).
    """
    return MARLIN_ZERO - (1 << (bits - 1))


@dataclasses.dataclass(frozen=True)
class QuantWeight:
    """One quantized linear layer, independent of the source format.

    Attributes:
        name: the layer prefix (the source's module or linear name).
        q: uint8 ``(size_k, size_n)``, codes in ``[0, 2**bits - 1]``, rows in Marlin
            order (already permuted by ``perm`` when act-order).
        scales: float16 ``(num_groups, size_n)``: Marlin's ``s`` in natural column order.
        zeros: the offset exactly as the source defines it after container decoding,
            ``(num_groups, size_n)``: integer zero points (uint8) for GPTQ/AWQ/
            compressed-tensors, the float16 additive ``zero`` for ``.tinyloop``.
        delta: float32 ``(num_groups, size_n)``, ``W_source - (q - 8) * s`` for the
            source codes ``q``; the artifact stores :meth:`marlin_delta`, which is the
            same for 4-bit layers.
        group_size: rows per group; ``size_k`` for per-channel (one group).
        bits: source bit width (2, 3 or 4); codes are valid 4-bit codes either way.
        zero_convention: how ``zeros`` is to be read, see :class:`ZeroConvention`.
        bias: ``(size_n,)`` in the source dtype, or None.
        perm: int32 ``(size_k,)`` or None: Marlin row k is source input channel
            ``perm[k]`` (act-order); None means the identity.
        k_offset: first Marlin row of ``q`` when the layer is loaded in K chunks.
        size_k: full in-features of the layer (``q`` may hold only a chunk).
        source_scales_dtype: safetensors dtype code of the scales as stored.
        source_scales: float32 ``(num_groups, size_n)`` scales as stored, when they
            differ from ``scales`` (bf16 sources); None otherwise.
    """

    name: str
    q: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray
    delta: np.ndarray
    group_size: int
    bits: int
    zero_convention: ZeroConvention
    bias: Tensor | None = None
    perm: np.ndarray | None = None
    k_offset: int = 0
    size_k: int = -1
    source_scales_dtype: str = "F16"
    source_scales: np.ndarray | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.size_k < 0:
            object.__setattr__(self, "size_k", int(self.q.shape[0]))

    @property
    def size_n(self) -> int:
        return int(self.q.shape[1])

    @property
    def num_groups(self) -> int:
        return int(self.scales.shape[0])

    @property
    def symmetric(self) -> bool:
        """True when ``delta`` is exactly zero everywhere (derived from data, not flags)."""
        return not bool(np.any(self.delta))

    @property
    def code_offset(self) -> int:
        """``marlin_code_offset(bits)``: Marlin code = source code + this."""
        return marlin_code_offset(self.bits)

    def marlin_codes(self) -> np.ndarray:
        """uint8 ``(rows of q, size_n)``: the 4-bit codes that go into ``B`` (``q + code_offset``)."""
        off = self.code_offset
        return self.q if off == 0 else self.q + np.uint8(off)

    def marlin_delta(self) -> np.ndarray:
        """float32 ``(num_groups, size_n)``: ``W_source - (marlin_codes - 8) * s``.

        Evaluated in one fp32 step from the source's own quantities (``(8 - off - z) *
        s``, or ``zero + (8 - off) * s`` for ``.tinyloop``), so integer-zero formats stay
        exact.
        """
        off = self.code_offset
        if off == 0:
            return self.delta
        s = self.source_scales_f32()
        if self.zero_convention is ZeroConvention.TINYLOOP_ADDITIVE:
            return self.zeros.astype(np.float32) + np.float32(MARLIN_ZERO - off) * s
        return (np.float32(MARLIN_ZERO - off) - self.zeros.astype(np.float32)) * s

    def source_weight(self) -> np.ndarray:
        """The weight as the *source* defines it, float32 ``(rows of q, size_n)``.

        GPTQ/AWQ/compressed-tensors: ``s * (q - z)``; ``.tinyloop``: ``q * s + zero``
        (the spec formulas, evaluated in float32 from the scales as stored).  Rows are
        in Marlin order.
        """
        g = self._row_groups()
        q = self.q.astype(np.float32)
        s = self.source_scales_f32()[g]
        if self.zero_convention is ZeroConvention.TINYLOOP_ADDITIVE:
            return q * s + self.zeros.astype(np.float32)[g]
        return s * (q - self.zeros.astype(np.float32)[g])

    def source_formula(self) -> tuple[np.ndarray, np.ndarray | float, np.ndarray | None]:
        """:meth:`source_weight` as ``W = (q - c[g]) * a[g] + b[g]`` per row's group ``g``.

        Returns:
            ``(a, c, b)``, float32 ``(num_groups, size_n)`` (``c`` may be the constant 0,
            ``b`` None for zero): ``(s, z, None)`` for integer zero points (``s * (q - z)``),
            ``(s, 0, zero)`` for ``.tinyloop`` (``q * s + zero``); ``s`` as stored.  What
            :mod:`converter.numerics` evaluates per weight for the CPU check's reference.
        """
        s = self.source_scales_f32()
        if self.zero_convention is ZeroConvention.TINYLOOP_ADDITIVE:
            return s, 0.0, self.zeros.astype(np.float32)
        return s, self.zeros.astype(np.float32), None

    def marlin_weight(self) -> np.ndarray:
        """``(marlin_codes - 8) * s + marlin_delta`` in float32 ``(rows of q, size_n)``: what the artifact computes."""
        g = self._row_groups()
        q = self.marlin_codes().astype(np.float32)
        return (q - MARLIN_ZERO) * self.scales.astype(np.float32)[g] + self.marlin_delta()[g]

    def source_scales_f32(self) -> np.ndarray:
        """float32 ``(num_groups, size_n)``: the scales as the source stored them."""
        if self.source_scales is not None:
            return self.source_scales
        return self.scales.astype(np.float32)

    def _row_groups(self) -> np.ndarray:
        # Chunks start on a group boundary (or the layer is per-channel), so the
        # local group of row i is i // group_size.
        return np.arange(self.q.shape[0]) // self.group_size

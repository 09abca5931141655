"""Packed shapes and conversion limits, derived from ``(size_k, size_n, group_size)``.

Used by the converter to plan and by ``marlin-verify --shapes`` to check an artifact
without touching tensor data.
"""

from __future__ import annotations

import dataclasses

from ..constants import (
    CONVERT_GROUP_MULTIPLE,
    CONVERT_K_MULTIPLE,
    CONVERT_N_MULTIPLE,
    KERNEL_K_MULTIPLE,
    MARLIN_PACK_FACTOR,
    MARLIN_TILE,
    UPSTREAM_GROUP_SIZES,
    UPSTREAM_K_MULTIPLE,
    UPSTREAM_N_MULTIPLE,
    Suffix,
)


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """Shapes of one converted layer's artifact tensors.

    ``group_size == size_k`` means per-channel (one group).
    """

    size_k: int
    size_n: int
    group_size: int

    @property
    def num_groups(self) -> int:
        return self.size_k // self.group_size

    @property
    def b_shape(self) -> tuple[int, int]:
        """int32 ``(size_k // 16, size_n * 16 // pack_factor)`` = ``(K/16, 2N)``."""
        return (self.size_k // MARLIN_TILE, self.size_n * MARLIN_TILE // MARLIN_PACK_FACTOR)


def marlin_shapes(shape: LayerShape, *, act_order: bool, bias_dtype: str | None) -> dict[Suffix, tuple[str, tuple[int, ...]]]:
    """The artifact tensors of one converted layer.

    Args:
        shape: the layer's sizes.
        act_order: whether a ``marlin_perm`` tensor is present.
        bias_dtype: safetensors dtype code of the bias, or None when there is none.

    Returns:
        ``{suffix: (safetensors dtype code, shape)}``.
    """
    out: dict[Suffix, tuple[str, tuple[int, ...]]] = {
        Suffix.B: ("I32", shape.b_shape),
        Suffix.SCALES: ("F16", (shape.num_groups, shape.size_n)),
        Suffix.DELTA: ("F32", (shape.num_groups, shape.size_n)),
    }
    if act_order:
        out[Suffix.PERM] = ("I32", (shape.size_k,))
    if bias_dtype is not None:
        out[Suffix.BIAS] = (bias_dtype, (shape.size_n,))
    return out


def check_convertible(size_k: int, size_n: int, group_size: int) -> tuple[bool, str]:
    """Whether our layout can hold the layer, and if not, why.

    Args:
        size_k: in-features K.
        size_n: out-features N.
        group_size: rows per group, or -1 / ``size_k`` for per-channel.

    Returns:
        ``(True, "")`` or ``(False, reason)`` with the rule and the numbers.
        The rule: ``K % 16 == 0``, ``N % 64 == 0``, and the group size is a
        multiple of 16 that divides K, or per-channel.
    """
    if size_k <= 0 or size_n <= 0:
        return False, f"empty layer (size_k={size_k}, size_n={size_n})"
    if size_k % CONVERT_K_MULTIPLE:
        return False, f"size_k = {size_k} is not a multiple of {CONVERT_K_MULTIPLE} (Marlin tile)"
    if size_n % CONVERT_N_MULTIPLE:
        return False, f"size_n = {size_n} is not a multiple of {CONVERT_N_MULTIPLE} (Marlin tile)"
    if group_size in (-1, size_k):
        return True, ""
    if group_size <= 0 or group_size % CONVERT_GROUP_MULTIPLE or size_k % group_size:
        return False, (
            f"group_size = {group_size} is not a multiple of {CONVERT_GROUP_MULTIPLE} "
            f"that divides size_k = {size_k}"
        )
    return True, ""


def upstream_compatible(size_k: int, size_n: int, group_size: int) -> bool:
    """Whether upstream IST-DASLab Marlin's own ``Layer`` accepts the layer.

    Its limits: ``K % 128 == 0``, ``N % 256 == 0``, group 128 or per-channel
    (checkpoint-formats.md section 4.5).
    """
    per_channel = group_size in (-1, size_k)
    return (
        size_k % UPSTREAM_K_MULTIPLE == 0
        and size_n % UPSTREAM_N_MULTIPLE == 0
        and (per_channel or group_size in UPSTREAM_GROUP_SIZES)
    )


def kernel_compatible(size_k: int, size_n: int, group_size: int) -> bool:
    """Whether our own CUDA GEMM (kernels/marlin_gemm.cu) runs the layer.

    Its limits: ``K % 64 == 0``, ``N % 64 == 0``, and a group size that is a multiple
    of 16 dividing K, or per-channel (``converter.gpu.kernels.gemm_plan``).
    """
    return size_k % KERNEL_K_MULTIPLE == 0 and check_convertible(size_k, size_n, group_size)[0]

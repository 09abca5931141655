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


def marlin_shapes(
    shape: LayerShape, *, act_order: bool, bias_dtype: str | None
) -> dict[Suffix, tuple[str, tuple[int, ...]]]:
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


def per_channel(size_k: int, group_size: int) -> bool:
    """One group spanning K: ``group_size`` -1 (the HF convention) or ``size_k``."""
    return group_size in (-1, size_k)


def resolve_group_size(size_k: int, group_size: int) -> int:
    """Rows per group, with per-channel (-1) written as ``size_k``."""
    return size_k if per_channel(size_k, group_size) else group_size


def tiles_fit(size_k: int, size_n: int) -> bool:
    """The rule Marlin's ``B`` layout imposes: ``K % 16 == 0`` and ``N % 64 == 0`` (positive)."""
    return size_k > 0 and size_n > 0 and size_k % CONVERT_K_MULTIPLE == 0 and size_n % CONVERT_N_MULTIPLE == 0


def groups_fit(size_k: int, group_size: int) -> bool:
    """The group rule: per-channel, or a multiple of 16 that divides K."""
    if per_channel(size_k, group_size):
        return True
    return group_size > 0 and group_size % CONVERT_GROUP_MULTIPLE == 0 and size_k % group_size == 0


def tile_error(size_k: int, size_n: int) -> str | None:
    """Why :func:`tiles_fit` fails, in one line with the numbers; None when it holds."""
    if tiles_fit(size_k, size_n):
        return None
    return (
        f"Marlin B needs size_k % {CONVERT_K_MULTIPLE} == 0 and size_n % {CONVERT_N_MULTIPLE} == 0, "
        f"got size_k={size_k}, size_n={size_n}"
    )


def group_error(size_k: int, group_size: int) -> str | None:
    """Why :func:`groups_fit` fails, in one line with the numbers; None when it holds."""
    if groups_fit(size_k, group_size):
        return None
    return f"group_size = {group_size} is not a multiple of {CONVERT_GROUP_MULTIPLE} that divides size_k = {size_k}"


def check_convertible(size_k: int, size_n: int, group_size: int) -> tuple[bool, str]:
    """Whether our layout can hold the layer, and if not, why.

    Args:
        size_k: in-features K.
        size_n: out-features N.
        group_size: rows per group, or -1 / ``size_k`` for per-channel.

    Returns:
        ``(True, "")`` or ``(False, reason)`` with the rule and the numbers (the
        reason is recorded in the manifest for the layer's pass-through tensors).
        The rule: :func:`tiles_fit` and :func:`groups_fit`.
    """
    if size_k <= 0 or size_n <= 0:
        return False, f"empty layer (size_k={size_k}, size_n={size_n})"
    if size_k % CONVERT_K_MULTIPLE:
        return False, f"size_k = {size_k} is not a multiple of {CONVERT_K_MULTIPLE} (Marlin tile)"
    if size_n % CONVERT_N_MULTIPLE:
        return False, f"size_n = {size_n} is not a multiple of {CONVERT_N_MULTIPLE} (Marlin tile)"
    reason = group_error(size_k, group_size)
    return (False, reason) if reason else (True, "")


def group_count(size_k: int, group_size: int) -> tuple[int, int]:
    """``(group_size, num_groups)`` with per-channel resolved, for code that only needs
    the groups to tile K (the NumPy twins accept any such size).

    Raises:
        ValueError: the group size does not divide ``size_k``.
    """
    gs = resolve_group_size(size_k, group_size)
    if gs <= 0 or size_k % gs:
        raise ValueError(f"group_size {group_size} does not divide size_k {size_k}")
    return gs, size_k // gs


def kernel_layer_sizes(
    size_k: int, size_n: int, group_size: int, *, error: type[Exception] = ValueError
) -> tuple[int, int, bool]:
    """``(group_size, num_groups, per_channel)`` of a layer our kernels can run.

    Raises:
        error: the sizes break :func:`tiles_fit` or :func:`groups_fit`.
    """
    reason = tile_error(size_k, size_n) or group_error(size_k, group_size)
    if reason:
        raise error(reason)
    gs = resolve_group_size(size_k, group_size)
    return gs, size_k // gs, per_channel(size_k, group_size)


def upstream_compatible(size_k: int, size_n: int, group_size: int) -> bool:
    """Whether upstream IST-DASLab Marlin's own ``Layer`` accepts the layer.

    Its limits: ``K % 128 == 0``, ``N % 256 == 0``, group 128 or per-channel
    (checkpoint-formats.md section 4.5).
    """
    return (
        size_k % UPSTREAM_K_MULTIPLE == 0
        and size_n % UPSTREAM_N_MULTIPLE == 0
        and (per_channel(size_k, group_size) or group_size in UPSTREAM_GROUP_SIZES)
    )


def kernel_compatible(size_k: int, size_n: int, group_size: int) -> bool:
    """Whether our own CUDA GEMM (kernels/marlin_gemm.cu) runs the layer.

    Its limits: ``K % 64 == 0``, ``N % 64 == 0``, and a group size that is a multiple
    of 16 dividing K, or per-channel (:func:`kernel_layer_sizes`, ``converter.gpu.plan``).
    """
    return size_k % KERNEL_K_MULTIPLE == 0 and check_convertible(size_k, size_n, group_size)[0]

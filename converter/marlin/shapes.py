"""Packed shapes and conversion limits, derived from ``(size_k, size_n, group_size)``.

Used by the converter to plan and by ``marlin-verify --shapes`` to check an artifact
without touching tensor data.

Two rules live here.  :func:`check_convertible` is the layout's own: ``K % 16``,
``N % 64`` and a group size that is a multiple of 16 dividing K (or per-channel); an
artifact layer always satisfies it, with ``N`` its layout width.  :func:`fit_layer`
is how a *source* layer is brought to that rule without changing a value:

* a short last group (``K % group_size != 0``, as GPTQModel, AutoGPTQ and
  compressed-tensors quantize ``K = 576`` at ``g = 128``: groups of 128, 128, 128, 128
  and 64) is re-expressed at ``gcd(K, group_size)`` rows per group, each source group's
  scale and zero repeated for each of its slices (one group of K when the one source
  group is longer than K): *regrouped*;
* an ``N`` that no 64-column block divides is padded to the next multiple of 64 with
  zero columns (code 8, scale 1, delta 0): *padded*; ``size_n`` stays the true N and
  the kernels store only those columns.

``K`` is never padded: a ``K % 16 != 0`` layer does not convert.
"""

from __future__ import annotations

import dataclasses
import math

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

    ``group_size == size_k`` means per-channel (one group).  ``size_n`` is the true N
    (the bias and the layer's output); ``padded_n``, when set, the width of ``B``,
    the scales and ``delta`` (:attr:`layout_n`).
    """

    size_k: int
    size_n: int
    group_size: int
    padded_n: int | None = None

    @property
    def num_groups(self) -> int:
        return self.size_k // self.group_size

    @property
    def layout_n(self) -> int:
        """Columns of ``B``, the scales and ``delta``: ``padded_n``, else ``size_n``."""
        return self.size_n if self.padded_n is None else self.padded_n

    @property
    def b_shape(self) -> tuple[int, int]:
        """int32 ``(size_k // 16, layout_n * 16 // pack_factor)`` = ``(K/16, 2N)``."""
        return (self.size_k // MARLIN_TILE, self.layout_n * MARLIN_TILE // MARLIN_PACK_FACTOR)


def marlin_shapes(
    shape: LayerShape, *, act_order: bool, bias_dtype: str | None
) -> dict[Suffix, tuple[str, tuple[int, ...]]]:
    """The artifact tensors of one converted layer.

    Args:
        shape: the layer's sizes.
        act_order: whether a ``marlin_perm`` tensor is present.
        bias_dtype: safetensors dtype code of the bias, or None when there is none.

    Returns:
        ``{suffix: (safetensors dtype code, shape)}``: ``B``, scales and ``delta`` are
        ``layout_n`` wide, the bias ``size_n`` long.
    """
    out: dict[Suffix, tuple[str, tuple[int, ...]]] = {
        Suffix.B: ("I32", shape.b_shape),
        Suffix.SCALES: ("F16", (shape.num_groups, shape.layout_n)),
        Suffix.DELTA: ("F32", (shape.num_groups, shape.layout_n)),
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


@dataclasses.dataclass(frozen=True)
class LayerFit:
    """How a source layer goes into the layout (:func:`fit_layer`), or why it cannot.

    Attributes:
        ok: it converts.
        reason: why not ("" when it does), one line with the rule and the numbers.
        group_size: the artifact's rows per group (``size_k`` for one group).
        source_group_size: the source's group size when it was regrouped, else None.
        padded_n: the layout's N when N was padded, else None.
    """

    ok: bool
    reason: str = ""
    group_size: int = 0
    source_group_size: int | None = None
    padded_n: int | None = None


def padded_width(size_n: int) -> int:
    """``size_n`` rounded up to the next multiple of 64, the layout's column block."""
    return -(-size_n // CONVERT_N_MULTIPLE) * CONVERT_N_MULTIPLE


def regrouped_size(size_k: int, group_size: int) -> int:
    """The group size a layer with a short last group is stored at (``K % group_size != 0``).

    ``gcd(K, group_size)``: it divides every source group, the short one included, so
    each artifact group lies inside one source group; a multiple of 16 when K and the
    group size are.  A group size above K (one short group) gives ``size_k``: one group.
    """
    return size_k if group_size > size_k else math.gcd(size_k, group_size)


def fit_layer(size_k: int, size_n: int, group_size: int, *, pad: bool = True) -> LayerFit:
    """Whether a source layer converts, and at which group size and width (module docstring).

    Args:
        size_k: in-features K.
        size_n: out-features N, as the source has it.
        group_size: the source's rows per group, or -1 / ``size_k`` for per-channel;
            the source has ``ceil(K / group_size)`` groups, the last one short when
            ``K % group_size``.
        pad: pad an ``N % 64 != 0`` layer (else it does not convert).

    Returns:
        A :class:`LayerFit`.  The rule: ``K % 16 == 0`` (K is never padded); ``N %
        64 == 0``, or padded; a group size that fits (:func:`groups_fit`), or one
        that leaves a short last group and is a multiple of 16 or longer than K
        (regrouped at :func:`regrouped_size`).
    """
    if size_k <= 0 or size_n <= 0:
        return LayerFit(False, f"empty layer (size_k={size_k}, size_n={size_n})")
    if size_k % CONVERT_K_MULTIPLE:
        return LayerFit(False, f"size_k = {size_k} is not a multiple of {CONVERT_K_MULTIPLE} (Marlin tile)")
    padded = None
    if size_n % CONVERT_N_MULTIPLE:
        if not pad:
            return LayerFit(False, f"size_n = {size_n} is not a multiple of {CONVERT_N_MULTIPLE} (Marlin tile)")
        padded = padded_width(size_n)
    gs = resolve_group_size(size_k, group_size)
    if groups_fit(size_k, group_size):
        return LayerFit(True, group_size=gs, padded_n=padded)
    if gs > size_k or (gs > 0 and gs % CONVERT_GROUP_MULTIPLE == 0):
        return LayerFit(True, group_size=regrouped_size(size_k, gs), source_group_size=gs, padded_n=padded)
    return LayerFit(False, group_error(size_k, group_size) or "")


def regroup_rows(k_start: int, k_stop: int, group_size: int, source_group_size: int) -> list[int]:
    """For each artifact group of rows ``[k_start, k_stop)``, its source group, counted
    from the source group of row ``k_start`` (where a reader's chunk of source groups starts).

    Args:
        k_start, k_stop: rows of a chunk, ``k_start`` on an artifact group (or any row
            of a one-group layer).
        group_size: the artifact's rows per group (:func:`regrouped_size`); every
            artifact group lies inside one source group.
        source_group_size: the source's.

    Returns:
        ``[t * group_size // source_group_size - k_start // source_group_size]`` for each
        artifact group ``t`` the rows touch: the rows of the chunk's source scales and
        zeros that give the artifact's.
    """
    first = k_start // source_group_size
    groups = range(k_start // group_size, -(-k_stop // group_size))
    return [t * group_size // source_group_size - first for t in groups]


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

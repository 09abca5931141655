"""A layer's compressed-tensors tensors (``weight_packed``, ``weight_scale``,
``weight_zero_point``, ``weight_shape``, ``weight_g_idx``) from its codes, exactly, and
why a layer has no exact form.
"""

from __future__ import annotations

import numpy as np

from ..constants import ZeroConvention
from ..formats.base import LayerPlan
from ..quant_weight import QuantWeight
from .quant_config import COMPRESSED_TENSORS_VERSION


def pack_int32(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """compressed-tensors ``pack_to_int32`` on unsigned codes: a dense LSB-first bit
    stream along ``axis`` (32 codes in ``bits`` words), zero-padded, ``ceil(n*bits/32)``
    words.  ``values`` are the *unsigned* codes (the library's signed code + 2^(b-1))."""
    vals = np.asarray(values)
    if axis == 0:
        vals = vals.T
    rows, cols = vals.shape
    out = np.empty((rows, -(-cols * bits // 32)), dtype=np.int32)
    # The bit arithmetic runs in uint64, 8 bytes a code: rows in chunks of ~2M codes keep
    # it to tens of MB where a whole layer at once took ~16x the layer's codes.
    step = max(1, 2**21 // max(cols, 1))
    for r0 in range(0, rows, step):
        out[r0 : r0 + step] = _pack_rows(vals[r0 : r0 + step], bits)
    return np.ascontiguousarray(out.T if axis == 0 else out)


def _pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """:func:`pack_int32` along the last axis of ``values`` (rows, cols)."""
    v = np.asarray(values, dtype=np.uint64)
    rows, cols = v.shape
    blocks = -(-cols // 32)
    padded = np.zeros((rows, blocks * 32), dtype=np.uint64)
    padded[:, :cols] = v
    padded = padded.reshape(rows, blocks, 32)
    words = np.zeros((rows, blocks, bits + 1), dtype=np.uint64)
    for i in range(32):
        start = i * bits
        w, off = divmod(start, 32)
        shifted = padded[:, :, i] << np.uint64(off)
        words[:, :, w] |= shifted & np.uint64(0xFFFFFFFF)
        words[:, :, w + 1] |= shifted >> np.uint64(32)
    out = words[:, :, :bits].reshape(rows, blocks * bits)[:, : -(-cols * bits // 32)]
    return out.astype(np.uint32).view(np.int32)


def scale_dtype_of(qw: QuantWeight) -> str:
    """The dtype ``weight_scale`` is written in: the source's own (BF16, F32), else F16."""
    return qw.source_scales_dtype if qw.source_scales_dtype in ("BF16", "F32") else "F16"


def _scales_for(qw: QuantWeight) -> tuple[str, np.ndarray]:
    """The source's scales transposed to ``(N, G)``, in the source's own dtype (exact)."""
    s = qw.source_scales_f32()
    dtype = scale_dtype_of(qw)
    if dtype == "BF16":
        return dtype, np.ascontiguousarray((s.view(np.uint32) >> np.uint32(16)).astype(np.uint16).T)
    if dtype == "F32":
        return dtype, np.ascontiguousarray(s.T)
    return dtype, np.ascontiguousarray(qw.scales.T)


def _unrepresentable(layer: LayerPlan, legacy_act_order: bool) -> str | None:
    """Why a planned layer has no exact compressed-tensors form (None: it may have one)."""
    if not layer.convertible:
        return layer.reason
    if layer.zero_convention is ZeroConvention.TINYLOOP_ADDITIVE:
        return ".tinyloop float zero (W = q*s + zero) has no integer zero point"
    if layer.source_group_size is not None:
        return f"ragged last group (K = {layer.size_k} is not a multiple of group size {layer.source_group_size})"
    if layer.padded_n is not None:
        return f"padded N (N = {layer.size_n} would need padding to {layer.padded_n})"
    if layer.act_order and not legacy_act_order:
        return (
            f"act-order (g_idx): compressed-tensors {COMPRESSED_TENSORS_VERSION} removed actorder 'group' "
            "(its config refuses it and its decompression ignores weight_g_idx); legacy_act_order "
            "(--legacy-act-order) writes it for older compressed-tensors and vLLM"
        )
    return None


def _zero_problem(qw: QuantWeight) -> str | None:
    hi = (1 << qw.bits) - 1
    z = np.asarray(qw.zeros)
    if z.dtype.kind not in "iu":
        return "zero points are not integers"
    if z.size and (int(z.min()) < 0 or int(z.max()) > hi):
        return f"zero point {int(z.max())} is outside the {qw.bits}-bit range [0, {hi}]"
    return None


def layer_tensor_names(layer: LayerPlan) -> list[str]:
    """The names :func:`_layer_tensors` writes for ``layer`` (``weight_g_idx`` on act-order only)."""
    suffixes = ["weight_packed", "weight_scale", "weight_zero_point", "weight_shape"]
    return [f"{layer.name}.{x}" for x in suffixes + (["weight_g_idx"] if layer.act_order else [])]


def _layer_tensors(qw: QuantWeight, layer: LayerPlan) -> dict[str, tuple[str, np.ndarray]]:
    b, k, n = qw.bits, layer.size_k, layer.size_n
    q = qw.q
    if qw.perm is not None:  # back to source row order: Marlin row i is source row perm[i]
        q = np.empty_like(qw.q)
        q[qw.perm] = qw.q
    p = layer.name
    out = {
        f"{p}.weight_packed": ("I32", pack_int32(q.T, b, axis=1)),
        f"{p}.weight_scale": _scales_for(qw),
        f"{p}.weight_zero_point": ("I32", pack_int32(np.ascontiguousarray(qw.zeros.T), b, axis=0)),
        f"{p}.weight_shape": ("I64", np.array([n, k], dtype=np.int64)),
    }
    if qw.perm is not None:
        g_idx = np.empty(k, dtype=np.int32)
        g_idx[qw.perm] = np.arange(k, dtype=np.int32) // qw.group_size
        out[f"{p}.weight_g_idx"] = ("I32", g_idx)
    return out

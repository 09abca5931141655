"""The values of each layer's tensors: scales, ``delta`` and bias finite, the weights the
codes form within float16, and 2- and 3-bit codes within their range.
"""

from __future__ import annotations

import numpy as np

from ..constants import SCALE_PERM_GROUPED_CHUNK, Suffix
from ..formats.scales import kernel_range_error
from ..marlin.layout import unpermute_scales
from ..quant_weight import marlin_code_offset
from .problems import ProblemCode, Report
from .reader import Artifact
from .validate_facts import expected_layer_tensors

P = ProblemCode


#: Layer tensors whose values must be finite (a NaN scale, delta or bias poisons every output).
FINITE_SUFFIXES = (Suffix.SCALES, Suffix.DELTA, Suffix.BIAS)


def _check_finite(art: Artifact, report: Report) -> set[str]:
    """Report NaN/Inf in every layer's scales and delta, even when checksums agree
    (a producer that wrote them would also have hashed them).  Returns those layers."""
    bad_layers: set[str] = set()
    for rec in art.layers.values():
        for suffix in FINITE_SUFFIXES:
            name = f"{rec.name}.{suffix.value}"
            info = art.file.infos.get(name)
            if info is None or info.dtype not in ("F16", "F32", "BF16"):
                continue  # reported as missing / dtype_mismatch already (or a layer without bias)
            bad = art.file.tensor(name).non_finite()
            if bad:
                what = suffix.value.removeprefix("marlin_")
                report.add(P.NON_FINITE, f"{name}: {bad} NaN or Inf value(s); {what} must be finite", name, 0, bad)
                bad_layers.add(rec.name)
        art.file.release_pages()
    return bad_layers


def _check_fp16_range(art: Artifact, report: Report, *, skip: set[str]) -> None:
    """Report a layer whose ``delta``, or a weight ``(q - 8) * s + delta`` its codes can
    form, overflows float16, the dtype the kernels compute them in (finite float32
    values can still be infinite there)."""
    for rec in art.layers.values():
        if rec.name in skip:
            continue
        shape = (rec.shape.num_groups, rec.layout_n)
        s_name, d_name = f"{rec.name}.{Suffix.SCALES.value}", f"{rec.name}.{Suffix.DELTA.value}"
        s_info, d_info = art.file.infos.get(s_name), art.file.infos.get(d_name)
        if (
            s_info is None
            or d_info is None
            or (s_info.dtype, s_info.shape, d_info.dtype, d_info.shape) != ("F16", shape, "F32", shape)
            or rec.layout_n % SCALE_PERM_GROUPED_CHUNK
        ):
            continue  # reported as missing / dtype_mismatch / shape_mismatch already
        scales = unpermute_scales(art.file.array(s_name), single=shape[0] == 1)
        why = kernel_range_error(scales, np.asarray(art.file.array(d_name)), marlin_code_offset(rec.bits), rec.bits)
        if why:
            report.add(P.FP16_OVERFLOW, f"layer {rec.name}: {why}", rec.name)
        art.file.release_pages()


#: Bytes of ``marlin_B`` scanned at a time by :func:`_check_code_range`.
CODE_SCAN_BYTES = 16 << 20


def _check_code_range(art: Artifact, report: Report) -> None:
    """Report a 2- or 3-bit layer whose ``marlin_B`` holds a code outside the range its
    ``bits`` and ``code_offset`` allow: a re-sealed manifest that lowers ``bits`` would
    otherwise pass, and the fp16 range check would only try the codes it claims.  Every
    nibble of ``B`` is one code (the layout permutes, it never mixes), so the nibbles'
    minimum and maximum decide."""
    for rec in art.layers.values():
        offset = marlin_code_offset(rec.bits)
        if rec.bits >= 4 or rec.code_offset != offset:
            continue  # 4-bit: every nibble is a code; a wrong code_offset is reported already
        name = f"{rec.name}.{Suffix.B.value}"
        info = art.file.infos.get(name)
        if info is None or (info.dtype, info.shape) != (
            "I32",
            expected_layer_tensors(art, rec)[Suffix.B][1],
        ):
            continue  # reported as missing / dtype_mismatch / shape_mismatch already
        flat = np.asarray(art.file.array(name)).reshape(-1).view(np.uint8)
        lo, hi = 15, 0
        for i in range(0, flat.size, CODE_SCAN_BYTES):
            part = flat[i : i + CODE_SCAN_BYTES]
            low, high = part & 0xF, part >> 4
            lo, hi = min(lo, int(low.min()), int(high.min())), max(hi, int(low.max()), int(high.max()))
            art.file.release_pages()
        top = offset + (1 << rec.bits) - 1
        if flat.size and (lo < offset or hi > top):
            report.add(
                P.MANIFEST_INCONSISTENT,
                f"layer {rec.name}: {name} holds codes {lo}..{hi}, but {rec.bits}-bit codes stored with offset "
                f"{offset} lie in {offset}..{top} (bits lies, or B is not this layer's)",
                rec.name,
            )

"""A layer's manifest record against what it implies: the tensors it needs, and the
derived facts (code offset, zero convention, padding, regrouping, compatibility flags,
symmetric, the permutation) that a runtime trusts.
"""

from __future__ import annotations

import numpy as np

from ..constants import CONVERT_N_MULTIPLE, Suffix
from ..formats import CONVENTIONS
from ..marlin.shapes import (
    kernel_compatible,
    marlin_shapes,
    padded_width,
    regroup_rows,
    regrouped_size,
    upstream_compatible,
)
from ..quant_weight import marlin_code_offset
from .problems import ProblemCode, Report
from .reader import Artifact
from .schema import LayerEntry, Manifest

P = ProblemCode


def expected_layer_tensors(art: Artifact, rec: LayerEntry) -> dict[Suffix, tuple[str, tuple[int, ...]]]:
    """``{suffix: (dtype, shape)}`` the manifest implies for one layer."""
    bias_name = f"{rec.name}.{Suffix.BIAS.value}"
    bias_dtype = None
    if rec.has_bias:
        bias_dtype = art.file.infos[bias_name].dtype if bias_name in art.file else "F16"
    return marlin_shapes(rec.shape, act_order=rec.act_order, bias_dtype=bias_dtype)


def _check_layer_facts(art: Artifact, manifest: Manifest, report: Report) -> None:
    """Manifest facts that are derived, so they can be checked: a manifest whose
    tensors and checksums are consistent but whose flags lie would make a runtime
    compute the wrong thing (skip the correction, drop a bias, skip a gather)."""
    names = [entry.name for entry in manifest.layers]
    for name in sorted({n for n in names if names.count(n) > 1}):
        report.add(P.DUPLICATE_ENTRY, f"layer {name} is listed {names.count(name)} times", name)
    fmt = manifest.source.format.value
    owned_suffixes = tuple(f".{s.value}" for s in Suffix)
    layer_names = set(art.layers)
    for entry in manifest.passthrough:
        prefix, _, suffix = entry.name.rpartition(".")
        if prefix in layer_names and f".{suffix}" in owned_suffixes:
            report.add(
                P.LAYER_TENSOR_AS_PASSTHROUGH,
                f"{entry.name}: belongs to converted layer {prefix} but is listed as pass-through",
                entry.name,
            )
    for rec in art.layers.values():
        offset = marlin_code_offset(rec.bits)
        if rec.code_offset != offset:
            report.add(
                P.MANIFEST_INCONSISTENT,
                f"layer {rec.name}: code_offset {rec.code_offset} but {rec.bits}-bit "
                f"codes are stored with offset {offset}",
                rec.name,
                offset,
                rec.code_offset,
            )
        if rec.zero_convention.value not in CONVENTIONS.get(fmt, ()):
            report.add(
                P.MANIFEST_INCONSISTENT,
                f"layer {rec.name}: zero_convention {rec.zero_convention.value!r} cannot come from a {fmt!r} source",
                rec.name,
            )
        _check_padding(rec, report)
        _check_regrouping(art, rec, report)
        for key, fn in (("upstream_marlin_compatible", upstream_compatible), ("kernel_compatible", kernel_compatible)):
            want, recorded = fn(rec.size_k, rec.layout_n, rec.group_size), getattr(rec, key)
            if recorded is not want:
                report.add(
                    P.MANIFEST_INCONSISTENT,
                    f"layer {rec.name}: {key} is {recorded} but the sizes say {want}",
                    rec.name,
                    want,
                    recorded,
                )
        delta_name = f"{rec.name}.{Suffix.DELTA.value}"
        info = art.file.infos.get(delta_name)
        if info is not None and info.dtype == "F32" and info.shape == (rec.shape.num_groups, rec.layout_n):
            zero = not np.any(art.file.array(delta_name))
            if zero is not rec.symmetric:
                report.add(
                    P.MANIFEST_INCONSISTENT,
                    f"layer {rec.name}: symmetric is {rec.symmetric} but marlin_delta "
                    f"is {'all zero' if zero else 'not zero'}",
                    rec.name,
                    zero,
                    rec.symmetric,
                )
        perm_name = f"{rec.name}.{Suffix.PERM.value}"
        info = art.file.infos.get(perm_name)
        if rec.act_order and info is not None and info.dtype == "I32" and info.shape == (rec.size_k,):
            perm = art.file.array(perm_name)
            if not np.array_equal(np.sort(perm), np.arange(rec.size_k)):
                report.add(P.BAD_PERMUTATION, f"{perm_name}: not a permutation of 0..{rec.size_k - 1}", perm_name)
        art.file.release_pages()


def _check_padding(rec: LayerEntry, report: Report) -> None:
    """``padded_n`` is ``size_n`` rounded up to the next multiple of 64, present exactly
    when ``size_n`` needs it (a runtime sizes its output by ``size_n``, its operands by ``padded_n``)."""
    needs = rec.size_n % CONVERT_N_MULTIPLE != 0
    if rec.padded_n is None and needs:
        report.add(
            P.MANIFEST_INCONSISTENT,
            f"layer {rec.name}: size_n {rec.size_n} is not a multiple of {CONVERT_N_MULTIPLE} and padded_n is absent",
            rec.name,
        )
    elif rec.padded_n is not None and rec.padded_n != (padded_width(rec.size_n) if needs else None):
        want = padded_width(rec.size_n) if needs else "absent"
        report.add(
            P.MANIFEST_INCONSISTENT,
            f"layer {rec.name}: padded_n {rec.padded_n} is not size_n {rec.size_n} rounded up to a multiple of "
            f"{CONVERT_N_MULTIPLE} (expected {want})",
            rec.name,
            want,
            rec.padded_n,
        )


def _check_regrouping(art: Artifact, rec: LayerEntry, report: Report) -> None:
    """A regrouped layer: ``group_size`` is the one its ``source_group_size`` regroups to,
    and the scale and ``delta`` rows of each source group are one row repeated (bitwise;
    the Marlin scale permutation moves columns, not rows)."""
    sgs = rec.source_group_size
    if sgs is None:
        return
    if rec.size_k % sgs == 0 or rec.group_size != regrouped_size(rec.size_k, sgs):
        want = "no regrouping" if rec.size_k % sgs == 0 else f"group_size {regrouped_size(rec.size_k, sgs)}"
        report.add(
            P.MANIFEST_INCONSISTENT,
            f"layer {rec.name}: source_group_size {sgs} with size_k {rec.size_k} means {want}, "
            f"but group_size is {rec.group_size}",
            rec.name,
        )
        return
    src = np.asarray(regroup_rows(0, rec.size_k, rec.group_size, sgs))
    first = np.searchsorted(src, src)  # each artifact group's first sibling in its source group
    for suffix in (Suffix.SCALES, Suffix.DELTA):
        name = f"{rec.name}.{suffix.value}"
        info = art.file.infos.get(name)
        if info is None or info.shape != (rec.shape.num_groups, rec.layout_n) or info.dtype not in ("F16", "F32"):
            continue  # reported as missing / shape or dtype mismatch already
        a = np.asarray(art.file.array(name))
        bits = a.view(np.uint16 if info.dtype == "F16" else np.uint32)
        bad = np.flatnonzero(np.any(bits != bits[first], axis=1))
        if bad.size:
            row = int(bad[0])
            report.add(
                P.MANIFEST_INCONSISTENT,
                f"{name}: row {row} differs from row {int(first[row])} of the same source group "
                f"(source_group_size {sgs}, group_size {rec.group_size}): a regrouped layer repeats each source "
                f"group's row ({bad.size} row(s) differ)",
                name,
            )

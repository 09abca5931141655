"""Structural validation of an artifact: every problem, not just the first.

``validate_artifact`` never raises on bad *content*: it returns a report listing
each problem with a stable code (:class:`~converter.artifact.problems.ProblemCode`).
Only an unreadable container (or a schema version from the future) raises, because
then nothing further can be checked.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

from ..constants import (
    CONVERT_N_MULTIPLE,
    META_FORMAT,
    META_FORMAT_VALUE,
    META_MANIFEST,
    META_MANIFEST_CHECKSUM,
    META_SCHEMA_VERSION,
    SCALE_PERM_GROUPED_CHUNK,
    Suffix,
)
from ..dtypes import FLOAT_DTYPES
from ..errors import ArtifactError
from ..formats import CONVENTIONS
from ..formats.hf_checkpoint import MAX_COPIED_FILE_BYTES
from ..formats.scales import kernel_range_error
from ..jsonio import read_regular_file
from ..marlin.layout import unpermute_scales
from ..marlin.shapes import (
    kernel_compatible,
    marlin_shapes,
    padded_width,
    regroup_rows,
    regrouped_size,
    upstream_compatible,
)
from ..quant_weight import marlin_code_offset
from .problems import Problem, ProblemCode, Report
from .reader import Artifact, open_artifact
from .schema import LayerEntry, Manifest, schema_errors

__all__ = ["CONVENTIONS", "Problem", "ProblemCode", "Report", "broken_layers", "check_artifact", "validate_artifact"]

P = ProblemCode


def expected_layer_tensors(art: Artifact, rec: LayerEntry) -> dict[Suffix, tuple[str, tuple[int, ...]]]:
    """``{suffix: (dtype, shape)}`` the manifest implies for one layer."""
    bias_name = f"{rec.name}.{Suffix.BIAS.value}"
    bias_dtype = None
    if rec.has_bias:
        bias_dtype = art.file.infos[bias_name].dtype if bias_name in art.file else "F16"
    return marlin_shapes(rec.shape, act_order=rec.act_order, bias_dtype=bias_dtype)


def validate_artifact(
    path: str | Path, *, checksums: bool = True, progress: Callable[[str, int], None] | None = None
) -> tuple[Report, Artifact]:
    """Check an artifact's structure without a GPU (what ``--shapes`` runs).

    Checks: the manifest validates against its version's JSON Schema and its own
    checksum; every layer's tensors are present with the dtypes and shapes derived from
    ``size_k``, ``size_n`` (``padded_n`` when padded) and ``group_size``; every
    pass-through tensor is present; no tensor is unaccounted for; every tensor's
    xxh3-128 matches the manifest; scales, ``delta`` and bias are finite, and float16 holds
    ``delta`` and the weights the codes form; folder mode's files beside the artifact
    match ``checksums.files``; and the derived facts hold (below).

    Args:
        path: the artifact file.
        checksums: hash every tensor's bytes (reads the whole file once).
        progress: called as ``progress("checksums", tensors)``, then ``progress("", 1)``
            per tensor hashed.

    Returns:
        ``(report, artifact)``; the caller closes the artifact.

    Raises:
        ConverterError: missing or unreadable file.
        ArtifactError: malformed container or no manifest.
        SchemaVersionError: unsupported schema version.
    """
    art = open_artifact(path)
    return check_artifact(art, checksums=checksums, progress=progress), art


def check_artifact(
    art: Artifact, *, checksums: bool = True, progress: Callable[[str, int], None] | None = None
) -> Report:
    """:func:`validate_artifact` on an artifact already open (same checks and arguments)."""
    report = Report(str(art.path), schema_version=art.document.data.get("schema_version"))
    for note in art.notes:
        report.add(P.MANIFEST_CHECKSUM, note, META_MANIFEST)
    # Sharded artifacts: inconsistencies between the index and the shards.
    report.extend(getattr(art.file, "shard_problems", []))
    _check_header_extras(art, report)
    errors = schema_errors(art.document.data, art.document.version)
    if errors is None:
        report.add(
            P.SCHEMA_UNCHECKED,
            "jsonschema is not installed; manifest not validated against the schema",
            severity="warning",
        )
    else:
        for err in errors:
            report.add(
                P.SCHEMA_VIOLATION, f"manifest does not match schema v{art.document.version}: {err}", META_MANIFEST
            )
    if not errors and art.manifest is None:  # the typed reader is the last word without jsonschema
        report.add(
            P.SCHEMA_VIOLATION,
            f"manifest does not match schema v{art.document.version}: {art.manifest_error}",
            META_MANIFEST,
        )
    infos = art.file.infos
    if errors or art.manifest is None:  # field access below assumes a well-formed manifest
        report.checked = {"layers": 0, "tensors": len(infos), "checksums": False}
        return report
    manifest = art.manifest
    accounted: set[str] = set()
    for rec in art.layers.values():
        if rec.size_k % rec.group_size or rec.shape.num_groups != rec.num_groups:
            report.add(
                P.SHAPE_MISMATCH,
                f"layer {rec.name}: group_size {rec.group_size} and num_groups "
                f"{rec.num_groups} disagree with size_k {rec.size_k}",
                rec.name,
            )
        for suffix, (dtype, shape) in expected_layer_tensors(art, rec).items():
            name = f"{rec.name}.{suffix.value}"
            accounted.add(name)
            if name not in infos:
                report.add(P.MISSING_TENSOR, f"{name}: missing (layer {rec.name} needs it)", name)
                continue
            info = infos[name]
            ok_dtype = info.dtype in FLOAT_DTYPES if suffix is Suffix.BIAS else info.dtype == dtype
            if not ok_dtype:
                report.add(P.DTYPE_MISMATCH, f"{name}: dtype {info.dtype}, expected {dtype}", name, dtype, info.dtype)
            if info.shape != shape:
                report.add(
                    P.SHAPE_MISMATCH,
                    f"{name}: shape {list(info.shape)}, expected {list(shape)} from "
                    f"size_k={rec.size_k}, size_n={rec.size_n}, "
                    + (f"padded_n={rec.padded_n}, " if rec.padded_n is not None else "")
                    + f"group_size={rec.group_size}",
                    name,
                    list(shape),
                    list(info.shape),
                )
    for entry in manifest.passthrough:
        if entry.name in accounted:
            report.add(
                P.DUPLICATE_ENTRY, f"{entry.name}: listed both as a layer tensor and as pass-through", entry.name
            )
        accounted.add(entry.name)
        if entry.name not in infos:
            report.add(P.MISSING_TENSOR, f"{entry.name}: pass-through tensor is missing", entry.name)
    for name in infos:
        if name not in accounted:
            report.add(P.UNKNOWN_TENSOR, f"{name}: tensor is neither a layer tensor nor listed as pass-through", name)
    sums = manifest.checksums.tensors
    for name in sums:
        if name not in infos:
            report.add(P.CHECKSUM_ORPHAN, f"{name}: has a checksum but no tensor", name)
    if checksums:
        if progress:
            progress("checksums", len(infos))
        for name in infos:
            if progress:
                progress("", 1)
            want = sums.get(name)
            if want is None:
                report.add(P.CHECKSUM_MISSING, f"{name}: no checksum in the manifest", name)
                continue
            got = _xxh3_streamed(art, name)
            if got != want:
                report.add(
                    P.CHECKSUM_MISMATCH,
                    f"{name}: xxh3-128 {got} does not match the manifest's {want} (corrupted bytes)",
                    name,
                    want,
                    got,
                )
            art.file.release_pages()  # keep RSS bounded on multi-GB artifacts
    non_finite = _check_finite(art, report)
    _check_fp16_range(art, report, skip=non_finite)
    _check_code_range(art, report)
    _check_layer_facts(art, manifest, report)
    _check_folder_files(art, manifest, report)
    report.checked = {"layers": len(art.layers), "tensors": len(infos), "checksums": checksums}
    return report


#: Bytes of a tensor hashed between two drops of its pages: a multi-GB embedding would
#: otherwise sit in RSS whole while it is hashed.
HASH_CHUNK_BYTES = 64 << 20


def _xxh3_streamed(art: Artifact, name: str) -> str:
    """xxh3-128 of a tensor's bytes, in blocks, dropping the mapped pages after each."""
    raw = art.file.raw(name)
    if len(raw) <= HASH_CHUNK_BYTES:
        return xxhash.xxh3_128_hexdigest(raw)
    h = xxhash.xxh3_128()
    for start in range(0, len(raw), HASH_CHUNK_BYTES):
        h.update(raw[start : start + HASH_CHUNK_BYTES])
        art.file.release_pages()
    return h.hexdigest()


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


def broken_layers(report: Report, layer_names: set[str]) -> set[str]:
    """Layers that have an error in ``report``: numerics on them would be meaningless."""
    out = set()
    for p in report.problems:
        if p.severity != "error" or not p.tensor:
            continue
        if p.tensor in layer_names:
            out.add(p.tensor)
        else:
            prefix = p.tensor.rpartition(".")[0]
            if prefix in layer_names:
                out.add(prefix)
    return out


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


def artifact_folder(art: Artifact) -> Path:
    """The folder an artifact's files sit in (the path itself for a folder artifact)."""
    return art.path if art.path.is_dir() else art.path.parent


def _check_folder_files(art: Artifact, manifest: Manifest, report: Report) -> None:
    """Folder mode's ``config.json`` and tokenizer files against ``checksums.files``
    (schema v2): present beside the artifact, with the recorded size and xxh3-128."""
    folder = artifact_folder(art)
    for entry in manifest.checksums.files:
        if Path(entry.name).name != entry.name or entry.name in ("", ".", ".."):
            report.add(P.FOLDER_FILE_MISMATCH, f"{entry.name!r}: not a plain file name in the artifact's folder", "")
            continue
        path = folder / entry.name
        if not os.path.lexists(path):
            report.add(
                P.FOLDER_FILE_MISSING,
                f"{entry.name}: the manifest lists this file beside the artifact, but it is missing",
                entry.name,
            )
            continue
        try:
            data = read_regular_file(path, what="file", error=ArtifactError, max_bytes=MAX_COPIED_FILE_BYTES)
        except ArtifactError as exc:
            report.add(P.FOLDER_FILE_MISMATCH, f"{entry.name}: {exc.rule}", entry.name)
            continue
        got = xxhash.xxh3_128_hexdigest(data)
        if len(data) != entry.bytes or got != entry.xxh3_128:
            report.add(
                P.FOLDER_FILE_MISMATCH,
                f"{entry.name}: {len(data)} bytes with xxh3-128 {got}, the manifest records {entry.bytes} bytes "
                f"with {entry.xxh3_128} (changed since conversion)",
                entry.name,
                entry.xxh3_128,
                got,
            )


#: The ``__metadata__`` keys every artifact file carries (manifest.metadata_for).
METADATA_KEYS = (META_FORMAT, META_SCHEMA_VERSION, META_MANIFEST, META_MANIFEST_CHECKSUM)


def _check_header_extras(art: Artifact, report: Report) -> None:
    """The header bytes no checksum covers: ``__metadata__`` keys and values outside the
    manifest, and the padding after the JSON.  With these checks a flipped byte
    anywhere in an artifact is reported (tests/artifact/test_corruption.py)."""
    for f in getattr(art.file, "shards", None) or [art.file]:
        where = Path(f.path).name
        padding = getattr(f, "header_padding", b"")
        odd = len(padding) - padding.count(b" ")
        if odd:
            report.add(
                P.HEADER_PADDING,
                f"{where}: {odd} header padding byte(s) are not spaces (corrupted header)",
                "__metadata__",
                0,
                odd,
            )
        meta = f.metadata
        for key in METADATA_KEYS:
            if key not in meta:
                report.add(P.METADATA, f"{where}: __metadata__ lacks {key!r}", "__metadata__", key, None)
        if META_FORMAT in meta and meta[META_FORMAT] != META_FORMAT_VALUE:
            report.add(
                P.METADATA,
                f"{where}: __metadata__[{META_FORMAT!r}] is {meta[META_FORMAT]!r}, expected {META_FORMAT_VALUE!r}",
                "__metadata__",
                META_FORMAT_VALUE,
                meta[META_FORMAT],
            )
        for key in sorted(meta.keys() - set(METADATA_KEYS)):
            report.add(
                P.METADATA, f"{where}: unknown __metadata__ key {key!r}", "__metadata__", None, key, severity="warning"
            )

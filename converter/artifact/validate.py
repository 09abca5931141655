"""Structural validation of an artifact: every problem, not just the first.

``validate_artifact`` never raises on bad *content*: it returns a report listing
each problem with a stable code (:class:`~converter.artifact.problems.ProblemCode`).
Only an unreadable container (or a schema version from the future) raises, because
then nothing further can be checked.

The checks live by what they read: :mod:`~converter.artifact.validate_facts` (a layer's
record and the tensors it implies), :mod:`~converter.artifact.validate_values` (the
tensors' values), :mod:`~converter.artifact.validate_bytes` (hashes, folder files,
header bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..constants import META_MANIFEST, Suffix
from ..dtypes import FLOAT_DTYPES
from ..formats import CONVENTIONS
from .problems import Problem, ProblemCode, Report
from .reader import Artifact, open_artifact
from .schema import schema_errors
from .validate_bytes import (
    HASH_CHUNK_BYTES,
    METADATA_KEYS,
    _check_folder_files,
    _check_header_extras,
    _xxh3_streamed,
    artifact_folder,
)
from .validate_facts import _check_layer_facts, _check_padding, _check_regrouping, expected_layer_tensors
from .validate_values import CODE_SCAN_BYTES, FINITE_SUFFIXES, _check_code_range, _check_finite, _check_fp16_range

# The first line is the public API; the rest, defined here before the split (issue 39), stay importable.
__all__ = ["CONVENTIONS", "Problem", "ProblemCode", "Report", "broken_layers", "check_artifact", "validate_artifact"]
__all__ += [
    "CODE_SCAN_BYTES",
    "FINITE_SUFFIXES",
    "HASH_CHUNK_BYTES",
    "METADATA_KEYS",
    "P",
    "_check_code_range",
    "_check_finite",
    "_check_folder_files",
    "_check_fp16_range",
    "_check_header_extras",
    "_check_layer_facts",
    "_check_padding",
    "_check_regrouping",
    "_xxh3_streamed",
    "artifact_folder",
    "expected_layer_tensors",
]

P = ProblemCode


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

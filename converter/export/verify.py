"""Checking an export against its source (what ``marlin-verify OUT --against SRC`` runs on a
compressed-tensors export): our compressed-tensors reader reads the export back, and every
exported layer's codes, scales (bits of the stored values), zero points and act-order
permutation must equal the source's exactly; the source's files must match the sha256
the export recorded."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from ..digests import sha256_files
from ..errors import ConverterError
from ..formats import open_source
from ..formats.compressed_tensors import CONVERTIBLE_BITS
from ..safetensors_io import SafetensorsFile
from .compressed_tensors import EXPORT_META_KEY


@dataclasses.dataclass
class ExportCheck:
    """Result of :func:`check_export`: ``problems`` empty means it passed."""

    checked: list[str]
    unchecked: list[str]  # layers our reader does not read back (3-bit), with the reason
    problems: list[str]


def export_manifest(folder: str | Path) -> dict | None:
    """The export manifest of a compressed-tensors export folder, or None when the folder
    is not one of ours (no ``marlin_convert_export`` metadata)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    metas = [SafetensorsFile(f, error=ConverterError).metadata for f in files]
    found = {m[EXPORT_META_KEY] for m in metas if EXPORT_META_KEY in m}
    if not found:
        return None
    if len(found) != 1 or any(EXPORT_META_KEY not in m for m in metas):
        raise ConverterError("the export's shards carry different manifests", path=folder)
    return json.loads(found.pop())


def check_export(export: str | Path, src: str | Path) -> ExportCheck:
    """Compare an export with its source exactly (module docstring)."""
    manifest = export_manifest(export)
    if manifest is None:
        raise ConverterError("not a marlin-convert compressed-tensors export (no export manifest)", path=export)
    out = ExportCheck([], [], [])
    with open_source(src) as s, open_source(export) as e:
        recorded = {f["name"]: f.get("sha256") for f in manifest["source"]["files"]}
        actual = {p.name: h for p, h in sha256_files(s.digest_files()).items()}
        for name, digest in recorded.items():
            if actual.get(name) != digest:
                out.problems.append(f"source file {name}: sha256 differs from the one the export recorded")
        splan = {lay.name: lay for lay in s.plan(pad=True).layers}
        eplan = {lay.name: lay for lay in e.plan(pad=True).layers}
        for rec in manifest["layers"]:
            name = rec["name"]
            if not rec["exported"]:
                continue
            if rec["bits"] not in CONVERTIBLE_BITS:
                out.unchecked.append(f"{name}: {rec['bits']}-bit compressed-tensors is not read by our reader")
                continue
            if name not in eplan or not eplan[name].convertible:
                out.problems.append(f"{name}: not readable in the export")
                continue
            a, b = s.load_layer(splan[name]), e.load_layer(eplan[name])
            diffs = [
                what
                for what, x, y in (
                    ("codes", a.q, b.q),
                    ("scales", a.source_scales_f32().view(np.uint32), b.source_scales_f32().view(np.uint32)),
                    ("zero points", np.asarray(a.zeros), np.asarray(b.zeros)),
                )
                if x.shape != y.shape or not np.array_equal(x, y)
            ]
            if (a.perm is None) != (b.perm is None) or (a.perm is not None and not np.array_equal(a.perm, b.perm)):
                diffs.append("act-order permutation")
            if diffs:
                out.problems.append(f"{name}: {', '.join(diffs)} differ from the source")
            else:
                out.checked.append(name)
    return out

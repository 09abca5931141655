"""Read, edit and re-seal safetensors artifacts in tests.

An edited artifact gets fresh tensor and manifest checksums, so the only thing
wrong with it is the edit: the tests then show which check catches what.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

from converter.artifact.manifest import checksum, dump_manifest
from converter.constants import META_MANIFEST, META_MANIFEST_CHECKSUM, META_SCHEMA_VERSION, SAFETENSORS_DTYPES


def read_st(path: Path) -> tuple[dict[str, str], dict[str, tuple[str, list[int], bytes]]]:
    """(metadata, {name: (dtype, shape, raw bytes)}) of a well-formed file, header order."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    meta = header.pop("__metadata__", {})
    data = blob[8 + n :]
    return meta, {
        k: (v["dtype"], v["shape"], data[v["data_offsets"][0] : v["data_offsets"][1]]) for k, v in header.items()
    }


def write_st(
    path: Path, tensors: dict[str, tuple[str, list[int], bytes]], metadata: dict[str, str] | None = None
) -> None:
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    off, blobs = 0, []
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blobs.append(raw)
    raw_h = json.dumps(header, separators=(",", ":")).encode()
    raw_h += b" " * (-len(raw_h) % 8)
    path.write_bytes(struct.pack("<Q", len(raw_h)) + raw_h + b"".join(blobs))


def rewrite_artifact(src: Path, dst: Path, edit, *, schema_version: int | None = None) -> Path:
    """Rewrite an artifact with ``edit(manifest, tensors)``, then re-seal every checksum,
    so the only thing wrong with the result is what ``edit`` did; ``schema_version``
    restamps the manifest and ``marlin.schema_version`` (an older version's artifact)."""
    meta, tensors = read_st(src)
    manifest = json.loads(meta[META_MANIFEST])
    edit(manifest, tensors)
    manifest["checksums"]["tensors"] = {n: checksum(raw) for n, (_, _, raw) in tensors.items()}
    if schema_version is not None:
        manifest["schema_version"] = schema_version
        meta = {**meta, META_SCHEMA_VERSION: str(schema_version)}
    text = dump_manifest(manifest, allow_nan=True)  # a test may plant what we never write
    meta = {**meta, META_MANIFEST: text, META_MANIFEST_CHECKSUM: checksum(text.encode())}
    write_st(dst, tensors, meta)
    return dst


def rewrite_artifact_arrays(
    src: Path, dst: Path, edit: Callable[[dict, dict[str, tuple[str, np.ndarray]]], None]
) -> Path:
    """:func:`rewrite_artifact` with tensors as ``{name: (dtype, ndarray)}`` for ``edit``."""

    def on_arrays(manifest: dict, tensors: dict) -> None:
        arrays = {
            n: (d, np.frombuffer(raw, dtype=SAFETENSORS_DTYPES[d]).reshape(shape))
            for n, (d, shape, raw) in tensors.items()
        }
        edit(manifest, arrays)
        tensors.clear()
        for n, (d, a) in arrays.items():
            a = np.ascontiguousarray(a, dtype=SAFETENSORS_DTYPES[d])
            tensors[n] = (d, list(a.shape), a.tobytes())

    return rewrite_artifact(src, dst, on_arrays)


def reseal_folder_files(folder: Path) -> None:
    """After a test edits ``config.json`` (or a tokenizer file) of a one-file model
    folder, record the files' new sizes and checksums in the artifact's manifest
    (``checksums.files``), so that the folder check does not flag the edit and the
    check under test sees it."""
    import xxhash

    def edit(manifest: dict, tensors: dict) -> None:
        for entry in manifest["checksums"].get("files", []):
            data = (folder / entry["name"]).read_bytes()
            entry["bytes"], entry["xxh3_128"] = len(data), xxhash.xxh3_128_hexdigest(data)

    art = folder / "model.safetensors"
    rewrite_artifact(art, art, edit)

"""The bytes of an artifact that no layer rule reads: every tensor's xxh3-128 (hashed in
blocks), folder mode's files against ``checksums.files``, and the header bytes outside
the manifest (``__metadata__`` keys, padding).
"""

from __future__ import annotations

import os
from pathlib import Path

import xxhash

from ..constants import (
    META_FORMAT,
    META_FORMAT_VALUE,
    META_MANIFEST,
    META_MANIFEST_CHECKSUM,
    META_SCHEMA_VERSION,
)
from ..errors import ArtifactError
from ..formats.hf_checkpoint import MAX_COPIED_FILE_BYTES
from ..jsonio import link_out_of, read_regular_file
from .problems import ProblemCode, Report
from .reader import Artifact
from .schema import Manifest

P = ProblemCode


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
        real = link_out_of(path, folder)
        if real is not None:  # not read: its size and hash would tell what lies outside
            report.add(
                P.FOLDER_FILE_MISMATCH,
                f"{entry.name}: a symbolic link to {real}, outside the artifact's folder (not followed)",
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

"""The artifact manifest as typed data, and its versioned reader.

The manifest is one JSON string under ``__metadata__["marlin.manifest"]``, described
by ``schemas/marlin-artifact.v<N>.schema.json``.  The frozen dataclasses below are the
current schema version's objects, field for field (a test checks them, and the enums
they use, against the schema file).  Rules that keep them in step:

* a field without a default is required in the schema; a field with a default is
  optional there and written only when it differs from its default (``act_order``
  is written only when true, so an older reader rejects the layer instead of running
  it without its permutation);
* :meth:`Manifest.parse` reads ``marlin.schema_version`` first and hands the JSON
  object to the parser of that version (:data:`PARSERS`), which returns the *current*
  dataclasses.  A new schema version adds its file, its parser, and the migration of
  the older versions' objects (new fields get their defaults there), so a newer tool
  still reads every older artifact.

Adding a layer field is one dataclass field plus the schema's property: reading,
writing and the schema test follow from the dataclass.  A field a version adds is
listed in :data:`ADDED_IN` under that version, so the older versions' parsers refuse
it (their schema files do not have it) and the schema test checks each file.

Versions: v1 (the first); v2 adds ``layers[].source_group_size`` (a layer stored at a
smaller group size than its source's, whose last group was short) and
``layers[].padded_n`` (a layer whose N was padded to a multiple of 64; ``size_n`` is
the true N), and ``checksums.files`` (folder mode's ``config.json`` and tokenizer
files, so that verification covers them).  A v1 layer has neither layer field: it is

The parts: :mod:`~converter.artifact.schema_objects` (the dataclasses below
:class:`Manifest`), :mod:`~converter.artifact.schema_json` (JSON to dataclasses and
back), :mod:`~converter.artifact.schema_files` (the JSON Schema files).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import xxhash

from .. import jsonio
from ..constants import (
    EXPORT_META_KEY,
    META_MANIFEST,
    META_MANIFEST_CHECKSUM,
    META_SCHEMA_VERSION,
    SAFETENSORS_MAX_HEADER_BYTES,
    SUPPORTED_SCHEMA_VERSIONS,
)
from ..errors import ArtifactError, SchemaVersionError
from .schema_files import load_schema, schema_errors, schema_file
from .schema_json import T, _hints, _Mismatch, _read, from_json, to_json
from .schema_objects import (
    Checksums,
    FileChecksum,
    LayerEntry,
    Passthrough,
    Producer,
    SchemaObject,
    Shard,
    SourceFile,
    SourceInfo,
)

# Everything this module defined before the split (issue 39) stays importable from here.
__all__ = [
    "ADDED_IN",
    "PARSERS",
    "SCHEMA_OBJECTS",
    "Checksums",
    "FileChecksum",
    "LayerEntry",
    "Manifest",
    "ManifestDocument",
    "Passthrough",
    "Producer",
    "SchemaObject",
    "Shard",
    "SourceFile",
    "SourceInfo",
    "T",
    "_Mismatch",
    "_hints",
    "_objects_at",
    "_parse_v1",
    "_parse_v2",
    "_read",
    "_refuse_newer_fields",
    "checksum",
    "from_json",
    "load_schema",
    "read_document",
    "schema_errors",
    "schema_file",
    "to_json",
]


@dataclasses.dataclass(frozen=True)
class Manifest(SchemaObject):
    """The whole manifest (schema ``schema_version``), in the current version's form."""

    schema_version: int
    producer: Producer
    source: SourceInfo
    layers: tuple[LayerEntry, ...]
    passthrough: tuple[Passthrough, ...]
    checksums: Checksums
    shard: Shard | None = None

    @classmethod
    def parse(cls, metadata: Mapping[str, str], *, path: Path) -> Manifest:
        """Read the manifest of a safetensors ``__metadata__`` map.

        Raises:
            ArtifactError: no manifest, not JSON, or not the shape its version's schema gives.
            SchemaVersionError: a schema version this tool does not read, with the fix.
        """
        return read_document(metadata, path=path).manifest()


#: The dataclass of each object the schema owns, by its JSON path in the schema
#: (``"layers[]"``: the items of ``layers``); the schema test walks these.
SCHEMA_OBJECTS: dict[str, type] = {
    "": Manifest,
    "producer": Producer,
    "source": SourceInfo,
    "source.files[]": SourceFile,
    "layers[]": LayerEntry,
    "passthrough[]": Passthrough,
    "checksums": Checksums,
    "checksums.files[]": FileChecksum,
    "shard": Shard,
}


# --------------------------------------------------------------------------- versions


#: The fields each version added, by the object they belong to (SCHEMA_OBJECTS' paths):
#: a manifest of an older version that has one does not fit its own schema.
ADDED_IN: dict[int, dict[str, tuple[str, ...]]] = {
    2: {"layers[]": ("source_group_size", "padded_n"), "checksums": ("files",)},
}


def _objects_at(obj: Any, path: str) -> list[tuple[str, Any]]:
    """``[(JSON path, value)]`` of the objects at ``path`` in SCHEMA_OBJECTS' notation."""
    nodes: list[tuple[str, Any]] = [("", obj)]
    for part in filter(None, path.split(".")):
        name, found = part.removesuffix("[]"), []
        for where, node in nodes:
            if not isinstance(node, dict) or name not in node:
                continue
            at = f"{where}.{name}" if where else name
            child = node[name]
            if part.endswith("[]"):
                found += [(f"{at}[{i}]", c) for i, c in enumerate(child)] if isinstance(child, list) else []
            else:
                found.append((at, child))
        nodes = found
    return nodes


def _refuse_newer_fields(obj: dict[str, Any], version: int) -> None:
    """Raise when a version-``version`` manifest has a field a later version added.

    Raises:
        ArtifactError: naming the field, its path and the version that added it.
    """
    for later, objects in sorted(ADDED_IN.items()):
        if later <= version:
            continue
        for path, names in objects.items():
            for where, node in _objects_at(obj, path):
                found = [n for n in names if isinstance(node, dict) and n in node]
                if found:
                    raise ArtifactError(
                        f"manifest does not fit its schema: {where or '(root)'}: unknown field {found[0]!r} "
                        f"(schema v{later} added it; this manifest is v{version})",
                        tensor=META_MANIFEST,
                    )


def _parse_v1(obj: dict[str, Any]) -> Manifest:
    """Schema v1: the v2 objects without v2's fields, which keep their defaults (not
    regrouped, not padded: a v1 layer is stored at its source's group size and N; no
    checksummed files beside the artifact)."""
    _refuse_newer_fields(obj, 1)
    return from_json(Manifest, obj)


def _parse_v2(obj: dict[str, Any]) -> Manifest:
    """Schema v2 is the current version: its objects are the dataclasses as they are."""
    return from_json(Manifest, obj)


#: schema version -> reader of that version's JSON object into the current :class:`Manifest`.
PARSERS: dict[int, Callable[[dict[str, Any]], Manifest]] = {1: _parse_v1, 2: _parse_v2}


@dataclasses.dataclass(frozen=True)
class ManifestDocument:
    """A manifest as stored, before it is read into dataclasses.

    Attributes:
        version: ``marlin.schema_version``, already known to be supported.
        data: the manifest's JSON object as stored (what the JSON Schema validates).
        notes: non-fatal findings (a manifest checksum mismatch), reported with the rest.
        path: the file it came from.
    """

    version: int
    data: dict[str, Any]
    notes: tuple[str, ...]
    path: Path

    def manifest(self) -> Manifest:
        """The current-version :class:`Manifest` (:data:`PARSERS`).

        Raises:
            ArtifactError: the object does not fit its version's dataclasses.
        """
        try:
            return PARSERS[self.version](self.data)
        except ArtifactError as exc:
            raise ArtifactError(exc.rule, path=self.path, tensor=META_MANIFEST) from None


def checksum(data: bytes | memoryview) -> str:
    """xxh3-128 hex digest (32 chars) of raw bytes."""
    return xxhash.xxh3_128_hexdigest(data)


def read_document(metadata: Mapping[str, str], *, path: Path) -> ManifestDocument:
    """Sniff the schema version, check the manifest's own checksum, parse its JSON.

    Raises:
        ArtifactError: no manifest, or it is not a JSON object (:mod:`converter.jsonio`).
        SchemaVersionError: a schema version this tool does not read, with the fix.
    """
    version = metadata.get(META_SCHEMA_VERSION)
    if version is None and EXPORT_META_KEY in metadata:
        # marlin-verify reads an export by its folder (config.json and every shard)
        raise ArtifactError(
            f"a file of a compressed-tensors export: give its folder, {path.parent}, to check the export", path=path
        )
    if version is None or META_MANIFEST not in metadata:
        raise ArtifactError(
            f"not a marlin-convert artifact: __metadata__ lacks {META_SCHEMA_VERSION!r} or {META_MANIFEST!r} "
            "(a source checkpoint? convert it with marlin-convert, or compare with it through --against)",
            path=path,
        )
    # Canonical ASCII digits only: str.isdigit() also accepts "²" and "١", which int()
    # refuses or reads as another number.
    number = version.isascii() and version.isdecimal() and version == str(int(version))
    if not number or int(version) not in SUPPORTED_SCHEMA_VERSIONS:
        newer = number and int(version) > max(SUPPORTED_SCHEMA_VERSIONS)
        fix = "; upgrade marlin-convert" if newer else ""
        raise SchemaVersionError(
            f"artifact schema version {version!r} is not supported (this tool reads "
            f"{', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))}){fix}",
            path=path,
            tensor=META_SCHEMA_VERSION,
        )
    text = metadata[META_MANIFEST]
    notes = []
    stored = metadata.get(META_MANIFEST_CHECKSUM)
    # surrogatepass: a checksum of any text, even one no JSON reader accepts.
    actual = checksum(text.encode("utf-8", "surrogatepass"))
    if stored != actual:
        notes.append(f"manifest checksum mismatch: stored {stored}, computed {actual}")
    try:
        data = jsonio.loads(text, object_required=True, max_bytes=SAFETENSORS_MAX_HEADER_BYTES)
    except jsonio.JsonError as exc:
        raise ArtifactError(exc.message("manifest"), path=path, tensor=META_MANIFEST) from None
    return ManifestDocument(int(version), data, tuple(notes), path)

"""The artifact manifest (schema v1): build, serialise, parse.

The manifest is one JSON string under ``__metadata__["marlin.manifest"]``; it is
what ``schemas/marlin-artifact.v1.schema.json`` describes.  The schema version is
also stored as its own key (``marlin.schema_version``) so readers can sniff it
cheaply, and the manifest's own xxh3-128 under ``marlin.manifest_checksum``.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

import xxhash

from .. import __version__, jsonio
from ..constants import (
    ARTIFACT_SCHEMA_VERSION,
    CHECKSUM_ALGORITHM,
    META_FORMAT,
    META_FORMAT_VALUE,
    META_MANIFEST,
    META_MANIFEST_CHECKSUM,
    META_SCHEMA_VERSION,
    PRODUCER_NAME,
    SAFETENSORS_MAX_HEADER_BYTES,
    SUPPORTED_SCHEMA_VERSIONS,
)
from ..errors import ArtifactError, SchemaVersionError
from ..formats.base import LayerPlan
from ..marlin.shapes import kernel_compatible, upstream_compatible
from ..quant_weight import marlin_code_offset

SCHEMA_FILE = f"marlin-artifact.v{ARTIFACT_SCHEMA_VERSION}.schema.json"


def checksum(data: bytes | memoryview) -> str:
    """xxh3-128 hex digest (32 chars) of raw bytes."""
    return xxhash.xxh3_128_hexdigest(data)


def layer_entry(layer: LayerPlan) -> dict[str, Any]:
    """Manifest record of one converted layer."""
    entry: dict[str, Any] = {
        "name": layer.name,
        "size_k": layer.size_k,
        "size_n": layer.size_n,
        "group_size": layer.group_size,
        "num_groups": layer.num_groups,
        "bits": layer.bits,
        "code_offset": marlin_code_offset(layer.bits),
        "symmetric": layer.symmetric,
        "zero_convention": layer.zero_convention.value,
        "has_bias": layer.bias is not None,
        "upstream_marlin_compatible": upstream_compatible(layer.size_k, layer.size_n, layer.group_size),
        "kernel_compatible": kernel_compatible(layer.size_k, layer.size_n, layer.group_size),
        "warnings": list(layer.warnings),
    }
    if layer.act_order:
        # Written only when true: a v1 reader that predates the field rejects the
        # manifest (additionalProperties: false) instead of ignoring the permutation.
        entry["act_order"] = True
    return entry


def new_manifest(source: dict[str, Any], layers: list[dict[str, Any]], passthrough: list[dict[str, str]]) -> dict[str, Any]:
    """A manifest with empty checksums (filled in as tensors are written)."""
    return {
        "schema_version": ARTIFACT_SCHEMA_VERSION,
        "producer": {"name": PRODUCER_NAME, "version": __version__},
        "source": source,
        "layers": layers,
        "passthrough": passthrough,
        "checksums": {"algorithm": CHECKSUM_ALGORITHM, "tensors": {}},
    }


def dump_manifest(manifest: dict[str, Any]) -> str:
    """Canonical JSON text of the manifest (sorted keys, no spaces)."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def metadata_for(manifest: dict[str, Any]) -> dict[str, str]:
    """The safetensors ``__metadata__`` map carrying the manifest."""
    text = dump_manifest(manifest)
    return {
        META_FORMAT: META_FORMAT_VALUE,
        META_SCHEMA_VERSION: str(ARTIFACT_SCHEMA_VERSION),
        META_MANIFEST: text,
        META_MANIFEST_CHECKSUM: checksum(text.encode("utf-8")),
    }


def parse_metadata(metadata: dict[str, str], *, path: Path) -> tuple[dict[str, Any], list[str]]:
    """Sniff the schema version and parse the manifest.

    Returns:
        ``(manifest, notes)``; notes list non-fatal findings (a manifest checksum
        mismatch is returned here so ``validate`` can report it with the rest).

    Raises:
        ArtifactError: no manifest, or it is not a JSON object.
        SchemaVersionError: a schema version this tool does not read, with the fix.
    """
    version = metadata.get(META_SCHEMA_VERSION)
    if version is None or META_MANIFEST not in metadata:
        raise ArtifactError(
            f"not a marlin-convert artifact: __metadata__ lacks {META_SCHEMA_VERSION!r} or {META_MANIFEST!r}", path=path
        )
    if not version.isdigit() or int(version) not in SUPPORTED_SCHEMA_VERSIONS:
        newer = version.isdigit() and int(version) > max(SUPPORTED_SCHEMA_VERSIONS)
        fix = "; upgrade marlin-convert" if newer else ""
        raise SchemaVersionError(
            f"artifact schema version {version!r} is not supported (this tool reads "
            f"{', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))}){fix}", path=path, tensor=META_SCHEMA_VERSION,
        )
    text = metadata[META_MANIFEST]
    notes = []
    stored = metadata.get(META_MANIFEST_CHECKSUM)
    # surrogatepass: a lone surrogate escape (\ud800) in a corrupted manifest must give
    # a checksum mismatch, not a UnicodeEncodeError.
    actual = checksum(text.encode("utf-8", "surrogatepass"))
    if stored != actual:
        notes.append(f"manifest checksum mismatch: stored {stored}, computed {actual}")
    try:
        manifest = jsonio.loads(text, object_required=True, max_bytes=SAFETENSORS_MAX_HEADER_BYTES)
    except jsonio.JsonError as exc:
        raise ArtifactError(exc.message("manifest"), path=path, tensor=META_MANIFEST) from None
    return manifest, notes


@lru_cache(maxsize=1)
def load_schema() -> dict[str, Any]:
    """The JSON Schema of the current artifact version (shipped in the package)."""
    try:
        text = resources.files("converter").joinpath("_schemas", SCHEMA_FILE).read_text("utf-8")
    except (FileNotFoundError, ModuleNotFoundError, NotADirectoryError):
        text = (Path(__file__).resolve().parents[2] / "schemas" / SCHEMA_FILE).read_text("utf-8")
    return json.loads(text)


def schema_errors(manifest: dict[str, Any]) -> list[str] | None:
    """Every JSON Schema violation as ``"<json path>: <message>"``; None if jsonschema is absent."""
    try:
        import jsonschema
    except ImportError:
        return None
    validator = jsonschema.Draft202012Validator(load_schema())
    out = []
    for err in sorted(validator.iter_errors(manifest), key=lambda e: list(map(str, e.absolute_path))):
        where = "/".join(str(p) for p in err.absolute_path) or "(root)"
        out.append(f"{where}: {err.message}")
    return out

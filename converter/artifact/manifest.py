"""Building and storing the manifest (its typed form is :mod:`converter.artifact.schema`).

The manifest is one JSON string under ``__metadata__["marlin.manifest"]``; the schema
version is also stored as its own key (``marlin.schema_version``) so readers can sniff
it cheaply, and the manifest's own xxh3-128 under ``marlin.manifest_checksum``.
"""

from __future__ import annotations

import json
from typing import Any

from .. import __version__
from ..constants import (
    ARTIFACT_SCHEMA_VERSION,
    CHECKSUM_ALGORITHM,
    META_FORMAT,
    META_FORMAT_VALUE,
    META_MANIFEST,
    META_MANIFEST_CHECKSUM,
    META_SCHEMA_VERSION,
    PRODUCER_NAME,
)
from ..formats.base import LayerPlan
from ..marlin.shapes import kernel_compatible, upstream_compatible
from ..quant_weight import marlin_code_offset
from .schema import (
    Checksums,
    FileChecksum,
    LayerEntry,
    Manifest,
    Passthrough,
    Producer,
    SourceInfo,
    checksum,
    from_json,
)

__all__ = ["checksum", "dump_manifest", "layer_entry", "metadata_for", "new_manifest"]


def layer_entry(layer: LayerPlan) -> LayerEntry:
    """The manifest record of one converted layer."""
    return LayerEntry(
        name=layer.name,
        size_k=layer.size_k,
        size_n=layer.size_n,
        group_size=layer.group_size,
        num_groups=layer.num_groups,
        bits=layer.bits,
        code_offset=marlin_code_offset(layer.bits),
        symmetric=layer.symmetric,
        zero_convention=layer.zero_convention,
        has_bias=layer.bias is not None,
        # Of the stored layout: a runtime runs padded_n columns at the stored group size.
        upstream_marlin_compatible=upstream_compatible(layer.size_k, layer.layout_n, layer.group_size),
        kernel_compatible=kernel_compatible(layer.size_k, layer.layout_n, layer.group_size),
        warnings=tuple(layer.warnings),
        act_order=layer.act_order,
        source_group_size=layer.source_group_size,
        padded_n=layer.padded_n,
    )


def new_manifest(
    source: dict[str, Any],
    layers: list[LayerEntry],
    passthrough: list[Passthrough],
    *,
    files: tuple[FileChecksum, ...] = (),
) -> Manifest:
    """A manifest with no tensor checksums yet (filled in as tensors are written).

    Args:
        source: the reader's ``describe()`` (the schema's ``source`` object).
        files: checksums of folder mode's files beside the artifact (schema v2).

    Raises:
        ArtifactError: ``source`` does not fit the schema (a reader bug).
    """
    return Manifest(
        schema_version=ARTIFACT_SCHEMA_VERSION,
        producer=Producer(PRODUCER_NAME, __version__),
        source=from_json(SourceInfo, source, "source"),
        layers=tuple(layers),
        passthrough=tuple(passthrough),
        checksums=Checksums(CHECKSUM_ALGORITHM, {}, files),
    )


def dump_manifest(data: dict[str, Any], *, allow_nan: bool = False) -> str:
    """Canonical JSON text of a manifest object (sorted keys, no spaces).

    What we write is standard JSON: a NaN or infinity raises ValueError (the converter
    refuses them earlier, by name).  ``allow_nan`` is for comparing manifests as read.
    """
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=allow_nan)


def metadata_for(manifest: Manifest) -> dict[str, str]:
    """The safetensors ``__metadata__`` map carrying the manifest."""
    text = dump_manifest(manifest.to_json())
    return {
        META_FORMAT: META_FORMAT_VALUE,
        META_SCHEMA_VERSION: str(manifest.schema_version),
        META_MANIFEST: text,
        META_MANIFEST_CHECKSUM: checksum(text.encode("utf-8")),
    }

"""Building and storing the manifest (its typed form is :mod:`converter.artifact.schema`).

The manifest is one JSON string under ``__metadata__["marlin.manifest"]``; the schema
version is also stored as its own key (``marlin.schema_version``) so readers can sniff
it cheaply, and the manifest's own xxh3-128 under ``marlin.manifest_checksum``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterator, Mapping
from typing import Any

import xxhash

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
    to_json,
)

__all__ = ["checksum", "dump_manifest", "layer_entry", "manifest_text", "metadata_for", "new_manifest"]


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


#: A container this long is written item by item (:func:`manifest_text`); a shorter one at once.
_WHOLE_ITEMS = 256
_dump = functools.partial(json.dumps, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_encode_str = json.encoder.encode_basestring  # how json.dumps(ensure_ascii=False) writes a str
#: Characters of manifest text gathered before they are joined (and hashed).
_CHUNK_CHARS = 1 << 16


def _large(value: object) -> bool:
    return isinstance(value, (list, tuple, dict)) and len(value) > _WHOLE_ITEMS


def _json_pieces(value: Any) -> Iterator[str]:
    """``dump_manifest(to_json(value))`` in pieces, without building the JSON objects of
    a long container (the ``passthrough`` list and the tensor checksums of a model of
    100 k tensors) at once: each of its items is converted and dumped on its own
    (issue 42).  A container written item by item is written as ``json.dumps`` would
    (keys sorted, no spaces); everything else goes through ``json.dumps`` itself."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            f.name: getattr(value, f.name)
            for f in dataclasses.fields(value)
            if f.default is dataclasses.MISSING or not getattr(value, f.name) == f.default
        }  # the fields to_json writes
        if any(_large(v) or dataclasses.is_dataclass(v) for v in fields.values()):
            yield from _object_pieces(fields)
            return
    elif isinstance(value, (list, tuple)) and len(value) > _WHOLE_ITEMS:
        yield "["
        for i, item in enumerate(value):
            if i:
                yield ","
            yield from _json_pieces(item)
        yield "]"
        return
    elif _large(value) and all(type(k) is str for k in value):
        yield from _object_pieces(value)
        return
    yield _dump(to_json(value))


def _object_pieces(obj: Mapping[str, Any]) -> Iterator[str]:
    yield "{"
    for i, key in enumerate(sorted(obj)):
        yield ("," if i else "") + _encode_str(key) + ":"
        yield from _json_pieces(obj[key])
    yield "}"


def manifest_text(manifest: Manifest) -> tuple[str, str]:
    """The manifest's canonical JSON text (``dump_manifest(manifest.to_json())``) and its
    xxh3-128, built from pieces (:func:`_json_pieces`) joined a chunk at a time: at most
    about twice the text's size at once, never the JSON objects of every tensor."""
    hasher = xxhash.xxh3_128()
    chunks: list[str] = []
    buf: list[str] = []
    size = 0
    for piece in _json_pieces(manifest):
        buf.append(piece)
        size += len(piece)
        if size >= _CHUNK_CHARS:
            chunks.append("".join(buf))
            hasher.update(chunks[-1].encode("utf-8"))
            buf, size = [], 0
    if buf:
        chunks.append("".join(buf))
        hasher.update(chunks[-1].encode("utf-8"))
    del buf
    text = chunks[0] if len(chunks) == 1 else "".join(chunks)
    return text, hasher.hexdigest()


def metadata_for(manifest: Manifest) -> dict[str, str]:
    """The safetensors ``__metadata__`` map carrying the manifest."""
    text, digest = manifest_text(manifest)
    return {
        META_FORMAT: META_FORMAT_VALUE,
        META_SCHEMA_VERSION: str(manifest.schema_version),
        META_MANIFEST: text,
        META_MANIFEST_CHECKSUM: digest,
    }

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
stored at its source's group size and N; a v1 manifest checksums no files.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Mapping
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar, Union

import xxhash

from .. import jsonio
from ..constants import (
    ARTIFACT_SCHEMA_VERSION,
    META_MANIFEST,
    META_MANIFEST_CHECKSUM,
    META_SCHEMA_VERSION,
    SAFETENSORS_MAX_HEADER_BYTES,
    SUPPORTED_SCHEMA_VERSIONS,
    SourceFormat,
    ZeroConvention,
)
from ..errors import ArtifactError, SchemaVersionError
from ..marlin.shapes import LayerShape

T = TypeVar("T")


class SchemaObject:
    """Base of the manifest's dataclasses: :meth:`to_json` gives the stored JSON object."""

    __slots__ = ()  # so that a subclass with slots (one object per tensor) has no __dict__

    def to_json(self) -> dict[str, Any]:
        """The JSON object this is stored as (see :func:`to_json`)."""
        return to_json(self)


@dataclasses.dataclass(frozen=True)
class Producer(SchemaObject):
    """The program that wrote the artifact: its name and its own version (PEP 440)."""

    name: str
    version: str


@dataclasses.dataclass(frozen=True)
class SourceFile(SchemaObject):
    """One input file read: name (no directory), size in bytes, hex sha256."""

    name: str
    bytes: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class SourceInfo(SchemaObject):
    """What the artifact was converted from.

    Attributes:
        format: the detected input format.
        files: the weight files and configs read.
        quant_config: the source's quantization config as found (free-form; for
            ``.tinyloop``, ``{"model": <the header's model object>}``).
    """

    format: SourceFormat
    files: tuple[SourceFile, ...]
    quant_config: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class LayerEntry(SchemaObject):
    """One converted layer (tensors ``<name>.marlin_B`` / ``_scales`` / ``_delta``
    [/ ``.marlin_perm``] [/ ``.bias``]).

    Attributes:
        name: the layer prefix, the source's own module or linear name.
        size_k, size_n: in- and out-features K and N.
        group_size: input rows per scale group; ``size_k`` for per-channel.
        num_groups: ``size_k / group_size``.
        bits: source code width (2, 3 or 4); all are stored as 4-bit Marlin codes.
        code_offset: Marlin code = source code + this (``8 - 2**(bits - 1)``).
        symmetric: ``marlin_delta`` is exactly zero (from the data, not a flag).
        zero_convention: how the source stored its offset.
        has_bias: ``<name>.bias`` is present.
        upstream_marlin_compatible: IST-DASLab Marlin's own limits hold.
        kernel_compatible: this project's GEMM limits hold.
        warnings: data-versus-config findings from conversion.
        act_order: the layer carries ``<name>.marlin_perm`` (written only when true).
        source_group_size: (v2) the source's group size when the layer was regrouped
            (its last group was short, ``size_k % source_group_size != 0``): every
            source group's scale and zero are repeated for each of its
            ``group_size``-row slices.  Written only when regrouped.
        padded_n: (v2) the width of ``marlin_B``, the scales and ``delta`` when N was
            padded to a multiple of 64 (columns ``size_n..padded_n`` hold code 8,
            scale 1, delta 0); ``size_n`` stays the true N, the bias and the output
            have ``size_n`` columns.  Written only when padded, so a reader that
            does not know it refuses the layer instead of running ``padded_n`` columns.
    """

    name: str
    size_k: int
    size_n: int
    group_size: int
    num_groups: int
    bits: int
    code_offset: int
    symmetric: bool
    zero_convention: ZeroConvention
    has_bias: bool
    upstream_marlin_compatible: bool
    kernel_compatible: bool
    warnings: tuple[str, ...]
    act_order: bool = False
    source_group_size: int | None = None
    padded_n: int | None = None

    @property
    def shape(self) -> LayerShape:
        """The tensor shapes ``size_k``, ``size_n``, ``padded_n`` and ``group_size`` imply
        (its ``num_groups`` is computed, so it can be checked against the recorded one)."""
        return LayerShape(self.size_k, self.size_n, self.group_size, self.padded_n)

    @property
    def layout_n(self) -> int:
        """Columns of ``marlin_B``, the scales and ``delta``: ``padded_n``, else ``size_n``."""
        return self.shape.layout_n


@dataclasses.dataclass(frozen=True, slots=True)
class Passthrough(SchemaObject):
    """A tensor carried over unchanged (same name, dtype, shape, bytes), and why (one per
    tensor: slots keep it small, issue 42)."""

    name: str
    reason: str


@dataclasses.dataclass(frozen=True)
class FileChecksum(SchemaObject):
    """A file folder mode writes beside the artifact (``config.json``, tokenizer files):
    its name in the artifact's folder, its size in bytes and its xxh3-128 (schema v2)."""

    name: str
    bytes: int
    xxh3_128: str


@dataclasses.dataclass(frozen=True)
class Checksums(SchemaObject):
    """Integrity of every tensor's bytes: ``{tensor name: 32-hex-digit xxh3-128}``, and
    (schema v2, folder mode) of every file written beside the artifact."""

    algorithm: str
    tensors: dict[str, str]
    files: tuple[FileChecksum, ...] = ()


@dataclasses.dataclass(frozen=True)
class Shard(SchemaObject):
    """This file is shard ``index`` (1-based) of ``count``; the manifest describes the whole model."""

    index: int
    count: int


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


# --------------------------------------------------------------------------- JSON <-> dataclasses


def to_json(obj: Any) -> Any:
    """The JSON value of a manifest dataclass (fields in declaration order; a field with
    a default only when it differs from it), enum, tuple or plain value."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if f.default is not dataclasses.MISSING and value == f.default:
                continue
            out[f.name] = to_json(value)
        return out
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (tuple, list)):
        return [to_json(v) for v in obj]
    return obj


class _Mismatch(Exception):
    """A JSON value that does not fit the dataclass field it is read into."""


def from_json(cls: type[T], value: Any, where: str = "") -> T:
    """Read a JSON object into dataclass ``cls``, checking every field's type.

    Integers written as integral floats (``128.0``) read as ints, as JSON Schema allows.

    Raises:
        ArtifactError: a field is missing, unknown or of the wrong type (naming its path).
    """
    try:
        return _read(cls, value, where)
    except _Mismatch as exc:
        raise ArtifactError(f"manifest does not fit its schema: {exc}", tensor=META_MANIFEST) from None


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _read(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise _Mismatch(f"{where or '(root)'}: expected an object, found {jsonio.json_type(value)}")
        fields = {f.name: f for f in dataclasses.fields(tp)}
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise _Mismatch(f"{where or '(root)'}: unknown field {unknown[0]!r}")
        hints = _hints(tp)
        kwargs = {}
        for name, f in fields.items():
            at = f"{where}.{name}" if where else name
            if name in value:
                kwargs[name] = _read(hints[name], value[name], at)
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise _Mismatch(f"{at}: required field is missing")
        return tp(**kwargs)
    if origin in (Union, types.UnionType):  # X | None
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else _read(args[0], value, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise _Mismatch(f"{where}: expected an array, found {jsonio.json_type(value)}")
        (item, _) = typing.get_args(tp)
        return tuple(_read(item, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        _, item = typing.get_args(tp)
        if not isinstance(value, dict):
            raise _Mismatch(f"{where}: expected an object, found {jsonio.json_type(value)}")
        if item is not Any:
            for key, v in value.items():
                _read(item, v, f"{where}.{key}")
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise _Mismatch(f"{where}: {value!r} is not one of {[m.value for m in tp]}") from None
    if tp is bool:
        if not isinstance(value, bool):
            raise _Mismatch(f"{where}: expected a boolean, found {jsonio.json_type(value)}")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise _Mismatch(f"{where}: expected an integer, found {jsonio.json_type(value)}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise _Mismatch(f"{where}: expected a string, found {jsonio.json_type(value)}")
        return value
    raise TypeError(f"no JSON reading for {tp!r}")  # a dataclass field of a type the schema has no form for


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
    if version is None or META_MANIFEST not in metadata:
        raise ArtifactError(
            f"not a marlin-convert artifact: __metadata__ lacks {META_SCHEMA_VERSION!r} or {META_MANIFEST!r}", path=path
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


# --------------------------------------------------------------------------- the schema files


def schema_file(version: int = ARTIFACT_SCHEMA_VERSION) -> str:
    return f"marlin-artifact.v{version}.schema.json"


@cache
def load_schema(version: int = ARTIFACT_SCHEMA_VERSION) -> dict[str, Any]:
    """The JSON Schema of artifact schema ``version`` (shipped in the package)."""
    name = schema_file(version)
    try:
        text = resources.files("converter").joinpath("_schemas", name).read_text("utf-8")
    except (FileNotFoundError, ModuleNotFoundError, NotADirectoryError):
        text = (Path(__file__).resolve().parents[2] / "schemas" / name).read_text("utf-8")
    return jsonio.loads(text, object_required=True)


def schema_errors(data: dict[str, Any], version: int = ARTIFACT_SCHEMA_VERSION) -> list[str] | None:
    """Every JSON Schema violation as ``"<json path>: <message>"``; None if jsonschema is absent."""
    try:
        import jsonschema
    except ImportError:
        return None
    validator = jsonschema.Draft202012Validator(load_schema(version))
    out = []
    for err in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path))):
        where = "/".join(str(p) for p in err.absolute_path) or "(root)"
        out.append(f"{where}: {err.message}")
    return out

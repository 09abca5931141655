"""The manifest's objects below the whole (producer, source, layers, pass-through,
checksums, shard) as frozen dataclasses, field for field as the current schema version
has them; the rules that keep them in step are :mod:`converter.artifact.schema`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..constants import SourceFormat, ZeroConvention
from ..marlin.shapes import LayerShape
from .schema_json import to_json


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

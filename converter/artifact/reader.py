"""Open a marlin-convert artifact: header, manifest and tensors on demand."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ArtifactError, ConverterError
from .manifest import parse_metadata


@dataclasses.dataclass(frozen=True)
class LayerRecord:
    """One converted layer as the manifest records it (see the v1 schema).

    ``group_size == size_k`` means per-channel.
    """

    name: str
    size_k: int
    size_n: int
    group_size: int
    bits: int
    act_order: bool
    symmetric: bool
    has_bias: bool
    raw: dict[str, Any]

    @classmethod
    def from_manifest(cls, entry: dict[str, Any]) -> LayerRecord:
        return cls(
            name=entry["name"], size_k=int(entry["size_k"]), size_n=int(entry["size_n"]),
            group_size=int(entry["group_size"]), bits=int(entry["bits"]),
            act_order=bool(entry.get("act_order", False)), symmetric=bool(entry["symmetric"]),
            has_bias=bool(entry["has_bias"]), raw=entry,
        )

    @property
    def num_groups(self) -> int:
        return self.size_k // self.group_size


class Artifact:
    """A validated-container artifact file.

    Attributes:
        path: the file.
        file: the underlying :class:`SafetensorsFile`, or for a sharded artifact (an
            index or a folder) a :class:`~converter.artifact.sharded_reader.ShardedFile`
            presenting all shards as one (its ``shard_problems`` list inconsistencies).
        manifest: the parsed manifest dict.
        notes: non-fatal findings from parsing (manifest checksum mismatch).
        layers: ``{prefix: LayerRecord}`` (empty if the manifest's layer list is malformed;
            :func:`~converter.artifact.validate.validate_artifact` reports why).

    Raises:
        ArtifactError: the container is malformed or has no manifest.
        SchemaVersionError: an unsupported schema version.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        from .sharded_reader import open_artifact_file

        self.file = open_artifact_file(self.path)
        try:
            self.manifest, self.notes = parse_metadata(self.file.metadata, path=self.path)
        except BaseException:
            self.file.close()
            raise
        self.layers: dict[str, LayerRecord] = {}
        try:
            for entry in self.manifest.get("layers", []):
                rec = LayerRecord.from_manifest(entry)
                self.layers[rec.name] = rec
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError):  # e.g. int(Infinity)
            self.layers = {}

    def tensor(self, name: str) -> np.ndarray:
        """Array view of a tensor in its storage dtype (BF16 as uint16).

        Raises:
            ArtifactError: no such tensor.
        """
        if name not in self.file:
            raise ArtifactError("tensor is missing", path=self.path, tensor=name)
        return self.file.array(name)

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> Artifact:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_artifact(path: str | Path) -> Artifact:
    """Open an artifact (see :class:`Artifact`).

    Raises:
        ConverterError: the file does not exist or cannot be read.
        ArtifactError, SchemaVersionError: see :class:`Artifact`.
    """
    path = Path(path)
    if not path.is_file() and not (path.is_dir() or path.name.endswith(".index.json")):
        raise ConverterError("no such file" if not path.exists() else "not a file", path=path)
    from ..formats.tinyloop import sniff

    if sniff(path):
        raise ArtifactError("this is a .tinyloop source, not an artifact (to compare with it, use --against)", path=path)
    return Artifact(path)

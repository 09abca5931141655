"""Open a marlin-convert artifact: header, manifest and tensors on demand."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ArtifactError, ConverterError
from .schema import LayerEntry, Manifest, read_document


class Artifact:
    """A validated-container artifact file.

    Attributes:
        path: the file.
        file: the underlying :class:`SafetensorsFile`, or for a sharded artifact (an
            index or a folder) a :class:`~converter.artifact.sharded_reader.ShardedFile`
            presenting all shards as one (its ``shard_problems`` list inconsistencies).
        document: the manifest as stored (:class:`~converter.artifact.schema.ManifestDocument`:
            its JSON object, what the JSON Schema validates, and non-fatal notes).
        manifest: the typed :class:`~converter.artifact.schema.Manifest`, or None when the
            stored object does not fit the schema's shape
            (:func:`~converter.artifact.validate.validate_artifact` reports why).
        notes: non-fatal findings from parsing (manifest checksum mismatch).
        layers: ``{prefix: LayerEntry}`` of the converted layers (empty without a manifest).

    Raises:
        ArtifactError: the container is malformed or has no manifest.
        SchemaVersionError: an unsupported schema version.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        from .sharded_reader import open_artifact_file

        self.file = open_artifact_file(self.path)
        try:
            self.document = read_document(self.file.metadata, path=self.path)
        except BaseException:
            self.file.close()
            raise
        self.notes = list(self.document.notes)
        self.manifest: Manifest | None = None
        #: Why :attr:`manifest` is None (the typed reader's message), else None.
        self.manifest_error: str | None = None
        try:
            self.manifest = self.document.manifest()
        except ArtifactError as exc:
            self.manifest_error = exc.rule
        self.layers: dict[str, LayerEntry] = {rec.name: rec for rec in self.manifest.layers} if self.manifest else {}

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
        if not path.exists():
            from .sharded_reader import missing_artifact

            raise missing_artifact(path)
        raise ConverterError("not a file", path=path)
    from ..formats.tinyloop import sniff

    if sniff(path):
        raise ArtifactError(
            "this is a .tinyloop source, not an artifact (to compare with it, use --against)", path=path
        )
    return Artifact(path)

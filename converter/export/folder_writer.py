"""Writing the export folder: the tensors recomputed one layer at a time, every shard, the
extra files and the index staged, then committed all at once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..artifact.shards import Layout
from ..artifact.target import InputGuard, OutputTarget, artifact_stem
from ..atomic import (
    OutputLock,
    commit_all,
    interrupts_deferred,
    note_committed,
    stage_placeholder,
    target_mode,
    write_durably,
)
from ..errors import ConverterError
from ..formats.base import LayerPlan, Source
from ..hf_index import index_bytes
from ..safetensors_io import StreamingWriter, header_size_for, release_mapped_pages
from .layer_tensors import _layer_tensors


class _TensorSource:
    """The export's tensor data by name: plain tensors from the source as stored, a
    layer's tensors recomputed from the source (the last layer cached)."""

    #: Input bytes read between two page releases: bounds the mapped input held in RSS
    #: without a release call for each of many tiny tensors.
    RELEASE_BYTES = 64 * 2**20

    def __init__(self, source: Source, tensors: Mapping[str, tuple[str, tuple[int, ...], str | LayerPlan]]) -> None:
        self.source = source
        self.tensors = tensors
        self._cached: tuple[str, dict[str, tuple[str, np.ndarray]]] | None = None
        self._touched = 0

    def __getitem__(self, name: str) -> np.ndarray:
        where = self.tensors[name][2]
        if isinstance(where, str):
            self._read(self.tensors[name])
            return np.asarray(self.source.load_tensor(where).data)
        if self._cached is None or self._cached[0] != where.name:
            self._cached = None
            self._read(self.tensors[name], layer=where)
            self._cached = (where.name, _layer_tensors(self.source.load_layer(where), where))
        return self._cached[1][name][1]

    def _read(self, entry: tuple[str, tuple[int, ...], str | LayerPlan], layer: LayerPlan | None = None) -> None:
        """Before a read: drop the input pages read so far once they pass RELEASE_BYTES
        (a layer always counts as large), as the Marlin stream does; the mapped input
        would otherwise stay resident to the end of the export."""
        from ..dtypes import nbytes

        self._touched += self.RELEASE_BYTES if layer is not None else nbytes(entry[0], entry[1])
        if self._touched >= self.RELEASE_BYTES:
            self._touched = 0
            release_mapped_pages()
            self.source.release_pages()

    def total_bytes(self) -> int:
        from ..dtypes import nbytes

        return sum(nbytes(d, shape) for d, shape, _ in self.tensors.values())


def _write(
    target: OutputTarget,
    shards: list[Layout],
    tensors: _TensorSource,
    meta: dict[str, str],
    extras: Mapping[str, bytes],
    guard: InputGuard,
) -> list[Path]:
    """Stage every shard, the extra files and the index, then rename them all into
    place at once (:func:`converter.atomic.commit_all`)."""
    folder = target.folder
    paths = target.shard_paths(len(shards))
    lock = OutputLock(folder, artifact_stem(target.path), target.path)
    temps: list[Path] = []
    writers: list[StreamingWriter] = []
    pairs: list[tuple[Path, Path]] = []
    done = False
    try:
        for shard, final in zip(shards, paths, strict=True):
            staged = stage_placeholder(folder, final.name, temps)
            with StreamingWriter(
                staged, shard, header_reserve=header_size_for(shard, meta), error_path=final
            ) as writer:
                writers.append(writer)
                for name, _, _ in shard:
                    writer.write(name, np.ascontiguousarray(tensors[name]))
                writer.finish(meta)
            pairs.append((staged, final))

        def stage(name: str, content: bytes) -> None:
            tmp = stage_placeholder(folder, name, temps)
            write_durably(tmp, content)
            pairs.append((tmp, folder / name))

        for name, content in extras.items():
            stage(name, content)
        if len(shards) > 1:
            wmap = {n: paths[i].name for i, shard in enumerate(shards) for n, _, _ in shard}
            total = tensors.total_bytes()
            stage(target.index.name, index_bytes(wmap, total))
        stale = target.stale_paths(len(shards), extras)
        for old in stale:
            guard.check_delete(old)
        for tmp, final in pairs:
            os.chmod(tmp, target_mode(final))
        with interrupts_deferred():
            commit_all(pairs, folder)
            done = True
            note_committed(paths[0] if len(shards) == 1 else target.index)
            for old in stale:
                old.unlink(missing_ok=True)
    except OSError as exc:
        raise ConverterError(f"could not write the export ({exc.strerror or exc})", path=folder) from None
    finally:
        lock.release()  # first: its file would keep a folder this run created from being removed
        if not done:
            for tmp in temps:
                tmp.unlink(missing_ok=True)
            target.discard_created()
    return [final for _, final in pairs]

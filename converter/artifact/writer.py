"""Writing an artifact: one file, or HF shards plus an index, plus folder-mode extras.

* One shard: a single file at the output path, no index.  More: files
  ``<stem>-0000i-of-0000n.safetensors`` beside an HF index
  ``<stem>.safetensors.index.json`` (:mod:`converter.hf_index`; spec section 7).
* Every shard carries the whole-model manifest (``layers``, ``passthrough`` and
  ``checksums`` describe the whole model) plus ``shard: {index, count}`` (schema v1 and later).
* Atomicity: every shard (and, in folder mode, ``config.json`` and the tokenizer
  files) is first written under a temporary name in the output folder; only when all
  of them are complete and fsynced are they renamed onto their final names, the index
  last (:func:`converter.atomic.commit_all`).  A failure before that point leaves the
  output folder as it was.

Where the files go, and what they may replace, is :mod:`converter.artifact.target`;
how tensors split into shards, :mod:`converter.artifact.shards`; reading them back as
one file, :mod:`converter.artifact.sharded_reader`.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..atomic import (
    TEMP_SUFFIX,
    OutputLock,
    commit_all,
    interrupts_deferred,
    note_committed,
    output_write_error,
    remove_stale_temporaries,
    stage_placeholder,
    target_mode,
    temp_stem,
    track,
    untrack,
    write_durably,
)
from ..constants import SAFETENSORS_MAX_HEADER_BYTES
from ..dtypes import nbytes
from ..errors import SourceFormatError
from ..hf_index import index_bytes
from ..safetensors_io import StreamingWriter, header_size_for
from .manifest import metadata_for
from .schema import Manifest, Shard
from .shards import Layout
from .target import SHARD_NAME_RE, InputGuard, OutputTarget, artifact_stem

#: Shard writers that keep their descriptor open at once (the rest are parked).
OPEN_SHARDS = 16


class ArtifactWriter:
    """Writes an artifact as one file or as shards, plus folder-mode extras, atomically.

    Same ``write``/``write_flat`` interface as :class:`StreamingWriter`; tensors are
    routed to their shard by name.  :meth:`finish` takes the manifest (it adds the
    ``shard`` object per file) and commits everything.

    Args:
        target: where to write (already checked by :meth:`OutputTarget.check`).
        shards: the artifact's tensors per shard (:func:`~converter.artifact.shards.plan_shards`).
        manifest: the manifest with placeholder checksums of final length (sizes the headers).
        guard: the input's files: nothing the commit deletes may be one of them.
        extra_files: folder-mode files ``{name: bytes}`` committed with the shards.
        reserves: :meth:`header_reserves` of ``shards`` and ``manifest``, when the caller
            has them already (each builds the manifest's text once per shard).

    Raises:
        ConverterError: the folder is not writable.
    """

    def __init__(
        self,
        target: OutputTarget,
        shards: list[Layout],
        manifest: Manifest,
        *,
        guard: InputGuard,
        extra_files: Mapping[str, bytes] | None = None,
        reserves: list[int] | None = None,
    ) -> None:
        self.target = target
        self.guard = guard
        self.shards = shards
        count = len(self.shards)
        self.names = [p.name for p in target.shard_paths(count)]
        self.extra_files = dict(extra_files or {})
        self.total_size = sum(nbytes(d, s) for shard in shards for _, d, s in shard)
        #: ``{tensor: its shard's writer}`` when there are several (one shard needs no map)
        self._route: dict[str, StreamingWriter] | None = None
        self._writers: list[StreamingWriter] = []
        #: the shard writers with an open descriptor, least recently used first
        self._live: list[StreamingWriter] = []
        #: every staged file (deleted by abort), and (staged, final) pairs to commit.
        self._temps: list[Path] = []
        self._commit: list[tuple[Path, Path]] = []
        self._done = False
        # One run per output at a time, from here to the commit (a second one refuses).
        self._lock = OutputLock(target.folder, artifact_stem(target.path), target.path)
        track(self, self.abort)
        try:
            # Left by a killed earlier run to this output, sharded or not, with any shard count.
            for name in {*self.names, target.path.name, target.index.name, *_earlier_shard_names(target)}:
                remove_stale_temporaries(target.folder / name, keep=guard.is_input)
            if reserves is None:
                reserves = self.header_reserves(target, shards, manifest)
            for shard, name, reserve in zip(self.shards, self.names, reserves, strict=True):
                staged = self._stage_path(name)
                writer = StreamingWriter(staged, shard, header_reserve=reserve, error_path=target.folder / name)
                self._writers.append(writer)
                self._opened(writer)
                self._commit.append((staged, target.folder / name))
            if count > 1:
                self._route = {entry[0]: w for shard, w in zip(shards, self._writers, strict=True) for entry in shard}
        except BaseException:
            self.abort()
            raise

    @staticmethod
    def header_reserves(target: OutputTarget, shards: list[Layout], manifest: Manifest) -> list[int]:
        """Bytes each shard's header takes, exact when ``manifest`` holds checksums and
        digests of their final lengths.

        Raises:
            SourceFormatError: a header would be larger than its readers accept.
        """
        count = len(shards)
        reserves = []
        for i, (shard, path) in enumerate(zip(shards, target.shard_paths(count), strict=True)):
            meta = metadata_for(_shard_manifest(manifest, i, count))
            reserve = header_size_for(shard, meta)
            if reserve > SAFETENSORS_MAX_HEADER_BYTES:
                # what no reader of ours (nor the safetensors library) would open: refused before
                # anything is written or hashed
                manifest_bytes = sum(len(v) for v in meta.values())
                raise SourceFormatError(
                    f"the artifact's safetensors header would be {reserve} bytes, above the "
                    f"{SAFETENSORS_MAX_HEADER_BYTES}-byte limit its readers enforce ({len(shard)} tensors, "
                    f"{manifest_bytes} bytes of manifest: the input's tensor names and quant config); nothing "
                    "was written",
                    path=path,
                )
            reserves.append(reserve)
        return reserves

    @staticmethod
    def file_sizes(
        target: OutputTarget,
        shards: list[Layout],
        manifest: Manifest,
        extra_files: Mapping[str, bytes],
        *,
        reserves: list[int] | None = None,
    ) -> dict[Path, int]:
        """``{final path: bytes}`` of every file a write of ``shards`` creates, in commit
        order (shards, extra files, the index), exact when ``manifest`` holds checksums and
        digests of their final lengths: what the free-space check compares.

        Args:
            reserves: :meth:`header_reserves` (computed here when not given).

        Raises:
            SourceFormatError: a header would be larger than its readers accept.
        """
        count = len(shards)
        if reserves is None:
            reserves = ArtifactWriter.header_reserves(target, shards, manifest)
        sizes: dict[Path, int] = {}
        for shard, path, reserve in zip(shards, target.shard_paths(count), reserves, strict=True):
            sizes[path] = 8 + reserve + (-reserve % 8) + sum(nbytes(d, s) for _, d, s in shard)
        for name, content in extra_files.items():
            sizes[target.folder / name] = len(content)
        if count > 1:
            names = [p.name for p in target.shard_paths(count)]
            wmap = {n: names[i] for i, shard in enumerate(shards) for n, _, _ in shard}
            total = sum(nbytes(d, s) for shard in shards for _, d, s in shard)
            sizes[target.index] = len(index_bytes(wmap, total))
        return sizes

    @property
    def artifact_path(self) -> Path:
        """What to open the artifact by: the file, or the index when sharded."""
        return self.target.path if len(self.shards) == 1 else self.target.index

    def _stage_path(self, name: str) -> Path:
        try:
            return stage_placeholder(self.target.folder, name, self._temps)
        except OSError as exc:  # named by the output, never by the hidden placeholder
            raise output_write_error(exc, self.target.folder / name) from None

    def _shard_manifest(self, manifest: Manifest, i: int) -> Manifest:
        return _shard_manifest(manifest, i, len(self.shards))

    def _opened(self, writer: StreamingWriter) -> StreamingWriter:
        """Note that ``writer`` is (about to be) written to: at most
        :data:`OPEN_SHARDS` shard writers keep their descriptor open, the least recently
        used others are parked (:meth:`StreamingWriter.park`; the output's lock keeps
        cleaners away meanwhile), so hundreds of shards fit a small open-files limit."""
        live = self._live
        if live and live[-1] is writer:
            return writer
        if writer in live:
            live.remove(writer)
        live.append(writer)
        while len(live) > OPEN_SHARDS:
            live.pop(0).park()
        return writer

    def _writer_of(self, name: str) -> StreamingWriter:
        return self._writers[0] if self._route is None else self._route[name]

    def write(self, name: str, data: np.ndarray, row_start: int = 0) -> None:
        """See :meth:`StreamingWriter.write`."""
        self._opened(self._writer_of(name)).write(name, data, row_start)

    def write_flat(self, name: str, data: np.ndarray, elem_start: int) -> None:
        """See :meth:`StreamingWriter.write_flat`."""
        self._opened(self._writer_of(name)).write_flat(name, data, elem_start)

    def copy_flat(self, name: str, fd: int, src_offset: int, byte_start: int, nbytes: int) -> int | None:
        """See :meth:`StreamingWriter.copy_flat`."""
        return self._opened(self._writer_of(name)).copy_flat(name, fd, src_offset, byte_start, nbytes)

    def finish(self, manifest: Manifest) -> list[Path]:
        """Write every header, stage the index and extra files, then rename all of
        them onto their final names (the index last).

        Returns:
            The final paths, in commit order.

        Raises:
            ValueError: a header outgrew its reserve (nothing is renamed then).
            ConverterError: an extra file cannot be staged (nothing is renamed then).
        """
        try:
            for i, writer in enumerate(self._writers):
                writer.finish(metadata_for(self._shard_manifest(manifest, i)))  # reopens a parked one, closes it
                if writer in self._live:
                    self._live.remove(writer)
            for name, content in self.extra_files.items():
                remove_stale_temporaries(self.target.folder / name, keep=self.guard.is_input)
                self._commit.append((self._stage_bytes(name, content), self.target.folder / name))
            if len(self.shards) > 1:
                wmap = {n: self.names[i] for i, shard in enumerate(self.shards) for n, _, _ in shard}
                text = index_bytes(wmap, self.total_size)
                self._commit.append((self._stage_bytes(self.target.index.name, text), self.target.index))
            stale = self.target.stale_paths(len(self.shards), self.extra_files)
            for old in stale:
                self.guard.check_delete(old)
        except BaseException:
            self.abort()
            raise
        # Temporary files are created 0600; give each result the mode a plain open()
        # would, or that of the file it replaces.
        for tmp, final in self._commit:
            os.chmod(tmp, target_mode(final))
        # An interrupt is held from the first rename until the commit is recorded: it
        # then finds either every output file as it was or the new output complete.
        # The old artifact's leftovers go in the same held stretch, or an interrupt would
        # leave two models' files in one folder.
        with interrupts_deferred():
            try:
                commit_all(self._commit, self.target.folder)
            except BaseException:
                self.abort()
                raise
            self._done = True
            note_committed(self.artifact_path)
            untrack(self)
            self._temps.clear()
            for old in stale:
                old.unlink(missing_ok=True)
            self._lock.release()
        return [final for _, final in self._commit]

    def _stage_bytes(self, name: str, content: bytes) -> Path:
        tmp = self._stage_path(name)
        try:
            write_durably(tmp, content)
        except OSError as exc:
            raise output_write_error(exc, self.target.folder / name, len(content)) from None
        return tmp

    def abort(self) -> None:
        """Delete every temporary and staged file; the output folder is left as it was."""
        if self._done:
            return
        self._done = True
        untrack(self)
        for writer in self._writers:
            writer.abort()
        for tmp in self._temps:
            # A shard writer interrupted before it was registered leaves its temporary
            # beside its placeholder, under the placeholder's (random, so ours) name.
            for orphan in tmp.parent.glob(f".{glob.escape(temp_stem(tmp.name))}.*{TEMP_SUFFIX}"):
                orphan.unlink(missing_ok=True)
            tmp.unlink(missing_ok=True)
        self._lock.release()
        if self.target.created:
            try:
                self.target.folder.rmdir()  # only succeeds while empty
            except OSError:
                pass

    def __enter__(self) -> ArtifactWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if not self._done:
            self.abort()


def _shard_manifest(manifest: Manifest, i: int, count: int) -> Manifest:
    """Shard ``i`` (0-based) of ``count``'s manifest: the whole model's, plus ``shard``."""
    return manifest if count == 1 else dataclasses.replace(manifest, shard=Shard(i + 1, count))


def _earlier_shard_names(target: OutputTarget) -> set[str]:
    """Shard names of this output, for any shard count, that hidden temporaries in its
    folder belong to (``.<stem>-0000i-of-0000n.safetensors.<random>...``): what a
    killed sharded run left, which a later run must clean up whatever its own count."""
    stem = artifact_stem(target.path)
    names: set[str] = set()
    try:
        entries = os.listdir(target.folder)
    except OSError:
        return names
    for entry in entries:
        if not entry.startswith(f".{stem}-") and not entry.startswith(f"..{stem}-"):
            continue
        final, sep, _ = entry.lstrip(".").partition(".safetensors.")
        m = SHARD_NAME_RE.match(final + ".safetensors") if sep else None
        if m and m.group("stem") == stem:
            names.add(m.group(0))
    return names

"""Where an artifact goes: one file, HF shards plus an index, or a model folder.

Writing (``marlin-convert IN OUT [--max-shard-size 5GB]``):

* Tensors are grouped into units (all tensors of one converted layer form one unit,
  so a layer's ``B``, scales, ``delta``, ``perm`` and bias are always in the same
  shard; every pass-through tensor is its own unit) and packed greedily in layout
  order into shards of at most ``max_shard_size`` bytes of tensor data; a unit larger
  than the limit gets a shard of its own, as Hugging Face's ``save_pretrained`` does.
* One shard: a single file at the output path, no index.  More: files
  ``<stem>-0000i-of-0000n.safetensors`` beside an HF index
  ``<stem>.safetensors.index.json`` (``{"metadata": {"total_size": bytes},
  "weight_map": {tensor: file}}``; spec section 7).
* Every shard carries the whole-model manifest (``layers``, ``passthrough`` and
  ``checksums`` describe the whole model) plus ``shard: {index, count}`` (schema v1).
* Atomicity: every shard (and, in folder mode, ``config.json`` and the tokenizer
  files) is first written under a temporary name in the output folder; only when all
  of them are complete and fsynced are they renamed onto their final names, the index
  last.  A failure before that point leaves the output folder as it was.

Folder mode: OUT is an existing directory or ends with ``/``.  The artifact is
``OUT/model.safetensors`` (or its shards), plus ``config.json`` (the source's, or a
minimal one built from a ``.tinyloop`` header's model dict) whose
``quantization_config`` describes the artifact, plus the source's tokenizer files.

Reading them back as one file is :mod:`converter.artifact.sharded_reader`.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__
from ..constants import ARTIFACT_SCHEMA_VERSION, PRODUCER_NAME, SAFETENSORS_DTYPES, Suffix
from ..errors import ConverterError, OutputExistsError
from ..atomic import BACKUP_SUFFIX, commit_all, remove_stale_temporaries, stage_placeholder, target_mode, write_durably  # noqa: F401
from ..hf_index import index_bytes
from ..safetensors_io import StreamingWriter, header_size_for
from .manifest import metadata_for
from .target import CONFIG_NAME, DIR_MODE_NAME, SHARD_NAME_RE, InputGuard, OutputTarget, artifact_stem, index_name_for, shard_name  # noqa: F401

Layout = list[tuple[str, str, tuple[int, ...]]]

#: Decimal and binary units, as ``huggingface_hub``'s ``parse_size_to_int`` reads them.
_SIZE_UNITS = {
    "": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)


# --------------------------------------------------------------------------- sizes, names


def parse_size(text: str | int) -> int:
    """Bytes from a size such as ``5GB`` (10^9), ``500MiB`` (2^20) or ``1000000``.

    Raises:
        ConverterError: not a positive size (names the option and the value).
    """
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.match(text)
        if not m:
            raise ConverterError(
                f"{text!r} is not a size (expected a number with an optional unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)",
                tensor="--max-shard-size",
            )
        value = int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").upper()])
    if value <= 0:
        raise ConverterError(f"must be positive, found {text!r}", tensor="--max-shard-size")
    return value


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * np.dtype(SAFETENSORS_DTYPES[dtype]).itemsize


def plan_shards(layout: Layout, layer_names: list[str], max_bytes: int | None) -> list[Layout]:
    """Split the artifact's tensors into shards.

    Args:
        layout: ``[(name, dtype, shape)]`` of every artifact tensor, in write order.
        layer_names: the converted layers' prefixes; every tensor named
            ``<prefix>.<marlin suffix or bias>`` belongs to that layer's unit.
        max_bytes: the most tensor-data bytes per shard, or None for one shard.

    Returns:
        The shards' layouts, in order; never empty (one empty shard for an empty layout).
    """
    suffixes = {s.value for s in Suffix}
    layers = set(layer_names)
    units: dict[str, Layout] = {}
    for entry in layout:
        name = entry[0]
        prefix, _, suffix = name.rpartition(".")
        key = f"layer:{prefix}" if prefix in layers and suffix in suffixes else f"tensor:{name}"
        units.setdefault(key, []).append(entry)
    if max_bytes is None:
        return [list(layout)]
    shards: list[Layout] = []
    current: Layout = []
    size = 0
    for unit in units.values():
        ubytes = sum(_nbytes(d, s) for _, d, s in unit)
        if current and size + ubytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current += unit
        size += ubytes
    shards.append(current)
    return shards


def artifact_config(source_config: Mapping[str, Any] | None, model: Mapping[str, Any] | None, *,
                    source_format: str, layers: list[dict[str, Any]], weight_file: str,
                    source_quant_config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``config.json`` written in folder mode.

    The source's ``config.json`` with ``quantization_config`` replaced by a
    description of the artifact; for a ``.tinyloop`` source (no config), a minimal
    config built from the header's ``model`` dict.
    """
    cfg: dict[str, Any] = dict(source_config) if source_config else {"model_type": "tinyloop", **dict(model or {})}
    groups = sorted({int(lay["group_size"]) for lay in layers})
    cfg["quantization_config"] = {
        "quant_method": PRODUCER_NAME,
        "producer_version": __version__,
        "schema_version": ARTIFACT_SCHEMA_VERSION,
        "bits": 4,
        "zero_correction": "delta",
        "weight_dtype": "uint4b8",
        "scale_dtype": "float16",
        "delta_dtype": "float32",
        "group_sizes": groups,
        "act_order": any(lay.get("act_order", False) for lay in layers),
        "source_bits": sorted({int(lay["bits"]) for lay in layers}),
        "tensor_suffixes": {s.name.lower(): s.value for s in Suffix},
        "weight_file": weight_file,
        "converted_layers": len(layers),
        "source_format": source_format,
        "source_quantization_config": dict(source_quant_config),
    }
    return cfg


# --------------------------------------------------------------------------- writer


class ArtifactWriter:
    """Writes an artifact as one file or as shards, plus folder-mode extras, atomically.

    Same ``write``/``write_flat`` interface as :class:`StreamingWriter`; tensors are
    routed to their shard by name.  :meth:`finish` takes the manifest (it adds the
    ``shard`` object per file) and commits everything.

    Args:
        target: where to write (already checked by :meth:`OutputTarget.check`).
        shards: the artifact's tensors per shard (:func:`plan_shards`).
        manifest: the manifest with placeholder checksums of final length (sizes the headers).
        guard: the input's files: nothing the commit deletes may be one of them.
        extra_files: folder-mode files ``{name: bytes or source Path}`` committed with the shards.

    Raises:
        ConverterError: the folder is not writable.
    """

    def __init__(self, target: OutputTarget, shards: list[Layout], manifest: dict[str, Any], *,
                 guard: InputGuard, extra_files: Mapping[str, bytes | Path] | None = None) -> None:
        self.target = target
        self.guard = guard
        self.shards = shards
        count = len(self.shards)
        self.names = [p.name for p in target.shard_paths(count)]
        self.extra_files = dict(extra_files or {})
        self.total_size = sum(_nbytes(d, s) for shard in shards for _, d, s in shard)
        self._route: dict[str, StreamingWriter] = {}
        self._writers: list[StreamingWriter] = []
        #: every staged file (deleted by abort), and (staged, final) pairs to commit.
        self._temps: list[Path] = []
        self._commit: list[tuple[Path, Path]] = []
        self._done = False
        for name in [*self.names, target.index.name]:
            remove_stale_temporaries(target.folder / name)  # left by a killed earlier run
        try:
            for i, (shard, name) in enumerate(zip(self.shards, self.names)):
                meta = metadata_for(self._shard_manifest(manifest, i))
                staged = self._stage_path(name)
                writer = StreamingWriter(staged, shard, header_reserve=header_size_for(shard, meta))
                self._writers.append(writer)
                self._commit.append((staged, target.folder / name))
                for entry in shard:
                    self._route[entry[0]] = writer
        except BaseException:
            self.abort()
            raise

    @property
    def artifact_path(self) -> Path:
        """What to open the artifact by: the file, or the index when sharded."""
        return self.target.path if len(self.shards) == 1 else self.target.index

    def _stage_path(self, name: str) -> Path:
        tmp = stage_placeholder(self.target.folder, name)
        self._temps.append(tmp)
        return tmp

    def _shard_manifest(self, manifest: dict[str, Any], i: int) -> dict[str, Any]:
        if len(self.shards) == 1:
            return manifest
        return {**manifest, "shard": {"index": i + 1, "count": len(self.shards)}}

    def write(self, name: str, data: np.ndarray, row_start: int = 0) -> None:
        """See :meth:`StreamingWriter.write`."""
        self._route[name].write(name, data, row_start)

    def write_flat(self, name: str, data: np.ndarray, elem_start: int) -> None:
        """See :meth:`StreamingWriter.write_flat`."""
        self._route[name].write_flat(name, data, elem_start)

    def finish(self, manifest: dict[str, Any]) -> list[Path]:
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
                writer.finish(metadata_for(self._shard_manifest(manifest, i)))
            for name, content in self.extra_files.items():
                remove_stale_temporaries(self.target.folder / name)
                tmp = self._stage_bytes(name, content) if isinstance(content, bytes) else self._stage_copy(name, content)
                self._commit.append((tmp, self.target.folder / name))
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
        try:
            commit_all(self._commit, self.target.folder)
        except BaseException:
            self.abort()
            raise
        self._done = True
        self._temps.clear()
        for old in stale:
            old.unlink(missing_ok=True)
        return [final for _, final in self._commit]

    def _stage_bytes(self, name: str, content: bytes) -> Path:
        tmp = self._stage_path(name)
        write_durably(tmp, content)
        return tmp

    def _stage_copy(self, name: str, src: Path) -> Path:
        tmp = self._stage_path(name)
        try:
            shutil.copyfile(src, tmp)
        except OSError as exc:
            raise ConverterError(f"cannot copy into the output folder: {exc.strerror}", path=src) from None
        return tmp

    def abort(self) -> None:
        """Delete every temporary and staged file; the output folder is left as it was."""
        if self._done:
            return
        self._done = True
        for writer in self._writers:
            writer.abort()
        for tmp in self._temps:
            tmp.unlink(missing_ok=True)
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


def folder_extras(source: Any, description: Mapping[str, Any], layers: list[dict[str, Any]], weight_file: str) -> dict[str, bytes | Path]:
    """The extra files of folder mode: ``config.json`` and the source's tokenizer files.

    Args:
        source: the opened source; HF readers expose ``ckpt`` (an ``HFCheckpoint``
            with ``config`` and ``folder``), a ``.tinyloop`` source has neither.
        description: ``source.describe()`` (its ``quant_config``; for ``.tinyloop``
            ``{"model": {...}}``).
        layers: the manifest's layer records.
        weight_file: the artifact's file name or index name, recorded in the config.

    Returns:
        ``{file name: bytes to write or source path to copy}``.
    """
    from ..formats.hf import TOKENIZER_FILES

    ckpt = getattr(source, "ckpt", None)
    quant = description.get("quant_config", {}) or {}
    if ckpt is not None:
        cfg = artifact_config(ckpt.config or {"model_type": "unknown"}, None, source_format=description["format"],
                              layers=layers, weight_file=weight_file, source_quant_config=quant)
        folder = ckpt.folder
    else:
        cfg = artifact_config(None, quant.get("model", {}), source_format=description["format"], layers=layers,
                              weight_file=weight_file, source_quant_config=quant)
        folder = Path(getattr(source, "path", ".")).parent
    extras: dict[str, bytes | Path] = {CONFIG_NAME: json.dumps(cfg, indent=2, sort_keys=False).encode("utf-8") + b"\n"}
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            extras[name] = folder / name
    return extras

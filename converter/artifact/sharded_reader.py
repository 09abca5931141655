"""Reading a sharded artifact (an HF index, or a folder) back as one file.

:class:`ShardedFile` presents the shards as one
:class:`~converter.safetensors_io.SafetensorsFile`-like object, and lists what is
inconsistent between them in ``shard_problems`` for ``marlin-verify`` to report.
The writing side is :mod:`converter.artifact.writer`; the naming rules, :mod:`converter.artifact.target`.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from ..constants import HF_INDEX_NAME
from ..errors import ArtifactError, ConverterError
from ..hf_index import HFIndex, read_index
from ..jsonio import link_out_of, not_regular
from ..quant_weight import Tensor, TensorInfo
from ..safetensors_io import SafetensorsFile
from .manifest import dump_manifest
from .problems import Problem, ProblemCode
from .schema import read_document
from .target import DIR_MODE_NAME, SHARD_NAME_RE, artifact_stem, index_name_for


def _strip_shard(manifest: dict[str, Any]) -> str:
    return dump_manifest({k: v for k, v in manifest.items() if k != "shard"}, allow_nan=True)


def resolve_artifact(path: Path) -> tuple[HFIndex | None, list[Path]]:
    """``(index or None, shard files)`` of an artifact path: a file, an index, or a folder.

    A folder is read through its ``model.safetensors.index.json`` if present, else
    its ``model.safetensors``, else its only ``*.safetensors.index.json`` (a sharded
    ``--max-shard-size`` artifact written into it), else its only ``*.safetensors`` file.

    Raises:
        ArtifactError: a folder with no artifact or with several, or a malformed index.
        ConverterError: the path does not exist (the message names the index when the
            path is a sharded conversion's ``OUT``, which then holds no file).
    """
    if not path.exists():
        raise missing_artifact(path)
    if path.is_dir():
        index, files = _resolve_in_folder(path)
        # A folder's files stay in it (as a source checkpoint's do): a link out of a
        # downloaded folder would have the checks and the loaders read any file.
        for p in ([index.path] if index is not None else []) + files:
            real = link_out_of(p, path)
            if real is not None:
                raise ArtifactError(
                    f"is a symbolic link to {real}, outside the artifact's folder; links that leave it are not "
                    "followed (copy the file into the folder)",
                    path=p,
                )
        return index, files
    return _resolve_file(path)


def _resolve_in_folder(folder: Path) -> tuple[HFIndex | None, list[Path]]:
    """:func:`resolve_artifact` of a folder."""
    if (folder / HF_INDEX_NAME).is_file():
        return _resolve_file(folder / HF_INDEX_NAME)
    if (folder / DIR_MODE_NAME).is_file():
        return None, [folder / DIR_MODE_NAME]
    indexes = sorted(p for p in folder.glob("*.safetensors.index.json") if p.is_file())
    if len(indexes) == 1:
        return _resolve_file(indexes[0])
    files = sorted(folder.glob("*.safetensors"))
    if len(files) != 1 or indexes:
        found = ", ".join(p.name for p in indexes) or f"{len(files)} .safetensors files"
        raise ArtifactError(
            f"folder holds no single artifact ({found}; no {HF_INDEX_NAME} or {DIR_MODE_NAME}); "
            "give the artifact file or its index",
            path=folder,
        )
    return None, files


def _resolve_file(path: Path) -> tuple[HFIndex | None, list[Path]]:
    """:func:`resolve_artifact` of a file: an index or one artifact file."""
    if not path.name.endswith(".index.json"):
        return None, [path]
    index = read_index(path, error=ArtifactError, allow_empty=True)
    return index, [index.shard_path(f) for f in sorted(index.shard_names)]


def missing_artifact(path: Path) -> ConverterError:
    """The error for an artifact path that does not exist; when it is a sharded
    conversion's ``OUT`` (``marlin-convert IN OUT --max-shard-size``, which writes the
    shards and ``OUT.index.json`` instead), the message names the index."""
    index = index_name_for(path) if path.suffix == ".safetensors" else None
    if index is not None and index.is_file():
        return ConverterError(
            f"no such file; it was written as shards: verify their index, {index.name}, or the folder", path=path
        )
    return ConverterError("no such file or directory", path=path)


def held_shards_budget() -> int:
    """How many shards a reader may hold open: half the soft open-files limit (the rest is
    the process's own), at least 16."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 16
    return 1 << 30 if soft == resource.RLIM_INFINITY else max(16, soft // 2)


class ShardedFile:
    """The shards of a sharded artifact, read as one file.

    Same read interface as :class:`SafetensorsFile` (``infos``, ``in``, ``array``,
    ``raw``, ``tensor``, ``metadata``, ``close``); ``metadata`` is the first readable
    shard's.  Each shard is opened once, held open and read by handle (an atomic replace
    during a verify is before or after it) while there are at most
    :func:`held_shards_budget` shards; more are reopened by path (a process under
    ``ulimit -n 256`` still reads 611 shards). Each is validated as a container on its own
    (``ArtifactError`` if one is malformed).

    Attributes:
        path: the index (or folder).
        shards: the opened shard files, in name order.
        shard_problems: ``[Problem]``: a shard listed but missing, a
            tensor in two shards or in a shard the index does not name, index
            entries without a tensor, ``total_size`` wrong, a shard whose manifest
            differs from the others or whose ``shard`` object is wrong.

    Raises:
        ArtifactError: no shard could be opened, or a shard's container is malformed.
    """

    def __init__(self, index_file: HFIndex, files: list[Path]) -> None:
        index = self.path = index_file.path
        self.shards: list[SafetensorsFile] = []
        self.shard_problems: list[Problem] = []
        self._where: dict[str, SafetensorsFile] = {}
        wmap, total = index_file.weight_map, index_file.total_size
        unreadable: list[ArtifactError] = []
        hold = len(files) <= held_shards_budget()
        try:
            for f in files:
                if not f.is_file():
                    try:
                        what = not_regular(f.stat().st_mode)
                    except OSError:
                        what = "missing"
                    self._problem(
                        ProblemCode.MISSING_SHARD, f"{f.name}: shard listed in {index.name} is {what}", f.name
                    )
                    continue
                try:
                    # Held open: verify reads the shard it opened, even if it is replaced meanwhile
                    # (beyond the open-files budget, shards are reopened by path instead).
                    shard = SafetensorsFile(f, error=ArtifactError, hold=hold)
                except ArtifactError as exc:
                    # Like a missing shard: reported, and the other shards still checked.
                    unreadable.append(exc)
                    where = f"{exc.tensor}: " if exc.tensor else ""
                    self._problem(
                        ProblemCode.MISSING_SHARD,
                        f"{f.name}: shard listed in {index.name} cannot be read: {where}{exc.rule}",
                        f.name,
                    )
                    continue
                self.shards.append(shard)
                for name in shard.infos:
                    if name in self._where:
                        self._problem(
                            ProblemCode.DUPLICATE_TENSOR,
                            f"{name}: in two shards ({self._where[name].path.name} and {f.name})",
                            name,
                        )
                        continue
                    self._where[name] = shard
                    if wmap.get(name) != f.name:
                        says = f"says {wmap[name]}" if name in wmap else "does not list it"
                        self._problem(
                            ProblemCode.INDEX_MISMATCH, f"{name}: stored in {f.name} but the index {says}", name
                        )
        except BaseException:
            self.close()
            raise
        if not self.shards:
            if unreadable:
                raise unreadable[0]
            if not files:
                raise ArtifactError("the index names no shards (its weight_map is empty)", path=index)
            raise ArtifactError("none of the shards named by the index exists", path=index)
        unread = {Path(exc.path).name for exc in unreadable if exc.path}
        for name, fname in wmap.items():
            if name not in self._where and fname not in unread and (index.parent / fname).is_file():
                self._problem(
                    ProblemCode.INDEX_MISMATCH, f"{name}: the index places it in {fname}, which does not hold it", name
                )
        size = sum(s.byte_range(n)[1] - s.byte_range(n)[0] for n, s in self._where.items())
        if (
            total is not None
            and total != size
            and not any(p.code is ProblemCode.MISSING_SHARD for p in self.shard_problems)
        ):
            self._problem(
                ProblemCode.INDEX_MISMATCH,
                f"metadata.total_size is {total}, the shards hold {size} bytes of tensor data",
                "metadata.total_size",
            )
        single = index.parent / index.name.removesuffix(".index.json")
        if single != index and single.is_file():
            # transformers' from_pretrained looks for the single file before the index
            self._problem(
                ProblemCode.INDEX_MISMATCH,
                f"{single.name} lies beside {index.name}: a loader that looks for the single file first "
                "(transformers does) would load it instead of the shards; move it away",
                single.name,
            )
        self.metadata = self.shards[0].metadata
        self._check_manifests(len(files))

    def _problem(self, code: ProblemCode, message: str, tensor: str) -> None:
        self.shard_problems.append(Problem(code, message, tensor))

    def _check_manifests(self, count: int) -> None:
        ref = None
        for shard in self.shards:
            try:
                manifest = read_document(shard.metadata, path=shard.path).data
            except ArtifactError as exc:
                self._problem(ProblemCode.SHARD_MANIFEST, f"{shard.path.name}: {exc.rule}", shard.path.name)
                continue
            m = SHARD_NAME_RE.match(shard.path.name)
            want = {"index": int(m.group("i")), "count": int(m.group("n"))} if m else None
            got = manifest.get("shard")
            if want is not None and got != want:
                self._problem(
                    ProblemCode.SHARD_MANIFEST,
                    f"{shard.path.name}: manifest shard is {got}, expected {want} from the file name",
                    shard.path.name,
                )
            if want is not None and want["count"] != count:
                self._problem(
                    ProblemCode.SHARD_MANIFEST,
                    f"{shard.path.name}: name says {want['count']} shards, the index lists {count}",
                    shard.path.name,
                )
            text = _strip_shard(manifest)
            if ref is None:
                ref = (shard.path.name, text)
            elif text != ref[1]:
                self._problem(
                    ProblemCode.SHARD_MANIFEST,
                    f"{shard.path.name}: manifest differs from {ref[0]}'s (shards of different conversions?)",
                    shard.path.name,
                )

    @functools.cached_property  # the shard set is fixed once opened
    def infos(self) -> dict[str, TensorInfo]:
        return {n: s.infos[n] for n, s in self._where.items()}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def file_of(self, name: str) -> Path:
        return self._where[name].path

    def array(self, name: str) -> np.ndarray:
        return self._where[name].array(name)

    def raw(self, name: str) -> memoryview:
        return self._where[name].raw(name)

    def tensor(self, name: str) -> Tensor:
        return self._where[name].tensor(name)

    def byte_range(self, name: str) -> tuple[int, int]:
        """Absolute ``[begin, end)`` offsets of a tensor's bytes within its own shard."""
        return self._where[name].byte_range(name)

    def release_pages(self) -> None:
        """Forwarded to every shard (see ``SafetensorsFile.release_pages``)."""
        for s in self.shards:
            release = getattr(s, "release_pages", None)
            if release is not None:
                release()

    def close(self) -> None:
        for s in self.shards:
            s.close()

    def __enter__(self) -> ShardedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_artifact_file(path: str | Path) -> SafetensorsFile | ShardedFile:
    """Open an artifact path (file, index or folder) as one readable file.

    Raises:
        ConverterError: the path does not exist.
        ArtifactError: see :func:`resolve_artifact` and :class:`ShardedFile`.
    """
    index, files = resolve_artifact(Path(path))
    if index is None:
        if not files[0].is_file():
            raise ConverterError("not a file", path=files[0])
        # Held open: verify reads the file it opened, even if it is replaced meanwhile.
        single = SafetensorsFile(files[0], error=ArtifactError, hold=True)
        try:
            _refuse_lone_shard(single)
        except BaseException:
            single.close()
            raise
        return single
    return ShardedFile(index, files)


def _refuse_lone_shard(file: SafetensorsFile) -> None:
    """A shard opened on its own would report most of the model as missing: say why instead."""
    try:
        manifest = read_document(file.metadata, path=file.path).data
    except ArtifactError:
        return  # not an artifact at all: the caller reports that
    shard = manifest.get("shard")
    if isinstance(shard, dict) and shard.get("count", 1) != 1:
        index = index_name_for(file.path.with_name(_stem_of_shard(file.path.name) + ".safetensors"))
        raise ArtifactError(
            f"this file is shard {shard.get('index')} of {shard.get('count')} of a sharded artifact; "
            f"verify its index ({index.name}) or its folder",
            path=file.path,
            tensor="shard",
        )


def _stem_of_shard(name: str) -> str:
    m = SHARD_NAME_RE.match(name)
    return m.group("stem") if m else artifact_stem(Path(name))

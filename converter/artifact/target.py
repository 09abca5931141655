"""Where an artifact goes, what it may replace, and what it must never touch.

An output is one file (``OUT.safetensors``), HF shards beside an index
(``<stem>-0000i-of-0000n.safetensors`` + ``<stem>.safetensors.index.json``), or a model
folder (``OUT/`` holding ``model.safetensors`` or its shards, ``config.json`` and the
source's tokenizer files). As with ``save_pretrained``, an ``OUT`` that does not end in
``.safetensors`` is a folder (a trailing ``/`` is not needed).

The rule that no option relaxes, ``--force`` included: **no output may coincide with,
or be read back as, a file of the input.** Identity is decided by device and inode
(``os.stat`` follows symbolic links, and hard links share an inode), so a path that is
a link to an input file counts as that file. "Read back" means a file written into the
folder of an HF checkpoint: the next read of that checkpoint would glob it as one more
weight file. The same rule covers the files a ``--force`` run would delete (an earlier
artifact's shards at the output path).
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Iterable, Mapping
from pathlib import Path

import xxhash

from ..atomic import free_bytes, stores_files
from ..constants import EXPORT_META_KEY, META_MANIFEST, META_SCHEMA_VERSION
from ..errors import ArtifactError, ConverterError, OutputExistsError, OutputPathError
from ..hf_index import SHARD_NAME_RE, read_index
from ..safetensors_io import MAX_MAPPED_FILES, SafetensorsFile, set_map_limit

#: The artifact's file name in folder mode (HF's single-file name).
DIR_MODE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


def shard_name(stem: str, index: int, count: int) -> str:
    """``<stem>-0000i-of-0000n.safetensors`` (1-based ``index``), the HF convention."""
    return f"{stem}-{index:05d}-of-{count:05d}.safetensors"


def index_name_for(path: Path) -> Path:
    """The index beside an artifact path: ``model.safetensors`` -> ``model.safetensors.index.json``."""
    if path.suffix == ".safetensors":
        return path.with_name(path.name + ".index.json")
    return path.with_name(path.name + ".safetensors.index.json")


def artifact_stem(path: Path) -> str:
    return path.name[: -len(".safetensors")] if path.name.endswith(".safetensors") else path.name


def _name_max(folder: Path) -> int:
    """The longest file name (bytes) ``folder``'s filesystem takes (255 where unknown)."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _is_file(path: Path) -> bool:
    """``path.is_file()``, False where the name itself is refused (too long)."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)  # follows symlinks: a link to an input file is that file
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


class InputGuard:
    """The files of one input, by identity, and the folder a reader would glob again.

    Args:
        files: every file the reader reads or folder mode copies (weights, index,
            configs, tokenizer files).
        folder: the HF checkpoint folder (None for a single-file format such as
            ``.tinyloop``, which nothing globs).
    """

    def __init__(self, files: Iterable[Path], folder: Path | None) -> None:
        self.files = [Path(f) for f in files]
        self.folder = Path(folder) if folder is not None else None
        self._ids = {i for i in map(_identity, self.files) if i is not None}
        self._folder_id = _identity(self.folder) if self.folder is not None else None

    def is_input(self, path: Path) -> bool:
        """True when ``path`` exists and is (a link to) one of the input's files."""
        ident = _identity(path)
        return ident is not None and ident in self._ids

    def inside_input_folder(self, path: Path) -> bool:
        """True when ``path`` would sit in the HF checkpoint folder, directly or in a
        folder below it (links resolved): no output is written into a checkpoint."""
        if self._folder_id is None:
            return False
        parent = Path(os.path.realpath(path.parent))
        return any(_identity(p) == self._folder_id for p in (parent, *parent.parents))

    def check_write(self, path: Path) -> None:
        """Refuse to write (or replace) ``path``.

        Raises:
            ConverterError: ``path`` is an input file, or lies in the input's
                checkpoint folder.
        """
        if self.is_input(path):
            raise ConverterError("output would overwrite the input; choose another path", path=path)
        if self.inside_input_folder(path):
            if _identity(path.parent) != self._folder_id:
                raise ConverterError(
                    f"output is in a folder inside the input checkpoint folder {self.folder}; nothing is ever "
                    "written into the input's folder: choose a path outside it",
                    path=path,
                )
            raise ConverterError(
                f"output is inside the input checkpoint folder {self.folder}, where reading the checkpoint "
                "again would pick it up as input; choose a path outside that folder",
                path=path,
            )

    def check_delete(self, path: Path) -> None:
        """Refuse to delete ``path`` (a stale file of an earlier artifact).

        Raises:
            ConverterError: ``path`` is (a link to) an input file.
        """
        if self.is_input(path):
            raise ConverterError(
                "replacing the output would delete this file, which is part of the input; choose another path",
                path=path,
            )


class OutputTarget:
    """Where an artifact goes.

    Attributes:
        path: the single-file artifact path (``OUT`` or ``OUT/model.safetensors``).
        folder: the folder everything is written into.
        directory: folder mode (also write ``config.json`` and tokenizer files): ``OUT``
            is an existing folder, ends in ``/``, or does not end in ``.safetensors``.
        index: the index path used when the output is sharded.
    """

    def __init__(self, out: str | Path) -> None:
        text = str(out)
        if not text:
            # Path("") is ".": an unset $OUT in a script would write a model folder here
            raise ConverterError("output path is empty; give a .safetensors file or a folder", path=None)
        out = Path(out)
        self.trailing_slash = text.endswith(("/", os.sep))
        self.directory = out.is_dir() or self.trailing_slash or out.suffix != ".safetensors"
        self.path = out / DIR_MODE_NAME if self.directory else out
        self.folder = self.path.parent
        self.index = index_name_for(self.path)
        #: True when :meth:`check` created the folder (removed again if the write fails).
        self.created = False

    def shard_paths(self, count: int) -> list[Path]:
        """The weight files of an artifact in ``count`` shards (one: the path itself)."""
        if count == 1:
            return [self.path]
        stem = artifact_stem(self.path)
        return [self.folder / shard_name(stem, i + 1, count) for i in range(count)]

    def final_paths(self, count: int, extra_names: Iterable[str] = ()) -> list[Path]:
        """Every file a write of ``count`` shards creates or replaces, index last."""
        paths = self.shard_paths(count) + [self.folder / n for n in extra_names]
        return paths + ([self.index] if count > 1 else [])

    def stale_paths(self, count: int, extra_names: Iterable[str] = ()) -> list[Path]:
        """Files of an earlier artifact at this path that a write of ``count`` shards
        orphans, and deletes after its commit: old shards it does not overwrite, an old
        index when the new artifact is one file, an old single file when the new one is
        sharded (either would shadow the new artifact for some loader), and in folder
        mode the old artifact's tokenizer and config files the new one does not write."""
        finals = set(self.final_paths(count, extra_names))
        out: list[Path] = []
        files: set[str] = set()
        if _is_file(self.index):  # a name too long for an index (a 250-byte OUT) has none
            try:
                files = set(read_index(self.index, error=ConverterError, allow_empty=True).shard_names)
            except ConverterError:  # an unreadable old index orphans nothing we know of
                pass
            for f in sorted(files):
                p = self.folder / f
                if SHARD_NAME_RE.match(f) and p not in finals:
                    out.append(p)
            if count == 1:
                out.append(self.index)
        if count > 1 and self.path.is_file():
            out.append(self.path)
        if self.directory:
            out += self._stale_extras(finals, [self.path, *(self.folder / f for f in sorted(files))])
        return out

    def _stale_extras(self, finals: set[Path], olds: list[Path]) -> list[Path]:
        """Folder mode: the files an earlier artifact here wrote beside itself (its
        manifest's ``checksums.files``: a tokenizer, a generation config) that this write
        does not, so that the folder does not mix two models. Only files still exactly
        as written (size and xxh3-128) are taken: one edited since is left alone."""
        written: dict[str, tuple[int, str]] = {}
        for old in olds:  # the old single file, then the old index's shards: the first manifest found
            try:
                meta = SafetensorsFile(old, error=ArtifactError).metadata
                if META_SCHEMA_VERSION not in meta:
                    continue  # not a marlin-convert artifact's file
                entries = json.loads(meta[META_MANIFEST])["checksums"]["files"]
                written = {
                    f["name"]: (f["bytes"], f["xxh3_128"])
                    for f in entries
                    if isinstance(f, dict)
                    and isinstance(f.get("name"), str)
                    and type(f.get("bytes")) is int
                    and isinstance(f.get("xxh3_128"), str)
                }
                break
            except (ConverterError, OSError, KeyError, TypeError, ValueError):
                continue  # not there, not ours, or a manifest without folder files
        taken = {p.name.casefold() for p in finals}  # a case-insensitive filesystem: the same file
        out = []
        for name, (size, digest) in sorted(written.items()):
            p = self.folder / name
            if not name or name.casefold() in taken or os.sep in name or name.startswith(".") or "\0" in name:
                continue
            try:
                if p.is_symlink() or not p.is_file() or p.stat().st_size != size:
                    continue
                if xxhash.xxh3_128_hexdigest(p.read_bytes()) == digest:
                    out.append(p)
            except (OSError, ValueError):  # a name the filesystem refuses: not a file we wrote
                continue
        return out

    def check(
        self, guard: InputGuard, force: bool, *, count: int = 1, extra_names: Iterable[str] = (), create: bool = True
    ) -> None:
        """Refuse to touch the input, or an existing output without ``force``.

        Args:
            guard: the input's files and folder.
            force: replace existing outputs.
            count: the number of shards the artifact will have.
            extra_names: folder-mode files written beside it (``config.json``, tokenizer).
            create: create a folder-mode folder that does not exist yet (False: dry runs).

        Raises:
            ConverterError: the folder is missing, OUT without '.safetensors' is not a folder,
                an output or a file the write would delete is (a link to) an input
                file, or an output lies in the input's checkpoint folder.
            OutputExistsError: an output file exists and ``force`` is False.
            ConverterError: a file the write would delete (a shard an old index beside
                OUT names) is not a marlin-convert artifact's.
        """
        extra_names = list(extra_names)
        try:
            str(self.path).encode("utf-8")
        except UnicodeEncodeError:  # the index and config.json name the files in UTF-8 JSON
            raise ConverterError(
                f"output path {ascii(str(self.path))} is not valid UTF-8; choose another name", path=self.folder
            ) from None
        if (
            self.directory
            and self.folder.exists()
            and guard.folder is not None
            and _identity(self.folder) == _identity(guard.folder)
        ):
            # Folder mode writes config.json and tokenizer files: never into the source's folder.
            raise ConverterError("output folder is the input's folder; choose another folder", path=self.folder)
        finals = self.final_paths(count, extra_names)
        limit = _name_max(self.folder if self.folder.is_dir() else self.folder.parent)
        for p in finals:
            if len(os.fsencode(p.name)) > limit:
                what = "its index" if p == self.index else "a shard" if p.name.endswith(".safetensors") else p.name
                raise ConverterError(
                    f"output name too long: {what} would be named {len(os.fsencode(p.name))} bytes, above the "
                    f"filesystem's limit of {limit}; choose a shorter name (or no --max-shard-size)",
                    path=self.path,
                )
        stale = self.stale_paths(count, extra_names)
        for p in finals:
            guard.check_write(p)
            if p != self.path and os.path.isdir(p) and not os.path.islink(p):
                # (the artifact path itself has its own message below)
                raise ConverterError(
                    "is a folder where the output writes a file; --force replaces files only: move it away; "
                    "nothing was written",
                    path=p,
                )
        for p in stale:
            guard.check_delete(p)
        for p in stale:
            # An index beside OUT may be another model's, not an earlier artifact's:
            # only shards that are ours are ever deleted (--force replaces OUT, nothing else).
            if p != self.path and p.suffix == ".safetensors" and os.path.lexists(p) and not is_artifact_file(p):
                raise ConverterError(
                    f"replacing the output would delete this file, which {self.index.name} names but which is not "
                    "a shard marlin-convert wrote; move it away or choose another output",
                    path=p,
                )
        if self.directory and not self.folder.is_dir():
            # Folder mode because of the name alone: refuse what is surely meant as a file
            # (the input itself first, by the guard's own words).
            guard.check_write(self.folder)
            if not self.trailing_slash and self.folder.suffix.lower() in (".safetensors", ".json"):
                raise ConverterError(
                    "output names neither a .safetensors file nor a folder: a single file ends in '.safetensors' "
                    "(lower case; a sharded artifact's index is written beside it), any other path is a model folder",
                    path=self.folder,
                )
            if os.path.lexists(self.folder):
                # The rule that made it a folder, as the user wrote the path: a trailing
                # slash ('x.safetensors/') does end in '.safetensors' before it.
                why = (
                    "a path ending in '/' names a model folder; drop the '/' to write the file"
                    if self.trailing_slash
                    else "a path that does not end in '.safetensors' names a model folder; give a .safetensors "
                    "file name to write one file"
                )
                raise ConverterError(f"output exists and is not a folder: {why}", path=self.folder)
        if self.directory and not self.folder.exists():
            if not self.folder.parent.is_dir():  # the missing folder named (mkdir's error names the new one)
                raise OutputPathError("output folder's parent does not exist", path=self.folder.parent)
            if not create:  # a dry run creates nothing; the checks above (the input guard) still ran
                return
            try:
                self.folder.mkdir(parents=False)
                self.created = True
            except OSError as exc:
                raise OutputPathError(f"cannot create the output folder: {exc.strerror}", path=self.folder) from None
        if not self.folder.is_dir():
            raise OutputPathError("output folder does not exist", path=self.folder)
        if self.path.is_dir():
            raise ConverterError(
                "output is a directory; give a .safetensors file name, or end OUT with '/'", path=self.path
            )
        if not force:
            for p in finals + stale:
                if os.path.lexists(p):
                    raise OutputExistsError("output exists; pass --force to overwrite it", path=p)

    def preflight(self, sizes: Mapping[Path, int], *, artifact: Path, inputs: int = 1) -> None:
        """Check that the outputs can be written at all, before the input is hashed and
        before anything is written: the folder is writable, its filesystem has room for
        every file, no file exceeds the file-size limit (``ulimit -f``), and the
        open-files limit allows the shards open at once (at most ``writer.OPEN_SHARDS``;
        see :func:`ensure_open_files`).

        Args:
            sizes: ``{final path: bytes}`` of every file the write creates.
            artifact: the path errors name (the file, or the index when sharded).
            inputs: how many input files are memory-mapped (at most ``MAX_MAPPED_FILES`` at once).

        Raises:
            ConverterError: one of the above, with the numbers.
        """
        folder = self.folder if self.folder.exists() else self.folder.parent
        if not stores_files(folder):
            raise ConverterError(
                "output folder is on a filesystem that stores no files (such as /proc or /sys); nothing was written",
                path=folder,
            )
        if not writable(folder):
            raise ConverterError(
                "output folder is not writable (its permissions, or a read-only filesystem); nothing was written",
                path=folder,
            )
        need = sum(sizes.values())
        free = free_bytes(folder)
        if free is not None and need > free:
            raise ConverterError(
                f"not enough free space: the output needs {need} bytes, its filesystem has {free} free; "
                "nothing was written",
                path=artifact,
            )
        limit, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        biggest = max(sizes, key=lambda p: sizes[p])
        if limit != resource.RLIM_INFINITY and sizes[biggest] > limit:
            raise ConverterError(
                f"this file would be {sizes[biggest]} bytes, above the file-size limit of {limit} bytes (ulimit -f); "
                "raise the limit, or split the output with a smaller --max-shard-size",
                path=biggest,
            )
        shards = sum(1 for p in sizes if p.name.endswith(".safetensors"))
        # the writer keeps at most OPEN_SHARDS shard files open at once (it parks the rest)
        from .writer import OPEN_SHARDS

        ensure_open_files(min(shards, OPEN_SHARDS), inputs, path=artifact)

    def discard_created(self) -> None:
        """Remove the folder :meth:`check` created, while it is still empty."""
        if self.created:
            try:
                self.folder.rmdir()
            except OSError:
                pass
            self.created = False


def is_artifact_file(path: Path) -> bool:
    """Whether ``path`` is a safetensors file marlin-convert wrote: a Marlin artifact's
    (its manifest) or a compressed-tensors export's (its export manifest)."""
    try:
        meta = SafetensorsFile(path, error=ArtifactError).metadata
    except ConverterError:
        return False
    return META_SCHEMA_VERSION in meta or EXPORT_META_KEY in meta


def writable(folder: Path) -> bool:
    """Whether this process may create files in ``folder`` (``access(2)``: permissions,
    and EROFS for a read-only filesystem)."""
    return os.access(folder, os.W_OK | os.X_OK)


#: Descriptors beyond the shards and the input maps: the interpreter, stdio, the index, extras.
_SPARE_FILES = 32
#: Fewest input maps worth running with (each remap costs a few system calls).
_MIN_MAPS = 4


def ensure_open_files(shards: int, inputs: int, *, path: Path) -> None:
    """Make sure this process may hold every output shard open (and locked) until the
    commit, beside the input maps: the soft open-files limit is raised up to the hard
    one; where that is not enough, fewer input files are mapped at once.

    Raises:
        ConverterError: even with only a few input maps the shards do not fit, naming
            the counts and what to do.
    """
    maps = min(MAX_MAPPED_FILES, max(inputs, 1))
    needed = shards + maps + _SPARE_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or needed <= soft:
        return
    if hard == resource.RLIM_INFINITY or needed <= hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
            return
        except (ValueError, OSError):
            pass
    room = soft - shards - _SPARE_FILES
    if room >= min(_MIN_MAPS, maps):
        set_map_limit(room)
        return
    raise ConverterError(
        f"writing {shards} shards holds {shards} files open at once, and with the input that needs "
        f"{shards + min(_MIN_MAPS, maps) + _SPARE_FILES}; the open-files limit is {soft} (hard limit {hard}, "
        "ulimit -n): raise it, or pass a larger --max-shard-size",
        path=path,
    )

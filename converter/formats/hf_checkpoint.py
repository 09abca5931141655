"""Hugging Face checkpoint folders: weight files, shard index, config discovery.

What the HF readers (GPTQ, AWQ, compressed-tensors) read through.  Pickle checkpoints
(``.bin``, ``.pt``, ``.pth``, ``.ckpt``) are refused by name and never opened, let
alone unpickled.

A checkpoint folder is untrusted input.  Every file found in it (weights, index,
configs, tokenizer files) must be a regular file inside the folder
(:func:`folder_member`): a symbolic link that leaves the folder is refused by name, not
followed, so that no file from elsewhere (a private key) can end up in an output.  The
one exception is the Hugging Face hub cache, whose ``snapshots/<revision>/`` folders
hold links into the same repository's ``blobs/``.  A path the user names directly
(``IN``) is taken as given.
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..constants import HF_INDEX_NAME
from ..digests import PLACEHOLDER, sha256_files
from ..errors import ConfigError, SourceFormatError, printable, short_name
from ..hf_index import SHARD_NAME_RE, HFIndex, read_index
from ..jsonio import inside_folder, not_regular, read_object, read_regular_file
from ..quant_weight import Tensor, TensorInfo
from ..safetensors_io import SafetensorsFile

#: Where producers put the quant config, in lookup order (checkpoint-formats.md 1.7;
#: auto-round writes quantization_config.json).
QUANT_CONFIG_FILES = ("quantize_config.json", "quantization_config.json", "quant_config.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
#: What IN may be, said when a file of another name is no safetensors file either.
INPUT_KINDS = "IN is a .tinyloop file, a checkpoint folder, a .safetensors file or a model.safetensors.index.json"
#: Files copied next to a directory-mode artifact so it is a complete model folder.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "generation_config.json",
)  # fmt: skip


#: Bound on a tokenizer or generation-config file copied in folder mode (read whole).
MAX_COPIED_FILE_BYTES = 512 * 1024 * 1024


def folder_member(folder: Path, name: str) -> Path | None:
    """``folder / name`` when it exists and may be read as part of the checkpoint.

    Returns:
        The path, or None when nothing of that name exists.

    Raises:
        SourceFormatError: it is a symbolic link that resolves outside ``folder`` (or
            nowhere), or not a regular file (a folder, a FIFO, a device); the message
            names it.
    """
    path = folder / name
    try:
        lst = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SourceFormatError(f"cannot read: {exc.strerror}", path=path) from None
    except ValueError:  # a NUL byte in the name
        raise SourceFormatError(f"{printable(repr(name))} is not a valid file name", path=folder) from None
    if stat.S_ISLNK(lst.st_mode):
        real = Path(os.path.realpath(path))
        if not real.exists():
            raise SourceFormatError(f"is a symbolic link to {real}, which does not exist", path=path)
        if not inside_folder(real, Path(os.path.realpath(folder))):
            raise SourceFormatError(
                f"is a symbolic link to {real}, outside the checkpoint folder; links that leave a checkpoint "
                "are not followed (copy the file into the folder)",
                path=path,
            )
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        raise SourceFormatError(f"{not_regular(mode)}; a checkpoint's files must be regular files", path=path)
    return path


def read_member_bytes(path: Path) -> bytes:
    """The bytes of a file :func:`folder_member` returned (tokenizer files copied in folder mode).

    Raises:
        SourceFormatError: unreadable, no longer a regular file, or larger than
            :data:`MAX_COPIED_FILE_BYTES`.
    """
    return read_regular_file(path, what="file to copy", error=SourceFormatError, max_bytes=MAX_COPIED_FILE_BYTES)


def read_json_file(path: Path) -> dict[str, Any]:
    """Read a config file that must hold a JSON object (:mod:`converter.jsonio`'s policy).

    Raises:
        ConfigError: unreadable, too large, not JSON, or not an object.
    """
    return read_object(path, what="JSON file", error=ConfigError)


def _is_text(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes, surrogate-escaped by os.fsdecode
        return False
    return True


class HFCheckpoint:
    """The safetensors weights and JSON configs of an HF-style checkpoint.

    Args:
        path: a folder, a single ``.safetensors`` file (its configs are read from the
            same folder), or a ``model.safetensors.index.json``.

    Attributes:
        folder: the checkpoint folder.
        files: the weight files, in shard order.
        config: ``config.json`` as a dict ({} when absent).
        quant_config: the quantization config, from the first of
            ``QUANT_CONFIG_FILES`` that exists, else ``config["quantization_config"]``
            ({} when none); ``quant_config_file`` names where it came from.

    Raises:
        SourceFormatError: pickle weights only, no weights, a bad index, a tensor
            in two shards, or any container rule broken in a shard.
        ConfigError: a config file is not a JSON object.
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        #: The shard index, when the weights are sharded.
        self.index: HFIndex | None = None
        if path.is_dir():
            self.folder = path
            self.files = self._find_weights(path)
        elif path.name.endswith(".index.json"):
            self.folder = path.parent
            self.files = self._read_index(path)
        elif path.suffix in PICKLE_SUFFIXES:
            raise SourceFormatError(
                "pickle checkpoints are refused and never unpickled; convert to safetensors first", path=path
            )
        else:
            self.folder = path.parent
            self.files = [path]
        #: For a single file that is one shard of a sharded checkpoint: what to pass instead
        #: (appended to "missing tensor" errors, which is how a lone shard fails).
        self.lone_shard_hint = self._lone_shard_hint(path) if self.files == [path] else ""
        cfg_path = folder_member(self.folder, "config.json")
        self.config: dict[str, Any] = read_json_file(cfg_path) if cfg_path else {}
        self.quant_config, self.quant_config_file = self._find_quant_config()
        self._shards: list[SafetensorsFile] = []
        self._where: dict[str, SafetensorsFile] = {}
        try:
            for f in self.files:
                # Opened lazily (SafetensorsFile): headers now, maps on use, a bounded number at once.
                shard = self._open_weights(f, given=path)
                self._shards.append(shard)
                for name in shard.infos:
                    if name in self._where:
                        raise SourceFormatError(
                            f"tensor appears in two shards ({self._where[name].path.name} and {f.name})",
                            path=f,
                            tensor=name,
                        )
                    self._where[name] = shard
            if self.index is not None:
                self._check_index_placement(self.index)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _open_weights(file: Path, *, given: Path) -> SafetensorsFile:
        """A weight file's reader; IN itself, named other than ``*.safetensors`` (a
        config.json, a README given by mistake), says what IN may be when it is no
        safetensors file, not only the header length its first bytes spell."""
        try:
            return SafetensorsFile(file)
        except SourceFormatError as e:
            if file != given or file.suffix == ".safetensors":
                raise
            detail = e.rule.removeprefix("not a safetensors file: ")
            raise SourceFormatError(f"neither .tinyloop nor safetensors ({detail}); {INPUT_KINDS}", path=file) from None

    def _check_index_placement(self, index: HFIndex) -> None:
        """Every tensor the index names is in the shard it names: a loader that looks
        tensors up through the index would otherwise miss it, and a conversion would
        silently drop it."""
        for name, fname in index.weight_map.items():
            shard = self._where.get(name)
            if shard is None:
                raise SourceFormatError(
                    f"the index names this tensor in {fname}, but no shard holds it", path=index.path, tensor=name
                )
            if shard.path.name != fname:
                raise SourceFormatError(
                    f"the index places this tensor in {fname}, but it is stored in {shard.path.name}",
                    path=index.path,
                    tensor=name,
                )

    def _lone_shard_hint(self, path: Path) -> str:
        index = self.folder / HF_INDEX_NAME
        try:
            if index.is_file() and path.name in read_index(index, error=SourceFormatError).shard_names:
                return f"; {path.name} is one shard of {HF_INDEX_NAME}: pass the index or the folder"
        except SourceFormatError:
            pass
        m = SHARD_NAME_RE.match(path.name)
        if m and int(m.group("n")) > 1:
            return f"; {path.name} is one shard of {int(m.group('n'))}: pass the index or the folder"
        return ""

    def _find_weights(self, folder: Path) -> list[Path]:
        index = folder_member(folder, HF_INDEX_NAME)
        if index is not None:
            return self._read_index(index)
        files = [folder_member(folder, p.name) for p in sorted(folder.glob("*.safetensors"))]
        if files:
            return [f for f in files if f is not None]
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise SourceFormatError(
                f"only pickle weights found ({', '.join(pickles[:3])}); they are refused and never "
                "unpickled: convert them to safetensors first",
                path=folder,
            )
        raise SourceFormatError("no weights: expected *.safetensors or model.safetensors.index.json", path=folder)

    def _read_index(self, path: Path) -> list[Path]:
        index = read_index(path, error=SourceFormatError, json_error=ConfigError)
        files = []
        for name in index.shard_names:
            if "\0" in name or not name:  # no file can have that name (the OS refuses a NUL byte)
                raise SourceFormatError(
                    f"shard {printable(repr(short_name(name)))} listed in the index is not a valid file name",
                    path=path,
                    tensor="weight_map",
                )
            shard = folder_member(path.parent, name)
            if shard is None:
                raise SourceFormatError(
                    f"shard {name} listed in the index does not exist", path=path, tensor="weight_map"
                )
            files.append(shard)
        self.index = index
        return files

    def _find_quant_config(self) -> tuple[dict[str, Any], str | None]:
        for name in QUANT_CONFIG_FILES:
            p = folder_member(self.folder, name)
            if p is not None:
                return read_json_file(p), name
        qc = self.config.get("quantization_config")
        if qc is not None:
            if not isinstance(qc, dict):
                raise ConfigError("must be an object", path=self.folder / "config.json", tensor="quantization_config")
            return qc, "config.json"
        return {}, None

    # -- tensors ---------------------------------------------------------------------
    @functools.cached_property  # the shard set is fixed once opened
    def infos(self) -> dict[str, TensorInfo]:
        """Every tensor in every shard: ``{name: TensorInfo}``."""
        return {n: s.infos[n] for n, s in self._where.items()}

    @property
    def shards(self) -> list[SafetensorsFile]:
        """The opened weight files, in shard order."""
        return list(self._shards)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def info(self, name: str) -> TensorInfo:
        return self._where[name].infos[name]

    def file_of(self, name: str) -> Path:
        return self._where[name].path

    def stored_bytes(self, name: str) -> tuple[SafetensorsFile, int, int]:
        """Where a tensor's bytes are: its weight file and their ``[begin, end)`` offsets in it."""
        where = self._where[name]
        return (where, *where.byte_range(name))

    def array(self, name: str) -> np.ndarray:
        """Memory-mapped, read-only array in its storage dtype (BF16 as uint16)."""
        return self._where[name].array(name)

    def tensor(self, name: str) -> Tensor:
        return self._where[name].tensor(name)

    def digest_paths(self) -> list[Path]:
        """The files :meth:`describe_files` lists: the weights, then the index and the configs read.

        Raises:
            SourceFormatError: a file name that is not valid UTF-8 (the manifest is UTF-8 JSON).
        """
        paths = list(self.files)
        for extra in (HF_INDEX_NAME if self.index is not None else None, "config.json", self.quant_config_file):
            p = folder_member(self.folder, extra) if extra else None
            if p is not None and p not in paths:
                paths.append(p)
        for p in paths:
            if not _is_text(p.name):
                raise SourceFormatError(
                    f"file name {ascii(p.name)} is not valid UTF-8, so the manifest cannot record it; rename the file",
                    path=self.folder,
                )
        return paths

    def describe_files(self, *, digests: bool | Mapping[Path, str] = True) -> list[dict[str, Any]]:
        """``[{"name", "bytes", "sha256"}]`` for the files of :meth:`digest_paths`.

        Args:
            digests: True hashes the files here; False gives placeholder digests of the
                same length (to size the manifest before the input is read); a mapping
                gives their sha256, computed elsewhere.

        Raises:
            SourceFormatError: a file name that is not valid UTF-8 (the manifest is UTF-8 JSON).
        """
        paths = self.digest_paths()
        if isinstance(digests, Mapping):
            sums = [digests[p] for p in paths]
        elif digests:
            found = sha256_files(paths)
            sums = [found[p] for p in paths]
        else:
            sums = [PLACEHOLDER] * len(paths)
        return [{"name": p.name, "bytes": p.stat().st_size, "sha256": h} for p, h in zip(paths, sums, strict=True)]

    def input_files(self) -> list[Path]:
        """The weight files, the index, the configs and the tokenizer files (folder mode
        copies those): every file of the checkpoint that the tool reads."""
        paths = list(self.files)
        names = [HF_INDEX_NAME, "config.json", *QUANT_CONFIG_FILES, *TOKENIZER_FILES]
        # Every one that exists, links included: what no output may replace (whether a
        # link may be read is folder_member's question, asked where a file is read).
        paths += [self.folder / n for n in names if os.path.lexists(self.folder / n)]
        return paths

    def close(self) -> None:
        for s in self._shards:
            s.close()

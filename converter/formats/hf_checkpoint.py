"""Hugging Face checkpoint folders: weight files, shard index, config discovery.

What the HF readers (GPTQ, AWQ, compressed-tensors) read through.  Pickle checkpoints
(``.bin``, ``.pt``, ``.pth``, ``.ckpt``) are refused by name and never opened, let
alone unpickled.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ..constants import HF_INDEX_NAME
from ..errors import ConfigError, SourceFormatError
from ..hf_index import HFIndex, read_index
from ..jsonio import read_object
from ..quant_weight import Tensor, TensorInfo
from ..safetensors_io import SafetensorsFile

#: Where producers put the quant config, in lookup order (checkpoint-formats.md 1.7;
#: auto-round writes quantization_config.json).
QUANT_CONFIG_FILES = ("quantize_config.json", "quantization_config.json", "quant_config.json")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
#: Files copied next to a directory-mode artifact so it is a complete model folder.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "generation_config.json",
)  # fmt: skip


def read_json_file(path: Path) -> dict[str, Any]:
    """Read a config file that must hold a JSON object (:mod:`converter.jsonio`'s policy).

    Raises:
        ConfigError: unreadable, too large, not JSON, or not an object.
    """
    return read_object(path, what="JSON file", error=ConfigError)


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    """Hex sha256 of a file, streamed in ``chunk``-byte reads."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


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
        cfg_path = self.folder / "config.json"
        self.config: dict[str, Any] = read_json_file(cfg_path) if cfg_path.is_file() else {}
        self.quant_config, self.quant_config_file = self._find_quant_config()
        self._shards: list[SafetensorsFile] = []
        self._where: dict[str, SafetensorsFile] = {}
        try:
            for f in self.files:
                shard = SafetensorsFile(f)
                self._shards.append(shard)
                for name in shard.infos:
                    if name in self._where:
                        raise SourceFormatError(
                            f"tensor appears in two shards ({self._where[name].path.name} and {f.name})",
                            path=f,
                            tensor=name,
                        )
                    self._where[name] = shard
        except BaseException:
            self.close()
            raise

    def _find_weights(self, folder: Path) -> list[Path]:
        index = folder / HF_INDEX_NAME
        if index.is_file():
            return self._read_index(index)
        files = sorted(folder.glob("*.safetensors"))
        if files:
            return files
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
            if not index.shard_path(name).is_file():
                raise SourceFormatError(
                    f"shard {name} listed in the index does not exist", path=path, tensor="weight_map"
                )
            files.append(index.shard_path(name))
        self.index = index
        return files

    def _find_quant_config(self) -> tuple[dict[str, Any], str | None]:
        for name in QUANT_CONFIG_FILES:
            p = self.folder / name
            if p.is_file():
                return read_json_file(p), name
        qc = self.config.get("quantization_config")
        if qc is not None:
            if not isinstance(qc, dict):
                raise ConfigError("must be an object", path=self.folder / "config.json", tensor="quantization_config")
            return qc, "config.json"
        return {}, None

    # -- tensors ---------------------------------------------------------------------
    @property
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

    def array(self, name: str) -> np.ndarray:
        """Memory-mapped, read-only array in its storage dtype (BF16 as uint16)."""
        return self._where[name].array(name)

    def tensor(self, name: str) -> Tensor:
        return self._where[name].tensor(name)

    def describe_files(self) -> list[dict[str, Any]]:
        """``[{"name", "bytes", "sha256"}]`` for the weight files and configs read."""
        paths = list(self.files)
        for extra in (HF_INDEX_NAME if self.index is not None else None, "config.json", self.quant_config_file):
            if extra and (self.folder / extra).is_file() and self.folder / extra not in paths:
                paths.append(self.folder / extra)
        # Two threads: hashlib releases the GIL, so shards hash in parallel on 2 cores.
        with ThreadPoolExecutor(max_workers=min(2, max(len(paths), 1))) as pool:
            sums = list(pool.map(sha256_file, paths))
        return [{"name": p.name, "bytes": p.stat().st_size, "sha256": h} for p, h in zip(paths, sums, strict=True)]

    def input_files(self) -> list[Path]:
        """The weight files, the index, the configs and the tokenizer files (folder mode
        copies those): every file of the checkpoint that the tool reads."""
        paths = list(self.files)
        names = [HF_INDEX_NAME, "config.json", *QUANT_CONFIG_FILES, *TOKENIZER_FILES]
        paths += [self.folder / n for n in names if (self.folder / n).is_file()]
        return paths

    def close(self) -> None:
        for s in self._shards:
            s.close()

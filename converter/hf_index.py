"""Hugging Face's shard index (``model.safetensors.index.json``), read and written.

The format (checkpoint-formats.md section 7; ``huggingface_hub`` writes it)::

    {"metadata": {"total_size": <bytes of tensor data>},
     "weight_map": {"<tensor name>": "<shard file name>", ...}}

Shards are plain file names in the index's own folder. One reader serves the HF input
(:mod:`converter.formats.hf_checkpoint`), the sharded artifact reader and the artifact writer's
check of what an earlier artifact left behind.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import ConverterError
from .jsonio import read_object

WEIGHT_MAP = "weight_map"
#: HF's shard file names: ``<stem>-0000i-of-0000n.safetensors`` (1-based ``i``).
SHARD_NAME_RE = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.safetensors$")


@dataclasses.dataclass(frozen=True)
class HFIndex:
    """One parsed index.

    Attributes:
        path: the index file.
        weight_map: ``{tensor name: shard file name}``, in file order.
        total_size: ``metadata.total_size`` as found (any JSON value), or None.
    """

    path: Path
    weight_map: dict[str, str]
    total_size: Any = None

    @property
    def shard_names(self) -> list[str]:
        """The shard file names in order of first appearance."""
        return list(dict.fromkeys(self.weight_map.values()))

    def shard_path(self, name: str) -> Path:
        """Where shard ``name`` lives: beside the index."""
        return self.path.parent / name


def read_index(
    path: Path,
    *,
    error: type[ConverterError],
    json_error: type[ConverterError] | None = None,
    allow_empty: bool = False,
) -> HFIndex:
    """Read an index and check its own rules (not whether the shards exist).

    Args:
        path: the ``*.index.json`` file.
        error: raised for a ``weight_map`` that breaks the rules.
        json_error: raised for a file that is not a JSON object (default ``error``).
        allow_empty: accept an empty ``weight_map`` (an artifact may have no tensors).

    Raises:
        json_error: unreadable, too large, or not a JSON object (:mod:`converter.jsonio`).
        error: ``weight_map`` is not a (non-empty) map of tensor names to strings, or
            names a shard that is not a plain file name in the index's folder.
    """
    data = read_object(path, what="JSON file", error=json_error or error)
    wmap = data.get(WEIGHT_MAP)
    if not isinstance(wmap, dict) or not (wmap or allow_empty) or not all(isinstance(v, str) for v in wmap.values()):
        kind = "map" if allow_empty else "non-empty map"
        raise error(f"{WEIGHT_MAP} must be a {kind} of tensor name to shard file", path=path, tensor=WEIGHT_MAP)
    for name in dict.fromkeys(wmap.values()):
        if Path(name).name != name:
            raise error(f"shard {name!r} must be a plain file name in the same folder", path=path, tensor=WEIGHT_MAP)
    meta = data.get("metadata")
    return HFIndex(path, dict(wmap), meta.get("total_size") if isinstance(meta, dict) else None)


def index_bytes(weight_map: Mapping[str, str], total_size: int) -> bytes:
    """The index file's bytes, as ``huggingface_hub`` lays them out (sorted keys, indent 2)."""
    index = {"metadata": {"total_size": total_size}, WEIGHT_MAP: dict(weight_map)}
    return json.dumps(index, indent=2, sort_keys=True).encode("utf-8") + b"\n"

"""Raw safetensors bytes and small checkpoints for the bad-input tests."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from converter.convert import convert

from .artifact_edit import read_st, write_st
from .synthetic_gptq import small_gptq

__all__ = [
    "LAYER",
    "NP_DTYPES",
    "T",
    "arr",
    "edit_tensor",
    "only_shard",
    "set_quant_config",
    "small_gptq",
    "small_gptq_artifact",
    "st_bytes",
]

NP_DTYPES = {"I32": "<i4", "F16": "<f2", "F32": "<f4", "U8": "u1", "BF16": "<u2", "I64": "<i8"}
#: A 4-bit layer of :func:`small_gptq` (K = N = 128, group 64).
LAYER = "model.layers.0.self_attn.q_proj"
#: A valid header entry: 4 float32 values at the start of the data.
T = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}


def st_bytes(header: dict | bytes, data: bytes = b"", *, header_len: int | None = None) -> bytes:
    """A safetensors file from a header (dict, or raw bytes used verbatim) and data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data


def arr(name_dtype: str, values) -> bytes:
    """Raw little-endian bytes of ``values`` in safetensors dtype ``name_dtype``."""
    return np.ascontiguousarray(values, dtype=NP_DTYPES[name_dtype]).tobytes()


def only_shard(folder: Path) -> Path:
    """The one ``*.safetensors`` file of a one-shard checkpoint."""
    (shard,) = sorted(folder.glob("*.safetensors"))
    return shard


def edit_tensor(
    folder: Path,
    name: str,
    dtype: str | None = None,
    shape: list[int] | None = None,
    raw: bytes | None = None,
    *,
    drop: bool = False,
) -> Path:
    """Rewrite one tensor of a 1-shard checkpoint (and its index) in place."""
    shard = only_shard(folder)
    meta, tensors = read_st(shard)
    if drop:
        del tensors[name]
        index = folder / "model.safetensors.index.json"
        data = json.loads(index.read_text())
        del data["weight_map"][name]
        index.write_text(json.dumps(data))
    else:
        d, s, r = tensors[name]
        tensors[name] = (dtype or d, shape if shape is not None else s, raw if raw is not None else r)
    write_st(shard, tensors, meta)
    return shard


def set_quant_config(folder: Path, **changes: object) -> None:
    """Change quant-config fields of a :func:`small_gptq` folder (in both files; ``...`` deletes)."""
    for name in ("quantize_config.json", "config.json"):
        p = folder / name
        cfg = json.loads(p.read_text())
        target = cfg if name == "quantize_config.json" else cfg["quantization_config"]
        for k, v in changes.items():
            if v is ...:
                target.pop(k, None)
            else:
                target[k] = v
        p.write_text(json.dumps(cfg))


def small_gptq_artifact(root: Path, **kw: object) -> Path:
    """``root/model.marlin.safetensors``, converted from a :func:`small_gptq` in ``root/src``."""
    out = root / "model.marlin.safetensors"
    convert(small_gptq(root / "src", **kw), out)
    return out

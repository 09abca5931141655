"""How an artifact's tensors split into HF shards (``--max-shard-size``).

Tensors are grouped into units (all tensors of one converted layer form one unit, so a
layer's ``B``, scales, ``delta``, ``perm`` and bias are always in the same shard; every
pass-through tensor is its own unit) and packed greedily in layout order into shards
of at most ``max_shard_size`` bytes of tensor data; a unit larger than the limit gets
a shard of its own, as Hugging Face's ``save_pretrained`` does.
"""

from __future__ import annotations

import re

from ..constants import Suffix
from ..dtypes import nbytes
from ..errors import OptionValueError

#: ``[(tensor name, safetensors dtype code, shape)]`` in write order.
Layout = list[tuple[str, str, tuple[int, ...]]]

#: Decimal and binary units, as ``huggingface_hub``'s ``parse_size_to_int`` reads them.
_SIZE_UNITS = {
    "": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)
_UNITS_TEXT = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"


def parse_size(text: str | int) -> int:
    """Bytes from a size such as ``5GB`` (10^9) or ``500MiB`` (2^20); an int is bytes.

    A string needs its unit: ``5`` is refused, not read as 5 bytes (``5B`` is).

    Raises:
        OptionValueError: not a positive size, or a number without a unit (names the
            option and the value).
    """
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE_RE.match(text)
        if not m:
            raise OptionValueError(
                f"{text!r} is not a size (expected a number and a unit: {_UNITS_TEXT}; e.g. 5GB)",
                tensor="--max-shard-size",
            )
        if m.group(2) is None:
            raise OptionValueError(
                f"{text!r} has no unit; add one of {_UNITS_TEXT}, e.g. {m.group(1)}GB ({m.group(1)}B for bytes)",
                tensor="--max-shard-size",
            )
        value = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])
    if value <= 0:
        raise OptionValueError(f"must be positive, found {text!r}", tensor="--max-shard-size")
    return value


def human_size(n: int) -> str:
    """``n`` bytes for people: ``512 B``, ``40.0 kB``, ``1.69 MB``, ``2.10 GB`` (powers of 1000)."""
    if n < 1000:
        return f"{n} B"
    if n < 10**6:
        return f"{n / 1e3:.1f} kB"
    if n < 10**9:
        return f"{n / 1e6:.2f} MB"
    return f"{n / 1e9:.2f} GB"


def oversize_warnings(shards: list[Layout], names: list[str], max_bytes: int | None, limit: str) -> list[str]:
    """One warning per shard over ``max_bytes``: each holds one unit (a layer's tensors,
    or one tensor) that is larger than the limit on its own.

    Args:
        shards: :func:`plan_shards`' result; names: the file name of each shard.
        limit: the limit as the user gave it (``10MB``).
    """
    if max_bytes is None:
        return []
    out = []
    for shard, name in zip(shards, names, strict=True):
        size = sum(nbytes(d, s) for _, d, s in shard)
        if size <= max_bytes:
            continue
        first = shard[0][0]
        if len(shard) == 1:
            what, why = f"tensor {first}", "a tensor is never split"
        else:
            what, why = f"layer {first.rpartition('.')[0]} ({len(shard)} tensors)", "a layer's tensors stay together"
        out.append(
            f"{what} is {human_size(size)}, larger than --max-shard-size {limit}: it gets a shard of its own, "
            f"{name}, over the limit ({why})"
        )
    return out


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
    if max_bytes is None:
        return [list(layout)]
    suffixes = {s.value for s in Suffix}
    layers = set(layer_names)
    units: dict[str, Layout] = {}
    for entry in layout:
        name = entry[0]
        prefix, _, suffix = name.rpartition(".")
        key = f"layer:{prefix}" if prefix in layers and suffix in suffixes else f"tensor:{name}"
        units.setdefault(key, []).append(entry)
    shards: list[Layout] = []
    current: Layout = []
    size = 0
    for unit in units.values():
        ubytes = sum(nbytes(d, s) for _, d, s in unit)
        if current and size + ubytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current += unit
        size += ubytes
    shards.append(current)
    return shards

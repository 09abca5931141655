"""What is settled before anything is written: the artifact's tensors, layer records and
pass-through list, the rows read per chunk, and the checks on the input (non-finite
config or bias, files changed while being converted)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from ..artifact.manifest import layer_entry
from ..artifact.schema import LayerEntry, Passthrough
from ..artifact.shards import Layout
from ..constants import MARLIN_TILE, PACKED_ROW_BLOCK, SAFETENSORS_METADATA_KEY, Suffix
from ..errors import ConfigError, SourceFormatError
from ..formats.base import LayerPlan, Source, SourcePlan
from ..jsonio import non_finite_path
from ..marlin.shapes import LayerShape, marlin_shapes

#: Bytes of uint8 codes unpacked at a time; bounds peak memory per layer.
CHUNK_CODE_BYTES = 24 << 20


PLAIN_REASON = "not a quantized linear layer"


def layer_tensor_names(layer: LayerPlan) -> dict[Suffix, tuple[str, tuple[int, ...], str]]:
    """``{suffix: (artifact name, shape, dtype)}`` for a convertible layer."""
    shapes = marlin_shapes(
        LayerShape(layer.size_k, layer.size_n, layer.group_size, layer.padded_n),
        act_order=layer.act_order,
        bias_dtype=layer.bias.dtype if layer.bias else None,
    )
    return {suf: (f"{layer.name}.{suf.value}", shape, dtype) for suf, (dtype, shape) in shapes.items()}


def build_layout(plan: SourcePlan, *, path: Path) -> tuple[Layout, list[LayerEntry], list[Passthrough]]:
    """The artifact's tensors, layer records and pass-through list.

    Raises:
        SourceFormatError: two artifact tensors would get the same name.
    """
    layout: Layout = []
    layers: list[LayerEntry] = []
    passthrough: list[Passthrough] = []
    for layer in plan.layers:
        if layer.convertible:
            layers.append(layer_entry(layer))
            for name, shape, dtype in layer_tensor_names(layer).values():
                layout.append((name, dtype, shape))
    for layer in plan.layers:
        if not layer.convertible:
            for t in layer.source_tensors + ((layer.bias.name,) if layer.bias else ()):
                passthrough.append(Passthrough(t, plan.passthrough_reasons.get(t, layer.reason)))
    for info in plan.tensors:
        passthrough.append(Passthrough(info.name, plan.passthrough_reasons.get(info.name, PLAIN_REASON)))
    known = {n for n, _, _ in layout}
    for entry in passthrough:
        if entry.name == SAFETENSORS_METADATA_KEY:
            raise SourceFormatError(
                f"a tensor may not be named {SAFETENSORS_METADATA_KEY!r}: safetensors reserves it; "
                "rename it in the source",
                path=path,
                tensor=entry.name,
            )
        if entry.name in known:
            raise SourceFormatError(
                "tensor name collides with a converted layer's artifact tensor; rename it in the source",
                path=path,
                tensor=entry.name,
            )
        known.add(entry.name)
    return layout, layers, passthrough


def _passthrough_infos(source: Source, plan: SourcePlan, names: list[str]) -> list[tuple[str, str, tuple[int, ...]]]:
    infos = {i.name: i for i in plan.tensors}
    out = []
    for name in names:
        info = infos.get(name)
        if info is None:
            t = source.load_tensor(name)
            out.append((name, t.dtype, tuple(t.shape)))
        else:
            out.append((name, info.dtype, tuple(info.shape)))
    return out


def chunk_rows(size_k: int, width: int, group_size: int, budget: int | None = None) -> int:
    """Rows of a layer read and packed (or verified) at a time: about ``budget`` bytes of
    codes (default :data:`CHUNK_CODE_BYTES`) over ``width`` columns, starting on
    boundaries of ``group_size`` rows (the source's groups; any 16-row boundary when
    per-channel) and on 32-row boundaries, so 2- and 3-bit words are never split."""
    unit = math.lcm(MARLIN_TILE if group_size >= size_k else group_size, PACKED_ROW_BLOCK)
    budget = CHUNK_CODE_BYTES if budget is None else budget
    rows = max(unit, (budget // max(width, 1)) // unit * unit)
    return min(rows, size_k)


class InputStats:
    """Size, modification time and identity (device, inode) of every input file, taken
    when the input is opened; :meth:`recheck` refuses any change since.  An input
    rewritten in place (or replaced) during a conversion would otherwise give an
    artifact whose codes come from the old bytes and whose sha256 from the new."""

    def __init__(self, paths: list[Path]) -> None:
        self._stats: dict[Path, tuple[int, int, int, int] | None] = {}
        self.add(paths)

    @staticmethod
    def _stat(path: Path) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            return None
        return st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino

    def add(self, paths: list[Path]) -> None:
        for p in paths:
            self._stats.setdefault(Path(p), self._stat(Path(p)))

    def recheck(self) -> None:
        """Raises:
        SourceFormatError: a file's size, mtime or inode changed (or it vanished)."""
        for path, before in self._stats.items():
            now = self._stat(path)
            if now == before:
                continue
            what = (
                "was deleted"
                if now is None
                else "was replaced by another file"
                if before is None or now[2:] != before[2:]
                else f"changed size ({before[0]} -> {now[0]} bytes)"
                if now[0] != before[0]
                else "was modified (its mtime changed)"
            )
            raise SourceFormatError(
                f"{what} while being converted; nothing was written: convert it again once nothing writes to it",
                path=path,
            )


def _refuse_non_finite(source: Source, desc: dict[str, Any]) -> None:
    """The manifest records the quant config as found, and is standard JSON: a NaN or an
    infinity in it (Python's json reads them) is refused by name."""
    where = non_finite_path(desc.get("quant_config"))
    if where is not None:
        raise ConfigError(
            f"field {where} is NaN or infinite, which standard JSON cannot hold; the artifact's manifest "
            "records the quant config and must be standard JSON: fix the value",
            path=getattr(source, "cfg_path", source.path),
        )


def _refuse_non_finite_bias(source: Source, plan: SourcePlan) -> None:
    """A converted layer's bias goes into the kernels' epilogue, added to every output
    row: a NaN or infinity there is refused by name before anything is written (scales
    and zeros are checked by the readers' plans)."""
    for lay in plan.layers:
        if not (lay.convertible and lay.bias is not None):
            continue
        bad = source.load_tensor(lay.bias.name).non_finite()
        if bad:
            ckpt = getattr(source, "ckpt", None)
            raise SourceFormatError(
                f"{bad} NaN or Inf value(s); a converted layer's bias must be finite (the kernels add it to "
                "every output row)",
                path=ckpt.file_of(lay.bias.name) if ckpt is not None else source.path,
                tensor=lay.bias.name,
            )
    source.release_pages()


def lone_shard_warnings(source: Source) -> list[str]:
    """A lone shard whose layers are whole converts; the other shards' tensors (embeddings,
    heads) are then missing from the output, so it says what to pass instead."""
    ckpt = getattr(source, "ckpt", None)
    hint = ckpt.lone_shard_hint if ckpt is not None else ""
    return [f"the other shards' tensors are left out{hint}"] if hint else []


def _plan_warnings(plan: SourcePlan, layers: list[LayerEntry]) -> list[str]:
    """Findings about the conversion as a whole (layer findings are in each layer's record)."""
    if not layers:
        return [
            f"none of the {len(plan.layers)} quantized layers converts (each passes through with its reason, "
            "listed above): the artifact holds the source's tensors unchanged"
        ]
    return []

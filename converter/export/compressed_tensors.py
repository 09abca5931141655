"""Exact export to asymmetric compressed-tensors ``pack-quantized`` (issue 41).

Per exported Linear ``<prefix>`` (checked against compressed-tensors 0.20.1,
``compressors/pack_quantized/base.py`` ``compress`` and ``helpers.py`` ``pack_to_int32``):

=========================  ======  ========================  =====================================
tensor                     dtype   shape                     content
=========================  ======  ========================  =====================================
``weight_packed``          I32     ``(N, ceil(K*b/32))``     unsigned codes ``q``, nn.Linear
                                                             orientation, dense LSB-first bit
                                                             stream along K (32 codes in b words)
``weight_scale``           source  ``(N, G)``                the source's scales, its own dtype
``weight_zero_point``      I32     ``(ceil(N*b/32), G)``     unsigned zeros ``z``, packed along N
``weight_shape``           I64     ``(2,)``                  ``[N, K]``
``weight_g_idx``           I32     ``(K,)``                  act-order layers only
=========================  ======  ========================  =====================================

The library's ``pack_to_int32`` adds ``2^(b-1)`` to its signed codes and zero points and
``dequantize`` computes ``(x_q - zp) * s`` on the signed values, so storing the source's
unsigned ``q`` and ``z`` gives ``s * (q - z)``: the source's own weight, bit for bit.

Exactness: a layer is written only when compressed-tensors holds it exactly: integer zero
points in ``[0, 2^b - 1]`` at the layer's own group size.  A ragged last group (the
converter regroups it), a padded N, a ``.tinyloop`` float zero, or a zero outside the
bit width is refused by name, or with ``allow_passthrough`` its source tensors are
copied unconverted and the module listed in ``ignore``.  Nothing is rounded.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__
from ..artifact.hf_config import copied_files
from ..artifact.shards import Layout, parse_size, plan_shards
from ..artifact.target import CONFIG_NAME, InputGuard, OutputTarget, artifact_stem
from ..atomic import (
    OutputLock,
    commit_all,
    interrupts_deferred,
    note_committed,
    stage_placeholder,
    target_mode,
    write_durably,
)
from ..constants import PRODUCER_NAME, ZeroConvention
from ..digests import sha256_files
from ..errors import ConverterError, OutputPathError, UnsupportedQuantError, short_name
from ..formats import open_source
from ..formats.base import LayerPlan, Source
from ..formats.hf import HFSource
from ..formats.hf_checkpoint import read_member_bytes
from ..hf_index import index_bytes
from ..jsonio import non_finite_path
from ..quant_weight import QuantWeight
from ..safetensors_io import StreamingWriter, header_size_for

#: The compressed-tensors release whose code this layout was checked against.
COMPRESSED_TENSORS_VERSION = "0.20.1"
#: safetensors ``__metadata__`` key of the export manifest (never the Marlin artifact's
#: keys: our own reader must read the export back as a source).
EXPORT_META_KEY = "marlin_convert_export"
EXPORT_SCHEMA = 1

#: Where :func:`vllm_kernels` takes its rules from (advice, not a guarantee).
VLLM_SOURCES = (
    "vllm-project/vllm vllm/model_executor/layers/quantization/utils/marlin_utils.py @ 007d500 "
    "(MARLIN_SUPPORTED_GROUP_SIZES = [-1, 32, 64, 128]; has_zp -> uint4 only; "
    "N % 64, K % 128, K_part % group_size)",
    "vllm-project/vllm vllm/model_executor/layers/quantization/kernels/mixed_precision/marlin.py @ 04aa528 "
    "(MarlinLinearKernel.can_implement, sm_80+, g_idx sorted at load)",
    "vllm-project/vllm vllm/model_executor/layers/quantization/utils/machete_utils.py @ 0531c22 "
    "(MACHETE_SUPPORTED_GROUP_SIZES = [-1, 128]; zero points -> uint4/uint8; K % 64, N % 128)",
    "vllm-project/vllm vllm/model_executor/layers/quantization/kernels/mixed_precision/machete.py @ 0065de9 "
    "(sm_90 only; act-order not with K split across tensor-parallel ranks; no bias in the kernel)",
)
VLLM_VERSION_NOTE = (
    "vLLM main of late 2025 / 2026 (v0.11 and later, the files cited in VLLM_SOURCES); "
    "compressed-tensors W{4,8}A16 only (WNA16_SUPPORTED_BITS = [4, 8])"
)


@dataclasses.dataclass
class LayerExport:
    """One source layer in the export."""

    name: str
    bits: int
    size_k: int
    size_n: int
    group_size: int
    strategy: str
    act_order: bool
    exported: bool
    reason: str = ""
    kernels: list[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ExportSummary:
    """What :func:`export_compressed_tensors` wrote."""

    source: str
    output: str
    source_format: str
    layers: list[LayerExport]
    passthrough: list[str]
    files: list[str]
    source_files: list[dict[str, Any]]
    warnings: list[str]

    @property
    def exported(self) -> list[LayerExport]:
        return [lay for lay in self.layers if lay.exported]

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "output": self.output,
            "source_format": self.source_format,
            "to": "compressed-tensors",
            "layers": [lay.to_json() for lay in self.layers],
            "passthrough": self.passthrough,
            "files": self.files,
            "source_files": self.source_files,
            "warnings": self.warnings,
            "kernel_advice": {"sources": list(VLLM_SOURCES), "vllm_version": VLLM_VERSION_NOTE},
        }

    def text(self) -> str:
        """A short human summary: one line per exported layer, with its vLLM kernels."""
        lines = [f"exported {len(self.exported)} layers to {self.output} (compressed-tensors pack-quantized, asym)"]
        for lay in self.layers:
            if lay.exported:
                g = "channel" if lay.strategy == "channel" else f"g{lay.group_size}"
                ao = ", act-order" if lay.act_order else ""
                lines.append(f"  {lay.name}: w{lay.bits} {g}{ao}; vLLM: {', '.join(lay.kernels) or 'none'}")
            else:
                lines.append(f"  {lay.name}: passed through unconverted ({lay.reason})")
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


# --------------------------------------------------------------------------- rules


def vllm_kernels(bits: int, group_size: int, size_k: int, size_n: int, act_order: bool) -> list[str]:
    """Which vLLM kernels can serve an asymmetric (zero-point) compressed-tensors layer.

    Derived from the vLLM files in :data:`VLLM_SOURCES` (version: :data:`VLLM_VERSION_NOTE`),
    for one GPU (no tensor parallelism: a split K adds ``K_part % group_size == 0`` and
    Machete refuses act-order).  Advice, not a guarantee.

    Args:
        group_size: rows per group; ``size_k`` (or -1) for per-channel.
    """
    if bits not in (4, 8):
        return []  # compressed_tensors_wNa16: WNA16_SUPPORTED_BITS = [4, 8]
    g = -1 if group_size in (-1, size_k) else group_size
    out = []
    # Marlin with zero points: uint4 only (query_marlin_supported_quant_types(has_zp=True)).
    if bits == 4 and g in (-1, 32, 64, 128) and size_n % 64 == 0 and size_k % 128 == 0 and (g == -1 or size_k % g == 0):
        out.append("Marlin (uint4 with zero points, sm_80+" + (", act-order via g_idx sort" if act_order else "") + ")")
    # Machete with zero points: uint4 / uint8, sm_90 only.
    if g in (-1, 128) and size_k % 64 == 0 and size_n % 128 == 0:
        out.append("Machete (Hopper sm_90" + (", act-order" if act_order else "") + ")")
    return out


# --------------------------------------------------------------------------- packing


def pack_int32(values: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """compressed-tensors ``pack_to_int32`` on unsigned codes: a dense LSB-first bit
    stream along ``axis`` (32 codes in ``bits`` words), zero-padded, ``ceil(n*bits/32)``
    words.  ``values`` are the *unsigned* codes (the library's signed code + 2^(b-1))."""
    v = np.asarray(values, dtype=np.uint64)
    if axis == 0:
        v = v.T
    rows, cols = v.shape
    blocks = -(-cols // 32)
    padded = np.zeros((rows, blocks * 32), dtype=np.uint64)
    padded[:, :cols] = v
    padded = padded.reshape(rows, blocks, 32)
    words = np.zeros((rows, blocks, bits + 1), dtype=np.uint64)
    for i in range(32):
        start = i * bits
        w, off = divmod(start, 32)
        shifted = padded[:, :, i] << np.uint64(off)
        words[:, :, w] |= shifted & np.uint64(0xFFFFFFFF)
        words[:, :, w + 1] |= shifted >> np.uint64(32)
    out = words[:, :, :bits].reshape(rows, blocks * bits)[:, : -(-cols * bits // 32)]
    out = out.astype(np.uint32).view(np.int32)
    return np.ascontiguousarray(out.T if axis == 0 else out)


def _scales_for(qw: QuantWeight) -> tuple[str, np.ndarray]:
    """The source's scales transposed to ``(N, G)``, in the source's own dtype (exact)."""
    s = qw.source_scales_f32()
    if qw.source_scales_dtype == "BF16":
        return "BF16", np.ascontiguousarray((s.view(np.uint32) >> np.uint32(16)).astype(np.uint16).T)
    if qw.source_scales_dtype == "F32":
        return "F32", np.ascontiguousarray(s.T)
    return "F16", np.ascontiguousarray(qw.scales.T)


# --------------------------------------------------------------------------- planning


def _names(names: list[str], shown: int = 4) -> str:
    """The first few names (shortened), then how many more."""
    head = ", ".join(short_name(n) for n in names[:shown])
    return head + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _unrepresentable(layer: LayerPlan, legacy_act_order: bool) -> str | None:
    """Why a planned layer has no exact compressed-tensors form (None: it may have one)."""
    if not layer.convertible:
        return layer.reason
    if layer.zero_convention is ZeroConvention.TINYLOOP_ADDITIVE:
        return ".tinyloop float zero (W = q*s + zero) has no integer zero point"
    if layer.source_group_size is not None:
        return f"ragged last group (K = {layer.size_k} is not a multiple of group size {layer.source_group_size})"
    if layer.padded_n is not None:
        return f"padded N (N = {layer.size_n} would need padding to {layer.padded_n})"
    if layer.act_order and not legacy_act_order:
        return (
            f"act-order (g_idx): compressed-tensors {COMPRESSED_TENSORS_VERSION} removed actorder 'group' "
            "(its config refuses it and its decompression ignores weight_g_idx); legacy_act_order "
            "(--legacy-act-order) writes it for older compressed-tensors and vLLM"
        )
    return None


def _zero_problem(qw: QuantWeight) -> str | None:
    hi = (1 << qw.bits) - 1
    z = np.asarray(qw.zeros)
    if z.dtype.kind not in "iu":
        return "zero points are not integers"
    if z.size and (int(z.min()) < 0 or int(z.max()) > hi):
        return f"zero point {int(z.max())} is outside the {qw.bits}-bit range [0, {hi}]"
    return None


def _layer_tensors(qw: QuantWeight, layer: LayerPlan) -> dict[str, tuple[str, np.ndarray]]:
    b, k, n = qw.bits, layer.size_k, layer.size_n
    q = qw.q
    if qw.perm is not None:  # back to source row order: Marlin row i is source row perm[i]
        q = np.empty_like(qw.q)
        q[qw.perm] = qw.q
    p = layer.name
    out = {
        f"{p}.weight_packed": ("I32", pack_int32(q.T, b, axis=1)),
        f"{p}.weight_scale": _scales_for(qw),
        f"{p}.weight_zero_point": ("I32", pack_int32(np.ascontiguousarray(qw.zeros.T), b, axis=0)),
        f"{p}.weight_shape": ("I64", np.array([n, k], dtype=np.int64)),
    }
    if qw.perm is not None:
        g_idx = np.empty(k, dtype=np.int32)
        g_idx[qw.perm] = np.arange(k, dtype=np.int32) // qw.group_size
        out[f"{p}.weight_g_idx"] = ("I32", g_idx)
    return out


def _weights_args(lay: LayerExport) -> dict[str, Any]:
    return {
        "num_bits": lay.bits,
        "type": "int",
        "symmetric": False,
        "strategy": lay.strategy,
        "group_size": lay.group_size if lay.strategy == "group" else None,
        "block_structure": None,
        "dynamic": False,
        "actorder": "group" if lay.act_order else None,
        "observer": "minmax",
        "observer_kwargs": {},
    }


def quantization_config(layers: list[LayerExport], ignore: list[str]) -> dict[str, Any]:
    """The ``quantization_config`` of the export: one config group per distinct
    (bits, strategy, group size, act-order), targeting its layers by exact name."""
    groups: dict[str, dict[str, Any]] = {}
    keys: dict[tuple, str] = {}
    for lay in layers:
        if not lay.exported:
            continue
        args = _weights_args(lay)
        key = tuple(sorted((k, str(v)) for k, v in args.items()))
        if key not in keys:
            keys[key] = f"group_{len(keys)}"
            groups[keys[key]] = {
                "targets": [],
                "weights": args,
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        groups[keys[key]]["targets"].append(lay.name)
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }


def _config_json(source: Source, qc: dict[str, Any]) -> bytes:
    if isinstance(source, HFSource):
        cfg = dict(source.ckpt.config or {"model_type": "unknown"})
        cfg.pop("quantization_config", None)
        where = non_finite_path(cfg)
        if where is not None:
            raise UnsupportedQuantError(
                f"field {where} of config.json is NaN or infinite, which standard JSON cannot hold",
                path=source.ckpt.folder / CONFIG_NAME,
            )
    else:
        cfg = {
            "model_type": "tinyloop",
            **dict(source.describe(digests=False).get("quant_config", {}).get("model", {})),
        }
    cfg["quantization_config"] = qc
    return json.dumps(cfg, indent=2, allow_nan=False).encode("utf-8") + b"\n"


# --------------------------------------------------------------------------- export


def export_compressed_tensors(
    src: str | Path,
    out_folder: str | Path,
    *,
    allow_passthrough: bool = False,
    max_shard_size: int | str | None = None,
    force: bool = False,
    legacy_act_order: bool = False,
) -> ExportSummary:
    """Export ``src`` exactly as an asymmetric compressed-tensors ``pack-quantized`` model folder.

    Args:
        src: any source :func:`~converter.formats.open_source` reads.
        out_folder: the model folder to write (``model.safetensors`` or shards plus
            ``model.safetensors.index.json``, ``config.json``, tokenizer and generation files).
        allow_passthrough: copy layers with no exact compressed-tensors form unconverted
            (listed in ``ignore``) instead of refusing.
        max_shard_size: bytes per shard (an int, or ``"5GB"``); None writes one file.
        force: replace an existing export.
        legacy_act_order: write act-order layers with ``weight_g_idx`` and ``actorder:
            group`` (what vLLM's Marlin/Machete paths apply) although compressed-tensors
            0.20.1 refuses that config; without it such layers are unrepresentable.

    Returns:
        An :class:`ExportSummary` (``.text()``, ``.to_json()``).

    Raises:
        UnsupportedQuantError: an unrepresentable layer without ``allow_passthrough``
            (all of them named, one line), or no layer to export; nothing is written.
        ConverterError: bad input, an existing output without ``force``, an output that
            would touch the input, or a write error; the output folder is left as it was.
    """
    src = Path(src)
    if Path(out_folder).suffix.lower() in (".safetensors", ".json"):
        # an export is a model folder; a file-like name is a mistaken OUT, not a folder to make
        raise OutputPathError(
            "an export is a model folder (config.json, weights, tokenizer): give OUT without "
            f"{Path(out_folder).suffix}",
            path=out_folder,
        )
    max_bytes = parse_size(max_shard_size) if max_shard_size is not None else None
    with open_source(src) as source:
        plan = source.plan(pad=True)
        layers: list[LayerExport] = []
        # name -> (dtype, shape, where): a plain tensor's name, or the layer it is computed from
        # (recomputed at write time, one layer at a time, so memory stays one layer's worth).
        tensors: dict[str, tuple[str, tuple[int, ...], str | LayerPlan]] = {}
        passthrough: list[str] = []
        refused: list[tuple[str, str]] = []
        warnings: list[str] = []
        for layer in plan.layers:
            why = _unrepresentable(layer, legacy_act_order)
            qw = None
            if why is None:
                qw = source.load_layer(layer)
                why = _zero_problem(qw)
            g = layer.source_group_size or layer.group_size
            strategy = "channel" if g >= layer.size_k else "group"
            info = LayerExport(
                layer.name, layer.bits, layer.size_k, layer.size_n, g, strategy, layer.act_order, why is None
            )
            layers.append(info)
            if why is not None:
                info.reason = why
                refused.append((layer.name, why))
                passthrough += [*layer.source_tensors, *((layer.bias.name,) if layer.bias else ())]
                continue
            assert qw is not None
            tensors.update({n: (d, tuple(a.shape), layer) for n, (d, a) in _layer_tensors(qw, layer).items()})
            del qw
            if layer.bias is not None:
                tensors[layer.bias.name] = (layer.bias.dtype, tuple(layer.bias.shape), layer.bias.name)
            info.kernels = vllm_kernels(layer.bits, g, layer.size_k, layer.size_n, layer.act_order)
        if refused and not allow_passthrough:
            by_reason: dict[str, list[str]] = {}
            for n, r in refused:
                by_reason.setdefault(r, []).append(n)
            # one clause per reason: a whole model refused for one rule stays one readable line
            names = "; ".join(f"{r}: {_names(ns)}" for r, ns in by_reason.items())
            raise UnsupportedQuantError(
                f"{len(refused)} layer(s) have no exact compressed-tensors form ({names}); nothing was written "
                "(allow_passthrough / --allow-passthrough copies them unconverted)",
                path=src,
            )
        if not any(lay.exported for lay in layers):
            raise UnsupportedQuantError("no layer has an exact compressed-tensors form; nothing to export", path=src)
        if any(lay.act_order for lay in layers if lay.exported):
            warnings.append(
                "act-order layers carry weight_g_idx with actorder 'group' (legacy_act_order): vLLM versions whose "
                f"compressed-tensors predates the removal apply it; compressed-tensors {COMPRESSED_TENSORS_VERSION} "
                "refuses the config"
            )
        plan_info: dict[str, Any] = {t.name: t for t in plan.tensors}
        for name in [t.name for t in plan.tensors] + passthrough:
            info = plan_info.get(name) or source.load_tensor(name)  # a memory map: header facts only
            tensors[name] = (info.dtype, tuple(info.shape), name)
        ignore = sorted({lay.name for lay in layers if not lay.exported})
        qc = quantization_config(layers, ignore)
        extras: dict[str, bytes] = {CONFIG_NAME: _config_json(source, qc)}
        copied = copied_files(source)
        for name, path in copied.items():
            extras[name] = read_member_bytes(path)
        # The manifest: the source's files with their sha256, as the Marlin artifact records them.
        desc = source.describe(digests=sha256_files(source.digest_files()))
        manifest = {
            "schema": EXPORT_SCHEMA,
            "producer": {"name": PRODUCER_NAME, "version": __version__},
            "to": {"format": "compressed-tensors/pack-quantized", "checked_against": COMPRESSED_TENSORS_VERSION},
            "source": desc,
            "layers": [lay.to_json() for lay in layers],
        }
        meta = {"format": "pt", EXPORT_META_KEY: json.dumps(manifest, sort_keys=True, separators=(",", ":"))}
        layout: Layout = [(n, d, shape) for n, (d, shape, _) in tensors.items()]
        shards = plan_shards(layout, [], max_bytes)
        target = OutputTarget(str(out_folder).rstrip("/") + "/")
        guard = InputGuard([*source.input_files(), *copied.values()], source.checkpoint_folder)
        target.check(guard, force, count=len(shards), extra_names=extras)
        files = _write(target, shards, _TensorSource(source, tensors), meta, extras, guard)
        return ExportSummary(
            str(src),
            str(target.folder),
            source.format.value,
            layers,
            passthrough,
            [p.name for p in files],
            desc["files"],
            warnings,
        )


class _TensorSource:
    """The export's tensor data by name: plain tensors from the source as stored, a
    layer's tensors recomputed from the source (the last layer cached)."""

    def __init__(self, source: Source, tensors: Mapping[str, tuple[str, tuple[int, ...], str | LayerPlan]]) -> None:
        self.source = source
        self.tensors = tensors
        self._cached: tuple[str, dict[str, tuple[str, np.ndarray]]] | None = None

    def __getitem__(self, name: str) -> np.ndarray:
        where = self.tensors[name][2]
        if isinstance(where, str):
            return np.asarray(self.source.load_tensor(where).data)
        if self._cached is None or self._cached[0] != where.name:
            self._cached = (where.name, _layer_tensors(self.source.load_layer(where), where))
        return self._cached[1][name][1]

    def total_bytes(self) -> int:
        from ..dtypes import nbytes

        return sum(nbytes(d, shape) for d, shape, _ in self.tensors.values())


def _write(
    target: OutputTarget,
    shards: list[Layout],
    tensors: _TensorSource,
    meta: dict[str, str],
    extras: Mapping[str, bytes],
    guard: InputGuard,
) -> list[Path]:
    """Stage every shard, the extra files and the index, then rename them all into
    place at once (:func:`converter.atomic.commit_all`)."""
    folder = target.folder
    paths = target.shard_paths(len(shards))
    lock = OutputLock(folder, artifact_stem(target.path), target.path)
    temps: list[Path] = []
    writers: list[StreamingWriter] = []
    pairs: list[tuple[Path, Path]] = []
    done = False
    try:
        for shard, final in zip(shards, paths, strict=True):
            staged = stage_placeholder(folder, final.name, temps)
            with StreamingWriter(
                staged, shard, header_reserve=header_size_for(shard, meta), error_path=final
            ) as writer:
                writers.append(writer)
                for name, _, _ in shard:
                    writer.write(name, np.ascontiguousarray(tensors[name]))
                writer.finish(meta)
            pairs.append((staged, final))

        def stage(name: str, content: bytes) -> None:
            tmp = stage_placeholder(folder, name, temps)
            write_durably(tmp, content)
            pairs.append((tmp, folder / name))

        for name, content in extras.items():
            stage(name, content)
        if len(shards) > 1:
            wmap = {n: paths[i].name for i, shard in enumerate(shards) for n, _, _ in shard}
            total = tensors.total_bytes()
            stage(target.index.name, index_bytes(wmap, total))
        stale = target.stale_paths(len(shards), extras)
        for old in stale:
            guard.check_delete(old)
        for tmp, final in pairs:
            os.chmod(tmp, target_mode(final))
        with interrupts_deferred():
            commit_all(pairs, folder)
            done = True
            note_committed(paths[0] if len(shards) == 1 else target.index)
            for old in stale:
                old.unlink(missing_ok=True)
    except OSError as exc:
        raise ConverterError(f"could not write the export ({exc.strerror or exc})", path=folder) from None
    finally:
        if not done:
            for tmp in temps:
                tmp.unlink(missing_ok=True)
            if target.created:
                try:
                    folder.rmdir()
                except OSError:
                    pass
        lock.release()
    return [final for _, final in pairs]

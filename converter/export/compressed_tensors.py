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

The parts: :mod:`~converter.export.summary` (what the export reports, vLLM kernel advice),
:mod:`~converter.export.layer_tensors` (a layer's tensors), :mod:`~converter.export.quant_config`
(``config.json``), :mod:`~converter.export.folder_writer` (the atomic write).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .. import __version__
from ..artifact.hf_config import copied_files
from ..artifact.shards import Layout, parse_size, plan_shards
from ..artifact.target import CONFIG_NAME, InputGuard, OutputTarget
from ..constants import EXPORT_META_KEY, PRODUCER_NAME
from ..convert.plan import _refuse_non_finite_bias, lone_shard_warnings
from ..digests import sha256_files
from ..errors import OutputPathError, UnsupportedQuantError, short_name
from ..formats import open_source
from ..formats.base import LayerPlan
from ..formats.hf_checkpoint import QUANT_CONFIG_FILES, read_member_bytes
from ..safetensors_io import release_mapped_pages
from .folder_writer import _TensorSource, _write
from .layer_tensors import _layer_tensors, _scales_for, _unrepresentable, _zero_problem, pack_int32
from .quant_config import (
    COMPRESSED_TENSORS_VERSION,
    _config_json,
    _weights_args,
    export_config_json,
    quantization_config,
)
from .summary import TORCH_DTYPE_NAMES, VLLM_SOURCES, VLLM_VERSION_NOTE, ExportSummary, LayerExport, vllm_kernels

# Everything this module defined before the split (issue 39) stays importable from here.
__all__ = [
    "COMPRESSED_TENSORS_VERSION",
    "EXPORT_META_KEY",
    "EXPORT_SCHEMA",
    "VLLM_SOURCES",
    "VLLM_VERSION_NOTE",
    "ExportSummary",
    "LayerExport",
    "_TensorSource",
    "_config_json",
    "_layer_tensors",
    "_names",
    "_scales_for",
    "_unrepresentable",
    "_weights_args",
    "_write",
    "_zero_problem",
    "export_compressed_tensors",
    "pack_int32",
    "quantization_config",
    "vllm_kernels",
]

EXPORT_SCHEMA = 1


def _names(names: list[str], shown: int = 4) -> str:
    """The first few names (shortened), then how many more."""
    head = ", ".join(short_name(n) for n in names[:shown])
    return head + (f" and {len(names) - shown} more" if len(names) > shown else "")


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
        _refuse_non_finite_bias(source, plan)  # an engine adds it to every output row, as our kernels do
        layers: list[LayerExport] = []
        # name -> (dtype, shape, where): a plain tensor's name, or the layer it is computed from
        # (recomputed at write time, one layer at a time, so memory stays one layer's worth).
        tensors: dict[str, tuple[str, tuple[int, ...], str | LayerPlan]] = {}
        passthrough: list[str] = []
        refused: list[tuple[str, str]] = []
        warnings: list[str] = lone_shard_warnings(source)
        for layer in plan.layers:
            # this pass reads every layer once; without this the whole mapped input stays resident
            release_mapped_pages()
            source.release_pages()
            why = _unrepresentable(layer, legacy_act_order)
            qw = None
            if why is None:
                qw = source.load_layer(layer)
                why = _zero_problem(qw)
            info = LayerExport.of(layer, why is None)
            layers.append(info)
            if why is not None:
                info.reason = why
                refused.append((layer.name, why))
                passthrough += [*layer.source_tensors, *((layer.bias.name,) if layer.bias else ())]
                continue
            assert qw is not None
            written = _layer_tensors(qw, layer)
            tensors.update({n: (d, tuple(a.shape), layer) for n, (d, a) in written.items()})
            info.scale_dtype = TORCH_DTYPE_NAMES[written[f"{layer.name}.weight_scale"][0]]
            del qw, written
            if layer.bias is not None:
                tensors[layer.bias.name] = (layer.bias.dtype, tuple(layer.bias.shape), layer.bias.name)
            info.kernels = vllm_kernels(layer.bits, info.group_size, layer.size_k, layer.size_n, layer.act_order)
        if refused and not allow_passthrough:
            by_reason: dict[str, list[str]] = {}
            for n, r in refused:
                by_reason.setdefault(r, []).append(n)
            # one clause per reason: a whole model refused for one rule stays one readable line
            names = "; ".join(f"{r}: {_names(ns)}" for r, ns in by_reason.items())
            # Passing every layer through would leave nothing to export: no hint that fails next.
            hint = (
                "; allow_passthrough / --allow-passthrough copies them unconverted"
                if len(refused) < len(layers)
                else ""
            )
            raise UnsupportedQuantError(
                f"{len(refused)} layer(s) have no exact compressed-tensors form ({names}); nothing was written{hint}",
                path=src,
            )
        if not any(lay.exported for lay in layers):
            raise UnsupportedQuantError("no layer has an exact compressed-tensors form; nothing to export", path=src)
        # The reader's notes on how it read a layer (a v1 zero of -1, a config the data
        # overrides) hold for the export's codes as for the Marlin artifact's: said the same.
        layer_notes: dict[str, list[str]] = {}
        exported = {lay.name for lay in layers if lay.exported}
        for layer in plan.layers:
            for note in layer.warnings if layer.name in exported else ():
                layer_notes.setdefault(note, []).append(layer.name)
        warnings += [f"{_names(names)}: {note}" for note, names in layer_notes.items()]
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
        extras: dict[str, bytes] = {CONFIG_NAME: export_config_json(source, layers)}
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
        for name in QUANT_CONFIG_FILES:  # not ours to delete, and a reader would take it over config.json's
            if os.path.lexists(target.folder / name):
                raise OutputPathError(
                    "a reader would take this file for the export's quantization config over config.json's "
                    "(a file of another checkpoint); move it away or choose another output; nothing was written",
                    path=target.folder / name,
                )
        guard = InputGuard([*source.input_files(), *copied.values()], source.checkpoint_folder)
        target.check(guard, force, count=len(shards), extra_names=extras)
        try:
            files = _write(target, shards, _TensorSource(source, tensors), meta, extras, guard)
        except BaseException:  # an interrupt before the write's own clean-up starts
            target.discard_created()
            raise
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

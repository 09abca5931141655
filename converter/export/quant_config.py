"""The export's ``config.json``: the source model's config with the ``quantization_config``
compressed-tensors reads (one config group per distinct weight scheme).
"""

from __future__ import annotations

import json
from typing import Any

from ..artifact.target import CONFIG_NAME
from ..errors import UnsupportedQuantError
from ..formats.base import Source
from ..formats.hf import HFSource
from ..jsonio import non_finite_path
from .summary import LayerExport

#: The compressed-tensors release whose code this layout was checked against.
COMPRESSED_TENSORS_VERSION = "0.20.1"


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


def export_config_json(source: Source, layers: list[LayerExport]) -> bytes:
    """The export's ``config.json``: the source's, with the ``quantization_config`` of
    ``layers`` (those not exported listed in ``ignore``)."""
    ignore = sorted({lay.name for lay in layers if not lay.exported})
    return _config_json(source, quantization_config(layers, ignore))


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

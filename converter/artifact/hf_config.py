"""The extra files of folder mode: ``config.json`` describing the artifact, and the
source's tokenizer files (``marlin-convert IN OUT/``).

The config is the source's ``config.json`` with ``quantization_config`` replaced by a
description of the artifact (for a ``.tinyloop`` source, which has none, a minimal one
built from the header's ``model`` object).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import __version__
from ..constants import ARTIFACT_SCHEMA_VERSION, PRODUCER_NAME, Suffix
from ..formats.base import Source
from ..formats.hf import HFSource
from ..formats.hf_checkpoint import TOKENIZER_FILES
from .schema import LayerEntry
from .target import CONFIG_NAME


def artifact_config(
    source_config: Mapping[str, Any] | None,
    model: Mapping[str, Any] | None,
    *,
    source_format: str,
    layers: list[LayerEntry],
    weight_file: str,
    source_quant_config: Mapping[str, Any],
) -> dict[str, Any]:
    """The ``config.json`` written in folder mode.

    The source's ``config.json`` with ``quantization_config`` replaced by a
    description of the artifact; for a ``.tinyloop`` source (no config), a minimal
    config built from the header's ``model`` dict.
    """
    cfg: dict[str, Any] = dict(source_config) if source_config else {"model_type": "tinyloop", **dict(model or {})}
    groups = sorted({lay.group_size for lay in layers})
    cfg["quantization_config"] = {
        "quant_method": PRODUCER_NAME,
        "producer_version": __version__,
        "schema_version": ARTIFACT_SCHEMA_VERSION,
        "bits": 4,
        "zero_correction": "delta",
        "weight_dtype": "uint4b8",
        "scale_dtype": "float16",
        "delta_dtype": "float32",
        "group_sizes": groups,
        "act_order": any(lay.act_order for lay in layers),
        "source_bits": sorted({lay.bits for lay in layers}),
        "tensor_suffixes": {s.name.lower(): s.value for s in Suffix},
        "weight_file": weight_file,
        "converted_layers": len(layers),
        "source_format": source_format,
        "source_quantization_config": dict(source_quant_config),
    }
    return cfg


def folder_extras(
    source: Source, description: Mapping[str, Any], layers: list[LayerEntry], weight_file: str
) -> dict[str, bytes | Path]:
    """The extra files of folder mode: ``config.json`` and the source's tokenizer files.

    Args:
        source: the opened source; an HF reader's checkpoint has a ``config.json`` and
            tokenizer files in its folder, a ``.tinyloop`` source has neither.
        description: ``source.describe()`` (its ``quant_config``; for ``.tinyloop``
            ``{"model": {...}}``).
        layers: the manifest's layer records.
        weight_file: the artifact's file name or index name, recorded in the config.

    Returns:
        ``{file name: bytes to write or source path to copy}``.
    """
    quant = description.get("quant_config", {}) or {}
    if isinstance(source, HFSource):
        ckpt = source.ckpt
        cfg = artifact_config(
            ckpt.config or {"model_type": "unknown"},
            None,
            source_format=description["format"],
            layers=layers,
            weight_file=weight_file,
            source_quant_config=quant,
        )
        folder = ckpt.folder
    else:
        cfg = artifact_config(
            None,
            quant.get("model", {}),
            source_format=description["format"],
            layers=layers,
            weight_file=weight_file,
            source_quant_config=quant,
        )
        folder = source.path.parent
    extras: dict[str, bytes | Path] = {CONFIG_NAME: json.dumps(cfg, indent=2, sort_keys=False).encode("utf-8") + b"\n"}
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            extras[name] = folder / name
    return extras

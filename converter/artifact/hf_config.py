"""The extra files of folder mode: ``config.json`` describing the artifact, and the
source's tokenizer files (``marlin-convert IN OUT/``).

The config is the source's ``config.json`` with ``quantization_config`` replaced by a
description of the artifact (for a ``.tinyloop`` source, which has none, a minimal one
built from the header's ``model`` object).  Both are standard JSON (no NaN or
Infinity), and every one of these files is checksummed in the manifest
(``checksums.files``, schema v2), so ``marlin-verify`` covers them too.  Tokenizer
files are taken from the source's folder only when they are regular files inside it
(a link that leaves the folder is refused, never copied).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

from .. import __version__
from ..constants import ARTIFACT_SCHEMA_VERSION, HF_WEIGHTS_GUARD, HF_WEIGHTS_KEY, PRODUCER_NAME, Suffix
from ..errors import ConfigError
from ..formats.base import Source
from ..formats.hf import HFSource
from ..formats.hf_checkpoint import TOKENIZER_FILES, folder_member, read_member_bytes
from ..jsonio import non_finite_path
from .schema import FileChecksum, LayerEntry
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
    config built from the header's ``model`` dict.  ``transformers_weights`` holds
    :data:`~converter.constants.HF_WEIGHTS_GUARD`: transformers refuses it as a weight
    file name, so a ``from_pretrained`` without ``import converter`` stops with that
    text instead of loading the quantized layers as random weights (docs/serving.md).
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
    cfg[HF_WEIGHTS_KEY] = HF_WEIGHTS_GUARD
    return cfg


def copied_files(source: Source) -> dict[str, Path]:
    """The source's tokenizer (and generation-config) files that folder mode copies:
    ``{name: path}``, from an HF checkpoint's folder; none for a ``.tinyloop`` file,
    whose neighbours are not part of it.

    Raises:
        SourceFormatError: one is a link that leaves the folder, or not a regular file
            (:func:`~converter.formats.hf_checkpoint.folder_member`).
    """
    if not isinstance(source, HFSource):
        # A single-file format (.tinyloop) carries no tokenizer: the files beside it
        # belong to whatever else lives in that folder, not to this model.
        return {}
    folder = source.ckpt.folder
    return {name: p for name in TOKENIZER_FILES if (p := folder_member(folder, name)) is not None}


def folder_extras(
    source: Source, description: Mapping[str, Any], layers: list[LayerEntry], weight_file: str
) -> dict[str, bytes]:
    """The extra files of folder mode: ``config.json`` and the source's tokenizer files.

    Args:
        source: the opened source; an HF reader's checkpoint has a ``config.json`` and
            tokenizer files in its folder, a ``.tinyloop`` source has neither.
        description: ``source.describe()`` (its ``quant_config``; for ``.tinyloop``
            ``{"model": {...}}``).
        layers: the manifest's layer records.
        weight_file: the artifact's file name or index name, recorded in the config.

    Returns:
        ``{file name: bytes to write}``; the tokenizer files are read now, so what is
        checksummed in the manifest is what is written.

    Raises:
        ConfigError: the source's ``config.json`` holds NaN or an infinity, which the
            written ``config.json`` (standard JSON) cannot (naming the field).
        SourceFormatError: a tokenizer file is a link out of the folder, not a regular
            file, or too large (:func:`copied_files`).
    """
    quant = description.get("quant_config", {}) or {}
    if isinstance(source, HFSource):
        ckpt = source.ckpt
        source_config = ckpt.config or {"model_type": "unknown"}
        # Its quantization_config is replaced by ours below.
        where = non_finite_path({k: v for k, v in source_config.items() if k != "quantization_config"})
        if where is not None:
            raise ConfigError(
                f"field {where} is NaN or infinite, which standard JSON cannot hold; the config.json written "
                "beside the artifact must be standard JSON: fix the value",
                path=ckpt.folder / CONFIG_NAME,
            )
        cfg = artifact_config(
            source_config,
            None,
            source_format=description["format"],
            layers=layers,
            weight_file=weight_file,
            source_quant_config=quant,
        )
    else:
        cfg = artifact_config(
            None,
            quant.get("model", {}),
            source_format=description["format"],
            layers=layers,
            weight_file=weight_file,
            source_quant_config=quant,
        )
    text = json.dumps(cfg, indent=2, sort_keys=False, allow_nan=False).encode("utf-8") + b"\n"
    extras: dict[str, bytes] = {CONFIG_NAME: text}
    for name, path in copied_files(source).items():
        extras[name] = read_member_bytes(path)
    return extras


def file_checksums(extras: Mapping[str, bytes]) -> tuple[FileChecksum, ...]:
    """The manifest's ``checksums.files`` for folder mode's extra files (schema v2)."""
    return tuple(FileChecksum(name, len(data), xxhash.xxh3_128_hexdigest(data)) for name, data in extras.items())

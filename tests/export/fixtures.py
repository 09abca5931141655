"""Synthetic GPTQ v2 checkpoints the export tests convert (two layers and an embedding)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.helpers.producers import gptq_config, gptq_tensors, make_layer, write_checkpoint

#: ``{layer: (K, N)}`` of every synthetic checkpoint.
SIZES = {"model.layers.0.mlp.up_proj": (256, 128), "model.layers.0.mlp.down_proj": (128, 192)}


def synthetic(folder: Path, *, bits: int, group_size: int, act_order: bool = False, scale_dtype: str = "F16") -> Path:
    """A GPTQ v2 checkpoint of :data:`SIZES` at ``bits`` and ``group_size`` (-1: per
    channel), act-order or not, scales in ``scale_dtype``; seeded by its arguments."""
    rng = np.random.default_rng(bits * 100 + group_size + act_order)
    layers = {
        n: make_layer(rng, k, nn, bits=bits, group_size=group_size, act_order=act_order, scale_dtype=scale_dtype)
        for n, (k, nn) in SIZES.items()
    }
    tensors = {t: a for n, lay in layers.items() for t, a in gptq_tensors(n, lay, v1=False).items()}
    tensors["model.embed_tokens.weight"] = rng.standard_normal((32, 16)).astype(np.float16)
    cfg = gptq_config(bits, group_size, fmt="gptq_v2", desc_act=act_order)
    return write_checkpoint(folder, tensors, cfg, where="quantize_config.json", scale_dtype=scale_dtype)

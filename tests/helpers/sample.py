"""The bundled sample ``tests/data/sample.tinyloop``, built deterministically (fixed seed).

A tiny looped transformer (d_model 128, d_ffn 512, vocabulary 1000): 2 pre blocks
and 1 loop block with 5 linears each, built to exercise every path of the reader
and the converter:

* grouped layers (G = 32, 64, 128) and per-row layers (G == K);
* one INT2 layer (``pre.1.attn_qkv``) and one symmetric 4-bit layer (``loop.0.attn_out``);
* one ``exact_int4`` layer (``pre.1.attn_out``), which never converts;
* ``frac4`` and ``sign_bit`` channels on ``pre.0.mlp_up``;
* a quantized ``head`` with 1000 outputs (not a multiple of 64): passes through;
* plain tensors: ``embed`` (bf16), ``pre.{i}.norm1``/``norm2``, ``loop.0.norm1``/``norm2``
  (f16) and ``final_norm`` (f32).

Regenerate it with ``python scripts/make_sample.py``; two runs give identical bytes
(a test checks that the committed file is what this module builds).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from converter.formats.tinyloop_writer import quantize_linear_tinyloop, write_tinyloop

SEED = 20261130
D_MODEL, D_FFN, VOCAB = 128, 512, 1000
MODEL = {
    "d_model": D_MODEL,
    "d_ffn": D_FFN,
    "n_heads": 4,
    "n_pre": 2,
    "n_loop": 1,
    "loop_iters": 8,
    "vocab_size": VOCAB,
}
#: linear -> (K, N); K = in_features, N = out_features.
SHAPES = {
    "attn_qkv": (D_MODEL, 3 * D_MODEL),
    "attn_out": (D_MODEL, D_MODEL),
    "mlp_gate": (D_MODEL, D_FFN),
    "mlp_up": (D_MODEL, D_FFN),
    "mlp_down": (D_FFN, D_MODEL),
}
#: (block, linear) -> options; group_size None means per-row (G == K).
LAYERS: dict[tuple[str, str], dict[str, Any]] = {
    ("pre.0", "attn_qkv"): {"group_size": 64, "bias": True},
    ("pre.0", "attn_out"): {"group_size": None},
    ("pre.0", "mlp_gate"): {"group_size": 32},
    ("pre.0", "mlp_up"): {"group_size": 64, "channels": ("frac4", "sign_bit")},
    ("pre.0", "mlp_down"): {"group_size": 128},
    ("pre.1", "attn_qkv"): {"group_size": 64, "bits": 2, "bias": True},
    ("pre.1", "attn_out"): {"group_size": 64, "exact_int4": True},
    ("pre.1", "mlp_gate"): {"group_size": None},
    ("pre.1", "mlp_up"): {"group_size": 128},
    ("pre.1", "mlp_down"): {"group_size": None},
    ("loop.0", "attn_qkv"): {"group_size": 128, "bias": True},
    ("loop.0", "attn_out"): {"group_size": 64, "symmetric": True},
    ("loop.0", "mlp_gate"): {"group_size": 64},
    ("loop.0", "mlp_up"): {"group_size": 64},
    ("loop.0", "mlp_down"): {"group_size": 64},
}


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 raw bits (round to nearest even), as uint16."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def build_sample(out: Path) -> Path:
    """Write the sample to ``out`` (atomically, validated by the reader) and return it."""
    rng = np.random.default_rng(SEED)
    tensors: dict[str, Any] = {"embed": ("bf16", _bf16_bits(rng.standard_normal((VOCAB, D_MODEL)) * 0.02))}
    linears: dict[str, Any] = {}
    for block in ("pre.0", "pre.1", "loop.0"):
        tensors[f"{block}.norm1"] = (1 + 0.05 * rng.standard_normal(D_MODEL)).astype(np.float16)
        tensors[f"{block}.norm2"] = (1 + 0.05 * rng.standard_normal(D_MODEL)).astype(np.float16)
        for lin, (k, n) in SHAPES.items():
            opts = dict(LAYERS[(block, lin)])
            group = opts.pop("group_size") or k
            bias = 0.01 * rng.standard_normal(n) if opts.pop("bias", False) else None
            w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
            t, entry = quantize_linear_tinyloop(f"{block}.{lin}", w, opts.pop("bits", 4), group, rng, bias=bias, **opts)
            tensors.update(t)
            linears[f"{block}.{lin}"] = entry
    tensors["final_norm"] = (1 + 0.05 * rng.standard_normal(D_MODEL)).astype(np.float32)
    w_head = (rng.standard_normal((D_MODEL, VOCAB)) / np.sqrt(D_MODEL)).astype(np.float32)
    t, entry = quantize_linear_tinyloop("head", w_head, 4, D_MODEL, rng)
    tensors.update(t)
    linears["head"] = entry
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_tinyloop(out, MODEL, tensors, linears)


#: GPT-2's vocabulary, TinyLoop's head width: no 64-column block divides it.
GPT2_VOCAB = 50257


def build_vocab_head(out: Path, *, vocab: int = GPT2_VOCAB, d_model: int = 64, seed: int = 15) -> Path:
    """A small ``.tinyloop`` model whose quantized ``head`` has ``vocab`` outputs.

    ``blk.0.mlp`` (64 -> 128, group 32, converts as it is), ``head`` (64 -> ``vocab``,
    group 32, with a bias; converts padded to the next multiple of 64), a bf16 embedding.
    """
    rng = np.random.default_rng(seed)
    tensors: dict[str, Any] = {"embed": ("bf16", _bf16_bits(rng.standard_normal((vocab, d_model)) * 0.02))}
    linears: dict[str, Any] = {}
    for name, n, bias in (("blk.0.mlp", 128, False), ("head", vocab, True)):
        w = (rng.standard_normal((d_model, n)) / np.sqrt(d_model)).astype(np.float32)
        b = 0.01 * rng.standard_normal(n) if bias else None
        t, entry = quantize_linear_tinyloop(name, w, 4, 32, rng, bias=b)
        tensors.update(t)
        linears[name] = entry
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_tinyloop(out, {"d_model": d_model, "vocab_size": vocab}, tensors, linears)

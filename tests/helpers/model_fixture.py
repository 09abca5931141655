"""A tiny GPTQ Llama written in tmp_path, for the whole-model tests that need no ../shared.

Every path of ``load_model`` in one model: hidden 128, intermediate 80, 4 heads (2 kv),
vocab 200, one layer, group size 16, real biases on q/k/v/o (``attention_bias``),
untied quantized ``lm_head``:

* q_proj (act-order), k_proj, v_proj, o_proj: convert, and our kernel runs them;
* down_proj (K = 80): converts, but K % 64 != 0 is outside the kernel (exact fallback on the GPU);
* gate_proj, up_proj (N = 80) and lm_head (N = 200): N % 64 != 0; converted with
  ``pad=False`` (``--no-pad``) they pass through unconverted and run dequantized in fp16
  (with the default ``--pad`` they convert padded: :func:`write_ragged_llama` covers that).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .producers import gptq_config, gptq_tensors, make_layer, save_safetensors

HIDDEN, INTER, VOCAB, HEADS, KV_HEADS = 128, 80, 200, 4, 2
HEAD_DIM = HIDDEN // HEADS
P = "model.layers.0"
#: name -> (K, N, act_order, bias)
LAYERS = {
    f"{P}.self_attn.q_proj": (HIDDEN, HIDDEN, True, True),
    f"{P}.self_attn.k_proj": (HIDDEN, KV_HEADS * HEAD_DIM, False, True),
    f"{P}.self_attn.v_proj": (HIDDEN, KV_HEADS * HEAD_DIM, False, True),
    f"{P}.self_attn.o_proj": (HIDDEN, HIDDEN, False, True),
    f"{P}.mlp.gate_proj": (HIDDEN, INTER, False, False),
    f"{P}.mlp.up_proj": (HIDDEN, INTER, False, False),
    f"{P}.mlp.down_proj": (INTER, HIDDEN, False, False),
    "lm_head": (HIDDEN, VOCAB, False, False),
}
KERNEL_LAYERS = [f"{P}.self_attn.{n}_proj" for n in "qkvo"]
FALLBACK_LAYERS = [f"{P}.mlp.down_proj"]
DEQUANT_LAYERS = [f"{P}.mlp.gate_proj", f"{P}.mlp.up_proj", "lm_head"]

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": INTER,
    "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "num_hidden_layers": 1,
    "vocab_size": VOCAB, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "attention_bias": True, "mlp_bias": False, "tie_word_embeddings": False, "dtype": "float16",
    "bos_token_id": 0, "eos_token_id": 1, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}  # fmt: skip


def write_tiny_llama(folder: Path, seed: int = 0) -> Path:
    """Write the checkpoint (``model.safetensors`` + ``config.json``) into ``folder``."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for name, (k, n, act_order, bias) in LAYERS.items():
        layer = make_layer(rng, k, n, group_size=16, act_order=act_order, bias=bias)
        if layer.bias is not None:
            layer.bias = (layer.bias * np.float16(0.25)).astype(np.float16)
        tensors.update(gptq_tensors(name, layer, v1=True))
    tensors["model.embed_tokens.weight"] = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float16)
    for norm in (f"{P}.input_layernorm", f"{P}.post_attention_layernorm", "model.norm"):
        tensors[f"{norm}.weight"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float16)
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors(folder / "model.safetensors", tensors)
    cfg = dict(CONFIG, quantization_config=gptq_config(4, 16, sym=False, lm_head=True))
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder


#: The regrouped-and-padded Llama (issue 15): hidden 192 and intermediate 320 at group
#: 128 end in a short group (regrouped at 64); k/v (one kv head of 32: N = 32) and the
#: quantized lm_head (vocab 200) convert padded.  Every layer converts, and every one
#: is inside the kernel's limits (K % 64 == 0).
RAGGED_HIDDEN, RAGGED_INTER, RAGGED_HEADS, RAGGED_HEAD_DIM = 192, 320, 6, 32
#: name -> (K, N, act_order, bias)
RAGGED_LAYERS = {
    f"{P}.self_attn.q_proj": (RAGGED_HIDDEN, RAGGED_HIDDEN, True, True),
    f"{P}.self_attn.k_proj": (RAGGED_HIDDEN, RAGGED_HEAD_DIM, False, True),
    f"{P}.self_attn.v_proj": (RAGGED_HIDDEN, RAGGED_HEAD_DIM, False, True),
    f"{P}.self_attn.o_proj": (RAGGED_HIDDEN, RAGGED_HIDDEN, True, True),
    f"{P}.mlp.gate_proj": (RAGGED_HIDDEN, RAGGED_INTER, False, False),
    f"{P}.mlp.up_proj": (RAGGED_HIDDEN, RAGGED_INTER, False, False),
    f"{P}.mlp.down_proj": (RAGGED_INTER, RAGGED_HIDDEN, True, False),
    "lm_head": (RAGGED_HIDDEN, VOCAB, False, False),
}
RAGGED_PADDED = {f"{P}.self_attn.k_proj": 64, f"{P}.self_attn.v_proj": 64, "lm_head": 256}
RAGGED_CONFIG = dict(
    CONFIG,
    hidden_size=RAGGED_HIDDEN,
    intermediate_size=RAGGED_INTER,
    num_attention_heads=RAGGED_HEADS,
    num_key_value_heads=1,
    head_dim=RAGGED_HEAD_DIM,
)


def write_ragged_llama(folder: Path, seed: int = 0) -> Path:
    """Write the regrouped-and-padded GPTQ Llama (``model.safetensors`` + ``config.json``)."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for name, (k, n, act_order, bias) in RAGGED_LAYERS.items():
        layer = make_layer(rng, k, n, group_size=128, act_order=act_order, bias=bias)
        if layer.bias is not None:
            layer.bias = (layer.bias * np.float16(0.25)).astype(np.float16)
        tensors.update(gptq_tensors(name, layer, v1=True))
    tensors["model.embed_tokens.weight"] = rng.standard_normal((VOCAB, RAGGED_HIDDEN)).astype(np.float16)
    for norm in (f"{P}.input_layernorm", f"{P}.post_attention_layernorm", "model.norm"):
        tensors[f"{norm}.weight"] = (1 + 0.1 * rng.standard_normal(RAGGED_HIDDEN)).astype(np.float16)
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors(folder / "model.safetensors", tensors)
    cfg = dict(RAGGED_CONFIG, quantization_config=gptq_config(4, 128, sym=False, lm_head=True, desc_act=True))
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder

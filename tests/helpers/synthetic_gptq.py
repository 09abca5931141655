"""Deterministic synthetic GPTQ checkpoints (sharded safetensors), written in bounded memory.

Llama-like blocks: q/k/v/o, gate/up/down (hidden -> kv-wide k/v), plus fp16
embeddings, lm_head and norms; random codes and v1 zeros, scales in [1e-3, 2e-2].
Every tensor is seeded from its name, so the bytes depend only on the arguments, and
tensors are generated and written in chunks of a few tens of MB, so a 2 GB checkpoint
needs no 2 GB of memory.  Used by the tests (:func:`small_gptq`), the fuzzer's seeds
and ``scripts/make_big_gptq.py`` (the scale tests and the CPU benchmark).
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

from tests.helpers.producers import gptq_config

DTYPES = {"I32": np.dtype("<i4"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "U8": np.dtype("u1")}
CHUNK_BYTES = 32 << 20

#: A tensor to write: name, dtype code, shape, and a function yielding its bytes in
#: row-major chunks (each an ndarray of the storage dtype).
TensorSpec = tuple[str, str, tuple[int, ...], Callable[[], Iterator[np.ndarray]]]


def _rng(name: str, seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _rows_per_chunk(shape: tuple[int, ...], itemsize: int) -> int:
    row = itemsize * math.prod(shape[1:]) if len(shape) > 1 else itemsize
    return max(1, CHUNK_BYTES // max(row, 1))


def _random_words(name: str, shape: tuple[int, ...], seed: int) -> Callable[[], Iterator[np.ndarray]]:
    def gen() -> Iterator[np.ndarray]:
        rng = _rng(name, seed)
        step = _rows_per_chunk(shape, 4)
        for r in range(0, shape[0], step):
            rows = min(step, shape[0] - r)
            yield np.frombuffer(rng.bytes(rows * math.prod(shape[1:]) * 4), dtype="<i4")

    return gen


def _zeros_words(name: str, shape: tuple[int, ...], seed: int) -> Callable[[], Iterator[np.ndarray]]:
    def gen() -> Iterator[np.ndarray]:
        rng = _rng(name, seed)
        # stored v1 nibbles in 0..14: true zero points 1..15, no borrows.
        nib = rng.integers(0, 15, size=(shape[0], shape[1], 8), dtype=np.uint32)
        words = np.bitwise_or.reduce(nib << (np.arange(8, dtype=np.uint32) * 4), axis=2)
        yield words.view("<i4")

    return gen


def _f16(name: str, shape: tuple[int, ...], seed: int, lo: float, hi: float) -> Callable[[], Iterator[np.ndarray]]:
    def gen() -> Iterator[np.ndarray]:
        rng = _rng(name, seed)
        step = _rows_per_chunk(shape, 2)
        for r in range(0, shape[0], step):
            rows = min(step, shape[0] - r)
            yield rng.uniform(lo, hi, size=(rows, *shape[1:])).astype("<f2")

    return gen


def _g_idx(size_k: int, g: int) -> Callable[[], Iterator[np.ndarray]]:
    def gen() -> Iterator[np.ndarray]:
        yield (np.arange(size_k, dtype=np.int32) // g).astype("<i4")

    return gen


#: The scales' uniform range: the default keeps every existing test's bytes.
SCALE_RANGE = (1e-3, 2e-2)
#: Scales 10x smaller: at hidden 4096 / intermediate 14336 the residual stream grows about
#: 60 a block (measured on the CPU in fp16 through load_model: max |h| 2.2e3 after 32
#: blocks, logits finite), far inside fp16's 65504.
FINITE_SCALE_RANGE = (1e-4, 2e-3)


def gptq_layer(
    prefix: str,
    size_k: int,
    size_n: int,
    *,
    group_size: int = 128,
    seed: int = 0,
    bias: bool = False,
    scale_range: tuple[float, float] = SCALE_RANGE,
) -> list[TensorSpec]:
    """The tensors of one 4-bit GPTQ linear (qweight, qzeros, scales, g_idx, optional bias).

    ``size_k % group_size != 0`` gives GPTQModel's short last group: ``ceil(K / g)``
    scale and zero rows, ``g_idx = k // g``."""
    g = size_k if group_size == -1 else group_size
    groups = -(-size_k // g)
    out: list[TensorSpec] = [
        (
            f"{prefix}.qweight",
            "I32",
            (size_k // 8, size_n),
            _random_words(f"{prefix}.qweight", (size_k // 8, size_n), seed),
        ),
        (
            f"{prefix}.qzeros",
            "I32",
            (groups, size_n // 8),
            _zeros_words(f"{prefix}.qzeros", (groups, size_n // 8), seed),
        ),
        (f"{prefix}.scales", "F16", (groups, size_n), _f16(f"{prefix}.scales", (groups, size_n), seed, *scale_range)),
        (f"{prefix}.g_idx", "I32", (size_k,), _g_idx(size_k, g)),
    ]
    if bias:
        out.append((f"{prefix}.bias", "F16", (size_n,), _f16(f"{prefix}.bias", (size_n,), seed, -0.1, 0.1)))
    return out


def model_tensors(
    *,
    hidden: int,
    intermediate: int,
    kv: int,
    blocks: int,
    vocab: int,
    group_size: int,
    seed: int,
    bias: bool = False,
    scale_range: tuple[float, float] = SCALE_RANGE,
) -> list[TensorSpec]:
    """Every tensor of a Llama-like GPTQ model, in a stable order."""
    specs: list[TensorSpec] = [
        (
            "model.embed_tokens.weight",
            "F16",
            (vocab, hidden),
            _f16("model.embed_tokens.weight", (vocab, hidden), seed, -0.05, 0.05),
        )
    ]
    for i in range(blocks):
        p = f"model.layers.{i}"
        for name, k, n in (
            ("self_attn.q_proj", hidden, hidden),
            ("self_attn.k_proj", hidden, kv),
            ("self_attn.v_proj", hidden, kv),
            ("self_attn.o_proj", hidden, hidden),
            ("mlp.gate_proj", hidden, intermediate),
            ("mlp.up_proj", hidden, intermediate),
            ("mlp.down_proj", intermediate, hidden),
        ):
            specs += gptq_layer(
                f"{p}.{name}", k, n, group_size=group_size, seed=seed, bias=bias, scale_range=scale_range
            )
        for norm in ("input_layernorm", "post_attention_layernorm"):
            specs.append(
                (f"{p}.{norm}.weight", "F16", (hidden,), _f16(f"{p}.{norm}.weight", (hidden,), seed, 0.9, 1.1))
            )
    specs.append(("model.norm.weight", "F16", (hidden,), _f16("model.norm.weight", (hidden,), seed, 0.9, 1.1)))
    if vocab:
        specs.append(
            ("lm_head.weight", "F16", (vocab, hidden), _f16("lm_head.weight", (vocab, hidden), seed, -0.05, 0.05))
        )
    return specs


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPES[dtype].itemsize


def write_safetensors(path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> int:
    """Write one safetensors file from tensor specs, streaming each tensor's chunks.

    Returns:
        The file size in bytes.
    """
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    off = 0
    for name, dtype, shape, _ in specs:
        n = nbytes_of(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        for name, dtype, shape, gen in specs:
            written = 0
            for chunk in gen():
                chunk = np.ascontiguousarray(chunk, dtype=DTYPES[dtype])
                fh.write(memoryview(chunk.view(np.uint8).reshape(-1)))
                written += chunk.nbytes
            if written != nbytes_of(dtype, shape):
                raise AssertionError(f"{name}: wrote {written} bytes, expected {nbytes_of(dtype, shape)}")
    return 8 + len(raw) + off


def write_gptq(
    folder: str | Path,
    *,
    hidden: int = 4096,
    intermediate: int = 14336,
    kv: int = 1024,
    blocks: int = 14,
    vocab: int = 32000,
    shards: int = 4,
    group_size: int = 128,
    seed: int = 0,
    bias: bool = False,
    config_extra: Mapping[str, object] | None = None,
    scale_range: tuple[float, float] = SCALE_RANGE,
) -> dict[str, object]:
    """Write a synthetic sharded GPTQ checkpoint into ``folder`` (created if needed).

    ``scale_range``: the scales' uniform range. The default's weights grow the residual
    stream about 100x a block at Llama-3-8B widths (fp16 overflows from the second block);
    ``FINITE_SCALE_RANGE`` keeps 32 such blocks finite in fp16 (a model that runs, for
    end-to-end benchmarks).

    ``config_extra`` adds keys to ``config.json`` (e.g. :func:`llama_attention_config`'s,
    so that transformers builds the intended attention); it cannot replace the shape keys
    or ``quantization_config`` written from the other arguments.

    Returns:
        ``{"files": [...], "bytes": total weight bytes, "largest_tensor": (name, bytes), "tensors": count}``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specs = model_tensors(
        hidden=hidden,
        intermediate=intermediate,
        kv=kv,
        blocks=blocks,
        vocab=vocab,
        group_size=group_size,
        seed=seed,
        bias=bias,
        scale_range=scale_range,
    )
    total = sum(nbytes_of(d, s) for _, d, s, _ in specs)
    per_shard = total / max(shards, 1)
    groups: list[list[TensorSpec]] = [[]]
    acc = 0
    for spec in specs:
        if acc >= per_shard * len(groups) and len(groups) < shards:
            groups.append([])
        groups[-1].append(spec)
        acc += nbytes_of(spec[1], spec[2])
    n = len(groups)
    files, weight_map, size = [], {}, 0
    for i, group in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        size += write_safetensors(folder / name, group)
        files.append(name)
        weight_map.update({t[0]: name for t in group})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    (folder / "quantize_config.json").write_text(json.dumps(gptq_config(4, group_size), indent=1))
    config: dict[str, object] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": blocks,
        "vocab_size": vocab,
        "quantization_config": gptq_config(4, group_size),
    }
    clash = sorted(k for k in (config_extra or {}) if k in config)
    if clash:
        raise ValueError(f"config_extra cannot replace {', '.join(clash)}: pass them as write_gptq's arguments")
    config.update(config_extra or {})
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    largest = max(specs, key=lambda s: nbytes_of(s[1], s[2]))
    return {
        "files": files,
        "bytes": size,
        "largest_tensor": (largest[0], nbytes_of(largest[1], largest[2])),
        "tensors": len(specs),
    }


def llama_attention_config(
    hidden: int,
    kv: int,
    *,
    head_dim: int = 128,
    max_position_embeddings: int = 8192,
    rope_theta: float = 500000.0,
    rms_norm_eps: float = 1e-5,
) -> dict[str, object]:
    """The ``config.json`` keys a Llama needs beyond :func:`write_gptq`'s shapes (Llama-3 style:
    ``hidden // head_dim`` query heads, ``kv // head_dim`` key-value heads, untied fp16 head)."""
    if hidden % head_dim or kv % head_dim:
        raise ValueError(f"hidden {hidden} and kv {kv} must be multiples of head_dim {head_dim}")
    return {
        "num_attention_heads": hidden // head_dim,
        "num_key_value_heads": kv // head_dim,
        "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": rms_norm_eps,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "dtype": "float16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "use_cache": True,
    }


def small_gptq(folder: Path, *, shards: int = 1, **kw: object) -> Path:
    """A tiny deterministic 4-bit GPTQ checkpoint: 1 block, hidden 128, group 64 (``kw`` overrides)."""
    args: dict[str, object] = dict(
        hidden=128, intermediate=256, kv=64, blocks=1, vocab=64, shards=shards, group_size=64
    )
    args.update(kw)
    write_gptq(folder, **args)  # type: ignore[arg-type]
    return folder


def largest_tensor(files: Iterable[Path]) -> tuple[str, int]:
    """``(name, bytes)`` of the largest tensor in ``files`` (the memory bound's unit)."""
    from converter.safetensors_io import SafetensorsFile

    best = ("", 0)
    for f in files:
        with SafetensorsFile(f) as sf:
            for name in sf.infos:
                b, e = sf.byte_range(name)
                if e - b > best[1]:
                    best = (name, e - b)
    return best


def largest_tensor_bytes(folder: Path) -> int:
    """Bytes of the largest tensor in a folder's ``*.safetensors`` files."""
    return largest_tensor(sorted(folder.glob("*.safetensors")))[1]


def write_gptq_layers(
    folder: str | Path, layers: list[tuple[str, int, int]], *, group_size: int = 128, seed: int = 0
) -> Path:
    """A one-file 4-bit GPTQ checkpoint holding just ``layers`` (``[(prefix, K, N)]``) and
    one fp16 norm, with its configs: for scale tests of single large layers."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specs: list[TensorSpec] = []
    for prefix, size_k, size_n in layers:
        specs += gptq_layer(prefix, size_k, size_n, group_size=group_size, seed=seed)
    width = max(k for _, k, _ in layers)
    specs.append(("model.norm.weight", "F16", (width,), _f16("model.norm.weight", (width,), seed, 0.9, 1.1)))
    write_safetensors(folder / "model.safetensors", specs)
    (folder / "quantize_config.json").write_text(json.dumps(gptq_config(4, group_size), indent=1))
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    return folder

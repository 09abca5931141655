"""The ``sdpa_kv_heads`` attention (converter.model.attention): a decode step's query heads
folded onto their key/value heads, eagerly and under torch.compile, against transformers'
eager attention in fp32."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from converter.model import attention  # noqa: E402

HEADS, KV, DIM = 8, 2, 32


def _models():
    from transformers import AutoModelForCausalLM, LlamaConfig

    attention.register()
    cfg = LlamaConfig(
        hidden_size=HEADS * DIM, intermediate_size=512, num_hidden_layers=2, num_attention_heads=HEADS,
        num_key_value_heads=KV, vocab_size=500, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    made = {}
    for impl in ("eager", "sdpa", attention.NAME):
        m = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=torch.float32).eval()
        if made:
            m.load_state_dict(next(iter(made.values())).state_dict())
        made[impl] = m
    return cfg, made


def _greedy(model, cfg, ids, steps: int, step_fn=None):
    """Prefill ``ids`` into a static cache, then ``steps`` greedy decode steps; the last
    position's logits of each forward."""
    from transformers import StaticCache

    cache = StaticCache(config=cfg, max_cache_len=ids.shape[1] + steps + 3)
    fwd = model if step_fn is None else step_fn
    out = model(ids, past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    for i in range(steps):
        nxt = logits[-1].argmax(-1, keepdim=True)
        pos = torch.tensor([ids.shape[1] + i])
        logits.append(fwd(nxt, past_key_values=cache, use_cache=True, cache_position=pos).logits[:, -1])
    return torch.stack(logits)


def test_decode_matches_eager_attention_fp32():
    cfg, models = _models()
    ids = torch.randint(0, cfg.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = _greedy(models["eager"], cfg, ids, 6)
        ours = _greedy(models[attention.NAME], cfg, ids, 6)
    assert ours.shape == (7, 3, cfg.vocab_size)
    assert (ours - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_decode_folds_query_heads_and_never_repeats_the_cache(monkeypatch):
    """The SDPA call of a decode step gets the query as (b, kv, n_rep, d) and the cache's
    key and value as they are (kv heads); a prompt goes to transformers' sdpa."""
    cfg, models = _models()
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *a, **kw):
        seen.append((tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    ids = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _greedy(models[attention.NAME], cfg, ids, 1)
    prompt, decode = seen[0], seen[-1]
    assert prompt[0] == (2, HEADS, 5, DIM)
    length = 5 + 1 + 3
    assert decode == ((2, KV, HEADS // KV, DIM), (2, KV, length, DIM), (2, KV, length, DIM))


def test_compiled_decode_step_folds_and_matches():
    """Under torch.compile (where transformers' sdpa repeats the cache) the traced SDPA node
    still takes the folded query and the unrepeated cache, and the logits match eager's."""
    cfg, models = _models()
    model = models[attention.NAME]
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(model, fullgraph=True, backend=backend)
    ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = _greedy(models["eager"], cfg, ids, 3)
        got = _greedy(model, cfg, ids, 3, step_fn=compiled)
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    sdpa = [
        n
        for gm in graphs
        for n in gm.graph.nodes
        if n.op == "call_function" and n.target is torch._C._nn.scaled_dot_product_attention
    ]
    assert len(sdpa) == cfg.num_hidden_layers
    for n in sdpa:
        q, k = (a.meta["example_value"].shape for a in n.args[:2])
        assert tuple(q) == (2, KV, HEADS // KV, DIM)
        assert tuple(k)[:2] == (2, KV)


def test_other_calls_go_to_transformers_sdpa(monkeypatch):
    """No grouping, a head-dependent mask, or a softcap: transformers' own sdpa runs."""
    from transformers.integrations import sdpa_attention

    calls = []
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", lambda *a, **k: calls.append(k) or ("sdpa", None))

    class Mod:
        num_key_value_groups = 4

    q = torch.zeros(1, 8, 1, 4)
    kv = torch.zeros(1, 2, 3, 4)
    head_mask = torch.ones(1, 8, 1, 3, dtype=torch.bool)
    assert attention.sdpa_kv_heads_forward(Mod(), q, kv, kv, head_mask)[0] == "sdpa"
    assert attention.sdpa_kv_heads_forward(Mod(), q, kv, kv, None, softcap=30.0)[0] == "sdpa"
    Mod.num_key_value_groups = 1
    mha = torch.zeros(1, 8, 3, 4)
    assert attention.sdpa_kv_heads_forward(Mod(), q, mha, mha, None)[0] == "sdpa"
    assert len(calls) == 3


def _eager_and_ours(cfg):
    """An eager and a sdpa_kv_heads model of ``cfg`` with the same random weights."""
    from transformers import AutoModelForCausalLM

    attention.register()
    torch.manual_seed(0)
    # from_config sets the implementation on the config it is given: one copy each
    eager, ours = (
        AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=impl, dtype=torch.float32).eval()
        for impl in ("eager", attention.NAME)
    )
    ours.load_state_dict(eager.state_dict())
    return eager, ours


def _generated_logits(model, ids, mask=None):
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=4, do_sample=False, output_logits=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    return torch.stack(out.logits)


@pytest.mark.parametrize(
    ("config", "extra"),
    [
        ("Gemma4TextConfig", {"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 128}),
        ("Gemma4UnifiedTextConfig", {}),
    ],
)
def test_gemma4_kv_shared_prompt_matches_eager_attention_fp32(config: str, extra: dict):
    """Before its KV-shared layers Gemma 4 cuts a prompt's queries down to the logits kept,
    unless the implementation is named "sdpa" and the mask was skipped (None): under ours the
    mask must not be skipped, or the cut queries see the static cache's empty slots (a
    dynamic cache's later keys)."""
    import transformers
    from transformers import DynamicCache, StaticCache

    if not hasattr(transformers, config):
        pytest.skip(f"no {config} in this transformers")
    cfg = getattr(transformers, config)(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=16, sliding_window=4, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=64, **extra,
    )  # fmt: skip
    eager, ours = _eager_and_ours(cfg)
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(1))
    caches = ((lambda: StaticCache(config=cfg, max_cache_len=16), 1), (lambda: DynamicCache(config=cfg), 3))
    for make, keep in caches:
        with torch.no_grad():
            ref = eager(ids, past_key_values=make(), logits_to_keep=keep).logits
            got = ours(ids, past_key_values=make(), logits_to_keep=keep).logits
        assert got.shape == (1, keep, cfg.vocab_size)
        assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_sparse_attention_indices_match_eager_attention_fp32():
    """DeepSeek V3.2 turns its indexer's top-k keys into the mask only under "eager" and
    "sdpa"; under ours it passes them as ``indices``, which must mask the other keys (top 3
    of up to 12 here)."""
    import transformers

    if not hasattr(transformers, "DeepseekV32Config"):
        pytest.skip("no DeepSeek V3.2 in this transformers")
    cfg = transformers.DeepseekV32Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, first_k_dense_replace=2, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, head_dim=8, index_topk=3, index_head_dim=16, index_n_heads=2,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    eager, ours = _eager_and_ours(cfg)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    ref = _generated_logits(eager, ids)
    assert (_generated_logits(ours, ids) - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("float_mask", [False, True])
def test_sparse_indices_fold_into_a_decode_steps_mask(float_mask: bool):
    """The folded decode path with ``indices``: only the chosen keys (and the mask's) count."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    class Mod(torch.nn.Module):
        num_key_value_groups = HEADS // KV

    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 1, HEADS, DIM, generator=g).transpose(1, 2)
    k, v = (torch.randn(3, KV, 10, DIM, generator=g) for _ in range(2))
    indices = torch.stack([torch.randperm(10, generator=g)[:4] for _ in range(3)])[:, None, :]
    allowed = torch.ones(3, 1, 1, 10, dtype=torch.bool)
    allowed[1, ..., :2] = False  # padding
    keep = allowed & torch.zeros(3, 1, 10, dtype=torch.bool).scatter(-1, indices, True).unsqueeze(1)
    neg = torch.finfo(torch.float32).min
    mask = torch.where(allowed, 0.0, neg) if float_mask else allowed
    got, _ = attention.sdpa_kv_heads_forward(Mod().eval(), q, k, v, mask, scaling=DIM**-0.5, indices=indices)
    ref, _ = eager_attention_forward(Mod().eval(), q, k, v, torch.where(keep, 0.0, neg), scaling=DIM**-0.5)
    assert got.shape == (3, 1, HEADS, DIM)
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_block_sparse_attention_matches_eager_attention_fp32():
    """MiniMax M3 builds its block-sparse mask only under "eager" and "sdpa"; under ours it
    passes ``block_indices`` (one of five 2-key blocks, plus the local one, here)."""
    pytest.importorskip("transformers.models.minimax_m3_vl")
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

    cfg = MiniMaxM3VLTextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, dense_intermediate_size=64, shared_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=16, rotary_dim=8,
        num_local_experts=4, num_experts_per_tok=2, index_n_heads=KV, index_head_dim=16, index_block_size=2,
        index_topk_blocks=1, index_local_blocks=1, layer_types=["minimax_m3_sparse"] * 2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    eager, ours = _eager_and_ours(cfg)
    ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(1))
    pad = torch.ones_like(ids)
    pad[1, :3] = 0
    ref = _generated_logits(eager, ids, pad)
    assert (_generated_logits(ours, ids, pad) - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()

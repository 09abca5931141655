"""The ``sdpa_kv_heads`` attention (converter.model.attention): a decode step's query heads
folded onto their key/value heads, eagerly and under torch.compile, against transformers'
eager attention in fp32."""

from __future__ import annotations

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

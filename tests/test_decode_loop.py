"""benchmarks/decode_loop.py on the CPU: its greedy loop on a static cache gives
``model.generate``'s tokens, eagerly and through the graph mode's warm-up and state
restore (emulated without CUDA); and the benchmark's pure arithmetic."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from benchmarks import bench_generate as bench  # noqa: E402
from benchmarks.decode_loop import EAGER, GRAPH, Decoder, greedy, make_runner  # noqa: E402

PROMPT, NEW = 7, 12


@pytest.fixture(scope="module")
def tiny() -> object:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        vocab_size=101,
        max_position_embeddings=64,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def _prompt(batch: int) -> torch.Tensor:
    return torch.randint(1, 101, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))


def _generate(model: object, prompt: torch.Tensor, **kw: object) -> torch.Tensor:
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            pad_token_id=0,
            **kw,
        )
    return out[:, PROMPT:]


@pytest.mark.parametrize("mode", [EAGER, GRAPH])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_loop_matches_generate(tiny: object, mode: str, batch: int) -> None:
    prompt = _prompt(batch)
    want = _generate(tiny, prompt)
    assert want.shape == (batch, NEW)
    seen: list[int] = []
    got = greedy(tiny, prompt, NEW, mode, on_step=lambda i, logits: seen.append(i))
    assert seen == list(range(NEW))
    assert torch.equal(got, want), (got, want)
    # the tokens vary: a loop stuck on one token would prove little
    assert len(set(got.flatten().tolist())) > 3


@pytest.mark.parametrize("mode", [EAGER, GRAPH])
def test_ban_repeats_is_no_repeat_ngram_1(tiny: object, mode: str) -> None:
    """``ban_repeats``: every token new to its row, as ``generate(no_repeat_ngram_size=1)``."""
    prompt = _prompt(3)
    got = greedy(tiny, prompt, NEW, mode, ban_repeats=True)
    assert torch.equal(got, _generate(tiny, prompt, no_repeat_ngram_size=1))
    for row, p in zip(got.tolist(), prompt.tolist(), strict=True):
        assert len(set(row)) == NEW and not set(row) & set(p)


def test_restore_replays_the_same_steps(tiny: object) -> None:
    """Two passes over the decode steps from one snapshot give the same tokens and logits."""
    prompt = _prompt(2)
    dec = Decoder(tiny, 2, PROMPT, NEW, "cpu")
    dec.prefill(prompt)
    snap = dec.snapshot()
    run = make_runner(dec, GRAPH, warmup=4)
    # the warm-up steps ran (and advanced the cache's own write position); all of it is back
    assert torch.equal(dec.pos, torch.full((2, 1), PROMPT)) and int(dec.n) == 1
    assert [int(layer.cumulative_length) for layer in dec.cache.layers] == [PROMPT, PROMPT]
    passes = []
    for _ in range(2):
        dec.restore(snap)
        logits = [run().clone() for _ in range(NEW - 1)]
        passes.append((dec.tokens.clone(), torch.stack(logits)))
    assert torch.equal(passes[0][0], passes[1][0]) and torch.equal(passes[0][1], passes[1][1])
    assert torch.equal(passes[0][0], _generate(tiny, prompt))


def test_kernel_classes() -> None:
    names = [
        "void marlin_decode<1, 8, 1, 4, true, false>(unsigned short const*, int4 const*)",
        "hopper_activations",
        "group_sums",
        "void cutlass::Kernel2<cutlass_80_tensorop_f16_s16816gemm_relu_f16_64x64_32x6_tn_align8>(Params)",
        "nvjet_hsh_128x64_64x4_1x2_h_bz_coopA_NTN",
        "sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1",
        "triton_tem_fused_mm_0",
        "fmha_cutlassF_f16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel)",
        "void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128>>(Flash_fwd_params)",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0",
        "Memset (Device)",
    ]
    got = [bench.kernel_class(n) for n in names]
    assert got == ["ours"] * 3 + ["gemm"] * 4 + ["attention"] * 2 + ["other"] * 2
    split = bench.split_profile([(n, 10.0) for n in names], steps=2, lm_head_ms=0.01, model="fp16")
    # per step: 4 GEMMs of 10 us = 0.02 ms, of which the lm_head's 0.01 ms counts outside
    assert split["linear_ms"] == pytest.approx(0.01) and split["outside_ms"] == pytest.approx(0.045)
    ours = bench.split_profile([(n, 10.0) for n in names], steps=2, lm_head_ms=0.01, model="ours")
    assert ours["linear_ms"] == pytest.approx(0.015) and ours["outside_ms"] == pytest.approx(0.04)


def test_linear_bytes_of_the_8b_shape() -> None:
    shapes = bench.linear_shapes(hidden=4096, intermediate=14336, kv=1024, blocks=32)
    assert len(shapes) == 224
    params = sum(k * n for k, n in shapes)
    assert params == 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    fp16 = bench.linear_bytes(shapes, batch=1, kind="fp16", group_size=128)
    ours = bench.linear_bytes(shapes, batch=1, kind="ours", group_size=128)
    acts = sum(2 * (k + n) for k, n in shapes)
    assert fp16 == 2 * params + acts
    # 4 bits a weight, plus an fp16 scale and an fp16 delta per 128 weights of a column
    assert ours == params // 2 + 2 * 2 * params // 128 + acts


def test_a_cuda_run_without_a_gpu_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch) -> None:
    """bench_generate on a CUDA device where torch sees none (a CPU build) says what it
    needs in one line before it writes any checkpoint (a raw assertion traceback before)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--device", "cuda", "--work", str(tmp_path / "work")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench_generate: --device cuda needs an NVIDIA GPU and a CUDA build of torch")
    assert len(err.splitlines()) == 1 and not (tmp_path / "work").exists()

"""The GEMM as a torch op (converter.gpu.torch_op): the same bits as the CuPy launcher,
captured in a CUDA graph and replayed, traced by torch.compile(fullgraph=True), and a
whole model's decode step captured and replayed."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

from tests.helpers.serving_layers import LAYERS, assert_replays_match_eager  # noqa: E402
from tests.helpers.serving_layers import make_layer as _layer  # noqa: E402

MS = (1, 5, 16, 33, 64, 130)


@pytest.fixture(scope="module")
def layers(cp):
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from converter.gpu.api import MarlinLinearModule

    made = [_layer(*spec, seed=i) for i, spec in enumerate(LAYERS)]
    return [(layer, MarlinLinearModule(layer)) for layer in made]


def _bits(t) -> np.ndarray:
    return t.detach().cpu().numpy().view(np.uint16)


def test_op_is_bitwise_the_cupy_launcher(cp, layers) -> None:
    rng = np.random.default_rng(0)
    for layer, mod in layers:
        for m in MS:
            a = rng.standard_normal((m, layer.size_k)).astype(np.float16)
            want = cp.asnumpy(layer(cp.asarray(a))).view(np.uint16)
            x = torch.from_numpy(a).cuda()
            assert np.array_equal(_bits(mod(x)), want), (layer.size_k, layer.size_n, m)
            y = torch.ops.marlin_convert.gemm(
                x, mod.b, mod.scales, mod.delta, mod.perm, mod.bias, mod.locks,
                mod.in_features, mod.size_n, mod.group_size, mod.out_features,
            )  # fmt: skip
            assert np.array_equal(_bits(y), want), ("op", layer.size_k, layer.size_n, m)


def test_op_follows_torchs_current_stream(cp, layers, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every launch goes to the stream torch has current, and gives the same bits there
    (the launch through run_gemm; test_fast_launch.py checks the packed launch's stream)."""
    from converter.gpu import kernels, torch_op

    monkeypatch.setenv(torch_op.FAST_LAUNCH_ENV, "0")

    layer, mod = layers[1]  # act-order: the gather launches too
    seen = []
    for name in ("emit_gemm", "emit_gather"):
        real = getattr(kernels, name)

        def spy(*args, _real=real, **kw):
            seen.append(args[-1].ptr)
            return _real(*args, **kw)

        monkeypatch.setattr(kernels, name, spy)
    x = torch.randn(3, layer.size_k, dtype=torch.float16, device="cuda")
    want = _bits(mod(x))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    seen.clear()
    with torch.cuda.stream(side):
        y = mod(x)
    torch.cuda.current_stream().wait_stream(side)
    assert seen and set(seen) == {side.cuda_stream}
    assert np.array_equal(_bits(y), want)


def test_graph_capture_and_replay(cp, layers) -> None:
    """A chain of every layer at several M, captured once: replays on new inputs give the
    eager bits."""
    assert_replays_match_eager([mod for _, mod in layers])


def test_compile_fullgraph_traces_the_op(cp, layers) -> None:
    _, q = layers[0]
    _, down = layers[3]

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.down = q, down

        def forward(self, x):
            # Only exact operations around the op (relu, a slice, a power of two): inductor
            # fuses and rounds elementwise chains its own way, the op must not differ.
            h = torch.relu(self.q(x))
            return self.down(h[..., : self.down.in_features] * 0.5)

    block = Block()
    compiled = torch.compile(block, fullgraph=True)
    for m in (1, 8):
        x = torch.randn(2, m, 4096, dtype=torch.float16, device="cuda")
        assert np.array_equal(_bits(compiled(x)), _bits(block(x))), m


def test_op_refuses_a_wrong_input(cp, layers) -> None:
    from converter.errors import KernelError

    _, mod = layers[0]
    with pytest.raises(KernelError, match="expected a float16 or bfloat16 CUDA tensor, got torch.float32"):
        mod(torch.randn(2, mod.in_features, dtype=torch.float32, device="cuda"))
    with pytest.raises(KernelError, match=r"expected a float16 or bfloat16 CUDA tensor \(M, 4096\)"):
        torch.ops.marlin_convert.gemm(
            torch.randn(2, 64, dtype=torch.float16, device="cuda"), mod.b, mod.scales, mod.delta, mod.perm,
            mod.bias, mod.locks, mod.in_features, mod.size_n, mod.group_size, mod.out_features,
        )  # fmt: skip


@pytest.mark.parametrize("which", ["tiny", "ragged"])
def test_model_decode_step_in_a_cuda_graph(cp, tmp_path, which: str) -> None:
    """A converted Llama's one-token decode step on a static cache, captured once: every
    replay gives the eager step's logits bitwise, so greedy tokens agree; and the same
    through torch.compile(fullgraph=True) then a graph (benchmarks/decode_loop.py). The
    ragged Llama's gate/up run fused (converter.model.fuse); the tiny one fuses nothing."""
    pytest.importorskip("transformers")
    from benchmarks.decode_loop import COMPILE, EAGER, GRAPH, greedy
    from converter import load_model
    from converter.convert import convert
    from tests.helpers.model_fixture import P, write_ragged_llama, write_tiny_llama

    src = (write_tiny_llama if which == "tiny" else write_ragged_llama)(tmp_path / "src")
    convert(src, str(tmp_path / "out") + "/")
    model = load_model(tmp_path / "out", "cuda")
    want_fused = {} if which == "tiny" else {f"{P}.mlp.gate_proj+up_proj": [f"{P}.mlp.gate_proj", f"{P}.mlp.up_proj"]}
    assert model.marlin_report.fused == want_fused
    prompt = torch.from_numpy(np.random.default_rng(5).integers(0, 200, (2, 9))).cuda()
    runs = {}
    for mode in (EAGER, GRAPH, COMPILE):
        logits = []
        keep = lambda i, lg, out=logits: out.append(lg.float().cpu().clone())  # noqa: E731
        toks = greedy(model, prompt, 8, mode, on_step=keep, compile_mode="default")
        runs[mode] = (toks.cpu(), logits)
    for mode in (GRAPH, COMPILE):
        assert torch.equal(runs[mode][0], runs[EAGER][0]), mode
    for a, b in zip(runs[GRAPH][1], runs[EAGER][1], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("which", ["tiny", "ragged"])
def test_kv_heads_attention_in_a_graph_and_compiled(cp, tmp_path, which: str) -> None:
    """``attn_implementation="sdpa_kv_heads"`` (converter.model.attention) on our kernels:
    graph replays give its eager step bitwise, compile gives its greedy tokens, and its
    logits follow the ``sdpa`` model's to fp16 rounding (GQA 4/2 and 6/1)."""
    pytest.importorskip("transformers")
    from benchmarks.decode_loop import COMPILE, EAGER, GRAPH, greedy
    from converter import load_model
    from converter.convert import convert
    from tests.helpers.model_fixture import write_ragged_llama, write_tiny_llama

    src = (write_tiny_llama if which == "tiny" else write_ragged_llama)(tmp_path / "src")
    convert(src, str(tmp_path / "out") + "/")
    prompt = torch.from_numpy(np.random.default_rng(6).integers(0, 200, (2, 9))).cuda()
    runs = {}
    for attn, modes in (("sdpa", (EAGER,)), ("sdpa_kv_heads", (EAGER, GRAPH, COMPILE))):
        model = load_model(tmp_path / "out", "cuda", attn_implementation=attn)
        assert model.config._attn_implementation == attn
        for mode in modes:
            logits = []
            keep = lambda i, lg, out=logits: out.append(lg.float().cpu().clone())  # noqa: E731
            toks = greedy(model, prompt, 8, mode, on_step=keep, compile_mode="default")
            runs[attn, mode] = (toks.cpu(), logits)
    ours = runs["sdpa_kv_heads", EAGER]
    for mode in (GRAPH, COMPILE):
        assert torch.equal(runs["sdpa_kv_heads", mode][0], ours[0]), mode
    for a, b in zip(runs["sdpa_kv_heads", GRAPH][1], ours[1], strict=True):
        assert torch.equal(a, b)
    ref = runs["sdpa", EAGER]
    for step, (a, b) in enumerate(zip(ours[1], ref[1], strict=True)):
        diff = float((a - b).abs().max())
        assert diff <= 0.01 * float(b.abs().max()), (step, diff)
        if not torch.equal(ours[0][:, step], ref[0][:, step]):
            top2 = b.topk(2, dim=-1).values  # apart only after a near tie of the sdpa model's
            assert float((top2[:, 0] - top2[:, 1]).min()) <= 2 * diff, step
            break


@pytest.mark.parametrize("attn", ["sdpa", "sdpa_kv_heads"])
def test_generate_with_a_static_cache_compiles_and_follows_eager(cp, tmp_path, attn: str) -> None:
    """transformers' own ``generate(..., cache_implementation="static")`` on the ragged
    Llama (gate/up fused) compiles its decode step through our op, and its greedy tokens
    follow eager ``generate``'s: equal, or apart only from a step where eager's top-2
    logit margin is within the two runs' logit difference (a near tie). With either
    attention (the README's example takes ``sdpa_kv_heads``)."""
    pytest.importorskip("transformers")
    import torch._dynamo

    from converter import load_model
    from converter.convert import convert
    from tests.helpers.model_fixture import write_ragged_llama

    convert(write_ragged_llama(tmp_path / "src"), str(tmp_path / "out") + "/")
    model = load_model(tmp_path / "out", "cuda", attn_implementation=attn)
    ids = torch.from_numpy(np.random.default_rng(7).integers(0, 200, (2, 9))).cuda()
    kw = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    eager = model.generate(ids, **kw)
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    static = model.generate(ids, cache_implementation="static", **kw)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > before  # the step was compiled
    start = ids.shape[1]
    for step, (le, ls) in enumerate(zip(eager.logits, static.logits, strict=True)):
        diff = float((le.float() - ls.float()).abs().max())
        te, ts = eager.sequences[:, start + step], static.sequences[:, start + step]
        if not torch.equal(te, ts):
            top2 = le.float().topk(2, dim=-1).values
            margin = float((top2[:, 0] - top2[:, 1]).min())
            assert margin <= 2 * diff, (step, margin, diff)
            break
        assert diff <= 0.02 * float(le.float().abs().max()), (step, diff)


def test_an_empty_batch_gives_an_empty_result(cp, layers) -> None:
    _, mod = layers[0]
    y = mod(torch.empty(2, 0, mod.in_features, dtype=torch.float16, device="cuda"))
    assert (tuple(y.shape), y.dtype) == ((2, 0, mod.out_features), torch.float16)


@pytest.mark.parametrize("fast", ["0", "1"])
def test_a_layer_on_another_gpu_launches_there(cp, monkeypatch: pytest.MonkeyPatch, fast: str) -> None:
    """A layer on cuda:1 called while cuda:0 is current (a model spread by device_map):
    the launch enters the layer's device, and gives the bits it gives there."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from converter.gpu import torch_op
    from converter.gpu.api import MarlinLinearModule

    monkeypatch.setenv(torch_op.FAST_LAUNCH_ENV, fast)
    with torch.cuda.device(1), cp.cuda.Device(1):
        mod = MarlinLinearModule(_layer(*LAYERS[1], seed=3))  # act-order: the gather launches too
        x = torch.randn(5, mod.in_features, dtype=torch.float16, device="cuda:1")
        want = _bits(mod(x))
    assert mod.b.device == torch.device("cuda", 1)
    with torch.cuda.device(0):
        y = mod(x)
        assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)
    assert y.device == torch.device("cuda", 1) and np.array_equal(_bits(y), want)

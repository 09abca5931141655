"""The user-facing GPU API end to end: artifact on disk -> layers on the GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from converter.artifact.reader import open_artifact
from converter.convert import convert
from converter.verify import artifact_weight, unpack_layer
from tests.helpers.paths import SAMPLE

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("api") / "s.safetensors"
    convert(SAMPLE, out)
    return out


def test_every_layer_matches_the_artifact_weight(cp, artifact: Path) -> None:
    from converter.gpu.api import load_artifact_gpu

    layers = load_artifact_gpu(artifact)
    rng = np.random.default_rng(11)
    with open_artifact(artifact) as art:
        assert set(layers) == set(art.layers)
        for name, rec in art.layers.items():
            w = artifact_weight(unpack_layer(art, rec), rec)  # fp32, source channel order
            bias = np.asarray(art.tensor(f"{name}.bias"), dtype=np.float32) if rec.has_bias else 0.0
            for m in (1, 17):
                a = rng.standard_normal((m, rec.size_k)).astype(np.float16)
                y = cp.asnumpy(layers[name](cp.asarray(a))).astype(np.float32)
                ref = a.astype(np.float32) @ w + bias
                rel = float(np.abs(y - ref).mean() / np.abs(ref).mean())
                assert rel < 1e-3, (name, m, rel)


def test_module_wrapper_runs_through_dlpack(cp, artifact: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from converter.gpu.api import MarlinLinearModule, load_artifact_gpu

    layer = load_artifact_gpu(artifact)["pre.0.mlp_down"]
    mod = MarlinLinearModule(layer)
    x = torch.randn(4, mod.in_features, dtype=torch.float16, device="cuda")
    y = mod(x)
    assert y.shape == (4, mod.out_features) and y.dtype == torch.float16 and y.is_cuda
    assert np.array_equal(
        y.cpu().numpy().view(np.uint16), cp.asnumpy(layer(cp.asarray(x.cpu().numpy()))).view(np.uint16)
    )


# --------------------------------------------------------------------------- padded and regrouped layers (issue 15)


def _layer_vs_cpu(cp, art_path: Path, name: str, n_true: int, ms=(1, 17, 64)) -> list[float]:
    """The loaded layer's output: exactly n_true columns, within the 1e-3 bar of the
    artifact's exact fp32 weight (the CPU reference) and within the twin's error bound."""
    from converter.gpu import kernels
    from converter.gpu import reference as ref
    from converter.gpu.api import load_artifact_gpu

    layer = load_artifact_gpu(art_path)[name]
    rng = np.random.default_rng(15)
    errs = []
    with open_artifact(art_path) as art:
        rec = art.layers[name]
        w = artifact_weight(unpack_layer(art, rec), rec)
        bias = np.asarray(art.tensor(f"{name}.bias"), dtype=np.float16) if rec.has_bias else None
        B, S, D = (np.asarray(art.tensor(f"{name}.{s}")) for s in ("marlin_B", "marlin_scales", "marlin_delta"))
        perm = np.asarray(art.tensor(f"{name}.marlin_perm")) if rec.act_order else None
    assert (layer.size_n, layer.padded_n) == (n_true, rec.layout_n)
    for m in ms:
        a = rng.standard_normal((m, rec.size_k)).astype(np.float16)
        y = cp.asnumpy(layer(cp.asarray(a)))
        assert y.shape == (m, n_true) and y.dtype == np.float16
        cpu = a.astype(np.float32) @ w + (0.0 if bias is None else bias.astype(np.float32))
        rel = float(np.abs(y.astype(np.float32) - cpu).mean() / np.abs(cpu).mean())
        assert rel < 1e-3, (name, m, rel)
        # The kernel's own arithmetic and K split (the plan), over the layout's width.
        plan = kernels.gemm_plan(m, rec.size_k, rec.layout_n, rec.group_size, delta=bool(np.any(D)))
        full_bias = None if bias is None else np.concatenate([bias, np.zeros(rec.layout_n - n_true, np.float16)])
        kw = dict(size_k=rec.size_k, size_n=rec.layout_n, group_size=rec.group_size, delta=D, perm=perm)
        host = dict(kw, bias=full_bias, arith=plan.arith)
        twin = ref.marlin_gemm(a, B, S, **host).astype(np.float64)[:, :n_true]
        bound = ref.gemm_error_bound(a, B, S, **host, splits=plan.splits * plan.wk)[:, :n_true]
        assert np.all(np.abs(y.astype(np.float64) - twin) <= bound), (name, m)
        errs.append(rel)
    return errs


def test_padded_vocab_head_returns_exactly_50257_columns(cp, tmp_path: Path) -> None:
    from tests.helpers.sample import GPT2_VOCAB, build_vocab_head

    src = build_vocab_head(tmp_path / "v.tinyloop")
    out = tmp_path / "v.safetensors"
    convert(src, out)
    print("head 50257 (pad 50304) rel err per M:", _layer_vs_cpu(cp, out, "head", GPT2_VOCAB))
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from converter.gpu.api import MarlinLinearModule, load_artifact_gpu

    mod = MarlinLinearModule(load_artifact_gpu(out)["head"])
    y = mod(torch.randn(3, 64, dtype=torch.float16, device="cuda"))
    assert (mod.out_features, tuple(y.shape), y.is_contiguous()) == (GPT2_VOCAB, (3, GPT2_VOCAB), True)


def test_n32_gptq_layer_returns_exactly_32_columns(cp, tmp_path: Path) -> None:
    from tests.helpers.producers import RAGGED_SIZES, ragged_gptq

    _, _, k_proj = RAGGED_SIZES
    src, _ = ragged_gptq(tmp_path / "src", np.random.default_rng(32), act_order=True)
    out = tmp_path / "a.safetensors"
    convert(src, out)
    print("k_proj 576 x 32 (pad 64, group 64 from 128) rel err per M:", _layer_vs_cpu(cp, out, k_proj, 32))


@pytest.mark.parametrize(
    ("bits", "group", "act"), [(4, 128, False), (4, 256, True), (2, 128, True), (2, 256, False), (4, 128, True)]
)
def test_regrouped_layers_pass_marlin_verify_gpu(cp, tmp_path: Path, bits: int, group: int, act: bool) -> None:
    """K = 576 and 960 with a short last group at g = 128 and 256, through the CLI."""
    import json

    from tests.helpers.clirun import run_cli
    from tests.helpers.producers import RAGGED_SIZES, ragged_gptq

    src, _ = ragged_gptq(
        tmp_path / "src", np.random.default_rng(bits + group + act), bits=bits, group_size=group, act_order=act
    )
    out = tmp_path / "a.safetensors"
    assert run_cli("marlin-convert", src, out).returncode == 0
    res = run_cli("marlin-verify", out, "--gpu", "--against", src, "--json")
    rep = json.loads(res.stdout)
    assert res.returncode == 0 and rep["ok"], rep["problems"]
    assert rep["checked"]["gpu_numerics"] is True and {r["name"] for r in rep["layers"]} == set(RAGGED_SIZES)
    for row in rep["layers"]:
        g = row["gpu"]
        print(
            f"bits={bits} g={group}->{row['group_size']} act={act!s:5} {row['name']:32} K={row['size_k']} "
            f"N={row['size_n']} pad={row.get('padded_n', '-')} mean {g['mean_rel_err']:.2e} "
            f"max {g['max_rel_err']:.2e} deterministic={g['deterministic']}"
        )
        assert g["ok"] and g["deterministic"] and g["mean_rel_err"] < 1e-3
        assert row["source_group_size"] == group and row["codes_exact"] and row["cpu_rel_err"] < 1e-5

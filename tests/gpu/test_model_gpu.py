"""load_model on CUDA: converted layers through our kernel (MarlinLinearModule), the rest
as on the CPU; on the synthetic GPTQ Llama of tests/helpers/model_fixture.py (needs no checkpoints)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from converter.convert import convert

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.helpers.model_fixture import DEQUANT_LAYERS, FALLBACK_LAYERS, KERNEL_LAYERS, write_tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny-gpu")
    src = write_tiny_llama(root / "src")
    convert(src, str(root / "out") + "/", pad=False)  # N % 64 layers pass through: the dequant-fp16 path
    return src, root / "out"


def test_load_model_cuda_runs_the_kernel(cp, tiny: tuple[Path, Path]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from converter import load_model
    from converter.model.modules import KernelMarlinLinear

    _, out = tiny
    gpu = load_model(out, "cuda")
    r = gpu.marlin_report
    assert r.device.startswith("cuda")
    assert r.layers == {
        **{n: "marlin-kernel" for n in KERNEL_LAYERS},
        **{n: "exact" for n in FALLBACK_LAYERS},
        **{n: "dequant-fp16" for n in DEQUANT_LAYERS},
    }
    assert set(r.kernel_fallback) == set(FALLBACK_LAYERS)
    assert isinstance(gpu.model.layers[0].self_attn.q_proj, KernelMarlinLinear)
    ids = torch.from_numpy(np.random.default_rng(1).integers(0, 200, (3, 33)))
    cpu = load_model(out, "cpu")
    with torch.no_grad():
        y_gpu = gpu(input_ids=ids.cuda(), use_cache=False).logits.float().cpu()
        y_cpu = cpu(input_ids=ids, use_cache=False).logits.float()
    rel = float((y_gpu - y_cpu).abs().mean() / y_cpu.abs().mean())
    assert rel < 3e-3, rel
    # The swapped kernel module alone, on bf16 activations: cast in and out around the fp16 kernel.
    q_gpu, q_cpu = gpu.model.layers[0].self_attn.q_proj, cpu.model.layers[0].self_attn.q_proj
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        a, b = q_gpu(x.cuda()).float().cpu(), q_cpu(x).float()
    assert q_gpu(x.cuda()).dtype == torch.bfloat16
    assert float((a - b).abs().mean() / b.abs().mean()) < 5e-3


def test_verify_model_on_the_gpu_passes(cp, tiny: tuple[Path, Path]) -> None:
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from converter.model.verify import verify_model

    src, out = tiny
    rep = verify_model(out, src, gpu=True)
    assert rep.ok, [p.message for p in rep.problems]
    assert rep.device.startswith("cuda") and rep.gpu_peak_bytes > 0
    assert list(rep.gpu_peak_by_device) == [rep.device] and 0 < rep.gpu_peak_by_device[rep.device] <= rep.gpu_peak_bytes
    kernel = [r for r in rep.layers if r["path"] == "marlin-kernel"]
    assert sorted(r["name"] for r in kernel) == sorted(KERNEL_LAYERS)
    assert all(r["rel_err"] < 1e-3 for r in kernel), kernel
    assert [p.tensor for p in rep.problems if p.code == "kernel_fallback"] == FALLBACK_LAYERS


def test_ragged_llama_runs_every_layer_on_the_kernel(cp, tmp_path: Path) -> None:
    """Regrouped (K = 192, 320 at group 128) and padded (k/v N = 32, lm_head 200) layers
    of a whole model, through MarlinLinearModule on the GPU, against the CPU exact path."""
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from converter import load_model
    from converter.model.verify import verify_model
    from tests.helpers.model_fixture import RAGGED_LAYERS, write_ragged_llama

    src = write_ragged_llama(tmp_path / "src")
    out = tmp_path / "out"
    convert(src, str(out) + "/")
    gpu = load_model(out, "cuda")
    assert gpu.marlin_report.layers == {n: "marlin-kernel" for n in RAGGED_LAYERS}
    assert list(gpu.marlin_report.fused) == ["model.layers.0.mlp.gate_proj+up_proj"]
    ids = torch.from_numpy(np.random.default_rng(2).integers(0, 200, (3, 33)))
    cpu = load_model(out, "cpu")
    with torch.no_grad():
        y_gpu = gpu(input_ids=ids.cuda(), use_cache=False).logits.float().cpu()
        y_cpu = cpu(input_ids=ids, use_cache=False).logits.float()
    assert tuple(y_gpu.shape) == (3, 33, 200)
    rel = float((y_gpu - y_cpu).abs().mean() / y_cpu.abs().mean())
    assert rel < 3e-3, rel
    rep = verify_model(out, src, gpu=True)
    assert rep.ok, [p.message for p in rep.problems]
    kernel = {r["name"]: r for r in rep.layers if r["path"] == "marlin-kernel"}
    assert set(kernel) == set(RAGGED_LAYERS) and all(r["rel_err"] < 1e-3 for r in kernel.values()), kernel


@pytest.mark.parametrize("device_map", ["auto", {"": 0}])
def test_verify_model_spread_by_a_device_map(cp, tiny: tuple[Path, Path], device_map) -> None:
    """issue 44 on one GPU: ``device_map`` builds ours through from_pretrained, on cuda:0,
    with the references on the CPU; the same layers take the kernel, and it passes."""
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from converter.model.verify import verify_model

    src, out = tiny
    rep = verify_model(out, src, gpu=True, device_map=device_map)
    assert rep.ok, [p.message for p in rep.problems]
    assert rep.device == "cuda:0" and rep.gpu_peak_bytes > 0
    assert set(rep.gpu_peak_by_device) == {f"cuda:{i}" for i in range(torch.cuda.device_count())}
    assert rep.gpu_peak_by_device["cuda:0"] > 0
    kernel = [r for r in rep.layers if r["path"] == "marlin-kernel"]
    assert sorted(r["name"] for r in kernel) == sorted(KERNEL_LAYERS)
    assert all(r["rel_err"] < 1e-3 for r in kernel), kernel


def test_bf16_model_runs_bf16_through_every_kernel_layer(cp, tiny: tuple[Path, Path]) -> None:
    """model.to(torch.bfloat16) on a converted model: the kernels' operands stay fp16 (their
    dtype is the kernels'), every module running our kernel then takes and gives bf16
    (hooks), the logits stay near the fp32 CPU model's, and an activation of 1e5 (inf in
    fp16) comes through finite."""
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from converter import load_model
    from converter.gpu.api import MarlinLinearModule

    _, out = tiny
    gpu = load_model(out, "cuda")
    ids = torch.from_numpy(np.random.default_rng(2).integers(0, 200, (2, 40)))
    with torch.no_grad():
        y16 = gpu(input_ids=ids.cuda(), use_cache=False).logits.float().cpu()
    gpu.to(torch.bfloat16)
    kernels = {n: m for n, m in gpu.named_modules() if isinstance(m, MarlinLinearModule)}
    assert kernels and all(m.scales.dtype == torch.float16 and m.b.dtype == torch.int32 for m in kernels.values())
    seen: dict[str, tuple[torch.dtype, torch.dtype]] = {}
    for name, mod in kernels.items():
        mod.register_forward_hook(lambda m, a, y, name=name: seen.__setitem__(name, (a[0].dtype, y.dtype)))
    cpu = load_model(out, "cpu")
    with torch.no_grad():
        y_gpu = gpu(input_ids=ids.cuda(), use_cache=False).logits.float().cpu()
        y_cpu = cpu(input_ids=ids, use_cache=False).logits.float()
    assert set(seen) == set(kernels)
    assert set(seen.values()) == {(torch.bfloat16, torch.bfloat16)}, seen
    # a whole bf16 model (norms, attention, residual) rounds 8x coarser than fp16 at every
    # step; measured on an H100 10.6x the fp16 model's error (0.0146 against 0.00138)
    rel, rel16 = (float((y - y_cpu).abs().mean() / y_cpu.abs().mean()) for y in (y_gpu, y16))
    assert rel < 16 * rel16, (rel, rel16)
    # the fp16 CPU model would overflow on 1e5 itself: compare with its bf16 cast (whose
    # exact layers run bf16 as the kernel does)
    cpu.to(torch.bfloat16)
    q_gpu, q_cpu = gpu.model.layers[0].self_attn.q_proj, cpu.model.layers[0].self_attn.q_proj
    x = torch.randn(5, 128)
    x[:, 3] = 1e5
    with torch.no_grad():
        a = q_gpu(x.to(torch.bfloat16).cuda())
        b = q_cpu(x.to(torch.bfloat16)).float()
    assert bool(torch.isfinite(b).all())
    assert a.dtype == torch.bfloat16 and bool(torch.isfinite(a).all())
    assert float((a.float().cpu() - b).abs().mean() / b.abs().mean()) < 1e-2


def test_verify_real_model_with_bf16_tensors_on_the_gpu_casts_nothing(cp, tmp_path: Path) -> None:
    """auto-round's real MiniLM keeps bf16 norms and embeddings: its converted layers run
    in whatever 16-bit type reaches them, and marlin-verify --model --gpu says so."""
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from converter.model.verify import verify_model
    from tests.helpers.paths import REALINPUT

    src = REALINPUT / "minilm" / "minilm-autoround-gptq-w4g128-asym-full"
    if not src.is_dir():
        pytest.skip(f"{src} not present")
    out = tmp_path / "out"
    convert(src, str(out) + "/")
    rep = verify_model(out, src, gpu=True)
    assert rep.ok, [p.message for p in rep.problems]
    kernel = [r for r in rep.layers if r["path"] == "marlin-kernel"]
    assert kernel and all(r["dtypes"][0] == r["dtypes"][1] for r in kernel), kernel
    print("kernel dtypes:", sorted({tuple(r["dtypes"]) for r in kernel}))

"""transformers' ``from_pretrained`` on a converted folder (issue 38): the quantizer that
``import converter`` registers, and the loud failure without it (docs/serving.md).

On the CPU ``from_pretrained`` must give bitwise the logits of ``load_model(..., "cpu")``:
the synthetic tiny Llama needs no ../shared (every path: exact, dequant-fp16, biases, a
quantized lm_head); the real GPTQ act-order, AWQ and bf16 auto-round llama-tiny skip without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers needs it for any device_map

from transformers import AutoModel, AutoModelForCausalLM  # noqa: E402
from transformers.quantizers import auto as hf_auto  # noqa: E402

from converter import hf_hook, load_model  # noqa: E402
from converter.constants import HF_WEIGHTS_GUARD, HF_WEIGHTS_KEY  # noqa: E402
from converter.convert import convert  # noqa: E402
from converter.model import ModelError  # noqa: E402
from converter.model.hf_quantizer import (  # noqa: E402
    MarlinConvertConfig,
    MarlinConvertHfQuantizer,
    device_of,
    register,
)
from converter.model.modules import DenseLinear, ExactMarlinLinear, swapped_modules  # noqa: E402
from tests.helpers.artifact_edit import reseal_folder_files  # noqa: E402
from tests.helpers.model_fixture import DEQUANT_LAYERS, write_tiny_llama  # noqa: E402
from tests.helpers.paths import REPO  # noqa: E402

GPTQ_ACT_ORDER = "gptqmodel-gptq-w4g128-asym-descact"
AWQ = "autoawq-gemm-w4g128-asym"
BF16 = "autoround-gptq-w4g128-asym"  # bf16 embedding and norms under a float16 config
MINILM = "minilm-autoround-gptq-w4g128-asym-full"
Q = "model.layers.0.self_attn.q_proj"


def python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (nothing imported yet), offline."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO, env=env, check=False
    )


def _ids(vocab: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(3).integers(0, vocab, (2, 9)))


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=False)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


# --------------------------------------------------------------------------- registration


def test_import_converter_imports_neither_transformers_nor_torch() -> None:
    p = python(
        "import sys, json, converter; from converter import hf_hook\n"
        "print(json.dumps([sorted(m for m in ('transformers', 'torch') if m in sys.modules),\n"
        "                  sum(isinstance(f, hf_hook._Finder) for f in sys.meta_path)]))"
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == [[], 1]  # nothing imported, one finder waiting


@pytest.mark.parametrize(
    "code",
    [
        "import converter, transformers",  # transformers after converter
        "import transformers, converter",  # before, its quantizer registry not imported yet
        "import transformers.quantizers.auto, converter",  # the registry imported first
    ],
)
def test_registration_whatever_the_import_order(code: str) -> None:
    p = python(
        f"{code}\nimport sys, json\nlazy = 'torch' not in sys.modules\n"
        "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING as Q, AUTO_QUANTIZATION_CONFIG_MAPPING as C\n"
        "from converter import hf_hook\n"
        "print(json.dumps([Q['marlin-convert'].__name__, C['marlin-convert'].__name__, lazy,\n"
        "                  sum(isinstance(f, hf_hook._Finder) for f in sys.meta_path)]))"
    )
    assert p.returncode == 0, p.stderr
    registry_first = code.startswith("import transformers.quantizers")
    # `import transformers` alone stays lazy: torch comes with the registry, not before.
    assert json.loads(p.stdout) == ["MarlinConvertHfQuantizer", "MarlinConvertConfig", not registry_first, 0]
    assert p.stderr == ""


def test_registration_is_idempotent() -> None:
    register()
    register()
    assert hf_hook.register_now() and hf_hook.register_now()
    assert hf_auto.AUTO_QUANTIZER_MAPPING["marlin-convert"] is MarlinConvertHfQuantizer
    assert hf_auto.AUTO_QUANTIZATION_CONFIG_MAPPING["marlin-convert"] is MarlinConvertConfig


def test_a_failing_registration_warns_and_breaks_no_import() -> None:
    p = python(
        "import sys, json, warnings\n"
        "sys.modules['converter.model.hf_quantizer'] = None  # its import now fails\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import converter, transformers.quantizers.auto as a\n"
        "print(json.dumps(['marlin-convert' in a.AUTO_QUANTIZER_MAPPING, [str(w.message) for w in caught]]))"
    )
    assert p.returncode == 0, p.stderr
    registered, messages = json.loads(p.stdout)
    assert registered is False
    ours = [m for m in messages if m.startswith("marlin-convert: the transformers quantizer")]
    assert len(ours) == 1
    assert ours[0].startswith(
        "marlin-convert: the transformers quantizer for quant_method 'marlin-convert' is not registered ("
    )
    assert ours[0].endswith(
        ": import of converter.model.hf_quantizer halted; None in sys.modules); "
        "from_pretrained cannot load converted model folders"
    )


def test_device_of_takes_the_longest_key_of_the_map() -> None:
    m = {"": "cpu", "model.layers.1": 1, "model.layers.10": torch.device("cuda", 0)}
    assert device_of("model.layers.10.mlp.up_proj", m) == torch.device("cuda", 0)
    assert device_of("model.layers.1.mlp.up_proj", m) == torch.device("cuda", 1)
    assert device_of("model.layers.2.mlp.up_proj", m) == torch.device("cpu")
    assert device_of("lm_head", None) == torch.device("cpu")
    with pytest.raises(ModelError, match=r"model.norm: device_map gives no device to module model.norm"):
        device_of("model.norm", {"model.layers": "cpu"})


# --------------------------------------------------------------------------- the synthetic Llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf-tiny")
    convert(write_tiny_llama(root / "src"), str(root / "out") + "/", pad=False)
    return root / "out"


def test_from_pretrained_on_cpu_is_load_model_bitwise(tiny: Path) -> None:
    ref = load_model(tiny, "cpu")
    m, info = AutoModelForCausalLM.from_pretrained(tiny, device_map="cpu", output_loading_info=True)
    # transformers' MISSING / UNEXPECTED / MISMATCHED report has nothing to say.
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    assert type(m).__name__ == "LlamaForCausalLM"
    assert m.marlin_report.to_json() == ref.marlin_report.to_json()
    assert isinstance(m.model.layers[0].self_attn.q_proj, ExactMarlinLinear)
    assert all(isinstance(m.get_submodule(n), DenseLinear) for n in DEQUANT_LAYERS)
    assert {str(b.device) for mod in swapped_modules(m).values() for b in mod.buffers()} == {"cpu"}
    assert sorted(m.state_dict()) == sorted(ref.state_dict())  # the swapped modules hold no state
    assert m.config.transformers_weights == "model.safetensors"  # the guard replaced by the artifact's name
    ids = _ids(200)
    assert torch.equal(_logits(m, ids), _logits(ref, ids))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_from_pretrained_honours_a_dtype_other_than_the_configs(tiny: Path, dtype: torch.dtype) -> None:
    """The tiny model's config.json says float16; dtype=bf16 (or fp32) gives that dtype's
    embeddings, norms and logits, and a bf16 model's converted layers take bf16 uncast;
    the default ("auto") keeps every tensor's own dtype, as load_model does."""
    m = AutoModelForCausalLM.from_pretrained(tiny, device_map="cpu", dtype=dtype)
    assert m.model.embed_tokens.weight.dtype == dtype and m.model.norm.weight.dtype == dtype
    ref = load_model(tiny, "cpu")
    assert torch.equal(m.model.embed_tokens.weight, ref.model.embed_tokens.weight.to(dtype))
    seen = []
    q = m.model.layers[0].self_attn.q_proj
    hook = q.register_forward_hook(lambda mod, args, out: seen.append((args[0].dtype, out.dtype)))
    logits = _logits(m, _ids(200))
    hook.remove()
    assert logits.dtype == dtype and seen == [(dtype, dtype)]
    auto = AutoModelForCausalLM.from_pretrained(tiny, device_map="cpu")
    assert auto.model.embed_tokens.weight.dtype == torch.float16
    assert torch.equal(_logits(auto, _ids(200)), _logits(ref, _ids(200)))


def test_from_pretrained_honours_a_dtype_where_config_json_names_none(tiny: Path, tmp_path: Path) -> None:
    """Without a dtype in config.json, "auto" resolves from the weights file, and a dtype
    other than that one is honoured too."""
    src = write_tiny_llama(tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("dtype", None), cfg.pop("torch_dtype", None)
    (src / "config.json").write_text(json.dumps(cfg))
    folder = tmp_path / "out"
    convert(src, str(folder) + "/", pad=False)
    assert not {"dtype", "torch_dtype"} & set(json.loads((folder / "config.json").read_text()))
    m = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu", dtype=torch.bfloat16)
    assert m.model.embed_tokens.weight.dtype == torch.bfloat16 and _logits(m, _ids(200)).dtype == torch.bfloat16
    auto = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu")
    assert auto.model.embed_tokens.weight.dtype == torch.float16


def test_from_pretrained_takes_a_per_module_device_map_and_shards(tiny: Path, tmp_path: Path) -> None:
    sharded = tmp_path / "sharded"
    convert(tiny.parent / "src", str(sharded) + "/", pad=False, max_shard_size="40KB")
    assert json.loads((sharded / "config.json").read_text())["quantization_config"]["weight_file"] == (
        "model.safetensors.index.json"
    )
    m = AutoModelForCausalLM.from_pretrained(sharded, device_map={"model": "cpu", "lm_head": "cpu"})
    assert m.marlin_report.device == "cpu"
    ids = _ids(200)
    assert torch.equal(_logits(m, ids), _logits(load_model(tiny, "cpu"), ids))


def test_auto_device_map_sizes_each_layer_by_its_bytes_and_loads_bitwise(
    tiny: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``device_map="auto"`` (issue 44): accelerate sizes every converted layer at the bytes
    it is built from (a placeholder holds no weight), the inferred map places the layers, and
    the model is load_model's, bitwise. Here the only device is the CPU (``max_memory``)."""
    from transformers.integrations import accelerate as hf_acc

    from converter.model.layers import ConvertedLayers
    from converter.model.loader import read_converted_config

    seen: list[dict[str, int]] = []
    real = hf_acc.compute_module_sizes

    def spy(model, hf_quantizer=None, *a, **k):
        sizes = real(model, hf_quantizer, *a, **k)
        if hf_quantizer is not None and not k.get("buffers_only"):  # the whole model's, as placed
            seen.append(dict(sizes[0]))
        return sizes

    monkeypatch.setattr(hf_acc, "compute_module_sizes", spy)
    m = AutoModelForCausalLM.from_pretrained(tiny, device_map="auto", max_memory={"cpu": "8GiB"})
    folder, cfg = read_converted_config(tiny)
    layers = ConvertedLayers(folder, cfg)
    try:
        want = {mod: layers.device_bytes(layer) for layer, mod in m.marlin_report.modules.items()}
    finally:
        layers.close()
    assert seen and want
    for mod, nbytes in want.items():
        assert seen[-1][mod] == nbytes, mod
    assert nbytes > 1000  # a real layer's size, not the placeholder's one byte
    assert str(m.marlin_report.device) == "cpu"
    ids = _ids(200)
    assert torch.equal(_logits(m, ids), _logits(load_model(tiny, "cpu"), ids))


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"device_map": "auto", "max_memory": {"cpu": 4096}}, "the whole model"),
        ({"device_map": {"model": "cpu", "lm_head": "disk"}}, "lm_head"),
    ],
)
def test_a_map_that_offloads_to_disk_is_refused(tiny: Path, kwargs: dict, named: str) -> None:
    want = rf"^device_map puts {named} on disk: a marlin-convert model is not offloaded; give the GPUs"
    with pytest.raises(ModelError, match=want):
        AutoModelForCausalLM.from_pretrained(tiny, **kwargs)


def test_an_inferred_map_spreads_the_blocks_by_their_bytes_over_two_gpus(tmp_path: Path) -> None:
    """issue 44's placement on the CPU, two GPUs described only by ``max_memory``: with
    each converted layer counted at its bytes, accelerate puts two of four blocks on each
    GPU where the budget says so; counted as the placeholders' one byte, all on the first."""
    from transformers.integrations.accelerate import compute_module_sizes, infer_auto_device_map

    from converter.model.build import hf_config
    from converter.model.layers import ConvertedLayers
    from converter.model.loader import read_converted_config
    from tests.helpers.synthetic_gptq import llama_attention_config, write_gptq

    extra = llama_attention_config(256, 128, head_dim=64)
    write_gptq(
        tmp_path / "src", hidden=256, intermediate=512, kv=128, blocks=4, vocab=512, shards=1, config_extra=extra
    )
    convert(tmp_path / "src", str(tmp_path / "out") + "/")
    folder, cfg = read_converted_config(tmp_path / "out")
    q = MarlinConvertHfQuantizer(MarlinConvertConfig(weight_file=cfg["quantization_config"]["weight_file"]))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(cfg, path=folder / "config.json"), dtype=torch.float16)
    layers = ConvertedLayers(folder, cfg)
    try:
        q._swap_in_placeholders(model, folder, layers)
        sizes = compute_module_sizes(model, q)[0]
        per_block = sum(
            layers.device_bytes(layer) for mod, layer in q._swaps.items() if mod.startswith("model.layers.0.")
        )
    finally:
        layers.close()
    block = sizes["model.layers.0"]
    assert per_block > 0 and block >= per_block  # the converted layers' bytes, plus the norms
    rest = sizes[""] - 4 * block
    budget = {0: rest + 2 * block + block // 2, 1: 10 * sizes[""], "cpu": 0}
    kw = dict(max_memory=budget, no_split_module_classes=model._no_split_modules)
    placed = infer_auto_device_map(model, hf_quantizer=q, **kw)
    assert [placed[f"model.layers.{i}"] for i in range(4)] == [0, 0, 1, 1]
    q._check_placement(placed)  # every converted layer on a GPU: fine
    assert set(infer_auto_device_map(model, hf_quantizer=None, **kw).values()) == {0}  # one byte a layer


def test_a_converted_layer_on_the_cpu_beside_a_gpu_is_refused() -> None:
    """accelerate runs a CPU-mapped module on the GPU with its weights offloaded when the map
    also holds a GPU; a converted layer cannot run that way (no GPU needed to check)."""
    q = MarlinConvertHfQuantizer(MarlinConvertConfig(weight_file="model.safetensors"))
    q._swaps = {"model.layers.0.mlp.up_proj": "a", "model.layers.1.mlp.up_proj": "b"}
    q._check_placement({"model.layers.0": 0, "model.layers.1": 1, "lm_head": "cpu"})  # the head is not ours: fine
    q._check_placement({"": "cpu"})  # all on the CPU: fine
    with pytest.raises(ModelError, match=r"converted layer model.layers.1.mlp.up_proj on the CPU beside a GPU"):
        q._check_placement({"model.layers.0": 0, "model.layers.1": "cpu", "lm_head": 0})


def test_a_folder_converted_before_the_guard_still_loads(tiny: Path, tmp_path: Path) -> None:
    old = tmp_path / "old"
    old.mkdir()
    for f in tiny.iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((old / "config.json").read_text())
    assert cfg.pop(HF_WEIGHTS_KEY) == HF_WEIGHTS_GUARD
    (old / "config.json").write_text(json.dumps(cfg, indent=2))
    reseal_folder_files(old)
    ids = _ids(200)
    m = AutoModelForCausalLM.from_pretrained(old, device_map="cpu")
    assert torch.equal(_logits(m, ids), _logits(load_model(old, "cpu"), ids))


def test_plain_from_pretrained_fails_loudly_naming_the_fix(tiny: Path) -> None:
    p = python(
        "import sys\nfrom transformers import AutoModelForCausalLM\n"
        f"try:\n    AutoModelForCausalLM.from_pretrained({str(tiny)!r}, device_map='cpu')\n"
        "finally:\n    print('converter' in sys.modules)"
    )
    assert p.returncode == 1 and p.stdout.strip() == "False"
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: ") and last.endswith(HF_WEIGHTS_GUARD)
    assert "`import converter` before from_pretrained" in last


# --------------------------------------------------------------------------- the real checkpoints


@pytest.fixture(scope="module")
def real(realinput: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-real")
    out = {}
    for name in (GPTQ_ACT_ORDER, AWQ, BF16, MINILM):
        convert(realinput / ("minilm" if name == MINILM else "llama-tiny") / name, str(root / name) + "/")
        out[name] = root / name
    return out


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        (GPTQ_ACT_ORDER, {"device_map": "cpu", "dtype": torch.float16}),
        (AWQ, {"device_map": "cpu"}),  # dtype "auto": the config's float16
        (BF16, {"device_map": "cpu", "dtype": torch.float16}),  # bf16 tensors stay bf16, as load_model keeps them
        (MINILM, {"device_map": "cpu"}),  # bert.-prefixed tensors into BertModel, fp32 pooler
    ],
)
def test_real_model_from_pretrained_is_load_model_bitwise(real: dict[str, Path], name: str, kwargs: dict) -> None:
    ref = load_model(real[name], "cpu")
    auto = AutoModel if name == MINILM else AutoModelForCausalLM
    m = auto.from_pretrained(real[name], **kwargs)
    assert m.marlin_report.to_json() == ref.marlin_report.to_json()
    assert set(m.marlin_report.layers.values()) == {"exact"} and len(m.marlin_report.layers) == (
        36 if name == MINILM else 7
    )
    want = {n: t.dtype for n, t in ref.state_dict().items()}
    assert {n: t.dtype for n, t in m.state_dict().items()} == want
    if name == BF16:
        assert m.model.embed_tokens.weight.dtype == torch.bfloat16 and m.lm_head.weight is m.model.embed_tokens.weight
    if name == GPTQ_ACT_ORDER:
        assert m.get_submodule(Q).perm is not None  # act-order: the gather is there
    ids = _ids(384)
    assert torch.equal(_logits(m, ids), _logits(ref, ids))


@pytest.mark.gpu
def test_from_pretrained_on_cuda_is_load_model_bitwise(real: dict[str, Path]) -> None:
    ref = load_model(real[GPTQ_ACT_ORDER], "cuda")
    m = AutoModelForCausalLM.from_pretrained(real[GPTQ_ACT_ORDER], device_map="cuda")
    assert set(m.marlin_report.layers.values()) == {"marlin-kernel"} and m.marlin_report.device == "cuda:0"
    assert {str(b.device) for mod in swapped_modules(m).values() for b in mod.buffers()} == {"cuda:0"}
    ids = _ids(384).cuda()
    assert torch.equal(_logits(m, ids), _logits(ref, ids))


@pytest.mark.gpu
@pytest.mark.parametrize("device_map", [{"": 0}, "auto", {"model": 0, "lm_head": "cpu"}])
def test_device_maps_on_one_gpu_are_load_model_bitwise(real: dict[str, Path], device_map) -> None:
    """issue 44 on one GPU: an explicit map, ``"auto"``, and the head (not converted) on the
    CPU, which accelerate runs on the GPU with its weight offloaded: every converted layer's
    buffers on cuda:0, and load_model's logits bitwise."""
    ref = load_model(real[GPTQ_ACT_ORDER], "cuda")
    m = AutoModelForCausalLM.from_pretrained(real[GPTQ_ACT_ORDER], device_map=device_map)
    assert set(m.marlin_report.layers.values()) == {"marlin-kernel"} and m.marlin_report.device == "cuda:0"
    assert {str(b.device) for mod in swapped_modules(m).values() for b in mod.buffers()} == {"cuda:0"}
    ids = _ids(384).cuda()
    assert torch.equal(_logits(m, ids).to("cuda:0"), _logits(ref, ids))


def test_both_loaders_take_the_kv_heads_attention_by_name(tiny: Path) -> None:
    """``attn_implementation="sdpa_kv_heads"`` needs no registration call of its own: in a
    fresh interpreter ``import converter`` is enough for from_pretrained and load_model, and
    the two give bitwise the same greedy step (converter.model.attention)."""
    code = f"""
import torch, converter
from transformers import AutoModelForCausalLM
a = AutoModelForCausalLM.from_pretrained({str(tiny)!r}, device_map="cpu", attn_implementation="sdpa_kv_heads")
b = converter.load_model({str(tiny)!r}, "cpu", attn_implementation="sdpa_kv_heads")
ids = torch.arange(1, 9).reshape(1, 8)
outs = []
for m in (a, b):
    assert m.config._attn_implementation == "sdpa_kv_heads", m.config._attn_implementation
    with torch.inference_mode():
        outs.append(m.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0))
assert torch.equal(outs[0], outs[1]), outs
print("ok", outs[0].shape[1])
"""
    r = python(code)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-2:] == ["ok", "12"]

"""Exact export to asymmetric compressed-tensors (issue 41): the two proofs on every real
producer and the synthetic 2/3/4-bit, act-order, bf16 and per-channel fixtures, the
refusals, and the write guarantees."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from converter.errors import ConverterError, UnsupportedQuantError
from converter.export import check_export, export_compressed_tensors, export_manifest, vllm_kernels
from converter.export.compressed_tensors import EXPORT_META_KEY, pack_int32
from converter.safetensors_io import SafetensorsFile
from tests.export.ct_proof import assert_library_codes, assert_library_exact, assert_reader_roundtrip
from tests.export.fixtures import synthetic as _synthetic
from tests.helpers.paths import LLAMA_TINY, SAMPLE
from tests.helpers.producers import gptq_config, gptq_tensors, make_layer, ragged_gptq, write_checkpoint

pytest.importorskip("compressed_tensors")

LLAMA = LLAMA_TINY
MINILM = ("minilm-autoround-gptq-w4g128-asym-layers0-1", "minilm-autoround-gptq-w4g128-asym-full")


def _real(realinput: Path, *parts: str) -> Path:
    p = realinput.joinpath(*parts)
    if not p.is_dir():
        pytest.skip(f"{p} not present")
    return p


def _manifest(out: Path) -> dict:
    files = sorted(out.glob("*.safetensors"))
    metas = [SafetensorsFile(f).metadata for f in files]
    assert all(m.get("format") == "pt" for m in metas)
    assert len({m[EXPORT_META_KEY] for m in metas}) == 1
    return json.loads(metas[0][EXPORT_META_KEY])


def _check_folder(src: Path, out: Path, summary) -> None:
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    for group in qc["config_groups"].values():
        w = group["weights"]
        assert w["symmetric"] is False and w["type"] == "int"
        assert w["strategy"] in ("group", "channel")
        assert (w["group_size"] is None) == (w["strategy"] == "channel")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).is_file():
            assert (out / name).read_bytes() == (src / name).read_bytes()
    # The manifest records the sha256 of the source's files, as the Marlin artifact does.
    files = _manifest(out)["source"]["files"]
    assert files
    for f in files:
        assert f["sha256"] == hashlib.sha256((src / f["name"]).read_bytes()).hexdigest()
    assert summary.exported


@pytest.mark.parametrize("producer", LLAMA)
def test_real_llama_tiny(realinput: Path, tmp_path: Path, producer: str) -> None:
    src = _real(realinput, "llama-tiny", producer)
    out = tmp_path / "out"
    summary = export_compressed_tensors(src, out, legacy_act_order=True)
    _check_folder(src, out, summary)
    assert len(summary.exported) == 7 and not summary.passthrough
    assert assert_reader_roundtrip(src, out) == 7
    check = check_export(out, src)
    assert len(check.checked) == 7 and not check.problems and not check.unchecked
    assert assert_library_codes(src, out) == 7
    assert assert_library_exact(src, out) == 7
    for lay in summary.exported:
        assert any(k.startswith("Marlin") for k in lay.kernels), lay


@pytest.mark.parametrize("name", MINILM)
def test_real_minilm_sharded(realinput: Path, tmp_path: Path, name: str) -> None:
    src = _real(realinput, "minilm", name)
    out = tmp_path / "out"
    summary = export_compressed_tensors(src, out, max_shard_size="1MB")
    _check_folder(src, out, summary)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in out.glob("model-*.safetensors")}
    n = len(summary.exported)
    assert assert_reader_roundtrip(src, out) == n
    assert assert_library_exact(src, out) == n


def test_act_order_refused_without_legacy(realinput: Path, tmp_path: Path) -> None:
    src = _real(realinput, "llama-tiny", "gptqmodel-gptq-w4g128-asym-descact")
    with pytest.raises(UnsupportedQuantError, match="act-order.*actorder 'group'"):
        export_compressed_tensors(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- synthetic


@pytest.mark.parametrize(
    ("bits", "group_size", "act_order", "scale_dtype"),
    [
        (4, 64, False, "F16"),
        (4, -1, False, "F16"),
        (4, 32, True, "F16"),
        (4, 64, False, "BF16"),
        (3, 64, False, "F16"),
        (3, 32, True, "F16"),
        (2, 64, False, "F16"),
        (2, 32, True, "F16"),
    ],
)
def test_synthetic_exact(tmp_path: Path, bits: int, group_size: int, act_order: bool, scale_dtype: str) -> None:
    src = _synthetic(tmp_path / "src", bits=bits, group_size=group_size, act_order=act_order, scale_dtype=scale_dtype)
    out = tmp_path / "out"
    summary = export_compressed_tensors(src, out, legacy_act_order=act_order)
    assert len(summary.exported) == 2
    assert all(lay.act_order == act_order for lay in summary.exported)
    # Our reader reads 2- and 4-bit compressed-tensors (3-bit passes through it), so
    # proof 1 covers those; proof 2 covers every width.
    assert assert_reader_roundtrip(src, out) == (0 if bits == 3 else 2)
    assert assert_library_codes(src, out) == 2
    check = check_export(out, src)
    assert not check.problems and len(check.checked) + len(check.unchecked) == 2
    assert assert_library_exact(src, out) == 2
    tensors = SafetensorsFile(next(out.glob("*.safetensors"))).infos
    scale = tensors["model.layers.0.mlp.up_proj.weight_scale"]
    assert scale.dtype == scale_dtype
    assert ("model.layers.0.mlp.up_proj.weight_g_idx" in tensors) == act_order
    if bits != 4:
        assert all(lay.kernels == [] for lay in summary.exported)  # vLLM's wNa16: 4 and 8 bits only


def test_pack_int32_matches_library() -> None:
    import torch
    from compressed_tensors.compressors.pack_quantized import pack_to_int32

    rng = np.random.default_rng(0)
    for bits in range(1, 9):
        for axis in (0, 1):
            q = rng.integers(0, 1 << bits, (37, 75), dtype=np.uint8)
            signed = torch.from_numpy(q.astype(np.int16) - (1 << (bits - 1))).to(torch.int8)
            ref = pack_to_int32(signed, bits, packed_dim=axis).numpy()
            np.testing.assert_array_equal(pack_int32(q, bits, axis), ref, err_msg=f"bits={bits} axis={axis}")


# --------------------------------------------------------------------------- refusals


def test_ragged_refused_by_name_then_passthrough(tmp_path: Path) -> None:
    src, layers = ragged_gptq(tmp_path / "src", np.random.default_rng(3), v1=False)
    with pytest.raises(UnsupportedQuantError, match="ragged last group") as exc:
        export_compressed_tensors(src, tmp_path / "out")
    for name in layers:
        assert name in str(exc.value)
    assert "\n" not in str(exc.value) and str(exc.value).endswith("nothing was written")  # no passthrough hint
    assert not (tmp_path / "out").exists()
    with pytest.raises(UnsupportedQuantError, match="no layer has an exact"):
        export_compressed_tensors(src, tmp_path / "out", allow_passthrough=True)


def test_passthrough_lists_ignore_and_copies_source_tensors(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    good = make_layer(rng, 256, 128, group_size=64)
    ragged = make_layer(rng, 200, 128, group_size=64)
    tensors = {**gptq_tensors("m.good", good, v1=False), **gptq_tensors("m.ragged", ragged, v1=False)}
    src = write_checkpoint(tmp_path / "src", tensors, gptq_config(4, 64, fmt="gptq_v2"), where="quantize_config.json")
    out = tmp_path / "out"
    with pytest.raises(UnsupportedQuantError, match=r"nothing was written; allow_passthrough / --allow-passthrough"):
        export_compressed_tensors(src, out)  # one layer of two refused: passing it through leaves the other
    summary = export_compressed_tensors(src, out, allow_passthrough=True)
    assert [lay.name for lay in summary.exported] == ["m.good"]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["m.ragged"]
    got = SafetensorsFile(out / "model.safetensors")
    ref = SafetensorsFile(src / "model.safetensors")
    for name in ("m.ragged.qweight", "m.ragged.qzeros", "m.ragged.scales"):
        assert bytes(got.raw(name)) == bytes(ref.raw(name))
    assert assert_library_exact(src, out) == 1


def test_padded_n_refused(tmp_path: Path) -> None:
    lay = make_layer(np.random.default_rng(7), 128, 96, group_size=64)
    src = write_checkpoint(
        tmp_path / "src",
        gptq_tensors("m.x", lay, v1=False),
        gptq_config(4, 64, fmt="gptq_v2"),
        where="quantize_config.json",
    )
    with pytest.raises(UnsupportedQuantError, match=r"\(padded N \(N = 96 would need padding to 128\): m\.x\)"):
        export_compressed_tensors(src, tmp_path / "out")


def test_tinyloop_float_zero_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedQuantError, match="float zero"):
        export_compressed_tensors(SAMPLE, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_force_and_input_is_untouched(tmp_path: Path) -> None:
    src = _synthetic(tmp_path / "src", bits=4, group_size=64)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    out = tmp_path / "out"
    export_compressed_tensors(src, out)
    first = (out / "model.safetensors").read_bytes()
    with pytest.raises(ConverterError):
        export_compressed_tensors(src, out)
    export_compressed_tensors(src, out, force=True)
    assert (out / "model.safetensors").read_bytes() == first  # deterministic
    with pytest.raises(ConverterError):
        export_compressed_tensors(src, src, force=True)  # never into the input's folder
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_vllm_kernel_rules() -> None:
    both = vllm_kernels(4, 128, 4096, 4096, False)
    assert [k.split()[0] for k in both] == ["Marlin", "Machete"]
    assert [k.split()[0] for k in vllm_kernels(4, 64, 4096, 4096, False)] == ["Marlin"]
    assert [k.split()[0] for k in vllm_kernels(4, 4096, 4096, 4096, False)] == ["Marlin", "Machete"]
    assert vllm_kernels(4, 16, 4096, 4096, False) == []
    assert vllm_kernels(3, 128, 4096, 4096, False) == []
    assert [k.split()[0] for k in vllm_kernels(4, 128, 4096, 4160, False)] == ["Marlin"]  # N % 128 != 0


# --------------------------------------------------------------------------- transformers


@pytest.mark.parametrize("producer", [p for p in LLAMA if "descact" not in p])
def test_transformers_loads_export_through_compressed_tensors(realinput: Path, tmp_path: Path, producer: str) -> None:
    """Proof 3: the exported llama-tiny loads in transformers (CPU) through its
    compressed-tensors quantizer, which dequantizes with compressed-tensors' own code,
    and its logits equal the source's dequantized model's within fp16 rounding.

    ``CompressedTensorsConfig(dequantize=True)``: with transformers 5.25 and
    compressed-tensors 0.20.1 the default (compressed) load refuses every asymmetric
    pack-quantized checkpoint, llm-compressor's own included (the meta model's
    ``weight_zero_point`` is left unpacked, ``(N, G)`` against the file's
    ``(N/8, G)``); :func:`test_transformers_default_load_same_as_producer` pins that.
    """
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, CompressedTensorsConfig

    from tests.export.ct_proof import source_layers

    src = _real(realinput, "llama-tiny", producer)
    out = tmp_path / "out"
    export_compressed_tensors(src, out)
    model = AutoModelForCausalLM.from_pretrained(
        out, device_map="cpu", dtype=torch.float16, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    cfg = AutoConfig.from_pretrained(realinput / "llama-tiny" / "base-llama-config.json")
    ref = AutoModelForCausalLM.from_config(cfg, dtype=torch.float16)
    plain = {}
    for f in src.glob("*.safetensors"):
        plain.update(load_file(str(f)))
    state = ref.state_dict()
    for k, v in plain.items():
        if k in state and state[k].shape == v.shape:
            state[k].copy_(v.to(torch.float16))
    layers = source_layers(src)
    for name, layer in layers.items():
        dense = torch.from_numpy(layer["w"].T.copy()).to(torch.float16)
        ref.get_submodule(name).weight.data.copy_(dense)
        # the dense weight transformers holds is the source's exact weight rounded once to fp16
        got = model.get_submodule(name).weight.data
        assert torch.equal(got.view(torch.int16), dense.view(torch.int16)), name
    ids = torch.tensor([[1, 5, 9, 33, 100, 7, 250, 3]])
    with torch.no_grad():
        a, b = model(ids).logits.float(), ref(ids).logits.float()
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_transformers_default_load_same_as_producer(realinput: Path, tmp_path: Path) -> None:
    """The default (compressed) transformers load treats our export exactly as it treats
    llm-compressor's own asymmetric checkpoint: both load, or both fail alike."""
    import torch
    from transformers import AutoModelForCausalLM

    src = _real(realinput, "llama-tiny", "llmcompressor-packq-w4g128-asym")
    out = tmp_path / "out"
    export_compressed_tensors(src, out)

    def outcome(path: Path) -> str:
        try:
            m = AutoModelForCausalLM.from_pretrained(path, device_map="cpu", dtype=torch.float16)
        except RuntimeError as exc:
            return f"error: {str(exc)[:80]}"
        with torch.no_grad():
            return str(m(torch.tensor([[1, 5, 9]])).logits[0, -1, :8].tolist())

    assert outcome(out) == outcome(src)


def test_check_export_finds_a_changed_source_and_rejects_a_non_export(tmp_path: Path) -> None:
    src = _synthetic(tmp_path / "src", bits=4, group_size=64)
    out = tmp_path / "out"
    export_compressed_tensors(src, out)
    assert export_manifest(src) is None
    with pytest.raises(ConverterError, match="not a marlin-convert compressed-tensors export"):
        check_export(src, src)
    other = _synthetic(tmp_path / "other", bits=4, group_size=32)
    check = check_export(out, other)
    assert any("sha256 differs" in p for p in check.problems)
    assert any("differ from the source" in p for p in check.problems)


@pytest.mark.parametrize(("scale_dtype", "name"), [("F16", "float16"), ("BF16", "bfloat16"), ("F32", "float32")])
def test_the_summary_names_the_dtype_to_serve_with(tmp_path: Path, scale_dtype: str, name: str) -> None:
    """vLLM and SGLang allocate weight_scale in the model dtype: the summary says which
    --dtype keeps the exported scales exact (their own)."""
    src = _synthetic(tmp_path / "src", bits=4, group_size=64, scale_dtype=scale_dtype)
    summary = export_compressed_tensors(src, tmp_path / "out")
    assert {lay.scale_dtype for lay in summary.exported} == {name}
    assert summary.to_json()["serve_dtype"] == name
    assert f"scales are {name}: serve with --dtype {name} (vLLM, SGLang)" in summary.text().splitlines()
    lay = summary.exported[0]
    lay.scale_dtype = "float16" if name != "float16" else "bfloat16"
    assert summary.serve_dtype is None and summary.to_json()["serve_dtype"] is None
    assert summary.text().splitlines()[-1].endswith("by layer: no one --dtype keeps them all exact")


def test_check_export_reads_the_config_as_an_engine_would(tmp_path: Path) -> None:
    src = _synthetic(tmp_path / "src", bits=4, group_size=64)
    out = tmp_path / "out"
    export_compressed_tensors(src, out)
    assert check_export(out, src, numerics=False).problems == []
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    qc = cfg["quantization_config"]
    qc["ignore"] = ["re:.*up_proj"]
    qc["config_groups"]["group_0"]["weights"].update(symmetric=True, actorder="group")
    cfg_path.write_text(json.dumps(cfg))
    both = "(model.layers.0.mlp.down_proj, model.layers.0.mlp.up_proj)"
    assert check_export(out, src, numerics=False).problems == [
        f"config group group_0: weights.symmetric is true, the layers need false {both}",
        f'config group group_0: weights.actorder is "group", the layers need null {both}',
        "config.json lists exported layers in quantization_config.ignore ('re:.*up_proj') (model.layers.0.mlp.up_proj)",
    ]
    qc["ignore"] = []
    qc["config_groups"]["group_0"]["targets"] = ["model.layers.0.mlp.down_proj"]
    qc["config_groups"]["group_0"]["weights"].update(symmetric=False, actorder=None)
    cfg_path.write_text(json.dumps(cfg))
    assert check_export(out, src, numerics=False).problems == [
        "no config group of config.json targets exported layers (model.layers.0.mlp.up_proj)",
        "model.layers.0.mlp.up_proj: not readable in the export",
    ]


def test_manifest_problems_lists_every_broken_field() -> None:
    from converter.export.verify import manifest_problems

    assert manifest_problems("x") == ["is a JSON str, not an object"]
    layer = {"name": "a", "exported": True, "bits": 4, "strategy": "group", "group_size": 128, "act_order": False}
    good = {"source": {"files": [{"name": "m.safetensors", "sha256": "00"}]}, "layers": [layer]}
    assert manifest_problems(good) == []
    bad = {"source": {"files": [{"name": "m", "sha256": 1}]}, "layers": [dict(layer, bits=True, act_order=None), 3]}
    assert manifest_problems(bad) == [
        "source.files[0] is not an object with a string name and sha256",
        "layers[0].bits is not int",
        "layers[0].act_order is not bool",
        "layers[1] is not an object",
    ]


def test_the_readers_notes_on_a_layer_reach_the_export_summary(tmp_path: Path) -> None:
    # A v1 zero of 0 (stored 15) is read by the whole-word add: convert says so, and the
    # export, whose zeros come from the same reading, must say it too.
    lay = make_layer(np.random.default_rng(14), 128, 64, zeros="with_zero")
    src = write_checkpoint(tmp_path / "src", gptq_tensors("m.up", lay, v1=True), gptq_config(4, 128))
    summary = export_compressed_tensors(src, tmp_path / "out")
    (note,) = [w for w in summary.warnings if "v1 zero field(s) store 15" in w]
    assert note.startswith("m.up: ") and "i.e. z - 1 = -1: a true zero of 0" in note
    assert f"warning: {note}" in summary.text()
    assert assert_library_exact(src, tmp_path / "out") == 1


def _late_symmetric_group(qc: dict) -> None:
    # a later group over the same names wins in vLLM and compressed-tensors
    g0 = qc["config_groups"]["group_0"]
    qc["config_groups"]["late"] = {**g0, "weights": {**g0["weights"], "symmetric": True}}


def _fused_regex_group(qc: dict) -> None:
    # vLLM matches the fused gate_up_proj before the unfused names
    w = {**qc["config_groups"]["group_0"]["weights"], "num_bits": 8}
    qc["config_groups"]["z"] = {"targets": ["re:.*gate_up_proj"], "weights": w, "format": "pack-quantized"}


IGNORE = "config.json lists exported layers in quantization_config.ignore"


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (_late_symmetric_group, ["config group late: weights.symmetric is true, the layers need false (both)"]),
        (_fused_regex_group,
         ["config group z (by 're:.*gate_up_proj'): weights.num_bits is 8, the layers need 4 (up)"]),
        (lambda qc: qc.update(ignore=["model.layers.0.mlp.gate_up_proj"]),
         [f"{IGNORE} ('model.layers.0.mlp.gate_up_proj') (up)"]),
        (lambda qc: qc.update(ignore=["Linear"]), [f"{IGNORE} ('Linear') (both)"]),
        # a class name that names no linear layer applies to none
        (lambda qc: qc["config_groups"]["group_0"].update(targets=["Embedding"]),
         ["no config group of config.json targets exported layers (both)"]),
        (lambda qc: qc["config_groups"]["group_0"]["weights"].update(dynamic=True),
         ["config group group_0: weights.dynamic is true, the layers need false (both)"]),
        (lambda qc: qc["config_groups"]["group_0"].update(format=""),
         ['config group group_0: format is "", the layers need "pack-quantized" (both)']),
    ],
)  # fmt: skip
def test_check_export_reads_the_config_as_strictly_as_the_engines_differ(tmp_path: Path, edit, expected) -> None:
    src = _synthetic(tmp_path / "src", bits=4, group_size=64)
    out = tmp_path / "out"
    export_compressed_tensors(src, out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    edit(cfg["quantization_config"])
    cfg_path.write_text(json.dumps(cfg))
    names = {"both": "(model.layers.0.mlp.down_proj, model.layers.0.mlp.up_proj)", "up": "(model.layers.0.mlp.up_proj)"}
    want = [e.replace("(both)", names["both"]).replace("(up)", names["up"]) for e in expected]
    assert check_export(out, src, numerics=False).problems == want


def test_a_channel_layer_with_a_group_size_in_its_config_fails(tmp_path: Path) -> None:
    # compressed-tensors refuses group_size with strategy "channel"; vLLM would read groups of it
    src = _synthetic(tmp_path / "src", bits=4, group_size=-1)
    out = tmp_path / "out"
    export_compressed_tensors(src, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 128
    (out / "config.json").write_text(json.dumps(cfg))
    assert check_export(out, src, numerics=False).problems == [
        "config group group_0: weights.group_size is 128, the layers need null "
        "(model.layers.0.mlp.down_proj, model.layers.0.mlp.up_proj)"
    ]


def test_the_manifest_cannot_leave_a_packed_layer_unchecked(tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    src = _synthetic(tmp_path / "src", bits=4, group_size=64)
    out = tmp_path / "out"
    export_compressed_tensors(src, out)
    shard = out / "model.safetensors"
    meta = SafetensorsFile(shard).metadata
    manifest = json.loads(meta[EXPORT_META_KEY])
    by_name = {rec["name"].rsplit(".", 1)[1]: rec for rec in manifest["layers"]}
    up, down = by_name["up_proj"], by_name["down_proj"]
    for layers, problem in [
        ([down], "the export packs layers its manifest does not list as exported (model.layers.0.mlp.up_proj)"),
        ([up, down, down], "the export manifest lists layers more than once (model.layers.0.mlp.down_proj)"),
    ]:
        tensors = load_file(shard)
        save_file(tensors, shard, metadata=dict(meta, **{EXPORT_META_KEY: json.dumps(dict(manifest, layers=layers))}))
        assert problem in check_export(out, src, numerics=False).problems


def test_a_shard_with_another_manifest_is_named(tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    src = _synthetic(tmp_path / "src", bits=4, group_size=64)
    out = tmp_path / "out"
    export_compressed_tensors(src, out, max_shard_size="20KB")
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) >= 2
    meta = SafetensorsFile(shards[1]).metadata
    save_file(load_file(shards[1]), shards[1], metadata=dict(meta, **{EXPORT_META_KEY: meta[EXPORT_META_KEY] + " "}))
    with pytest.raises(ConverterError) as exc:
        export_manifest(out)
    assert str(exc.value) == (
        f"{shards[1]}: the export's shards carry different manifests: this one's differs from {shards[0].name}'s"
    )


def _rewrite(shard: Path, edit) -> None:
    """Edit an export's shard as a hostile or careless tool would: tensors changed, its
    metadata (the manifest) kept."""
    from safetensors.numpy import load_file, save_file

    meta = SafetensorsFile(shard).metadata
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata=meta)


UP = "model.layers.0.mlp.up_proj"


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda t: t["model.embed_tokens.weight"].flat.__setitem__(0, 7),
         "bytes differ from the source's: model.embed_tokens.weight"),
        (lambda t: t.pop("model.embed_tokens.weight"), "missing from the export: model.embed_tokens.weight"),
        (lambda t: t.update({f"{UP}.bias": np.zeros(int(t[f"{UP}.weight_shape"][0]), np.float16)}),
         f"tensors the source does not have: {UP}.bias"),
        (lambda t: t.update({"model.embed_tokens.weight": t["model.embed_tokens.weight"].astype(np.float32)}),
         "dtype or shape differ from the source's: model.embed_tokens.weight"),
        (lambda t: t.update({f"{UP}.weight_scale": t[f"{UP}.weight_scale"].astype(np.float32)}),
         f"stored in another dtype than the source's scales (F16): {UP}.weight_scale"),
    ],
)  # fmt: skip
def test_check_export_compares_every_tensor_it_does_not_compute(tmp_path: Path, edit, expected: str) -> None:
    # the layers' values alone would pass: an edited embedding, a stray or missing tensor,
    # or a scale cast to another dtype (same values) used to give OK
    src = _synthetic(tmp_path / "src", bits=4, group_size=64)
    out = tmp_path / "out"
    export_compressed_tensors(src, out)
    _rewrite(out / "model.safetensors", edit)
    assert check_export(out, src, numerics=False).problems == [expected]


def test_a_dense_weight_beside_an_exported_layer_is_refused(tmp_path: Path) -> None:
    src = _synthetic(tmp_path / "src", bits=4, group_size=64)
    out = tmp_path / "out"
    export_compressed_tensors(src, out)
    dense = lambda t: t.update({f"{UP}.weight": np.zeros(tuple(t[f"{UP}.weight_shape"]), np.float16)})  # noqa: E731
    _rewrite(out / "model.safetensors", dense)
    with pytest.raises(ConverterError, match=f"layer {UP} has both weight_packed and a dense weight"):
        check_export(out, src, numerics=False)


def test_check_export_compares_passed_through_layers_and_biases(tmp_path: Path) -> None:
    # a layer with no exact form is copied as the source stores it; biases are copied beside
    rng = np.random.default_rng(5)
    good, ragged = make_layer(rng, 256, 128, group_size=64), make_layer(rng, 200, 128, group_size=64)
    tensors = {**gptq_tensors("m.good", good, v1=False), **gptq_tensors("m.ragged", ragged, v1=False)}
    tensors |= {f"m.{n}.bias": rng.standard_normal(128).astype(np.float16) for n in ("good", "ragged")}
    src = write_checkpoint(tmp_path / "src", tensors, gptq_config(4, 64, fmt="gptq_v2"), where="quantize_config.json")
    out = tmp_path / "out"
    export_compressed_tensors(src, out, allow_passthrough=True)
    assert check_export(out, src, numerics=False).problems == []
    for name in ("m.ragged.qzeros", "m.good.bias", "m.ragged.bias"):
        export_compressed_tensors(src, out, allow_passthrough=True, force=True)
        _rewrite(out / "model.safetensors", lambda t, n=name: t[n].view(np.uint8).flat.__setitem__(0, 0x55))
        assert check_export(out, src, numerics=False).problems == [f"bytes differ from the source's: {name}"]


WRITES = "differ from what the export writes for this source"


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda c: c.update(hidden_size=256), f"config.json: hidden_size {WRITES}"),
        (lambda c: c.update(architectures=["BertModel"], rope_theta=1.0),
         f"config.json: architectures, rope_theta {WRITES}"),
        (lambda c: c["quantization_config"].update(quantization_status="frozen", format="marlin-24"),
         f"config.json: quantization_config.format, quantization_config.quantization_status {WRITES}"),
        (lambda c: c["quantization_config"].update(kv_cache_scheme={"num_bits": 8, "type": "float"}),
         f"config.json: quantization_config.kv_cache_scheme {WRITES}"),
        (lambda c: c["quantization_config"]["config_groups"]["group_0"].update(
            input_activations={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}),
         'config group group_0: input_activations is {"num_bits": 8, "type": "float", "strategy": "token", '
         '"dynamic": true}, the layers need null (both)'),
        (lambda c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(
            scale_dtype="torch.bfloat16"),
         'config group group_0: weights.scale_dtype is "torch.bfloat16", the layers need null (both)'),
    ],
)  # fmt: skip
def test_check_export_compares_the_rest_of_the_config(tmp_path: Path, edit, expected: str) -> None:
    src = _synthetic(tmp_path / "src", bits=4, group_size=64)
    out = tmp_path / "out"
    export_compressed_tensors(src, out)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    both = "(model.layers.0.mlp.down_proj, model.layers.0.mlp.up_proj)"
    assert check_export(out, src, numerics=False).problems == [expected.replace("(both)", both)]


def test_force_replaces_a_sharded_export_it_wrote(tmp_path: Path) -> None:
    # its shards were taken for another model's (not a Marlin artifact's): every --force refused
    from converter.convert import convert

    src = _synthetic(tmp_path / "src", bits=4, group_size=64)
    out = tmp_path / "out"
    export_compressed_tensors(src, out, max_shard_size="20KB")
    assert len(list(out.glob("model-*.safetensors"))) >= 2
    export_compressed_tensors(src, out, force=True)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    assert check_export(out, src, numerics=False).problems == []
    export_compressed_tensors(src, out, max_shard_size="20KB", force=True)
    convert(src, out, force=True)  # a Marlin folder over the export
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert export_manifest(out) is None


def test_an_output_folder_with_another_quant_config_file_is_refused(tmp_path: Path) -> None:
    # --force over a GPTQ folder left its quantize_config.json, which readers take over
    # config.json's: the export then read as GPTQ (no *.qweight) and failed its own check
    src = _synthetic(tmp_path / "src", bits=4, group_size=64)
    out = tmp_path / "out"
    out.mkdir()
    (out / "quantize_config.json").write_text('{"bits": 4}')
    with pytest.raises(
        ConverterError,
        match=r"quantize_config.json: a reader would take this file for the export's quantization config",
    ):
        export_compressed_tensors(src, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["quantize_config.json"]


@pytest.mark.parametrize("where", ["write", "check"])
def test_an_interrupted_export_leaves_no_folder_it_created(tmp_path: Path, monkeypatch, where: str) -> None:
    # Ctrl-C mid-write said "no output was written" but left the new folder behind (its
    # lock file was released after the folder's removal was tried)
    from converter.export import folder_writer

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    if where == "write":
        monkeypatch.setattr(folder_writer._TensorSource, "__getitem__", interrupt)
    else:  # after the folder is made, before the write's own clean-up is in place
        from converter.export import compressed_tensors

        monkeypatch.setattr(compressed_tensors, "_write", interrupt)
    src = _synthetic(tmp_path / "src", bits=4, group_size=64)
    with pytest.raises(KeyboardInterrupt):
        export_compressed_tensors(src, tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_pass_through_bytes_are_compared_by_slices_and_scalars_too() -> None:
    # a 0-d tensor has no uint8 view of its own; an embedding is compared a slice at a time
    from converter.export.verify import _same_bytes

    x = np.arange(1000, dtype=np.int32)
    y = x.copy()
    y[999] = 0
    assert _same_bytes(np.float16(3), np.array(3, np.float16)) and not _same_bytes(np.float16(3), np.float16(2))
    assert _same_bytes(x, x.copy(), chunk=7) and not _same_bytes(x, y, chunk=7)
    assert not _same_bytes(x, x[:-1], chunk=7)

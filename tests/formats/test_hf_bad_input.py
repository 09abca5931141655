"""Bad HF checkpoints (issue 5, item 1): every malformed GPTQ folder (references,
dtypes and shapes, values, configs, files) raises one of our own errors whose
one-line message names the file, the tensor or field, the broken rule, and the
expected and found values.  Each test asserts the exception type and the message.
Pickle weights are refused by name and never unpickled."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from converter.convert import convert
from converter.errors import ConfigError, ConverterError, SourceFormatError
from converter.formats import open_source
from tests.helpers.checkpoints import LAYER, arr, edit_tensor, only_shard, set_quant_config, small_gptq
from tests.helpers.clirun import run_cli
from tests.helpers.producers import gptq_config


@pytest.fixture()
def gptq(tmp_path: Path) -> Path:
    return small_gptq(tmp_path / "ckpt")


# -- references, dtypes and shapes inside a GPTQ checkpoint ----------------------------
def test_layer_naming_a_missing_tensor(gptq: Path) -> None:
    edit_tensor(gptq, f"{LAYER}.scales", drop=True)
    with (
        open_source(gptq) as src,
        pytest.raises(SourceFormatError, match=rf"{LAYER}.scales: layer {LAYER} has qweight but no scales"),
    ):
        src.plan()


def test_a_layer_with_a_dense_weight_beside_its_codes_is_ambiguous(gptq: Path) -> None:
    # converted, the folder (or export) held both and each loader picked one silently
    from tests.helpers.artifact_edit import read_st, write_st

    shard = only_shard(gptq)
    meta, tensors = read_st(shard)
    tensors[f"{LAYER}.weight"] = ("F16", [4, 4], bytes(32))
    write_st(shard, tensors, meta)
    index = gptq / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"][f"{LAYER}.weight"] = shard.name
    index.write_text(json.dumps(data))
    with (
        open_source(gptq) as src,
        pytest.raises(
            SourceFormatError,
            match=rf"{LAYER}.weight: layer {LAYER} has both qweight and a dense weight: which one the model uses "
            "is ambiguous; remove one",
        ),
    ):
        src.plan()


def test_index_naming_a_missing_shard(gptq: Path) -> None:
    index = gptq / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["extra.weight"] = "model-00009-of-00009.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(
        SourceFormatError,
        match=r"weight_map: shard model-00009-of-00009.safetensors listed in the index does not exist",
    ):
        open_source(gptq)


def test_index_shard_outside_folder(gptq: Path) -> None:
    index = gptq / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["extra.weight"] = "../elsewhere.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(
        SourceFormatError, match=r"weight_map: shard '../elsewhere.safetensors' must be a plain file name"
    ):
        open_source(gptq)


def test_scales_shape_disagrees_with_k_n_group(gptq: Path) -> None:
    # 128 in-features, group 64: scales must be (2, 128); store (3, 128).
    edit_tensor(gptq, f"{LAYER}.scales", shape=[3, 128], raw=arr("F16", np.full((3, 128), 0.01)))
    with (
        open_source(gptq) as src,
        pytest.raises(
            SourceFormatError,
            match=rf"{LAYER}.scales: shape \[3, 128\] disagrees with K, N, bits and group_size \(expected \[2, 128\]\)",
        ),
    ):
        src.plan()


def test_qzeros_shape_disagrees(gptq: Path) -> None:
    edit_tensor(gptq, f"{LAYER}.qzeros", shape=[2, 8], raw=arr("I32", np.zeros((2, 8))))
    with (
        open_source(gptq) as src,
        pytest.raises(
            SourceFormatError, match=rf"{LAYER}.qzeros: shape \[2, 8\] disagrees with .* \(expected \[2, 16\]\)"
        ),
    ):
        src.plan()


def test_wrong_dtype_for_scales(gptq: Path) -> None:
    edit_tensor(gptq, f"{LAYER}.scales", dtype="I32", raw=arr("I32", np.zeros((2, 128))))
    with (
        open_source(gptq) as src,
        pytest.raises(SourceFormatError, match=rf"{LAYER}.scales: dtype I32, expected F16 or BF16 or F32"),
    ):
        src.plan()


def test_qweight_not_2d_int32(gptq: Path) -> None:
    edit_tensor(gptq, f"{LAYER}.qweight", dtype="F32")
    with (
        open_source(gptq) as src,
        pytest.raises(SourceFormatError, match=rf"{LAYER}.qweight: expected 2-D I32, found F32 \[16, 128\]"),
    ):
        src.plan()


# -- values ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_scales(gptq: Path, bad: float) -> None:
    s = np.full((2, 128), 0.01, dtype=np.float16)
    s[1, 5] = bad
    edit_tensor(gptq, f"{LAYER}.scales", raw=s.tobytes())
    with open_source(gptq) as src, pytest.raises(SourceFormatError, match=rf"{LAYER}.scales: 1 NaN or Inf scales"):
        src.plan()


def test_g_idx_out_of_range(gptq: Path) -> None:
    g = np.arange(128) // 64
    g[7] = 2
    edit_tensor(gptq, f"{LAYER}.g_idx", raw=arr("I32", g))
    with (
        open_source(gptq) as src,
        pytest.raises(SourceFormatError, match=rf"{LAYER}.g_idx: values must lie in \[0, 2\), found \[0, 2\]"),
    ):
        src.plan()


def test_g_idx_negative(gptq: Path) -> None:
    g = np.arange(128) // 64
    g[0] = -1
    edit_tensor(gptq, f"{LAYER}.g_idx", raw=arr("I32", g))
    with (
        open_source(gptq) as src,
        pytest.raises(SourceFormatError, match=r"values must lie in \[0, 2\), found \[-1, 1\]"),
    ):
        src.plan()


def test_g_idx_unequal_groups(gptq: Path) -> None:
    g = np.arange(128) // 64
    g[:70] = 0  # group 0 gets 70 members, group 1 gets 58
    edit_tensor(gptq, f"{LAYER}.g_idx", raw=arr("I32", g))
    with (
        open_source(gptq) as src,
        pytest.raises(
            SourceFormatError,
            match=rf"{LAYER}.g_idx: act-order groups must each have group_size=64 members; "
            r"group 0 has 70 \(expected 64\)",
        ),
    ):
        src.plan()


# -- configs -----------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["bits", "group_size"])
def test_config_missing_required_field(gptq: Path, field: str) -> None:
    set_quant_config(gptq, **{field: ...})
    with pytest.raises(ConfigError, match=rf"quantize_config.json: {field}: required field is missing"):
        open_source(gptq)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("bits", "4", r'bits: expected int, found "4"'),
        ("bits", 4.0, r"bits: expected int, found 4.0"),
        ("bits", True, r"bits: expected int, found true"),
        ("group_size", [128], r"group_size: expected int, found \[128\]"),
        ("sym", "false", r'sym: expected bool, found "false"'),
        ("sym", 0, r"sym: expected bool, found 0"),
        ("desc_act", {}, r"desc_act: expected bool, found \{\}"),
        ("checkpoint_format", 2, r"checkpoint_format: expected str, found 2"),
    ],
)
def test_config_field_wrong_type(gptq: Path, field: str, value, match: str) -> None:
    set_quant_config(gptq, **{field: value})
    with pytest.raises(ConfigError, match=match) as info:
        open_source(gptq)
    assert info.value.path.endswith("quantize_config.json")


def test_config_group_size_zero(gptq: Path) -> None:
    set_quant_config(gptq, group_size=0)
    with pytest.raises(ConfigError, match=r"group_size: must be -1 or positive, found 0"):
        open_source(gptq)


@pytest.mark.parametrize(
    "text,match",
    [
        (b"{", r"JSON file is not valid JSON"),
        (b"[]", r"JSON file must be a JSON object, found list"),
        (b"\xff", r"not valid UTF-8"),
    ],
)
def test_config_not_json_object(gptq: Path, text: bytes, match: str) -> None:
    (gptq / "quantize_config.json").write_bytes(text)
    with pytest.raises(ConfigError, match=match) as info:
        open_source(gptq)
    assert info.value.path.endswith("quantize_config.json")


def test_config_quantization_config_not_object(gptq: Path) -> None:
    (gptq / "quantize_config.json").unlink()
    cfg = json.loads((gptq / "config.json").read_text())
    cfg["quantization_config"] = "gptq"
    (gptq / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config.json: quantization_config: must be an object"):
        open_source(gptq)


# -- files ---------------------------------------------------------------------------------
class _Boom:
    """Unpickling this creates a file: the canary that proves nothing was unpickled."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


def _malicious_pickle(path: Path, canary: Path) -> None:
    path.write_bytes(pickle.dumps({"model.weight": _Boom(str(canary))}))
    # Sanity: the canary mechanism works when someone does unpickle it.
    probe = path.parent / "probe.canary"
    pickle.loads(pickle.dumps(_Boom(str(probe)))).close()
    assert probe.exists()
    probe.unlink()


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "model.pth", "model.ckpt"])
def test_pickle_folder_refused_never_unpickled(tmp_path: Path, name: str) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    canary = tmp_path / "pwned"
    _malicious_pickle(folder / name, canary)
    (folder / "quantize_config.json").write_text(json.dumps(gptq_config()))
    with pytest.raises(
        SourceFormatError, match=rf"only pickle weights found \({name}\); they are refused and never unpickled"
    ):
        open_source(folder)
    with pytest.raises(SourceFormatError):
        convert(folder, tmp_path / "out.safetensors")
    assert not canary.exists()
    assert not (tmp_path / "out.safetensors").exists()


def test_pickle_file_refused_never_unpickled(tmp_path: Path) -> None:
    canary = tmp_path / "pwned"
    p = tmp_path / "pytorch_model.bin"
    _malicious_pickle(p, canary)
    with pytest.raises(
        SourceFormatError, match=r"pytorch_model.bin: pickle checkpoints are refused and never unpickled"
    ):
        open_source(p)
    assert not canary.exists()


def test_pickle_disguised_as_safetensors(tmp_path: Path) -> None:
    """A pickle renamed to .safetensors is parsed as safetensors (and fails), never unpickled."""
    canary = tmp_path / "pwned"
    p = tmp_path / "model.safetensors"
    _malicious_pickle(p, canary)
    with pytest.raises(SourceFormatError, match=r"model.safetensors: (header length|not a safetensors)"):
        open_source(p)
    assert not canary.exists()


def test_cli_pickle_folder_never_unpickled(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    canary = tmp_path / "pwned"
    _malicious_pickle(folder / "pytorch_model.bin", canary)
    out = tmp_path / "out.safetensors"
    r = run_cli("marlin-convert", folder, out)
    assert r.returncode == 2
    assert "refused and never unpickled" in r.stderr and "Traceback" not in r.stderr
    assert not canary.exists() and not out.exists()


def test_directory_with_no_weights(tmp_path: Path) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(
        SourceFormatError, match=r"empty: no weights: expected \*.safetensors or model.safetensors.index.json"
    ):
        open_source(folder)


def test_missing_input(tmp_path: Path) -> None:
    with pytest.raises(ConverterError, match=r"nope: no such file or directory"):
        open_source(tmp_path / "nope")


def test_unreadable_file(gptq: Path) -> None:
    shard = only_shard(gptq)
    shard.chmod(0)
    try:
        try:
            with open(shard, "rb"):
                readable = True
        except PermissionError:
            readable = False
        if readable:
            pytest.skip("running as root (or with CAP_DAC_OVERRIDE): chmod 000 does not stop reads")
        with pytest.raises(ConverterError, match=r"cannot open: Permission denied"):
            open_source(gptq)
    finally:
        shard.chmod(0o644)


def test_directory_given_as_shard(gptq: Path) -> None:
    """A name in the index that is a folder, not a file (unreadable as weights)."""
    index = gptq / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    (gptq / "sub.safetensors").mkdir()
    data["weight_map"]["extra.weight"] = "sub.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(
        SourceFormatError,
        match=r"ckpt/sub.safetensors: a directory, not a file; a checkpoint's files must be regular files$",
    ):
        open_source(gptq)


@pytest.mark.parametrize(("dtype", "bad", "count"), [("F16", np.nan, 1), ("F16", -np.inf, 1), ("BF16", np.inf, 2)])
def test_a_non_finite_bias_is_refused_by_name(tmp_path: Path, dtype: str, bad: float, count: int) -> None:
    """The kernels add a converted layer's bias to every output row: NaN or Inf there is
    refused before anything is written, naming the shard and the tensor."""
    from converter.convert import convert
    from tests.helpers.producers import gptq_config, gptq_tensors, make_layer, write_checkpoint

    rng = np.random.default_rng(5)
    name = "model.layers.0.mlp.up_proj"
    tensors = gptq_tensors(name, make_layer(rng, 256, 128, bias=True), v1=False)
    b = tensors[f"{name}.bias"].astype(np.float32)
    b[7 : 7 + count] = bad
    tensors[f"{name}.bias"] = b if dtype == "BF16" else b.astype(np.float16)
    bf16 = {f"{name}.bias"} if dtype == "BF16" else set()
    folder = write_checkpoint(tmp_path / "src", tensors, gptq_config(4, 128), bf16=bf16)
    out = tmp_path / "o.safetensors"
    with pytest.raises(
        SourceFormatError,
        match=rf"model.safetensors: {name}.bias: {count} NaN or Inf value\(s\); a converted layer's bias must be "
        r"finite \(the kernels add it to every output row\)",
    ):
        convert(folder, out)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    # the export too (it copied the NaN, which an engine adds to every output row as well)
    from converter.export import export_compressed_tensors

    with pytest.raises(SourceFormatError, match=rf"{name}.bias: {count} NaN or Inf value\(s\)"):
        export_compressed_tensors(folder, tmp_path / "ct")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]

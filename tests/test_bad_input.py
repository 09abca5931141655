"""Bad input, all of it (issue 5, item 1).

Every malformed input must raise one of our own errors (a ConverterError subclass)
whose one-line message names the file, the tensor or field, the broken rule, and the
expected and found values; the CLI exits 2 with that line, no traceback, and no
output file.  One test per kind of breakage, for GPTQ folders (their safetensors
shards, index and configs) and for artifacts given to ``marlin-verify``.  Each test
asserts the exception type and the message.

The helpers here (``st_bytes``, ``read_st``, ``write_st``, ``small_gptq``) are shared
by the other reliability tests (fuzz, corruption, atomic, memory).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pickle
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
from artifact_edit import read_st, rewrite_artifact, write_st
from clirun import run_cli

from converter.artifact.validate import validate_artifact
from converter.constants import META_MANIFEST, META_SCHEMA_VERSION
from converter.convert import convert
from converter.errors import (
    ArtifactError,
    ConfigError,
    ConverterError,
    SchemaVersionError,
    SourceFormatError,
)
from converter.formats import open_source
from converter.safetensors_io import SafetensorsFile

REPO = Path(__file__).resolve().parents[1]


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_big_gptq", REPO / "scripts" / "make_big_gptq.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("make_big_gptq", mod)
    spec.loader.exec_module(mod)
    return mod


GEN = _load_generator()
NP_DTYPES = {"I32": "<i4", "F16": "<f2", "F32": "<f4", "U8": "u1", "BF16": "<u2", "I64": "<i8"}


# -- helpers -----------------------------------------------------------------------
def st_bytes(header: dict | bytes, data: bytes = b"", *, header_len: int | None = None) -> bytes:
    """A safetensors file from a header (dict, or raw bytes used verbatim) and data."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data


def arr(name_dtype: str, values) -> bytes:
    return np.ascontiguousarray(values, dtype=NP_DTYPES[name_dtype]).tobytes()


def small_gptq(folder: Path, *, shards: int = 1, **kw) -> Path:
    """A tiny deterministic 4-bit GPTQ checkpoint: 1 block, hidden 128, group 64."""
    args = dict(hidden=128, intermediate=256, kv=64, blocks=1, vocab=64, shards=shards, group_size=64)
    args.update(kw)
    GEN.write_gptq(folder, **args)
    return folder


def only_shard(folder: Path) -> Path:
    (shard,) = sorted(folder.glob("*.safetensors"))
    return shard


LAYER = "model.layers.0.self_attn.q_proj"


def edit_tensor(folder: Path, name: str, dtype: str | None = None, shape: list[int] | None = None, raw: bytes | None = None, *, drop: bool = False) -> Path:
    """Rewrite one tensor of a 1-shard checkpoint (and its index) in place."""
    shard = only_shard(folder)
    meta, tensors = read_st(shard)
    if drop:
        del tensors[name]
        index = folder / "model.safetensors.index.json"
        data = json.loads(index.read_text())
        del data["weight_map"][name]
        index.write_text(json.dumps(data))
    else:
        d, s, r = tensors[name]
        tensors[name] = (dtype or d, shape if shape is not None else s, raw if raw is not None else r)
    write_st(shard, tensors, meta)
    return shard


def good_file(tmp_path: Path) -> Path:
    p = tmp_path / "good.safetensors"
    write_st(p, {"a": ("F32", [2, 2], arr("F32", [[1, 2], [3, 4]])), "b": ("I32", [3], arr("I32", [1, 2, 3]))})
    return p


@pytest.fixture()
def gptq(tmp_path: Path) -> Path:
    return small_gptq(tmp_path / "ckpt")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("art")
    src = small_gptq(root / "src")
    out = root / "model.marlin.safetensors"
    convert(src, out)
    return out


def copy_of(path: Path, tmp_path: Path, data: bytes | None = None) -> Path:
    p = tmp_path / path.name
    p.write_bytes(path.read_bytes() if data is None else data)
    return p


# -- the container: every rule of the safetensors reader ------------------------------
T = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
CONTAINER_CASES = [
    # (id, file bytes, message regex)
    ("empty", b"", r"0 bytes, need at least 8"),
    ("short", b"\x01\x02\x03", r"3 bytes, need at least 8"),
    ("text_not_safetensors", b"this is a text file, not a model\n" * 4, r"header length \d+ exceeds the 100000000-byte limit"),
    ("zip_magic", b"PK\x03\x04" + b"\x00" * 60, r"header length \d+ runs past the end of the file \(64 bytes\)"),
    ("header_past_eof", st_bytes({"a": T}, b"\x00" * 16, header_len=10_000), r"header length 10000 runs past the end of the file"),
    ("header_absurd", st_bytes(b"{}", header_len=2**63), r"header length 9223372036854775808 exceeds the 100000000-byte limit"),
    ("header_not_json", st_bytes(b"{not json}   "), r"safetensors header is not valid JSON"),
    ("header_not_utf8", st_bytes(b'{"\xff\xfe": 1}'), r"safetensors header is not valid UTF-8"),
    ("header_list", st_bytes(b"[1, 2, 3]"), r"safetensors header must be a JSON object, found list"),
    ("header_number", st_bytes(b"42"), r"must be a JSON object, found int"),
    ("duplicate_names", st_bytes(b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "a": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}', b"\x00" * 32), r"duplicate key 'a'"),
    ("entry_not_object", st_bytes({"a": [1, 2]}), r"a: header entry must be an object"),
    ("metadata_not_strings", st_bytes({"__metadata__": {"x": 1}}), r"__metadata__: __metadata__ must be a map of strings to strings"),
    ("unknown_dtype", st_bytes({"a": {**T, "dtype": "F7"}}, b"\x00" * 16), r"a: unknown dtype 'F7' \(known: BOOL, U8"),
    ("dtype_not_string", st_bytes({"a": {**T, "dtype": 4}}, b"\x00" * 16), r"a: unknown dtype 4"),
    ("negative_shape", st_bytes({"a": {**T, "shape": [-1, 4]}}, b"\x00" * 16), r"a: shape must be a list of non-negative integers, found \[-1, 4\]"),
    ("float_shape", st_bytes({"a": {**T, "shape": [4.0]}}, b"\x00" * 16), r"a: shape must be a list of non-negative integers, found \[4.0\]"),
    ("bool_shape", st_bytes({"a": {**T, "shape": [True]}}, b"\x00" * 16), r"a: shape must be a list of non-negative integers, found \[True\]"),
    ("overflowing_shape", st_bytes({"a": {**T, "shape": [2**62, 2**62]}}, b"\x00" * 16), r"a: shape \[4611686018427387904, 4611686018427387904\] of F32 needs \d+ bytes, data_offsets span 16"),
    ("zero_size_absurd_dim", st_bytes({"a": {**T, "shape": [0, 2**70], "data_offsets": [0, 0]}}), r"a: shape \[0, 1180591620717411303424\] exceeds 64 dimensions or 9223372036854775807 elements per dimension"),
    ("too_many_dims", st_bytes({"a": {**T, "shape": [0] * 65, "data_offsets": [0, 0]}}), r"a: shape \[0, 0, .* exceeds 64 dimensions"),
    ("negative_offset", st_bytes({"a": {**T, "data_offsets": [-16, 0]}}, b"\x00" * 16), r"a: data_offsets must be \[begin, end\] with 0 <= begin <= end, found \[-16, 0\]"),
    ("reversed_offsets", st_bytes({"a": {**T, "data_offsets": [16, 0]}}, b"\x00" * 16), r"found \[16, 0\]"),
    ("offsets_not_pair", st_bytes({"a": {**T, "data_offsets": [0]}}, b"\x00" * 16), r"found \[0\]"),
    ("overflowing_offset", st_bytes({"a": {**T, "data_offsets": [2**64, 2**64 + 16]}}, b"\x00" * 16), r"a: data_offsets end 18446744073709551632 is past the end of the data buffer \(16 bytes; file truncated\?\)"),
    ("overlap", st_bytes({"a": T, "b": {**T, "data_offsets": [8, 24]}}, b"\x00" * 24), r"b: data_offsets \[8, 24\) overlaps the previous tensor \(expected begin 16\)"),
    ("gap", st_bytes({"a": T, "b": {**T, "data_offsets": [24, 40]}}, b"\x00" * 40), r"b: data_offsets \[24, 40\) leaves a gap after the previous tensor \(expected begin 16\)"),
    ("nbytes_vs_shape", st_bytes({"a": {**T, "data_offsets": [0, 12]}}, b"\x00" * 12), r"a: shape \[4\] of F32 needs 16 bytes, data_offsets span 12"),
    ("truncated", st_bytes({"a": T, "b": {**T, "data_offsets": [16, 32]}}, b"\x00" * 20), r"b: data_offsets end 32 is past the end of the data buffer \(20 bytes; file truncated\?\)"),
    ("trailing_bytes", st_bytes({"a": T}, b"\x00" * 20), r"4 trailing bytes after the last tensor \(data ends at 16, buffer is 20\)"),
]


@pytest.mark.parametrize("data,match", [c[1:] for c in CONTAINER_CASES], ids=[c[0] for c in CONTAINER_CASES])
def test_safetensors_container_rules(tmp_path: Path, data: bytes, match: str) -> None:
    p = tmp_path / "bad.safetensors"
    p.write_bytes(data)
    with pytest.raises(SourceFormatError, match=match) as info:
        SafetensorsFile(p)
    assert str(p) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("data,match", [c[1:] for c in CONTAINER_CASES], ids=[c[0] for c in CONTAINER_CASES])
def test_gptq_shard_container_rules(gptq: Path, data: bytes, match: str) -> None:
    """The same breakage inside a GPTQ folder's shard: refused before anything is read."""
    shard = only_shard(gptq)
    shard.write_bytes(data)
    with pytest.raises(SourceFormatError, match=match) as info:
        open_source(gptq).close()
    assert info.value.path == str(shard)


@pytest.mark.parametrize("data,match", [c[1:] for c in CONTAINER_CASES], ids=[c[0] for c in CONTAINER_CASES])
def test_artifact_container_rules(tmp_path: Path, data: bytes, match: str) -> None:
    """The same breakage in a file given to marlin-verify: ArtifactError (exit 2)."""
    p = tmp_path / "bad.marlin.safetensors"
    p.write_bytes(data)
    with pytest.raises(ArtifactError, match=match):
        validate_artifact(p)


def test_real_truncation_of_a_shard(gptq: Path) -> None:
    shard = only_shard(gptq)
    size = shard.stat().st_size
    os.truncate(shard, size - 100)
    with pytest.raises(SourceFormatError, match=r"is past the end of the data buffer \(\d+ bytes; file truncated\?\)"):
        open_source(gptq)


def test_real_trailing_bytes(gptq: Path) -> None:
    shard = only_shard(gptq)
    with open(shard, "ab") as fh:
        fh.write(b"\x00" * 3)
    with pytest.raises(SourceFormatError, match=r"3 trailing bytes after the last tensor"):
        open_source(gptq)


# -- references, dtypes and shapes inside a GPTQ checkpoint ----------------------------
def test_layer_naming_a_missing_tensor(gptq: Path) -> None:
    edit_tensor(gptq, f"{LAYER}.scales", drop=True)
    with open_source(gptq) as src, pytest.raises(SourceFormatError, match=rf"{LAYER}.scales: layer {LAYER} has qweight but no scales"):
        src.plan()


def test_index_naming_a_missing_shard(gptq: Path) -> None:
    index = gptq / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["extra.weight"] = "model-00009-of-00009.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(SourceFormatError, match=r"weight_map: shard model-00009-of-00009.safetensors listed in the index does not exist"):
        open_source(gptq)


def test_index_shard_outside_folder(gptq: Path) -> None:
    index = gptq / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["extra.weight"] = "../elsewhere.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(SourceFormatError, match=r"weight_map: shard '../elsewhere.safetensors' must be a plain file name"):
        open_source(gptq)


def test_scales_shape_disagrees_with_k_n_group(gptq: Path) -> None:
    # 128 in-features, group 64: scales must be (2, 128); store (3, 128).
    edit_tensor(gptq, f"{LAYER}.scales", shape=[3, 128], raw=arr("F16", np.full((3, 128), 0.01)))
    with open_source(gptq) as src, pytest.raises(
        SourceFormatError, match=rf"{LAYER}.scales: shape \[3, 128\] disagrees with K, N, bits and group_size \(expected \[2, 128\]\)"
    ):
        src.plan()


def test_qzeros_shape_disagrees(gptq: Path) -> None:
    edit_tensor(gptq, f"{LAYER}.qzeros", shape=[2, 8], raw=arr("I32", np.zeros((2, 8))))
    with open_source(gptq) as src, pytest.raises(SourceFormatError, match=rf"{LAYER}.qzeros: shape \[2, 8\] disagrees with .* \(expected \[2, 16\]\)"):
        src.plan()


def test_wrong_dtype_for_scales(gptq: Path) -> None:
    edit_tensor(gptq, f"{LAYER}.scales", dtype="I32", raw=arr("I32", np.zeros((2, 128))))
    with open_source(gptq) as src, pytest.raises(SourceFormatError, match=rf"{LAYER}.scales: dtype I32, expected F16 or BF16 or F32"):
        src.plan()


def test_qweight_not_2d_int32(gptq: Path) -> None:
    edit_tensor(gptq, f"{LAYER}.qweight", dtype="F32")
    with open_source(gptq) as src, pytest.raises(SourceFormatError, match=rf"{LAYER}.qweight: expected 2-D I32, found F32 \[16, 128\]"):
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
    with open_source(gptq) as src, pytest.raises(SourceFormatError, match=rf"{LAYER}.g_idx: values must lie in \[0, 2\), found \[0, 2\]"):
        src.plan()


def test_g_idx_negative(gptq: Path) -> None:
    g = np.arange(128) // 64
    g[0] = -1
    edit_tensor(gptq, f"{LAYER}.g_idx", raw=arr("I32", g))
    with open_source(gptq) as src, pytest.raises(SourceFormatError, match=r"values must lie in \[0, 2\), found \[-1, 1\]"):
        src.plan()


def test_g_idx_unequal_groups(gptq: Path) -> None:
    g = np.arange(128) // 64
    g[:70] = 0  # group 0 gets 70 members, group 1 gets 58
    edit_tensor(gptq, f"{LAYER}.g_idx", raw=arr("I32", g))
    with open_source(gptq) as src, pytest.raises(
        SourceFormatError, match=rf"{LAYER}.g_idx: act-order groups must each have group_size=64 members; group 0 has 70 \(expected 64\)"
    ):
        src.plan()


# -- configs -----------------------------------------------------------------------------
def _set_config(folder: Path, **changes) -> None:
    for name in ("quantize_config.json", "config.json"):
        p = folder / name
        cfg = json.loads(p.read_text())
        target = cfg if name == "quantize_config.json" else cfg["quantization_config"]
        for k, v in changes.items():
            if v is ...:
                target.pop(k, None)
            else:
                target[k] = v
        p.write_text(json.dumps(cfg))


@pytest.mark.parametrize("field", ["bits", "group_size"])
def test_config_missing_required_field(gptq: Path, field: str) -> None:
    _set_config(gptq, **{field: ...})
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
    _set_config(gptq, **{field: value})
    with pytest.raises(ConfigError, match=match) as info:
        open_source(gptq)
    assert info.value.path.endswith("quantize_config.json")


def test_config_group_size_zero(gptq: Path) -> None:
    _set_config(gptq, group_size=0)
    with pytest.raises(ConfigError, match=r"group_size: must be -1 or positive, found 0"):
        open_source(gptq)


@pytest.mark.parametrize("text,match", [(b"{", r"JSON file is not valid JSON"), (b"[]", r"JSON file must be a JSON object, found list"), (b"\xff", r"not valid UTF-8")])
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
    (folder / "quantize_config.json").write_text(json.dumps(GEN.quant_config()))
    with pytest.raises(SourceFormatError, match=rf"only pickle weights found \({name}\); they are refused and never unpickled"):
        open_source(folder)
    with pytest.raises(SourceFormatError):
        convert(folder, tmp_path / "out.safetensors")
    assert not canary.exists()
    assert not (tmp_path / "out.safetensors").exists()


def test_pickle_file_refused_never_unpickled(tmp_path: Path) -> None:
    canary = tmp_path / "pwned"
    p = tmp_path / "pytorch_model.bin"
    _malicious_pickle(p, canary)
    with pytest.raises(SourceFormatError, match=r"pytorch_model.bin: pickle checkpoints are refused and never unpickled"):
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
    with pytest.raises(SourceFormatError, match=r"empty: no weights: expected \*.safetensors or model.safetensors.index.json"):
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
    with pytest.raises(SourceFormatError, match=r"shard sub.safetensors listed in the index does not exist"):
        open_source(gptq)


# -- artifacts given to marlin-verify ----------------------------------------------------
def test_artifact_without_manifest(tmp_path: Path) -> None:
    p = good_file(tmp_path)
    with pytest.raises(ArtifactError, match=r"not a marlin-convert artifact: __metadata__ lacks 'marlin.schema_version' or 'marlin.manifest'"):
        validate_artifact(p)


def test_artifact_future_schema_version(artifact: Path, tmp_path: Path) -> None:
    meta, tensors = read_st(artifact)
    meta[META_SCHEMA_VERSION] = "7"
    p = tmp_path / "future.safetensors"
    write_st(p, tensors, meta)
    with pytest.raises(SchemaVersionError, match=r"marlin.schema_version: artifact schema version '7' is not supported \(this tool reads 1\); upgrade marlin-convert"):
        validate_artifact(p)


def test_artifact_manifest_not_json(artifact: Path, tmp_path: Path) -> None:
    meta, tensors = read_st(artifact)
    meta[META_MANIFEST] = meta[META_MANIFEST][:-5]
    p = tmp_path / "cut.safetensors"
    write_st(p, tensors, meta)
    with pytest.raises(ArtifactError, match=r"marlin.manifest: manifest is not valid JSON"):
        validate_artifact(p)


def test_artifact_manifest_not_object(artifact: Path, tmp_path: Path) -> None:
    meta, tensors = read_st(artifact)
    meta[META_MANIFEST] = "[1, 2]"
    p = tmp_path / "list.safetensors"
    write_st(p, tensors, meta)
    with pytest.raises(ArtifactError, match=r"marlin.manifest: manifest must be a JSON object"):
        validate_artifact(p)


def test_artifact_layer_missing_tensor(artifact: Path, tmp_path: Path) -> None:
    p = rewrite_artifact(artifact, tmp_path / "a.safetensors", lambda m, t: t.pop(f"{LAYER}.marlin_delta"))
    report, art = validate_artifact(p)
    art.close()
    msgs = [x.message for x in report.problems]
    assert f"{LAYER}.marlin_delta: missing (layer {LAYER} needs it)" in msgs


def test_artifact_shape_disagrees_with_manifest(artifact: Path, tmp_path: Path) -> None:
    def edit(m, t):
        d, s, raw = t[f"{LAYER}.marlin_scales"]
        t[f"{LAYER}.marlin_scales"] = (d, [1, 128], raw[: len(raw) // 2])

    p = rewrite_artifact(artifact, tmp_path / "a.safetensors", edit)
    report, art = validate_artifact(p)
    art.close()
    assert [x.code for x in report.problems] == ["shape_mismatch"]
    assert report.problems[0].expected == [2, 128] and report.problems[0].actual == [1, 128]


@pytest.mark.parametrize("tensor,dtype", [("marlin_delta", np.float32), ("marlin_scales", np.float16)])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_artifact_non_finite_values_reported(artifact: Path, tmp_path: Path, tensor: str, dtype, bad: float) -> None:
    """NaN/Inf written by a buggy producer, with checksums re-sealed: verify still reports it."""
    name = f"{LAYER}.{tensor}"

    def edit(m, t):
        d, s, raw = t[name]
        a = np.frombuffer(raw, dtype=dtype).copy()
        a[3] = bad
        t[name] = (d, s, a.tobytes())

    p = rewrite_artifact(artifact, tmp_path / "a.safetensors", edit)
    report, art = validate_artifact(p)
    art.close()
    assert not report.ok
    (prob,) = report.problems
    assert prob.code == "non_finite" and prob.tensor == name
    assert prob.message == f"{name}: 1 NaN or Inf value(s); {tensor[7:]} must be finite"
    r = run_cli("marlin-verify", p, "--shapes")
    assert r.returncode == 1 and "[non_finite]" in r.stdout


def test_artifact_manifest_schema_violation(artifact: Path, tmp_path: Path) -> None:
    def edit(m, t):
        m["layers"][0]["size_k"] = "128"

    p = rewrite_artifact(artifact, tmp_path / "a.safetensors", edit)
    report, art = validate_artifact(p)
    art.close()
    assert not report.ok
    assert any(x.code == "schema_violation" and "size_k" in x.message for x in report.problems)


# -- the CLI: exit 2, one line, no traceback, no output ------------------------------------
def _assert_one_line_error(r, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in r.stderr + r.stdout
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_cli_convert_truncated_shard(gptq: Path, tmp_path: Path) -> None:
    shard = only_shard(gptq)
    os.truncate(shard, shard.stat().st_size - 1)
    out = tmp_path / "out.safetensors"
    r = run_cli("marlin-convert", gptq, out)
    _assert_one_line_error(r, str(shard), "file truncated?")
    assert not out.exists() and not list(tmp_path.glob(".out.safetensors.*"))


def test_cli_convert_nan_scale(gptq: Path, tmp_path: Path) -> None:
    s = np.full((2, 128), 0.01, dtype=np.float16)
    s[0, 0] = np.nan
    edit_tensor(gptq, f"{LAYER}.scales", raw=s.tobytes())
    out = tmp_path / "out.safetensors"
    r = run_cli("marlin-convert", gptq, out)
    _assert_one_line_error(r, f"{LAYER}.scales", "NaN or Inf")
    assert not out.exists() and not list(tmp_path.glob(".out.safetensors.*"))


def test_cli_convert_config_wrong_type(gptq: Path, tmp_path: Path) -> None:
    _set_config(gptq, bits="four")
    out = tmp_path / "out.safetensors"
    r = run_cli("marlin-convert", gptq, out, "--json")
    assert r.returncode == 2
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and doc["error"]["type"] == "ConfigError" and doc["error"]["tensor"] == "bits"
    assert "Traceback" not in r.stderr and not out.exists()


def test_cli_convert_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors"
    p.write_bytes(b"")
    out = tmp_path / "out.safetensors"
    r = run_cli("marlin-convert", p, out)
    _assert_one_line_error(r, str(p), "need at least 8")
    assert not out.exists()


def test_cli_verify_truncated_artifact(artifact: Path, tmp_path: Path) -> None:
    data = artifact.read_bytes()
    p = copy_of(artifact, tmp_path, data[: len(data) - 7])
    r = run_cli("marlin-verify", p, "--shapes")
    _assert_one_line_error(r, str(p), "file truncated?")


def test_cli_verify_garbage(tmp_path: Path) -> None:
    p = tmp_path / "garbage.safetensors"
    p.write_bytes(os.urandom(4096))
    r = run_cli("marlin-verify", p, "--shapes")
    _assert_one_line_error(r, str(p), "header length")


def test_cli_debug_shows_traceback(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors"
    p.write_bytes(b"")
    r = run_cli("marlin-convert", p, tmp_path / "out.safetensors", "--debug")
    assert r.returncode != 0 and "Traceback" in r.stderr and "SourceFormatError" in r.stderr


def test_messages_are_single_line_for_hostile_names(tmp_path: Path) -> None:
    """A tensor name with a newline must not break the one-line contract."""
    p = tmp_path / "x.safetensors"
    p.write_bytes(st_bytes({"evil\nname": {**T, "dtype": "F7"}}, b"\x00" * 16))
    r = run_cli("marlin-convert", p, tmp_path / "out.safetensors")
    _assert_one_line_error(r, "unknown dtype")


def test_nbytes_overflow_is_not_a_crash() -> None:
    """Shapes whose element count overflows int64 are compared as Python ints."""
    assert math.prod([2**62, 2**62]) * 4 > 2**64


def test_cli_environment_oserror_is_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Disk full (or any OSError from the environment) mid-write: one line, exit 2."""
    import errno

    from typer.testing import CliRunner

    from converter.cli import convert_app

    convert_module = sys.modules["converter.convert"]  # the package re-exports a function of that name

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out.safetensors"))

    monkeypatch.setattr(convert_module, "convert", full_disk)
    r = CliRunner().invoke(convert_app, [str(tmp_path), str(tmp_path / "out.safetensors")])
    assert r.exit_code == 2
    out = r.output.strip().splitlines()
    assert out == [f"error: {tmp_path / 'out.safetensors'}: No space left on device"]


@pytest.mark.parametrize("tool", ["marlin-convert", "marlin-verify"])
def test_fifo_is_refused_not_waited_on(tmp_path: Path, tool: str) -> None:
    """A FIFO named like a weight file must not block the reader (nothing may hang)."""
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(ConverterError, match=r"model.safetensors: not a regular file"):
        SafetensorsFile(fifo)
    args = (fifo, tmp_path / "out.safetensors") if tool == "marlin-convert" else (fifo, "--shapes")
    r = run_cli(tool, *args, timeout=60)
    _assert_one_line_error(r, "not a regular file" if tool == "marlin-convert" else "not a file")

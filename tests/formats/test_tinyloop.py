"""`.tinyloop` v1 reader and writer (docs/spec/tinyloop-v1.md).

Round trips writer -> reader, the bundled sample's plan, and one test per kind of
malformed input (issue 5), each asserting the exception type and its message.  Bad
files are built by writing a good one and then patching its bytes or its header.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from converter.constants import (
    TINYLOOP_ALIGNMENT,
    TINYLOOP_MAX_HEADER_BYTES,
    TINYLOOP_PREAMBLE_FORMAT,
    TINYLOOP_PREAMBLE_SIZE,
    ZeroConvention,
)
from converter.errors import ConverterError, SourceFormatError, UnsupportedQuantError
from converter.formats.base import LayerPlan
from converter.formats.tinyloop import EXACT_INT4_REASON, TinyloopSource, sniff
from converter.formats.tinyloop_writer import pack_codes, quantize_linear_tinyloop, write_tinyloop
from tests.helpers.paths import SAMPLE
from tests.helpers.sample import build_sample

# --------------------------------------------------------------------------- helpers


def slow_unpack(qweight: np.ndarray, bits: int, size_k: int) -> np.ndarray:
    """Per-element reference for the spec's "Codes and weights": returns q[k, n]."""
    size_n = qweight.shape[0]
    q = np.zeros((size_k, size_n), dtype=np.uint8)
    per_byte = 8 // bits
    for n in range(size_n):
        for k in range(size_k):
            byte = int(qweight[n, k // per_byte])
            q[k, n] = (byte >> (bits * (k % per_byte))) & ((1 << bits) - 1)
    return q


def write_one(
    path: Path, *, bits: int = 4, k: int = 64, n: int = 64, group: int = 32, seed: int = 0, bias: bool = True
) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """A small valid file: linear ``lin`` plus plain tensors ``norm`` (f16) and ``emb`` (bf16)."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((k, n)).astype(np.float32)
    tensors, entry = quantize_linear_tinyloop("lin", w, bits, group, rng, bias=rng.standard_normal(n) if bias else None)
    tensors = {"norm": np.ones(n, np.float16), "emb": ("bf16", np.arange(12, dtype=np.uint16).reshape(3, 4)), **tensors}
    write_tinyloop(path, {"d_model": k}, tensors, {"lin": entry})
    return path, tensors, entry


def split(path: Path) -> tuple[bytes, dict[str, Any], bytes]:
    """(preamble, header, data from data_start) of a well-formed file."""
    raw = path.read_bytes()
    (header_len,) = struct.unpack_from("<Q", raw, 16)
    header = json.loads(raw[TINYLOOP_PREAMBLE_SIZE : TINYLOOP_PREAMBLE_SIZE + header_len])
    start = -(-(TINYLOOP_PREAMBLE_SIZE + header_len) // TINYLOOP_ALIGNMENT) * TINYLOOP_ALIGNMENT
    return raw[:TINYLOOP_PREAMBLE_SIZE], header, raw[start:]


def rebuild(
    path: Path,
    header_text: str | bytes,
    data: bytes,
    *,
    magic: bytes = b"TINYLOOP",
    version: int = 1,
    reserved: int = 0,
) -> Path:
    """Write a file from a header (re-padded to 64) and the data section, unchecked."""
    hb = header_text.encode() if isinstance(header_text, str) else header_text
    pad = -(TINYLOOP_PREAMBLE_SIZE + len(hb)) % TINYLOOP_ALIGNMENT
    path.write_bytes(struct.pack(TINYLOOP_PREAMBLE_FORMAT, magic, version, reserved, len(hb)) + hb + b"\0" * pad + data)
    return path


def patched(tmp_path: Path, mutate: Callable[[dict[str, Any]], None], name: str = "bad.tinyloop") -> Path:
    """A good file whose header dict went through ``mutate``, data section unchanged."""
    good, *_ = write_one(tmp_path / "good.tinyloop")
    _, header, data = split(good)
    mutate(header)
    return rebuild(tmp_path / name, json.dumps(header), data)


def open_and_plan(path: Path) -> None:
    with TinyloopSource(path) as src:
        src.plan()


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(
    ("bits", "k", "n", "group"),
    [(4, 128, 64, 32), (4, 128, 128, 128), (2, 128, 64, 64), (2, 256, 64, 256), (4, 96, 40, 96), (2, 64, 8, 4)],
)
def test_round_trip_exact(tmp_path: Path, bits: int, k: int, n: int, group: int) -> None:
    path, tensors, entry = write_one(tmp_path / "rt.tinyloop", bits=bits, k=k, n=n, group=group, seed=bits + k)
    qweight = tensors["lin.qweight"]
    with TinyloopSource(path) as src:
        plan = src.plan()
        (layer,) = plan.layers
        assert (layer.size_k, layer.size_n, layer.group_size, layer.bits) == (k, n, group, bits)
        assert layer.zero_convention is ZeroConvention.TINYLOOP_ADDITIVE
        qw = src.load_layer(layer)
    assert qw.q.dtype == np.uint8 and qw.q.shape == (k, n)
    np.testing.assert_array_equal(qw.q, slow_unpack(qweight, bits, k))
    assert qw.scales.dtype == np.float16 and qw.zeros.dtype == np.float16 and qw.delta.dtype == np.float32
    np.testing.assert_array_equal(qw.scales.view(np.uint16), tensors["lin.scale"].view(np.uint16))
    np.testing.assert_array_equal(qw.zeros.view(np.uint16), tensors["lin.zero"].view(np.uint16))
    expect_delta = tensors["lin.zero"].astype(np.float32) + np.float32(8) * tensors["lin.scale"].astype(np.float32)
    np.testing.assert_array_equal(qw.delta, expect_delta)
    assert (qw.bits, qw.group_size, qw.size_k, qw.k_offset) == (bits, group, k, 0)
    assert qw.bias is not None and qw.bias.dtype == "F16" and qw.bias.shape == (n,)
    np.testing.assert_array_equal(qw.bias.data, tensors["lin.bias"])
    # The Marlin form (q - 8) * s + delta reproduces the spec's q * s + zero in fp32.
    np.testing.assert_allclose(qw.marlin_weight(), qw.source_weight(), rtol=0, atol=1e-5)


@pytest.mark.parametrize(("bits", "group"), [(4, 32), (2, 64), (4, 256), (2, 256)])
def test_chunked_load_equals_full(tmp_path: Path, bits: int, group: int) -> None:
    k = 256
    path, *_ = write_one(tmp_path / "c.tinyloop", bits=bits, k=k, n=64, group=group)
    step = group if group < k else 16
    with TinyloopSource(path) as src:
        (layer,) = src.plan().layers
        full = src.load_layer(layer)
        for k0 in range(0, k, step * 2):
            k1 = min(k0 + step * 2, k)
            part = src.load_layer(layer, k0, k1)
            g0, g1 = k0 // group, -(-k1 // group)
            assert part.k_offset == k0 and part.size_k == k
            np.testing.assert_array_equal(part.q, full.q[k0:k1])
            np.testing.assert_array_equal(part.scales, full.scales[g0:g1])
            np.testing.assert_array_equal(part.zeros, full.zeros[g0:g1])
            np.testing.assert_array_equal(part.delta, full.delta[g0:g1])
            np.testing.assert_array_equal(part.source_weight(), full.source_weight()[k0:k1])


def test_pack_codes_matches_spec_bit_positions() -> None:
    q4 = np.zeros((4, 1), np.uint8)
    q4[0, 0], q4[1, 0] = 0x3, 0xA  # even k -> low nibble, odd k -> high nibble
    assert pack_codes(q4, 4).tolist() == [[0xA3, 0x00]]
    q2 = np.array([[1], [2], [3], [0]], np.uint8)  # k -> bits 2*(k%4)
    assert pack_codes(q2, 2).tolist() == [[1 | 2 << 2 | 3 << 4]]


def test_quantizer_error_is_within_half_a_step(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((128, 64)).astype(np.float32)
    path, _, _ = write_one(tmp_path / "q.tinyloop", k=128, group=32)
    tensors, entry = quantize_linear_tinyloop("lin", w, 4, 32, rng)
    write_tinyloop(path, {}, tensors, {"lin": entry})
    with TinyloopSource(path) as src:
        qw = src.load_layer(src.plan().layers[0])
    step = np.repeat(qw.scales.astype(np.float32), 32, axis=0)
    assert np.all(np.abs(qw.source_weight() - w) <= 0.5 * step + 1e-2 * np.abs(w) + 1e-3)


def test_symmetric_is_derived_from_data(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    t_sym, e_sym = quantize_linear_tinyloop("s", w, 4, 32, rng, symmetric=True)
    t_asym, e_asym = quantize_linear_tinyloop("a", w, 4, 32, rng)
    path = write_tinyloop(tmp_path / "s.tinyloop", {}, {**t_sym, **t_asym}, {"s": e_sym, "a": e_asym})
    with TinyloopSource(path) as src:
        by_name = {layer.name: layer for layer in src.plan().layers}
        assert by_name["s"].symmetric and not by_name["a"].symmetric
        assert src.load_layer(by_name["s"]).symmetric


def test_load_tensor_and_describe(tmp_path: Path) -> None:
    path, tensors, _ = write_one(tmp_path / "d.tinyloop")
    with TinyloopSource(path) as src:
        emb = src.load_tensor("emb")
        assert (emb.dtype, emb.shape, emb.data.dtype) == ("BF16", (3, 4), np.uint16)
        np.testing.assert_array_equal(emb.data, np.arange(12).reshape(3, 4))
        assert not emb.data.flags.writeable
        assert src.load_tensor("norm").dtype == "F16"
        desc = src.describe()
    assert desc == {
        "format": "tinyloop",
        "files": [
            {
                "name": "d.tinyloop",
                "bytes": path.stat().st_size,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            }
        ],
        "quant_config": {"model": {"d_model": 64}},
    }


def test_writer_layout_is_spec_exact(tmp_path: Path) -> None:
    path, _, _ = write_one(tmp_path / "w.tinyloop")
    raw = path.read_bytes()
    magic, version, reserved, header_len = struct.unpack_from(TINYLOOP_PREAMBLE_FORMAT, raw)
    assert (magic, version, reserved) == (b"TINYLOOP", 1, 0)
    data_start = -(-(24 + header_len) // 64) * 64
    assert raw[24 + header_len : data_start] == b"\0" * (data_start - 24 - header_len)
    header = json.loads(raw[24 : 24 + header_len])
    assert all(e["offset"] % 64 == 0 for e in header["tensors"].values())
    assert len(raw) % 64 == 0


def test_writer_check_refuses_bad_file_atomically(tmp_path: Path) -> None:
    target = tmp_path / "x.tinyloop"
    target.write_bytes(b"old")
    _, entry = quantize_linear_tinyloop("lin", np.zeros((64, 64), np.float32), 4, 32, np.random.default_rng(0))
    with pytest.raises(SourceFormatError, match="not in the tensor table"):
        write_tinyloop(target, {}, {}, {"lin": entry})
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.tinyloop"]


def test_load_layer_rejects_bad_ranges(tmp_path: Path) -> None:
    path, *_ = write_one(tmp_path / "r.tinyloop", k=128, group=32)
    with TinyloopSource(path) as src:
        (layer,) = src.plan().layers
        with pytest.raises(ConverterError, match=r"not inside \[0, 128\)"):
            src.load_layer(layer, 0, 160)
        with pytest.raises(ConverterError, match="k_start = 16 is not a multiple of group_size = 32"):
            src.load_layer(layer, 16, 64)


def test_sniff(tmp_path: Path) -> None:
    path, *_ = write_one(tmp_path / "s.tinyloop")
    assert sniff(path)
    (tmp_path / "other").write_bytes(b"PK\x03\x04")
    assert not sniff(tmp_path / "other")
    assert not sniff(tmp_path / "missing")


# --------------------------------------------------------------------------- the sample


def test_sample_plan() -> None:
    with TinyloopSource(SAMPLE) as src:
        plan = src.plan()
    layers = {layer.name: layer for layer in plan.layers}
    blocks = ("pre.0", "pre.1", "loop.0")
    kinds = ("attn_qkv", "attn_out", "mlp_gate", "mlp_up", "mlp_down")
    assert set(layers) == {f"{b}.{k}" for b in blocks for k in kinds} | {"head"}
    not_converted = {name: layer.reason for name, layer in layers.items() if not layer.convertible}
    assert not_converted == {"pre.1.attn_out": EXACT_INT4_REASON}
    # The 1000-vocabulary head converts padded to 1024 columns (--pad, the default).
    assert (layers["head"].size_n, layers["head"].padded_n, layers["head"].layout_n) == (1000, 1024, 1024)
    assert all(lay.padded_n is None and lay.source_group_size is None for n, lay in layers.items() if n != "head")
    assert layers["pre.1.attn_qkv"].bits == 2
    assert layers["pre.0.attn_qkv"].group_size == 64 and layers["pre.0.attn_out"].group_size == 128  # per-row
    assert layers["loop.0.attn_out"].symmetric and not layers["pre.0.attn_qkv"].symmetric
    assert layers["pre.0.attn_qkv"].bias is not None and layers["pre.0.attn_out"].bias is None
    plain = {t.name: t.dtype for t in plan.tensors}
    assert plain["embed"] == "BF16" and plain["final_norm"] == "F32" and plain["pre.0.norm1"] == "F16"
    # The converted layer's extra channels are carried over, with their reason.
    assert plan.passthrough_reasons["pre.0.mlp_up.frac4"] == (
        "frac4: TinyLoop stochastic-rounding channel; Marlin ignores it"
    )
    assert "pre.0.mlp_up.frac4" in plain and "pre.0.mlp_up.frac4" not in layers["pre.0.mlp_up"].source_tensors
    with TinyloopSource(SAMPLE) as src:
        unpadded = {layer.name: layer for layer in src.plan(pad=False).layers}
    assert unpadded["head"].padded_n is None and not unpadded["head"].convertible
    reason = "size_n = 1000 is not a multiple of 64 (Marlin tile)"
    assert unpadded["head"].reason == reason
    with TinyloopSource(SAMPLE) as src:
        reasons = src.plan(pad=False).passthrough_reasons
    for name in ("head.qweight", "head.scale", "head.zero"):
        assert reasons[name] == "layer head not converted: " + reason
    assert layers["pre.0.attn_qkv"].source_tensors == tuple(f"pre.0.attn_qkv.{s}" for s in ("qweight", "scale", "zero"))
    assert set(layers["pre.1.attn_out"].source_tensors) == {f"pre.1.attn_out.{s}" for s in ("qweight", "scale", "zero")}
    assert SAMPLE.stat().st_size < 1_500_000


def test_sample_is_deterministic_and_up_to_date(tmp_path: Path) -> None:
    a = build_sample(tmp_path / "a.tinyloop").read_bytes()
    b = build_sample(tmp_path / "b.tinyloop").read_bytes()
    assert a == b
    assert a == SAMPLE.read_bytes(), "tests/data/sample.tinyloop is stale: run scripts/make_sample.py"


# --------------------------------------------------------------------------- bad input: container


def test_empty_file(tmp_path: Path) -> None:
    (tmp_path / "e.tinyloop").write_bytes(b"")
    with pytest.raises(SourceFormatError, match=r"e\.tinyloop: empty file: expected at least the 24-byte"):
        TinyloopSource(tmp_path / "e.tinyloop")


def test_shorter_than_preamble(tmp_path: Path) -> None:
    (tmp_path / "s.tinyloop").write_bytes(b"TINYLOOP\x01")
    with pytest.raises(SourceFormatError, match="file is 9 bytes, shorter than the 24-byte preamble"):
        TinyloopSource(tmp_path / "s.tinyloop")


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(SourceFormatError, match="cannot open for reading"):
        TinyloopSource(tmp_path / "nope.tinyloop")
    with pytest.raises(SourceFormatError, match="not a regular file"):
        TinyloopSource(tmp_path)


def test_wrong_magic(tmp_path: Path) -> None:
    path, *_ = write_one(tmp_path / "m.tinyloop")
    path.write_bytes(b"GGUF\0\0\0\0" + path.read_bytes()[8:])
    with pytest.raises(SourceFormatError, match=r"magic: bad magic: expected b'TINYLOOP', found b'GGUF"):
        TinyloopSource(path)


def test_future_version(tmp_path: Path) -> None:
    path, *_ = write_one(tmp_path / "v.tinyloop")
    _, header, data = split(path)
    rebuild(path, json.dumps(header), data, version=2)
    with pytest.raises(SourceFormatError, match=r"version: format version 2 is not supported.*\[1\]"):
        TinyloopSource(path)


def test_reserved_nonzero(tmp_path: Path) -> None:
    path, *_ = write_one(tmp_path / "r.tinyloop")
    _, header, data = split(path)
    rebuild(path, json.dumps(header), data, reserved=7)
    with pytest.raises(SourceFormatError, match="reserved field must be 0, found 7"):
        TinyloopSource(path)


def _set_header_len(path: Path, value: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[16:24] = struct.pack("<Q", value)
    path.write_bytes(bytes(raw))


def test_header_length_past_eof(tmp_path: Path) -> None:
    path, *_ = write_one(tmp_path / "h.tinyloop")
    size = path.stat().st_size
    _set_header_len(path, size)
    with pytest.raises(SourceFormatError, match=f"header_length: header length {size} runs past end of file"):
        TinyloopSource(path)


@pytest.mark.parametrize("value", [TINYLOOP_MAX_HEADER_BYTES + 1, 2**64 - 1])
def test_absurd_header_length(tmp_path: Path, value: int) -> None:
    path, *_ = write_one(tmp_path / "h.tinyloop")
    _set_header_len(path, value)
    with pytest.raises(SourceFormatError, match=f"header length {value} bytes exceeds the limit of 104857600"):
        TinyloopSource(path)


def test_header_not_utf8(tmp_path: Path) -> None:
    path = rebuild(tmp_path / "u.tinyloop", b'{"model":"\xff\xfe"}', b"")
    with pytest.raises(SourceFormatError, match="header is not UTF-8: invalid byte at header offset 10"):
        TinyloopSource(path)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ('{"tensors": {', "header is not valid JSON"),
        ('{"model": NaN, "tensors": {}, "linears": {}}', "non-standard JSON constant NaN"),
        ('{"model": 1e999, "tensors": {}, "linears": {}}', "overflows a float"),
        ("[" * 100_000 + "]" * 100_000, "header is not valid JSON"),
        ("", "header is not valid JSON"),
    ],
)
def test_header_not_json(tmp_path: Path, text: str, match: str) -> None:
    path = rebuild(tmp_path / "j.tinyloop", text, b"")
    with pytest.raises(SourceFormatError, match=match):
        TinyloopSource(path)


@pytest.mark.parametrize(("text", "kind"), [("[1, 2]", "array"), ('"x"', "string"), ("null", "null")])
def test_header_not_object(tmp_path: Path, text: str, kind: str) -> None:
    path = rebuild(tmp_path / "o.tinyloop", text, b"")
    with pytest.raises(SourceFormatError, match=f"header: header must be a JSON object, found a JSON {kind}"):
        TinyloopSource(path)


def test_missing_and_mistyped_sections(tmp_path: Path) -> None:
    path = rebuild(tmp_path / "a.tinyloop", '{"model": {}, "linears": {}}', b"")
    with pytest.raises(SourceFormatError, match="tensors: header has no 'tensors' object"):
        TinyloopSource(path)
    path = rebuild(tmp_path / "b.tinyloop", '{"tensors": {}, "linears": []}', b"")
    with pytest.raises(SourceFormatError, match="linears: 'linears' must be a JSON object, found a JSON array"):
        TinyloopSource(path)
    path = rebuild(tmp_path / "c.tinyloop", '{"model": 3, "tensors": {}, "linears": {}}', b"")
    with pytest.raises(SourceFormatError, match="'model' must be a JSON object, found a JSON integer"):
        TinyloopSource(path)


def test_nonzero_header_padding(tmp_path: Path) -> None:
    path, *_ = write_one(tmp_path / "p.tinyloop")
    raw = bytearray(path.read_bytes())
    (header_len,) = struct.unpack_from("<Q", raw, 16)
    assert (24 + header_len) % 64, "test needs a header that is not already aligned"
    raw[24 + header_len] = 1
    path.write_bytes(bytes(raw))
    with pytest.raises(SourceFormatError, match="padding bytes .* after the header must be zero"):
        TinyloopSource(path)


# --------------------------------------------------------------------------- bad input: tensor table


def test_duplicate_tensor_names(tmp_path: Path) -> None:
    good, *_ = write_one(tmp_path / "good.tinyloop")
    _, header, data = split(good)
    text = json.dumps(header)
    norm = json.dumps(header["tensors"]["norm"])
    # Repeat the "norm" entry: json.loads would silently keep the last one.
    text = text.replace(f'"norm": {norm}', f'"norm": {norm}, "norm": {norm}', 1)
    path = rebuild(tmp_path / "dup.tinyloop", text, data)
    with pytest.raises(SourceFormatError, match="norm: duplicate tensor name 'norm' in header JSON"):
        TinyloopSource(path)


def test_duplicate_linear_names(tmp_path: Path) -> None:
    good, *_ = write_one(tmp_path / "good.tinyloop")
    _, header, data = split(good)
    lin = json.dumps(header["linears"]["lin"])
    text = json.dumps(header).replace(f'"lin": {lin}', f'"lin": {lin}, "lin": {lin}', 1)
    with pytest.raises(SourceFormatError, match="duplicate linear name 'lin'"):
        TinyloopSource(rebuild(tmp_path / "dup.tinyloop", text, data))


def _set(tensor: str, **fields: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(header: dict[str, Any]) -> None:
        header["tensors"][tensor].update(fields)

    return mutate


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (_set("norm", shape=[-1]), r"norm: shape \[-1\] must hold non-negative integers, found -1"),
        (_set("norm", shape=[True]), "must hold non-negative integers, found True"),
        (_set("norm", shape=[2**62, 2**62, 2**62]), r"nbytes = 128 disagrees with shape .* more than the whole file"),
        (_set("norm", shape=[1] * 33), "33 dimensions; this reader allows at most 32"),
        (_set("norm", shape="64"), "shape must be a JSON array of ints, found a JSON string"),
        (_set("norm", offset=-64), "norm: offset must be a non-negative integer, found -64"),
        (_set("norm", offset=2**70), "runs past end of file"),
        (_set("norm", offset=1.5), "offset must be a non-negative integer, found 1.5"),
        (_set("norm", offset=32), "norm: offset 32 is not a multiple of 64"),
        (_set("norm", nbytes=64), r"nbytes = 64 disagrees with shape \[64\] and dtype f16: prod\(shape\) \* 2 = 128"),
        (_set("norm", dtype="f64"), r"norm: unknown dtype 'f64': expected one of \['bf16', 'f16'"),
        (_set("norm", dtype=None), "unknown dtype None"),
    ],
    ids=[
        "negative-shape",
        "bool-shape",
        "overflowing-shape",
        "too-many-dims",
        "shape-not-list",
        "negative-offset",
        "huge-offset",
        "float-offset",
        "unaligned-offset",
        "nbytes-mismatch",
        "unknown-dtype",
        "null-dtype",
    ],
)
def test_bad_tensor_entry(tmp_path: Path, mutate: Callable[[dict[str, Any]], None], match: str) -> None:
    with pytest.raises(SourceFormatError, match=match):
        TinyloopSource(patched(tmp_path, mutate))


def test_tensor_entry_missing_field(tmp_path: Path) -> None:
    path = patched(tmp_path, lambda h: h["tensors"]["norm"].pop("nbytes"))
    with pytest.raises(SourceFormatError, match="norm: tensor entry has no 'nbytes' field"):
        TinyloopSource(path)


def test_overlapping_regions(tmp_path: Path) -> None:
    def mutate(header: dict[str, Any]) -> None:
        header["tensors"]["emb"]["offset"] = header["tensors"]["norm"]["offset"]

    with pytest.raises(SourceFormatError, match=r"norm: region \[0, 128\) overlaps tensor 'emb' at \[0, 24\)"):
        TinyloopSource(patched(tmp_path, mutate))


def test_truncated_file(tmp_path: Path) -> None:
    path, *_ = write_one(tmp_path / "t.tinyloop")
    raw = path.read_bytes()
    path.write_bytes(raw[:-100])
    with pytest.raises(SourceFormatError, match=r"lin\.\w+: region .* runs past end of file at \d+ bytes: truncated"):
        TinyloopSource(path)


def test_trailing_bytes(tmp_path: Path) -> None:
    path, *_ = write_one(tmp_path / "t.tinyloop")
    size = path.stat().st_size
    path.write_bytes(path.read_bytes() + b"\0" * 64)
    with pytest.raises(SourceFormatError, match=f"trailing bytes: file is {size + 64} bytes .* 64 extra bytes"):
        TinyloopSource(path)


def test_trailing_bytes_within_alignment_are_allowed(tmp_path: Path) -> None:
    # The spec allows the file to end anywhere up to the 64-byte boundary.
    path, *_ = write_one(tmp_path / "t.tinyloop", bias=False)
    _, header, data = split(path)
    end = max(e["offset"] + e["nbytes"] for e in header["tensors"].values())
    rebuild(path, json.dumps(header), data[:end])
    open_and_plan(path)


# --------------------------------------------------------------------------- bad input: linears


def _lin(**fields: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(header: dict[str, Any]) -> None:
        header["linears"]["lin"].update(fields)

    return mutate


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (_lin(scale="nope"), r"lin: field 'scale' names tensor 'nope', which is not in the tensor table"),
        (_lin(bias="missing.bias"), "field 'bias' names tensor 'missing.bias', which is not in the tensor table"),
        (_lin(frac4="norm"), r"norm: frac4 of linear 'lin' must be u8, found f16"),
        (
            _lin(group_size=64),
            r"lin.scale: scale of linear 'lin' must have shape \[K/G, N\] = \[1, 64\], found \[2, 64\]",
        ),
        (_lin(out_features=32), r"lin.qweight: qweight of linear 'lin' must have shape \[N, K\*bits/8\] = \[32, 32\]"),
        (_lin(zero="lin.qweight"), "already used by another field"),
        (_lin(zero="emb"), r"emb: zero of linear 'lin' must be f16, found bf16"),
        (_lin(bits="4"), "lin: field 'bits' must be an integer, found '4'"),
        (_lin(in_features=0), "field 'in_features' must be positive, found 0"),
        (_lin(group_size=24), "lin: group_size = 24 does not divide in_features K = 64"),
        (_lin(exact_int4="yes"), "field 'exact_int4' must be true or false"),
        (_lin(qweight=7), "field 'qweight' must name a tensor .a string., found 7"),
        (lambda h: h["linears"]["lin"].pop("group_size"), "lin: linear has no 'group_size' field"),
        (lambda h: h["linears"].update(lin=[1]), "lin: linear entry must be a JSON object, found a JSON array"),
    ],
    ids=[
        "missing-tensor",
        "missing-bias",
        "channel-dtype",
        "scale-shape-vs-group",
        "qweight-shape-vs-N",
        "tensor-twice-in-one-linear",
        "zero-wrong-tensor",
        "bits-type",
        "zero-K",
        "group-not-dividing-K",
        "exact-int4-type",
        "name-not-string",
        "missing-field",
        "linear-not-object",
    ],
)
def test_bad_linear(tmp_path: Path, mutate: Callable[[dict[str, Any]], None], match: str) -> None:
    with pytest.raises(SourceFormatError, match=match):
        TinyloopSource(patched(tmp_path, mutate))


def test_unsupported_bits(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedQuantError, match=r"lin: bits = 3 is not supported: expected one of \[2, 4\]"):
        TinyloopSource(patched(tmp_path, _lin(bits=3)))


def test_tensor_shared_by_two_linears(tmp_path: Path) -> None:
    def mutate(header: dict[str, Any]) -> None:
        header["linears"]["other"] = dict(header["linears"]["lin"])

    with pytest.raises(SourceFormatError, match="lin.qweight: tensor is named by linear 'lin' and by linear 'other'"):
        TinyloopSource(patched(tmp_path, mutate))


@pytest.mark.parametrize(("field", "value", "shown"), [("scale", np.nan, "nan"), ("zero", np.inf, "inf")])
def test_non_finite_scale_or_zero(tmp_path: Path, field: str, value: float, shown: str) -> None:
    rng = np.random.default_rng(0)
    tensors, entry = quantize_linear_tinyloop("lin", rng.standard_normal((64, 64)).astype(np.float32), 4, 32, rng)
    bad = tensors[f"lin.{field}"].copy()
    bad[1, 5] = value
    tensors[f"lin.{field}"] = bad
    path = write_tinyloop(tmp_path / "n.tinyloop", {}, tensors, {"lin": entry}, check=False)
    with TinyloopSource(path) as src:  # opening reads no values; planning does
        with pytest.raises(
            SourceFormatError, match=rf"lin\.{field}: values must be finite .* found {shown} at \[group 1, column 5\]"
        ):
            src.plan()
        with pytest.raises(SourceFormatError, match=rf"lin\.{field}: values must be finite"):
            src.load_layer(
                LayerPlan(
                    name="lin",
                    size_k=64,
                    size_n=64,
                    group_size=32,
                    bits=4,
                    zero_convention=ZeroConvention.TINYLOOP_ADDITIVE,
                    symmetric=False,
                    act_order=False,
                    source_tensors=(),
                )
            )


# --------------------------------------------------------------------------- fuzzing

_FUZZ_SEED_FILE: dict[str, bytes] = {}


def _seed_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    if "raw" not in _FUZZ_SEED_FILE:
        path, *_ = write_one(tmp_path_factory.mktemp("fuzz") / "seed.tinyloop", k=32, n=16, group=16)
        _FUZZ_SEED_FILE["raw"] = path.read_bytes()
    return _FUZZ_SEED_FILE["raw"]


def _only_our_errors(path: Path) -> None:
    try:
        with TinyloopSource(path) as src:
            plan = src.plan()
            for layer in plan.layers:
                src.load_layer(layer)
            for info in plan.tensors:
                src.load_tensor(info.name)
    except ConverterError:
        pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_byte_mutations_raise_only_our_errors(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    raw = bytearray(_seed_bytes(tmp_path_factory))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(raw))))
    path = tmp_path_factory.mktemp("f") / "f.tinyloop"
    path.write_bytes(bytes(raw[:cut] if cut is not None else raw))
    _only_our_errors(path)


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_header_fields_raise_only_our_errors(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    raw = _seed_bytes(tmp_path_factory)
    (header_len,) = struct.unpack_from("<Q", raw, 16)
    header = json.loads(raw[24 : 24 + header_len])
    start = -(-(24 + header_len) // 64) * 64
    section = data.draw(st.sampled_from(["tensors", "linears"]))
    entry = data.draw(st.sampled_from(sorted(header[section])))
    key = data.draw(st.sampled_from([*sorted(header[section][entry]), "extra"]))
    header[section][entry][key] = data.draw(_json_values)
    path = tmp_path_factory.mktemp("h") / "h.tinyloop"
    rebuild(path, json.dumps(header), raw[start:])
    _only_our_errors(path)


def test_lone_surrogate_in_header(tmp_path: Path) -> None:
    path = rebuild(tmp_path / "s.tinyloop", '{"model": {"name": "\\ud800"}, "tensors": {}, "linears": {}}', b"")
    with pytest.raises(SourceFormatError, match="header: header JSON escapes a lone UTF-16 surrogate"):
        TinyloopSource(path)


def test_not_a_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.tinyloop"
    if not hasattr(os, "mkfifo"):
        pytest.skip("no named pipes on this platform")
    os.mkfifo(fifo)
    with pytest.raises(SourceFormatError, match="pipe.tinyloop: not a regular file"):
        TinyloopSource(fifo)


def test_unconverted_layer_with_bias_and_channels(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    tensors, entry = quantize_linear_tinyloop(
        "x", w, 4, 32, rng, bias=np.ones(64), exact_int4=True, channels=("frac4", "sign_bit")
    )
    path = write_tinyloop(tmp_path / "x.tinyloop", {}, tensors, {"x": entry})
    with TinyloopSource(path) as src:
        plan = src.plan()
    (layer,) = plan.layers
    assert not layer.convertible and layer.reason == EXACT_INT4_REASON
    assert layer.bias is not None and layer.bias.name == "x.bias"
    assert layer.source_tensors == ("x.qweight", "x.scale", "x.zero", "x.frac4", "x.sign_bit")
    assert plan.tensors == []
    assert plan.passthrough_reasons == {
        f"x.{s}": f"layer x not converted: {EXACT_INT4_REASON}"
        for s in ("qweight", "scale", "zero", "bias", "frac4", "sign_bit")
    }

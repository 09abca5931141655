"""GPTQ reader extensions (issue 4): 2/3/8-bit, group sizes, mislabelled files, zero
borrows, bf16 scales, dynamic overrides, modules_to_not_convert, lm_head, sharded input.

Every fixture is packed by tests/helpers/producers.py the way its producer packs it,
converted, verified exactly against its source, and then checked against the TRUE
codes and zeros that were generated (the independent proof: ``--against`` uses our
own reader).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from converter.convert import convert
from converter.errors import ConfigError, SourceFormatError, UnsupportedQuantError
from converter.formats import open_source
from converter.formats.gptq import GptqSource
from converter.formats.hf_checkpoint import HFCheckpoint
from converter.formats.packing import (
    act_order_perm,
    decode_gptq_zeros,
    gather_rows,
    pack_words,
    unpack_words,
)
from converter.marlin.layout import pack_b
from tests.helpers.producers import (
    assert_truth,
    autogptq_pack_cols,
    autogptq_pack_rows,
    convert_and_verify,
    gptq_config,
    gptq_qzeros,
    gptq_tensors,
    make_layer,
    plain_tensors,
    write_checkpoint,
)
from tests.helpers.synthetic_gptq import small_gptq

P = "model.layers.0.mlp.up_proj"


def slow_unpack_rows(words: np.ndarray, bits: int, k: int) -> np.ndarray:
    """Per element, straight from spec 1.2: code k is bits [b*k', b*k'+b) of the
    little-endian bit string formed by each column's words."""
    u = words.view(np.uint32)
    n = u.shape[1]
    out = np.zeros((k, n), dtype=np.uint8)
    for col in range(n):
        big = 0
        for r in range(u.shape[0]):
            big |= int(u[r, col]) << (32 * r)
        for kk in range(k):
            out[kk, col] = (big >> (bits * kk)) & ((1 << bits) - 1)
    return out


# --------------------------------------------------------------------------- packing


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_unpack_matches_slow_reference_and_autogptq_packer(bits: int) -> None:
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 1 << bits, (64, 8), dtype=np.uint8)
    words = autogptq_pack_rows(q, bits)
    assert words.shape == (64 * bits // 32, 8)
    np.testing.assert_array_equal(slow_unpack_rows(words, bits, 64), q)
    np.testing.assert_array_equal(unpack_words(words, bits, axis=0), q)
    np.testing.assert_array_equal(pack_words(q, bits, axis=0), words)
    np.testing.assert_array_equal(unpack_words(autogptq_pack_cols(q.T, bits), bits, axis=1), q.T)


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([2, 3, 4, 8]), blocks=st.integers(1, 4), n=st.integers(1, 9), seed=st.integers(0, 2**31))
def test_pack_unpack_roundtrip_random_shapes(bits: int, blocks: int, n: int, seed: int) -> None:
    k = 32 * blocks
    q = np.random.default_rng(seed).integers(0, 1 << bits, (k, n), dtype=np.uint8)
    w = pack_words(q, bits, axis=0)
    np.testing.assert_array_equal(w, autogptq_pack_rows(q, bits))
    np.testing.assert_array_equal(unpack_words(w, bits, axis=0), q)
    rows = np.random.default_rng(seed).permutation(k)
    np.testing.assert_array_equal(gather_rows(w, rows, bits), q[rows])


def test_three_bit_straddling_values_10_and_21() -> None:
    # Value 10 occupies bits 30..32: 2 bits at the top of word0, 1 at the bottom of word1.
    q = np.zeros((32, 1), dtype=np.uint8)
    q[10, 0] = 0b111
    assert [int(x) for x in pack_words(q, 3, axis=0).view(np.uint32)[:, 0]] == [0xC0000000, 0x1, 0x0]
    q[:] = 0
    q[21, 0] = 0b111  # bits 63..65: 1 bit at the top of word1, 2 at the bottom of word2
    assert [int(x) for x in pack_words(q, 3, axis=0).view(np.uint32)[:, 0]] == [0x0, 0x80000000, 0x3]


@pytest.mark.parametrize(
    ("bits", "v1", "v2"),
    [
        (2, [0x55555555], [0xAAAAAAAA]),
        (3, [0xDB6DB6DB, 0xB6DB6DB6, 0x6DB6DB6D], [0x24924924, 0x49249249, 0x92492492]),
        (4, [0x77777777], [0x88888888]),
        (8, [0x7F7F7F7F], [0x80808080]),
    ],
)
def test_symmetric_qzeros_words_spec_table(bits: int, v1: list[int], v2: list[int]) -> None:
    """checkpoint-formats.md 1.6 table: both producers' words decode to z = 2^(b-1)."""
    n = 32 * len(v1) // bits
    z = np.full((1, n), 1 << (bits - 1), dtype=np.uint8)
    assert [int(w) for w in gptq_qzeros(z, bits, v1=True).view(np.uint32)[0]] == v1
    assert [int(w) for w in gptq_qzeros(z, bits, v1=False).view(np.uint32)[0]] == v2
    for words, is_v1 in ((v1, True), (v2, False)):
        arr = np.array([words], dtype=np.uint32).view(np.int32)
        np.testing.assert_array_equal(decode_gptq_zeros(arr, bits, v1=is_v1), z)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_v1_borrow_decodes_true_zero_of_zero(bits: int) -> None:
    """GPTQModel subtracts the per-field 1 from whole words with borrows; a true zero
    of 0 borrows from the next field.  Our decode gives back the true zeros."""
    rng = np.random.default_rng(7)
    z = rng.integers(0, 1 << bits, (3, 64), dtype=np.uint8)
    z[:, ::5] = 0
    np.testing.assert_array_equal(decode_gptq_zeros(gptq_qzeros(z, bits, v1=True), bits, v1=True), z)


def test_act_order_perm_shared_helper() -> None:
    g_idx = np.array([1, 0, 1, 0], dtype=np.int32)
    np.testing.assert_array_equal(act_order_perm(g_idx, 2, 2, path="f", tensor="t"), [1, 3, 0, 2])
    assert act_order_perm(np.array([0, 0, 1, 1]), 2, 2, path="f", tensor="t") is None
    with pytest.raises(
        SourceFormatError,
        match=r"f: t: act-order groups must each have group_size=2 members; group 0 has 3 \(expected 2\)",
    ):
        act_order_perm(np.array([0, 0, 0, 1]), 2, 2, path="f", tensor="t")
    with pytest.raises(SourceFormatError, match=r"values must lie in \[0, 2\), found \[0, 2\]"):
        act_order_perm(np.array([0, 2, 1, 1]), 2, 2, path="f", tensor="t")


# --------------------------------------------------------------------------- bit widths and groups


@pytest.mark.parametrize(
    ("bits", "group", "v1", "act"),
    [
        (2, 128, True, False),
        (2, 32, False, False),
        (3, 128, True, False),
        (3, 64, False, True),
        (3, -1, True, False),
        (4, 32, True, False),
        (4, 64, False, True),
        (4, 256, True, False),
        (4, -1, False, False),
        (2, 64, True, True),
    ],
)
def test_bit_widths_and_group_sizes_convert_losslessly(
    tmp_path: Path, bits: int, group: int, v1: bool, act: bool
) -> None:
    rng = np.random.default_rng(bits * 1000 + group)
    lay = make_layer(rng, 512, 128, bits=bits, group_size=group, act_order=act, zeros="with_zero", bias=True)
    tensors = {**gptq_tensors(P, lay, v1=v1), **plain_tensors(rng)}
    src = write_checkpoint(
        tmp_path / "src",
        tensors,
        gptq_config(bits, group, fmt="gptq" if v1 else "gptq_v2", desc_act=act),
        where="quantize_config.json",
    )
    out = convert_and_verify(src, tmp_path / "a.safetensors")
    (rec,) = out["converted"]
    assert (rec["bits"], rec["size_k"], rec["size_n"]) == (bits, 512, 128)
    assert rec["group_size"] == (512 if group == -1 else group)
    assert rec.get("act_order", False) is act
    assert rec["kernel_compatible"] is True  # K = 512, N = 128: every group size that converts
    assert rec["upstream_marlin_compatible"] is False  # N = 128 < 256
    got = assert_truth(tmp_path / "a.safetensors", P, lay)
    assert (got["perm"] is not None) is act


def test_eight_bit_passes_through_with_reason(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    lay = make_layer(rng, 128, 64, bits=8)
    src = write_checkpoint(tmp_path / "src", gptq_tensors(P, lay, v1=True), gptq_config(8, 128))
    out = convert_and_verify(src, tmp_path / "a.safetensors")
    assert out["converted"] == []
    reasons = {p["name"]: p["reason"] for p in out["passthrough"]}
    assert reasons[f"{P}.qweight"] == f"layer {P} not converted: 8-bit codes do not fit Marlin's 4-bit layout"
    assert set(reasons) == {f"{P}.{s}" for s in ("qweight", "qzeros", "scales", "g_idx")}


def test_bits_contradicting_g_idx_is_a_config_error(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    lay = make_layer(rng, 256, 64, bits=3)
    src = write_checkpoint(
        tmp_path / "src", gptq_tensors(P, lay, v1=True), gptq_config(4, 128), where="quantize_config.json"
    )
    with pytest.raises(
        ConfigError,
        match=r"quantize_config.json: model.layers.0.mlp.up_proj bits: bits=4 gives K = 192 "
        r"from qweight's 24 rows, but g_idx has 256 entries; bits=3 would fit",
    ):
        convert(src, tmp_path / "a.safetensors")


def test_a_g_idx_no_width_explains_is_named_not_the_config(tmp_path: Path) -> None:
    lay = make_layer(np.random.default_rng(3), 256, 64, act_order=True)
    tensors = gptq_tensors(P, lay, v1=True)
    tensors[f"{P}.g_idx"] = tensors[f"{P}.g_idx"][:100]
    src = write_checkpoint(tmp_path / "src", tensors, gptq_config(4, 128, desc_act=True), where="quantize_config.json")
    with pytest.raises(SourceFormatError) as exc:
        convert(src, tmp_path / "a.safetensors")
    assert str(exc.value) == (
        f"{src / 'model.safetensors'}: {P}.g_idx: g_idx has 100 entries, but qweight's 32 rows hold K = 256 "
        "4-bit codes (one entry per row of K)"
    )
    assert not (tmp_path / "a.safetensors").exists()


@pytest.mark.parametrize("act", [True, False])
def test_three_bits_on_four_bit_rows_is_a_config_error(tmp_path: Path, act: bool) -> None:
    """bits=3 where qweight's rows are no multiple of 3: when g_idx (act) or qzeros'
    width agree on another width, the config is named, with the width that fits."""
    rng = np.random.default_rng(4)
    lay = make_layer(rng, 256, 64, bits=4, act_order=act)
    tensors = gptq_tensors(P, lay, v1=True)
    if not act:
        tensors.pop(f"{P}.g_idx", None)
    src = write_checkpoint(tmp_path / "src", tensors, gptq_config(3, 128), where="quantize_config.json")
    with pytest.raises(
        ConfigError,
        match=r"quantize_config.json: model.layers.0.mlp.up_proj bits: bits=3, but qweight's 32 rows cannot "
        r"hold 3-bit codes: 3-bit packs 32 codes into every 3 rows \(spec 1.2\); bits=4 would fit",
    ):
        convert(src, tmp_path / "a.safetensors")


# --------------------------------------------------------------------------- mislabelled files


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize(("label", "stored_v1"), [("gptq", False), ("gptq_v2", True)])
def test_mislabelled_symmetric_zeros_decoded_by_the_data(
    tmp_path: Path, bits: int, label: str, stored_v1: bool
) -> None:
    """A sym layer whose zeros are all 2^(b-1) (v2) under a gptq (v1) label, or all
    2^(b-1) - 1 (v1) under gptq_v2: decoded by the data, with a layer warning."""
    rng = np.random.default_rng(11)
    lay = make_layer(rng, 128, 64, bits=bits, sym=True)
    src = write_checkpoint(
        tmp_path / "src", gptq_tensors(P, lay, v1=stored_v1), gptq_config(bits, 128, sym=True, fmt=label)
    )
    out = convert_and_verify(src, tmp_path / "a.safetensors")
    (rec,) = out["converted"]
    half = 1 << (bits - 1)
    stored = half - 1 if stored_v1 else half
    data = "gptq_v1" if stored_v1 else "gptq_v2"
    assert rec["zero_convention"] == data
    (w,) = rec["warnings"]
    assert f"but every stored zero is {stored}, the symmetric value of" in w and f"decoded as {data} (data wins)" in w
    assert rec["symmetric"] is True  # b-bit codes are stored centred on 8, so a symmetric layer has delta == 0
    assert_truth(tmp_path / "a.safetensors", P, lay)


def test_correctly_labelled_symmetric_file_has_no_warning(tmp_path: Path) -> None:
    rng = np.random.default_rng(12)
    lay = make_layer(rng, 128, 64, sym=True)
    src = write_checkpoint(tmp_path / "src", gptq_tensors(P, lay, v1=True), gptq_config(4, 128, sym=True))
    (rec,) = convert_and_verify(src, tmp_path / "a.safetensors")["converted"]
    assert rec["warnings"] == [] and rec["symmetric"] is True and rec["zero_convention"] == "gptq_v1"
    np.testing.assert_array_equal(assert_truth(tmp_path / "a.safetensors", P, lay)["delta"], 0)


def test_sym_true_with_varying_zeros_converts_with_delta_and_warns(tmp_path: Path) -> None:
    rng = np.random.default_rng(13)
    lay = make_layer(rng, 128, 64, zeros="vary_sym")
    src = write_checkpoint(tmp_path / "src", gptq_tensors(P, lay, v1=True), gptq_config(4, 128, sym=True))
    (rec,) = convert_and_verify(src, tmp_path / "a.safetensors")["converted"]
    assert rec["symmetric"] is False
    assert any(
        w.startswith("config says sym: true but 3 of 64 zero points differ from 8; converted with delta (data wins)")
        for w in rec["warnings"]
    )
    assert_truth(tmp_path / "a.safetensors", P, lay)


@pytest.mark.parametrize("bits", [3, 4])
def test_v1_true_zero_of_zero_warns_and_decodes_exactly(tmp_path: Path, bits: int) -> None:
    rng = np.random.default_rng(14)
    lay = make_layer(rng, 128, 64, bits=bits, zeros="with_zero")
    n_zero = int(np.count_nonzero(lay.z == 0))
    src = write_checkpoint(tmp_path / "src", gptq_tensors(P, lay, v1=True), gptq_config(bits, 128))
    (rec,) = convert_and_verify(src, tmp_path / "a.safetensors")["converted"]
    (w,) = rec["warnings"]
    # For 4-bit a borrow can also turn a neighbour field into 15; at least every true 0 shows.
    count = int(w.split(" ")[0])
    assert count >= n_zero and f"store {(1 << bits) - 1}, i.e. z - 1 = -1: a true zero of 0" in w
    assert_truth(tmp_path / "a.safetensors", P, lay)


# --------------------------------------------------------------------------- scales


def test_bf16_scales_convert_with_range_check(tmp_path: Path) -> None:
    rng = np.random.default_rng(15)
    lay = make_layer(rng, 128, 64, scale_dtype="BF16")
    src = write_checkpoint(
        tmp_path / "src", gptq_tensors(P, lay, v1=False), gptq_config(4, 128, fmt="gptq_v2"), scale_dtype="BF16"
    )
    with open_source(src) as s:
        assert s.ckpt.info(f"{P}.scales").dtype == "BF16"
    convert_and_verify(src, tmp_path / "a.safetensors")
    assert_truth(tmp_path / "a.safetensors", P, lay)


def test_bf16_scale_overflowing_fp16_names_the_layer(tmp_path: Path) -> None:
    rng = np.random.default_rng(16)
    lay = make_layer(rng, 128, 64, scale_dtype="BF16")
    lay.s[0, 5] = 131072.0  # exact in bf16, above fp16's 65504
    src = write_checkpoint(
        tmp_path / "src", gptq_tensors(P, lay, v1=False), gptq_config(4, 128, fmt="gptq_v2"), scale_dtype="BF16"
    )
    with pytest.raises(
        SourceFormatError,
        match=rf"model.safetensors: {P}.scales: 1 scales overflow float16 "
        r"\(largest \|s\| = 131072 > 65504\)",
    ):
        convert(src, tmp_path / "a.safetensors")
    assert not (tmp_path / "a.safetensors").exists()


def test_pack_dtype_other_than_int32_is_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng(17)
    lay = make_layer(rng, 128, 64)
    src = write_checkpoint(
        tmp_path / "src", gptq_tensors(P, lay, v1=True), gptq_config(pack_dtype="int16"), where="quantize_config.json"
    )
    with pytest.raises(
        UnsupportedQuantError,
        match=r"quantize_config.json: pack_dtype: pack_dtype 'int16' is not supported: only int32",
    ):
        convert(src, tmp_path / "a.safetensors")


@pytest.mark.parametrize(
    ("cfg", "field"),
    [({"checkpoint_format": "marlin"}, "checkpoint_format"), ({"is_marlin_format": True}, "is_marlin_format")],
)
def test_already_marlin_gptq_is_refused(tmp_path: Path, cfg: dict, field: str) -> None:
    src = write_checkpoint(tmp_path / "src", plain_tensors(np.random.default_rng(0)), {**gptq_config(), **cfg})
    with pytest.raises(
        UnsupportedQuantError, match=rf"config.json: {field}: checkpoint is already Marlin-packed .* never packs twice"
    ) as err:
        convert(src, tmp_path / "a.safetensors")
    # Documented change: the refusal is the one shared by every reader (formats.hf.already_marlin).
    assert err.value.rule == (
        "checkpoint is already Marlin-packed (AutoGPTQ checkpoint_format 'marlin': tensors B and s, symmetric only, "
        "spec 5.1); marlin-convert never packs twice: use the file as it is, or convert from the original GPTQ "
        "checkpoint"
    )


# --------------------------------------------------------------------------- per-module config


def _llama_block(rng: np.random.Generator, **cfg_for: dict) -> tuple[dict, dict]:
    layers, tensors = {}, {}
    for short, bits, group in (("q_proj", 4, 128), ("k_proj", 4, 64), ("up_proj", 8, 128)):
        name = f"model.layers.0.{'mlp' if short == 'up_proj' else 'self_attn'}.{short}"
        layers[name] = make_layer(rng, 128, 64, bits=bits, group_size=group)
        tensors.update(gptq_tensors(name, layers[name], v1=True))
    tensors["model.layers.0.mlp.down_proj.weight"] = rng.standard_normal((64, 128)).astype(np.float16)
    tensors["model.layers.0.self_attn.o_proj.weight"] = rng.standard_normal((64, 64)).astype(np.float16)
    return layers, tensors


def test_gptqmodel_dynamic_overrides(tmp_path: Path) -> None:
    rng = np.random.default_rng(18)
    layers, tensors = _llama_block(rng)
    dynamic = {r"-:.*down_proj": {}, r"+:.*\.up_proj": {"bits": 8}, r".*k_proj": {"group_size": 64}}
    src = write_checkpoint(
        tmp_path / "src", tensors, gptq_config(4, 128, dynamic=dynamic, modules_to_not_convert=["o_proj"])
    )
    out = convert_and_verify(src, tmp_path / "a.safetensors")
    conv = {r["name"]: r for r in out["converted"]}
    assert set(conv) == {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"}
    assert conv["model.layers.0.self_attn.k_proj"]["group_size"] == 64
    reasons = {p["name"]: p["reason"] for p in out["passthrough"]}
    assert (
        reasons["model.layers.0.mlp.down_proj.weight"]
        == "kept unquantized by the producer: excluded from quantization by dynamic rule '-:.*down_proj'"
    )
    assert (
        reasons["model.layers.0.self_attn.o_proj.weight"]
        == "kept unquantized by the producer: module matches modules_to_not_convert entry 'o_proj'"
    )
    assert (
        reasons["model.layers.0.mlp.up_proj.qweight"]
        == "layer model.layers.0.mlp.up_proj not converted: 8-bit codes do not fit Marlin's 4-bit layout"
    )
    for name in conv:
        assert_truth(tmp_path / "a.safetensors", name, layers[name])


def test_dynamic_bad_regex_is_a_config_error(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", plain_tensors(np.random.default_rng(0)), gptq_config(dynamic={"+:(": {}}))
    with pytest.raises(ConfigError, match=r"config.json: dynamic: key '\+:\(' is not a valid regular expression"):
        convert(src, tmp_path / "a.safetensors")


def test_quantized_lm_head_converts_and_unquantized_one_passes_through(tmp_path: Path) -> None:
    rng = np.random.default_rng(19)
    head = make_layer(rng, 64, 128)  # vocab 128, hidden 64
    tensors = {**gptq_tensors("lm_head", head, v1=False), **plain_tensors(rng)}
    src = write_checkpoint(tmp_path / "q", tensors, gptq_config(4, 64, fmt="gptq_v2", lm_head=True))
    out = convert_and_verify(src, tmp_path / "a.safetensors")
    assert [r["name"] for r in out["converted"]] == ["lm_head"] and out["converted"][0]["warnings"] == []
    assert_truth(tmp_path / "a.safetensors", "lm_head", head)
    # lm_head: false in the config but the data is quantized: converted, with a warning.
    src2 = write_checkpoint(tmp_path / "q2", tensors, gptq_config(4, 64, fmt="gptq_v2", lm_head=False))
    (rec,) = convert_and_verify(src2, tmp_path / "b.safetensors")["converted"]
    assert rec["warnings"] == ["config says lm_head: false but lm_head is quantized; converted by the data"]
    # lm_head: true but stored in fp16: carried over with that reason (a body layer is
    # quantized: a checkpoint without any quantized layer is refused).
    body = gptq_tensors("model.layers.0.mlp.up_proj", make_layer(rng, 64, 128), v1=True)
    plain = {**body, **plain_tensors(rng), "lm_head.weight": rng.standard_normal((128, 64)).astype(np.float16)}
    src3 = write_checkpoint(tmp_path / "q3", plain, gptq_config(4, 64, lm_head=True))
    out3 = convert_and_verify(src3, tmp_path / "c.safetensors")
    assert {p["name"]: p["reason"] for p in out3["passthrough"]}["lm_head.weight"].startswith(
        "config says lm_head: true but the checkpoint stores lm_head unquantized"
    )


# --------------------------------------------------------------------------- containers


def test_sharded_input_converts(tmp_path: Path) -> None:
    rng = np.random.default_rng(20)
    layers, tensors = _llama_block(rng)
    src = write_checkpoint(
        tmp_path / "src",
        tensors,
        gptq_config(4, 128, dynamic={r".*k_proj": {"group_size": 64}, r"+:.*up_proj": {"bits": 8}}),
        shards=3,
    )
    assert (src / "model.safetensors.index.json").is_file()
    for path in (src, src / "model.safetensors.index.json"):
        out = convert_and_verify(path, tmp_path / "a.safetensors", force=True)
        assert len(out["converted"]) == 2
    assert_truth(
        tmp_path / "a.safetensors", "model.layers.0.self_attn.q_proj", layers["model.layers.0.self_attn.q_proj"]
    )
    desc = json.loads(json.dumps(out))
    assert desc["source_format"] == "gptq"


def test_dynamic_unsupported_bits_pass_through_with_reason(tmp_path: Path) -> None:
    rng = np.random.default_rng(21)
    lay = make_layer(rng, 128, 64)
    src = write_checkpoint(
        tmp_path / "src", gptq_tensors(P, lay, v1=True), gptq_config(4, 128, dynamic={r".*up_proj": {"bits": 6}})
    )
    out = convert_and_verify(src, tmp_path / "a.safetensors")
    reasons = {p["name"]: p["reason"] for p in out["passthrough"]}
    assert reasons[f"{P}.qweight"] == (
        f"layer {P} not converted: 6-bit GPTQ (dynamic rule '.*up_proj') is not supported "
        "(2, 3, 4 convert; 8 passes through)"
    )


def test_legacy_quant_method_marlin_is_refused(tmp_path: Path) -> None:
    src = write_checkpoint(
        tmp_path / "src", plain_tensors(np.random.default_rng(0)), {"quant_method": "marlin", "group_size": 128}
    )
    with pytest.raises(
        UnsupportedQuantError,
        match=r"config.json: quant_method: quant_method 'marlin' checkpoints are already Marlin-packed",
    ):
        convert(src, tmp_path / "a.safetensors")


def test_unknown_quant_method_lists_supported(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", plain_tensors(np.random.default_rng(0)), {"quant_method": "bitsandbytes"})
    with pytest.raises(
        UnsupportedQuantError,
        match=r"quant_method: 'bitsandbytes' is not supported \(supported: awq, compressed-tensors, gptq\)",
    ):
        convert(src, tmp_path / "a.safetensors")


# --------------------------------------------------------------------------- conversion fast path


def test_gptq_fast_path_is_bit_identical(tmp_path: Path) -> None:
    """convert uses GptqSource.load_packed (B straight from qweight words); it must
    equal the reference path pack_b(load_layer().q) for every chunk."""
    src = small_gptq(tmp_path / "src", hidden=256, intermediate=512, kv=64, blocks=1, vocab=64)
    with GptqSource(HFCheckpoint(src)) as s:
        for layer in s.plan().layers:
            for k0, k1 in ((0, layer.size_k), (0, 128), (128, layer.size_k)):
                b, meta = s.load_packed(layer, k0, k1)
                full = s.load_layer(layer, k0, k1)
                assert np.array_equal(b, pack_b(full.q))
                assert np.array_equal(meta.scales, full.scales) and np.array_equal(meta.delta, full.delta)

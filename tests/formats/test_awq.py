"""AutoAWQ GEMM reader (issue 4): interleaved packing along N, unshifted zeros,
refusal of already-Marlin and other AWQ versions, modules_to_not_convert."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from converter.convert import convert
from converter.errors import SourceFormatError, UnsupportedQuantError
from converter.formats.packing import AWQ_ORDER, AWQ_REVERSE_ORDER, pack_awq, unpack_awq
from converter.marlin.layout import pack_b
from converter.verify import verify
from tests.helpers.producers import assert_truth, awq_pack, awq_tensors, make_layer, plain_tensors, write_checkpoint

P = "model.layers.0.self_attn.q_proj"


def awq_config(**kw) -> dict:
    return {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "version": "gemm",
        "zero_point": True,
        "modules_to_not_convert": None,
        **kw,
    }


def test_interleave_worked_example() -> None:
    # Column 8c + ORDER[i] sits in nibble i: code 1 in column 1 lands in nibble 4 (bit 16).
    codes = np.zeros((1, 8), dtype=np.uint8)
    codes[0, 1] = 1
    assert int(awq_pack(codes).view(np.uint32)[0, 0]) == 1 << 16
    assert int(pack_awq(codes).view(np.uint32)[0, 0]) == 1 << 16
    assert [AWQ_REVERSE_ORDER[j] for j in AWQ_ORDER] == list(range(8))


def test_unpack_awq_matches_autoawq_packer() -> None:
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (5, 64), dtype=np.uint8)
    words = awq_pack(codes)
    np.testing.assert_array_equal(unpack_awq(words), codes)
    np.testing.assert_array_equal(pack_awq(codes), words)


@pytest.mark.parametrize(("group", "bias"), [(128, False), (64, True), (32, False), (-1, True)])
def test_awq_fixture_converts_exactly(tmp_path: Path, group: int, bias: bool) -> None:
    rng = np.random.default_rng(group + 7)
    lay = make_layer(rng, 256, 128, group_size=group, bias=bias)
    src = write_checkpoint(
        tmp_path / "src", {**awq_tensors(P, lay), **plain_tensors(rng)}, awq_config(group_size=group)
    )
    report = convert(src, tmp_path / "a.safetensors")
    (rec,) = report.converted
    assert (rec.zero_convention, rec.group_size, rec.has_bias) == ("awq", 256 if group == -1 else group, bias)
    rep = verify(tmp_path / "a.safetensors", against=src, gpu=False)
    assert rep.ok, [p.message for p in rep.problems]
    assert_truth(tmp_path / "a.safetensors", P, lay)


def test_awq_symmetric_zeros_give_zero_delta(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    lay = make_layer(rng, 128, 64, sym=True)
    src = write_checkpoint(tmp_path / "src", awq_tensors(P, lay), awq_config())
    (rec,) = convert(src, tmp_path / "a.safetensors").converted
    assert rec.symmetric is True
    np.testing.assert_array_equal(assert_truth(tmp_path / "a.safetensors", P, lay)["delta"], 0)


def test_autoawq_marlin_version_is_refused(tmp_path: Path) -> None:
    src = write_checkpoint(
        tmp_path / "src", plain_tensors(np.random.default_rng(0)), awq_config(version="marlin", zero_point=False)
    )
    with pytest.raises(
        UnsupportedQuantError,
        match=r"config.json: version: AutoAWQ 'marlin' checkpoints are already "
        r"upstream-Marlin packed and symmetric .* never packs twice",
    ):
        convert(src, tmp_path / "a.safetensors")
    assert not (tmp_path / "a.safetensors").exists()


def test_marlin_packed_qweight_under_gemm_label_is_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    lay = make_layer(rng, 128, 64, sym=True)
    tensors = {f"{P}.qweight": pack_b(lay.q), f"{P}.scales": lay.s}
    src = write_checkpoint(tmp_path / "src", tensors, awq_config())
    with pytest.raises(
        UnsupportedQuantError, match=rf"{P}.qweight: qweight shape \[8, 128\] is Marlin's \(K/16, 2N\) for N = 64"
    ):
        convert(src, tmp_path / "a.safetensors")


@pytest.mark.parametrize("version", ["gemv", "gemv_fast"])
def test_other_awq_versions_are_refused(tmp_path: Path, version: str) -> None:
    src = write_checkpoint(tmp_path / "src", plain_tensors(np.random.default_rng(0)), awq_config(version=version))
    with pytest.raises(
        UnsupportedQuantError, match=rf"config.json: version: AWQ version '{version}' is not supported: only 'gemm'"
    ):
        convert(src, tmp_path / "a.safetensors")


def test_awq_missing_qzeros_is_a_format_error(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    lay = make_layer(rng, 128, 64)
    t = awq_tensors(P, lay)
    del t[f"{P}.qzeros"]
    src = write_checkpoint(tmp_path / "src", t, awq_config())
    with pytest.raises(SourceFormatError, match=rf"{P}.qzeros: layer {P} has qweight but no qzeros"):
        convert(src, tmp_path / "a.safetensors")


def test_awq_companion_of_the_wrong_rank_is_a_format_error(tmp_path: Path) -> None:
    """Documented change: the shared companion check (HFSource.need) names a wrong rank in
    the same words as a wrong shape."""
    rng = np.random.default_rng(3)
    t = awq_tensors(P, make_layer(rng, 128, 64))
    t[f"{P}.scales"] = t[f"{P}.scales"].reshape(-1)
    src = write_checkpoint(tmp_path / "src", t, awq_config())
    with pytest.raises(
        SourceFormatError,
        match=rf"{P}.scales: shape \[64\] disagrees with K, N and group_size "
        r"\(expected 2-D\)$",
    ):
        convert(src, tmp_path / "a.safetensors")


def test_modules_to_not_convert_pass_through_with_reason(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    lay = make_layer(rng, 128, 64)
    tensors = {
        **awq_tensors(P, lay),
        "model.layers.0.mlp.gate.weight": rng.standard_normal((8, 128)).astype(np.float16),
    }
    src = write_checkpoint(tmp_path / "src", tensors, awq_config(modules_to_not_convert=["mlp.gate"]))
    report = convert(src, tmp_path / "a.safetensors")
    reasons = {p.name: p.reason for p in report.passthrough}
    assert reasons == {
        "model.layers.0.mlp.gate.weight": "kept unquantized by the producer: module matches "
        "modules_to_not_convert entry 'mlp.gate'"
    }
    assert verify(tmp_path / "a.safetensors", against=src, gpu=False).ok


def test_legacy_autoawq_quant_config_json_without_quant_method(tmp_path: Path) -> None:
    """AutoAWQ's older quant_config.json spells w_bit / q_group_size / version "GEMM"."""
    rng = np.random.default_rng(5)
    lay = make_layer(rng, 128, 64, group_size=64)
    legacy = {"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}
    src = write_checkpoint(tmp_path / "src", awq_tensors(P, lay), legacy, where="quant_config.json")
    report = convert(src, tmp_path / "a.safetensors")
    assert report.source_format == "awq" and report.converted[0].group_size == 64
    assert verify(tmp_path / "a.safetensors", against=src, gpu=False).ok
    assert_truth(tmp_path / "a.safetensors", P, lay)

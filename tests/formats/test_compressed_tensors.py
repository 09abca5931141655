"""compressed-tensors pack-quantized reader (issue 4): nn.Linear orientation packed
along K, zero points packed along N, +2^(b-1) offset, actorder with weight_g_idx,
ignore list, config_groups targets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from converter.convert import convert
from converter.errors import SourceFormatError, UnsupportedQuantError
from converter.verify import verify
from tests.helpers.producers import (
    assert_truth,
    ct_pack_to_int32,
    ct_tensors,
    make_layer,
    plain_tensors,
    write_checkpoint,
)

P = "model.layers.0.self_attn.q_proj"


def ct_config(
    *,
    bits: int = 4,
    group: int | None = 128,
    sym: bool = False,
    strategy: str = "group",
    actorder: str | None = None,
    targets: list[str] | None = None,
    ignore: list[str] | None = None,
    fmt: str = "pack-quantized",
    extra_groups: dict | None = None,
) -> dict:
    weights = {
        "num_bits": bits,
        "type": "int",
        "symmetric": sym,
        "strategy": strategy,
        "group_size": group,
        "actorder": actorder,
        "dynamic": False,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": targets or ["Linear"], "weights": weights, "format": fmt},
            **(extra_groups or {}),
        },
        "ignore": ["lm_head"] if ignore is None else ignore,
        "sparsity_config": {},
    }


def test_pack_to_int32_offset_and_orientation() -> None:
    # signed -8 -> stored 0, signed 7 -> stored 15; packed LSB-first along the given dim.
    v = np.array([[-8, 7, 0, 1, -1, 2, 3, -3]], dtype=np.int8)
    word = int(ct_pack_to_int32(v, 4, 1).view(np.uint32)[0, 0])
    assert [(word >> (4 * i)) & 15 for i in range(8)] == [0, 15, 8, 9, 7, 10, 11, 5]
    col = ct_pack_to_int32(v.T, 4, 0)
    assert col.shape == (1, 1) and int(col.view(np.uint32)[0, 0]) == word


@pytest.mark.parametrize(
    ("bits", "group", "sym", "strategy", "act", "bias"),
    [
        (4, 128, False, "group", False, False),
        (4, 64, False, "group", True, True),
        (4, None, True, "channel", False, False),
        (4, 32, True, "group", False, True),
        (2, 128, False, "group", False, False),
    ],
)
def test_pack_quantized_fixture_converts_exactly(
    tmp_path: Path, bits: int, group: int | None, sym: bool, strategy: str, act: bool, bias: bool
) -> None:
    rng = np.random.default_rng(bits * 100 + (group or 0))
    lay = make_layer(rng, 256, 128, bits=bits, group_size=group or -1, sym=sym, act_order=act, bias=bias)
    tensors = {**ct_tensors(P, lay, sym=sym), **plain_tensors(rng)}
    assert (f"{P}.weight_g_idx" in tensors) is act
    src = write_checkpoint(
        tmp_path / "src",
        tensors,
        ct_config(bits=bits, group=group, sym=sym, strategy=strategy, actorder="group" if act else "static"),
    )
    report = convert(src, tmp_path / "a.safetensors")
    (rec,) = report.converted
    assert (rec.zero_convention, rec.bits, rec.group_size) == ("ct_offset8", bits, group or 256)
    assert rec.act_order is act
    assert rec.symmetric is (sym and bits == 4)
    rep = verify(tmp_path / "a.safetensors", against=src, gpu=False)
    assert rep.ok, [p.message for p in rep.problems]
    assert_truth(tmp_path / "a.safetensors", P, lay)


def test_no_strategy_and_group_size_minus_one_is_per_channel(tmp_path: Path) -> None:
    # compressed-tensors' QuantizationArgs reads group_size -1 without a strategy as "channel"
    rng = np.random.default_rng(31)
    lay = make_layer(rng, 256, 128, group_size=-1)
    cfg = ct_config(group=-1)
    del cfg["config_groups"]["group_0"]["weights"]["strategy"]
    src = write_checkpoint(tmp_path / "src", {**ct_tensors(P, lay, sym=False), **plain_tensors(rng)}, cfg)
    (rec,) = convert(src, tmp_path / "a.safetensors").converted
    assert rec.group_size == 256
    assert_truth(tmp_path / "a.safetensors", P, lay)


def test_ignore_and_targets(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    q = make_layer(rng, 128, 64)
    d = make_layer(rng, 128, 64, bits=8)
    tensors = {
        **ct_tensors(P, q, sym=False),
        **ct_tensors("model.layers.0.mlp.down_proj", d, sym=False),
        "lm_head.weight": rng.standard_normal((64, 128)).astype(np.float16),
        "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((64, 128)).astype(np.float16),
    }
    eight = {
        "targets": [r"re:.*down_proj$"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "group", "group_size": 128},
        "format": "pack-quantized",
    }
    cfg = ct_config(
        targets=[r"re:.*self_attn\..*"], ignore=["lm_head", r"re:.*gate_proj$"], extra_groups={"group_1": eight}
    )
    src = write_checkpoint(tmp_path / "src", tensors, cfg)
    report = convert(src, tmp_path / "a.safetensors")
    assert [r.name for r in report.converted] == [P]
    reasons = {p.name: p.reason for p in report.passthrough}
    assert (
        reasons["lm_head.weight"]
        == "kept unquantized by the producer: listed in quantization_config.ignore ('lm_head')"
    )
    assert (
        reasons["model.layers.0.mlp.gate_proj.weight"]
        == "kept unquantized by the producer: listed in quantization_config.ignore ('re:.*gate_proj$')"
    )
    assert reasons["model.layers.0.mlp.down_proj.weight_packed"] == (
        "layer model.layers.0.mlp.down_proj not converted: 8-bit codes (config group group_1) "
        "do not convert to Marlin's 4-bit layout"
    )
    assert verify(tmp_path / "a.safetensors", against=src, gpu=False).ok
    assert_truth(tmp_path / "a.safetensors", P, q)


EIGHT_BITS = {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "group", "group_size": 128}


@pytest.mark.parametrize(
    ("first", "later", "winner"),
    [
        (["Linear"], ["Linear"], "group_1"),  # one entry in two groups: the later group's
        ([P], [P], "group_1"),
        ([r"re:.*q_proj$"], [P], "group_1"),  # an exact name before a regex
        ([P], [r"re:.*q_proj$"], "group_0"),
        (["Linear"], [r"re:.*q_proj$"], "group_1"),  # a regex before a class name
        ([r"re:.*q_proj$"], ["Linear"], "group_0"),
        ([r"re:.*q_proj$"], [r"re:.*self_attn.*"], "group_0"),  # regexes in their first order
    ],
)
def test_group_precedence_is_the_engines(tmp_path: Path, first: list[str], later: list[str], winner: str) -> None:
    # vLLM and compressed-tensors map each target entry to its last group, then take an
    # exact name before a regex before a class name: convert what they would load
    rng = np.random.default_rng(8)
    lay = make_layer(rng, 128, 64)
    cfg = ct_config(targets=first, extra_groups={"group_1": {"targets": later, "weights": EIGHT_BITS}})
    if winner == "group_0":  # the 8-bit group is the loser: swap the args so the test says which applied
        cfg["config_groups"]["group_0"]["weights"], cfg["config_groups"]["group_1"]["weights"] = (
            EIGHT_BITS,
            cfg["config_groups"]["group_0"]["weights"],
        )
    src = write_checkpoint(tmp_path / "src", {**ct_tensors(P, lay, sym=False), **plain_tensors(rng)}, cfg)
    report = convert(src, tmp_path / "a.safetensors")
    assert not report.converted
    (refused,) = [p for p in report.passthrough if p.name == f"{P}.weight_packed"]
    assert refused.reason == (
        f"layer {P} not converted: 8-bit codes (config group {winner}) do not convert to Marlin's 4-bit layout"
    )


def test_marlin24_format_is_refused(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", plain_tensors(np.random.default_rng(0)), ct_config(fmt="marlin-24"))
    with pytest.raises(
        UnsupportedQuantError,
        match=r"config.json: format: compressed-tensors format \['marlin-24'\] is not supported: only 'pack-quantized'",
    ):
        convert(src, tmp_path / "a.safetensors")


@pytest.mark.parametrize("to", ["a.safetensors", "ct/"])
def test_an_online_transform_is_refused_not_dropped(tmp_path: Path, to: str) -> None:
    """A transform_config with groups (llm-compressor's Hadamard rotations) changes what the
    weights mean; converting or exporting without it would give another model, silently."""
    from converter.export import export_compressed_tensors

    rng = np.random.default_rng(8)
    cfg = ct_config()
    hadamard = {"type": "hadamard", "apply": [{"targets": ["re:.*o_proj$"], "location": "input"}]}
    cfg["transform_config"] = {"config_groups": {"R3": hadamard}}
    src = write_checkpoint(tmp_path / "src", {**ct_tensors(P, make_layer(rng, 128, 64), sym=False)}, cfg)
    run = convert if to.endswith(".safetensors") else export_compressed_tensors
    with pytest.raises(
        UnsupportedQuantError, match=r"config.json: transform_config: online transforms .* not supported"
    ):
        run(src, tmp_path / to)
    assert not (tmp_path / to).exists()
    cfg["transform_config"] = {"config_groups": {}}  # an empty one is no transform
    src = write_checkpoint(tmp_path / "src2", {**ct_tensors(P, make_layer(rng, 128, 64), sym=False)}, cfg)
    assert [r.name for r in convert(src, tmp_path / "b.safetensors").converted] == [P]


def test_quantized_input_activations_convert_weight_only_with_a_warning(tmp_path: Path) -> None:
    """A W4A8 group (``input_activations``): the weights convert exactly, and every layer
    says that Marlin runs its activations unquantized; a group without them says nothing."""
    rng = np.random.default_rng(9)
    lay = make_layer(rng, 128, 64)
    cfg = ct_config()
    acts = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}
    cfg["config_groups"]["group_0"]["input_activations"] = acts
    src = write_checkpoint(tmp_path / "src", ct_tensors(P, lay, sym=False), cfg)
    rep = convert(src, tmp_path / "a.safetensors")
    assert [list(r.warnings) for r in rep.converted] == [
        [
            "config group group_0 also quantizes input activations (int8 dynamic token); "
            "Marlin runs them unquantized in fp16: the converted layer is weight-only"
        ]
    ]
    assert verify(tmp_path / "a.safetensors", against=src, gpu=False).ok
    cfg["config_groups"]["group_0"]["input_activations"] = None
    src = write_checkpoint(tmp_path / "src2", ct_tensors(P, lay, sym=False), cfg)
    assert [list(r.warnings) for r in convert(src, tmp_path / "b.safetensors").converted] == [[]]


def test_weight_shape_disagreeing_with_packed_is_a_format_error(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    lay = make_layer(rng, 128, 64)
    t = ct_tensors(P, lay, sym=False)
    t[f"{P}.weight_shape"] = np.array([64, 256], dtype=np.int64)
    src = write_checkpoint(tmp_path / "src", t, ct_config())
    with pytest.raises(
        SourceFormatError,
        match=rf"{P}.weight_packed: shape \[64, 16\] disagrees with weight_shape \[N, K\] = \[64, 256\] at 4 bits "
        r"\(expected \[64, 32\]\)",
    ):
        convert(src, tmp_path / "a.safetensors")


@pytest.mark.parametrize("bits", [4, 3])  # 3-bit passes through: the negative size reached the plan unchecked
def test_negative_weight_shape_is_named(tmp_path: Path, bits: int) -> None:
    """Was 'weight_packed: ... disagrees with weight_shape [N, K] = [-64, -128] ... (expected [-64, -16])'."""
    rng = np.random.default_rng(6)
    t = ct_tensors(P, make_layer(rng, 128, 64), sym=False)
    t[f"{P}.weight_shape"] = np.array([-64, -128], dtype=np.int64)
    src = write_checkpoint(tmp_path / "src", t, ct_config(bits=bits))
    with pytest.raises(
        SourceFormatError,
        match=rf"model.safetensors: {P}.weight_shape: weight_shape \[N, K\] must hold two non-negative sizes, "
        r"found \[-64, -128\]$",
    ):
        convert(src, tmp_path / "a.safetensors")
    assert not (tmp_path / "a.safetensors").exists()


def test_asymmetric_group_without_zero_point_is_a_format_error(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    lay = make_layer(rng, 128, 64)
    t = ct_tensors(P, lay, sym=True)
    src = write_checkpoint(tmp_path / "src", t, ct_config(sym=False))
    with pytest.raises(
        SourceFormatError,
        match=rf"{P}.weight_zero_point: config group group_0 is asymmetric but the layer has no weight_zero_point",
    ):
        convert(src, tmp_path / "a.safetensors")

"""Layers whose last group is short (issue 15): ``K % group_size != 0``.

GPTQModel, AutoGPTQ and llm-compressor quantize such a layer with ``ceil(K / g)``
groups, the last one short (K = 576 at g = 128: 128, 128, 128, 128, 64).  Every
reader stores it at ``g' = gcd(K, g)`` rows per group, each source group's scale and
zero repeated for its slices (``source_group_size`` in the manifest), codes
unchanged.  The fixtures are packed by tests/helpers/producers.py as the producers
pack them; each is converted, verified exactly against its source (``--against``, CPU
numerics), and checked channel by channel against the TRUE codes, scales and zeros
that were generated (``assert_truth``: by the producer's ``g_idx``, not by our
regrouping).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from converter.convert import convert
from converter.errors import SourceFormatError
from converter.formats import open_source
from converter.verify import verify
from tests.helpers.producers import (
    RAGGED_SIZES,
    assert_truth,
    awq_tensors,
    convert_and_verify,
    ct_tensors,
    gptq_config,
    gptq_tensors,
    make_layer,
    plain_tensors,
    ragged_gptq,
    write_checkpoint,
)

Q, DOWN, K_PROJ = RAGGED_SIZES


@pytest.mark.parametrize("act", [False, True], ids=["in-order", "act-order"])
@pytest.mark.parametrize("v1", [True, False], ids=["v1", "v2"])
@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("group", [128, 256])
def test_short_last_group_converts_exactly(tmp_path: Path, group: int, bits: int, v1: bool, act: bool) -> None:
    """K = 576 and 960 at g = 128 and 256 (every layer on Marlin, at g' = 64)."""
    rng = np.random.default_rng(group + 10 * bits + 100 * v1 + 1000 * act)
    src, layers = ragged_gptq(tmp_path / "src", rng, bits=bits, group_size=group, v1=v1, act_order=act)
    out = convert_and_verify(src, tmp_path / "a.safetensors")
    assert out["not_converted"] == [] and len(out["converted"]) == 3
    recs = {r["name"]: r for r in out["converted"]}
    for name, (k, n) in RAGGED_SIZES.items():
        rec = recs[name]
        assert (rec["size_k"], rec["size_n"], rec["group_size"], rec["num_groups"]) == (k, n, 64, k // 64)
        assert rec["source_group_size"] == group and rec["bits"] == bits
        assert rec.get("act_order", False) is act and rec["kernel_compatible"] is True
        assert rec.get("padded_n") == (64 if n == 32 else None)
        got = assert_truth(tmp_path / "a.safetensors", name, layers[name])
        assert (got["perm"] is not None) is act


def test_the_short_group_is_the_last_and_its_rows_repeat(tmp_path: Path) -> None:
    """K = 576, g = 128: source groups of 128, 128, 128, 128, 64 become nine groups of 64;
    artifact group t holds source group t // 2."""
    rng = np.random.default_rng(5)
    src, layers = ragged_gptq(tmp_path / "src", rng, sizes={Q: (576, 64)})
    with open_source(src) as source:
        (lay,) = source.plan().layers
        assert (lay.group_size, lay.source_group_size, lay.source_groups, lay.num_groups) == (64, 128, (128, 5), 9)
        qw = source.load_layer(lay)
        # Loaded in chunks on source-group boundaries, the rows are the same.
        parts = [source.load_layer(lay, 0, 256), source.load_layer(lay, 256, 576)]
    truth = layers[Q]
    assert qw.group_size == 64 and qw.scales.shape == (9, 64)
    np.testing.assert_array_equal(qw.scales, truth.s[[0, 0, 1, 1, 2, 2, 3, 3, 4]].astype(np.float16))
    np.testing.assert_array_equal(qw.zeros, truth.z[[0, 0, 1, 1, 2, 2, 3, 3, 4]])
    np.testing.assert_array_equal(np.concatenate([p.scales for p in parts]), qw.scales)
    np.testing.assert_array_equal(np.concatenate([p.marlin_delta() for p in parts]), qw.marlin_delta())
    np.testing.assert_array_equal(qw.source_weight(), truth.weight())


def test_three_bit_short_last_group(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    src, layers = ragged_gptq(tmp_path / "src", rng, bits=3, group_size=128, v1=True, sizes={Q: (576, 64)})
    out = convert_and_verify(src, tmp_path / "a.safetensors")
    assert [(r["group_size"], r["source_group_size"], r["bits"]) for r in out["converted"]] == [(64, 128, 3)]
    assert_truth(tmp_path / "a.safetensors", Q, layers[Q])


def test_one_group_longer_than_k_is_per_channel(tmp_path: Path) -> None:
    """K = 64 at g = 128: one short group, stored as one group of K."""
    rng = np.random.default_rng(6)
    src, layers = ragged_gptq(tmp_path / "src", rng, v1=False, sizes={Q: (64, 64)})
    out = convert_and_verify(src, tmp_path / "a.safetensors")
    (rec,) = out["converted"]
    assert (rec["group_size"], rec["num_groups"], rec["source_group_size"]) == (64, 1, 128)
    assert_truth(tmp_path / "a.safetensors", Q, layers[Q])


def test_a_group_size_that_is_not_a_multiple_of_16_still_passes_through(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    src, _ = ragged_gptq(tmp_path / "src", rng, group_size=100, sizes={Q: (576, 64)})
    out = convert_and_verify(src, tmp_path / "a.safetensors")
    assert out["converted"] == []
    assert out["not_converted"] == [
        {
            "name": Q,
            "reason": "group_size = 100 is not a multiple of 16 that divides size_k = 576",
            "tensors": [f"{Q}.qweight", f"{Q}.qzeros", f"{Q}.scales", f"{Q}.g_idx"],
        }
    ]


def test_k_is_never_padded(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    src, _ = ragged_gptq(tmp_path / "src", rng, sizes={Q: (72, 64)})
    out = convert_and_verify(src, tmp_path / "a.safetensors")
    assert [(s["name"], s["reason"]) for s in out["not_converted"]] == [
        (Q, "size_k = 72 is not a multiple of 16 (Marlin tile)")
    ]


def test_act_order_with_the_short_group_not_last_is_refused(tmp_path: Path) -> None:
    """Act-order regroups because every source group is a contiguous run after the sort,
    the short one last (GPTQ's groups are runs of g in visiting order).  A g_idx whose
    short group is another one is refused, naming the group and the counts."""
    rng = np.random.default_rng(9)
    lay = make_layer(rng, 576, 64, group_size=128, act_order=True)
    sizes = np.array([128, 64, 128, 128, 128])  # group 1 short, group 4 full
    order = rng.permutation(576)
    lay.g_idx = np.empty(576, np.int32)
    lay.g_idx[order] = np.repeat(np.arange(5), sizes)
    src = write_checkpoint(
        tmp_path / "src",
        {**gptq_tensors(Q, lay, v1=True), **plain_tensors(rng)},
        gptq_config(4, 128, desc_act=True),
    )
    with pytest.raises(
        SourceFormatError,
        match=rf"{Q}.g_idx: act-order groups must each have group_size=128 members \(only the last, group 4, "
        r"may be short: 64 when K = 576\); group 1 has 64",
    ):
        convert(src, tmp_path / "a.safetensors")
    assert not (tmp_path / "a.safetensors").exists()


def test_awq_short_last_group(tmp_path: Path) -> None:
    """AutoAWQ itself quantizes only K % g == 0; a file whose scale rows say ceil(K / g)
    is read as those rows say: regrouped like GPTQ's."""
    rng = np.random.default_rng(10)
    lay = make_layer(rng, 576, 128, group_size=128)
    cfg = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}
    src = write_checkpoint(tmp_path / "src", {**awq_tensors(Q, lay), **plain_tensors(rng)}, cfg)
    out = convert_and_verify(src, tmp_path / "a.safetensors")
    assert [(r["group_size"], r["source_group_size"]) for r in out["converted"]] == [(64, 128)]
    assert_truth(tmp_path / "a.safetensors", Q, lay)


@pytest.mark.parametrize("act", [False, True], ids=["in-order", "actorder-group"])
def test_compressed_tensors_short_last_group(tmp_path: Path, act: bool) -> None:
    """compressed-tensors keeps ceil(K / g) groups (weight_scale (N, G)); actorder "group"
    carries weight_g_idx, regrouped as GPTQ's act-order."""
    rng = np.random.default_rng(11 + act)
    lay = make_layer(rng, 960, 64, group_size=256, act_order=act)
    weights = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 256}
    if act:
        weights["actorder"] = "group"
    cfg = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": "pack-quantized"}},
        "quantization_status": "compressed",
    }
    src = write_checkpoint(tmp_path / "src", {**ct_tensors(Q, lay, sym=False), **plain_tensors(rng)}, cfg)
    out = convert_and_verify(src, tmp_path / "a.safetensors")
    (rec,) = out["converted"]
    assert (rec["group_size"], rec["num_groups"], rec["source_group_size"], rec.get("act_order", False)) == (
        64,
        15,
        256,
        act,
    )
    assert_truth(tmp_path / "a.safetensors", Q, lay)


def test_tinyloop_has_no_short_last_group(tmp_path: Path) -> None:
    """The .tinyloop spec's group size divides K: a file that breaks it is refused on open."""
    from converter.formats.tinyloop_writer import quantize_linear_tinyloop, write_tinyloop

    rng = np.random.default_rng(12)
    w = rng.standard_normal((96, 64)).astype(np.float32)
    t, entry = quantize_linear_tinyloop("lin", w, 4, 32, rng)
    entry["group_size"] = 64
    with pytest.raises(
        SourceFormatError,
        match=r"lin: group_size = 64 does not divide in_features K = 96 \(the spec has no short last group\)",
    ):
        write_tinyloop(tmp_path / "t.tinyloop", {}, t, {"lin": entry})


@pytest.fixture()
def regrouped(tmp_path: Path) -> tuple[Path, Path]:
    src, _ = ragged_gptq(tmp_path / "src", np.random.default_rng(13), sizes={Q: (576, 128)})
    out = tmp_path / "a.safetensors"
    convert(src, out)
    return src, out


def test_shapes_checks_the_regrouping(regrouped: tuple[Path, Path], tmp_path: Path) -> None:
    """The rows of one source group are one row repeated; a re-sealed artifact whose
    rows differ, or whose group sizes do not follow, is inconsistent."""
    from tests.helpers.artifact_edit import rewrite_artifact, rewrite_artifact_arrays

    _, out = regrouped

    def one_row(manifest: dict, arrays: dict) -> None:
        d = arrays[f"{Q}.marlin_delta"][1].copy()
        d[3, 7] += 1.0  # artifact group 3 is the second slice of source group 1
        arrays[f"{Q}.marlin_delta"] = ("F32", d)

    rep = verify(rewrite_artifact_arrays(out, tmp_path / "rows.safetensors", one_row), shapes_only=True)
    assert [(p.code, p.message) for p in rep.problems] == [
        (
            "manifest_inconsistent",
            f"{Q}.marlin_delta: row 3 differs from row 2 of the same source group (source_group_size 128, "
            "group_size 64): a regrouped layer repeats each source group's row (1 row(s) differ)",
        )
    ]

    def sizes(manifest: dict, tensors: dict) -> None:
        manifest["layers"][0]["source_group_size"] = 192  # 576 = 3 x 192: nothing to regroup

    rep = verify(rewrite_artifact(out, tmp_path / "sizes.safetensors", sizes), shapes_only=True)
    assert [p.message for p in rep.problems] == [
        f"layer {Q}: source_group_size 192 with size_k 576 means no regrouping, but group_size is 64"
    ]


def test_a_wrong_source_group_size_is_caught_before_any_value(regrouped: tuple[Path, Path], tmp_path: Path) -> None:
    """A claimed source group size whose slices the rows do not repeat is structural: the
    layer is reported by ``--shapes`` and not compared or computed on."""
    from tests.helpers.artifact_edit import rewrite_artifact

    src, out = regrouped

    def claim(manifest: dict, tensors: dict) -> None:
        manifest["layers"][0]["source_group_size"] = 320  # also regroups 576 to 64

    bad = rewrite_artifact(out, tmp_path / "bad.safetensors", claim)
    rep = verify(bad, against=src, gpu=False)
    assert [(p.code, p.tensor) for p in rep.problems] == [
        ("manifest_inconsistent", f"{Q}.marlin_scales"),  # rows 0..4 would be one source group
        ("manifest_inconsistent", f"{Q}.marlin_delta"),
    ]
    assert rep.layers[0]["skipped"] == "structural problems (see problems)" and "cpu_rel_err" not in rep.layers[0]

"""Layers whose N no 64-column block divides convert padded (issue 15, ``--pad``, the default).

TinyLoop's head (vocabulary 50257) and tensor-parallel splits (N = 32) are stored with
N rounded up to a multiple of 64: zero columns (code 8, scale 1, delta 0), ``size_n``
the true N and ``padded_n`` the layout's; ``--against`` proves the real columns exact
and the padding zero, and the layer's outputs have exactly ``size_n`` columns.
``--no-pad`` passes such layers through, as before.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from converter.artifact.reader import open_artifact
from converter.constants import MARLIN_ZERO
from converter.convert import convert
from converter.marlin.layout import pack_b, permute_scales, unpack_b, unpermute_scales
from converter.verify import artifact_weight, unpack_layer, verify
from tests.helpers.artifact_edit import rewrite_artifact, rewrite_artifact_arrays
from tests.helpers.producers import (
    assert_truth,
    gptq_config,
    gptq_tensors,
    make_layer,
    plain_tensors,
    write_checkpoint,
)
from tests.helpers.sample import GPT2_VOCAB, build_vocab_head

HEAD = "head"


@pytest.fixture(scope="module")
def vocab_head(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("vocab")
    src = build_vocab_head(root / "v.tinyloop")
    out = root / "v.marlin.safetensors"
    convert(src, out)
    return src, out


def test_the_50257_vocabulary_head_converts_padded(vocab_head: tuple[Path, Path]) -> None:
    src, out = vocab_head
    with open_artifact(out) as art:
        rec = art.layers[HEAD]
        assert (rec.size_n, rec.padded_n, rec.layout_n, rec.num_groups) == (GPT2_VOCAB, 50304, 50304, 2)
        assert rec.kernel_compatible and rec.has_bias and art.layers["blk.0.mlp"].padded_n is None
        infos = art.file.infos
        assert infos["head.marlin_B"].shape == (4, 2 * 50304)
        assert infos["head.marlin_scales"].shape == infos["head.marlin_delta"].shape == (2, 50304)
        assert infos["head.bias"].shape == (GPT2_VOCAB,)  # the bias is the true N
        u = unpack_layer(art, rec)
        assert artifact_weight(u, rec).shape == (64, GPT2_VOCAB)
        # The padding is the zero weight: code 8, scale 1, delta +0.
        assert np.all(u["q"][:, GPT2_VOCAB:] == MARLIN_ZERO)
        assert np.all(u["scales"][:, GPT2_VOCAB:] == np.float16(1))
        assert not np.any(u["delta"][:, GPT2_VOCAB:].view(np.uint32))
    report = verify(out, against=src, gpu=False)
    assert report.ok, [p.message for p in report.problems]
    row = next(r for r in report.layers if r["name"] == HEAD)
    assert row["padded_n"] == 50304 and row["size_n"] == GPT2_VOCAB
    assert row["padding_exact"] and row["codes_exact"] and row["scales_exact"] and row["delta_exact"]
    assert row["cpu_rel_err"] <= 1e-5


def test_no_pad_passes_the_head_through(vocab_head: tuple[Path, Path], tmp_path: Path) -> None:
    src, _ = vocab_head
    out = tmp_path / "np.safetensors"
    report = convert(src, out, pad=False)
    assert [lay.name for lay in report.converted] == ["blk.0.mlp"]
    reason = "size_n = 50257 is not a multiple of 64 (Marlin tile)"
    assert [(s.name, s.reason) for s in report.not_converted] == [(HEAD, reason)]
    assert {p.name: p.reason for p in report.passthrough}["head.qweight"] == f"layer {HEAD} not converted: {reason}"
    # --against reads the --no-pad choice from the artifact.
    rep = verify(out, against=src, gpu=False)
    assert rep.ok, [p.message for p in rep.problems]


def test_a_n32_gptq_layer_converts_padded(tmp_path: Path) -> None:
    """A kv projection split for tensor parallelism: N = 32 -> padded_n 64."""
    rng = np.random.default_rng(32)
    lay = make_layer(rng, 256, 32, group_size=64, act_order=True, bias=True)
    name = "model.layers.0.self_attn.k_proj"
    src = write_checkpoint(
        tmp_path / "src", {**gptq_tensors(name, lay, v1=True), **plain_tensors(rng)}, gptq_config(4, 64)
    )
    report = convert(src, tmp_path / "a.safetensors")
    (rec,) = report.converted
    assert (rec.size_n, rec.padded_n, rec.act_order, rec.has_bias) == (32, 64, True, True)
    rep = verify(report.output, against=src, gpu=False)
    assert rep.ok, [p.message for p in rep.problems]
    got = assert_truth(tmp_path / "a.safetensors", name, lay)  # padding: code 8, scale 1, delta +0
    assert got["padding"]["q"].shape == (256, 32)


def _edit_padding(art_path: Path, dst: Path, what: str) -> Path:
    """Re-seal the artifact with one padding value of the head changed."""

    def edit(manifest: dict, arrays: dict) -> None:
        n, pn = GPT2_VOCAB, 50304
        if what == "codes":
            q = unpack_b(arrays["head.marlin_B"][1], pn)
            q[3, n + 5] = 7
            arrays["head.marlin_B"] = ("I32", pack_b(q))
        elif what == "scales":
            s = unpermute_scales(arrays["head.marlin_scales"][1].copy(), single=False)
            s[1, pn - 1] = 2.0
            arrays["head.marlin_scales"] = ("F16", permute_scales(s, single=False))
        else:
            d = arrays["head.marlin_delta"][1].copy()
            d[0, n] = -0.0
            arrays["head.marlin_delta"] = ("F32", d)

    return rewrite_artifact_arrays(art_path, dst, edit)


@pytest.mark.parametrize(
    ("what", "message"),
    [
        (
            "codes",
            r"^layer head: padding columns 50257..50303 of codes must all be 8; 1 differ, first at \[3, 50262\]: 7$",
        ),
        ("scales", r"padding columns 50257..50303 of scales must all be 1; 1 differ, first at \[1, 50303\]: 2.0"),
        ("delta", r"padding columns 50257..50303 of delta must all be 0; 1 differ, first at \[0, 50257\]: -0.0"),
    ],
)
def test_against_proves_the_padding_is_zero(vocab_head: tuple[Path, Path], tmp_path: Path, what, message) -> None:
    src, out = vocab_head
    bad = _edit_padding(out, tmp_path / "bad.safetensors", what)
    assert verify(bad, shapes_only=True).ok  # the structure is fine; only the values lie
    rep = verify(bad, against=src, gpu=False, shapes_only=True)
    problems = [p for p in rep.problems if p.severity == "error"]
    assert [p.code for p in problems] == ["source_mismatch"]
    assert re.search(message, problems[0].message), problems[0].message
    row = next(r for r in rep.layers if r["name"] == HEAD)
    assert row["padding_exact"] is False and row["codes_exact"] and row["scales_exact"] and row["delta_exact"]


@pytest.mark.parametrize(
    ("padded_n", "message"),
    [
        (None, "layer head: size_n 50257 is not a multiple of 64 and padded_n is absent"),
        (50368, "layer head: padded_n 50368 is not size_n 50257 rounded up to a multiple of 64 (expected 50304)"),
    ],
)
def test_shapes_checks_padded_n(vocab_head: tuple[Path, Path], tmp_path: Path, padded_n, message) -> None:
    _, out = vocab_head

    def edit(manifest: dict, tensors: dict) -> None:
        head = next(lay for lay in manifest["layers"] if lay["name"] == HEAD)
        if padded_n is None:
            del head["padded_n"]
        else:
            head["padded_n"] = padded_n

    bad = rewrite_artifact(out, tmp_path / "bad.safetensors", edit)
    rep = verify(bad, shapes_only=True)
    assert message in [p.message for p in rep.problems if p.code == "manifest_inconsistent"]
    # The tensors no longer have the shapes the record implies, and that is said too.
    assert {p.tensor for p in rep.problems if p.code == "shape_mismatch"} == {
        "head.marlin_B",
        "head.marlin_scales",
        "head.marlin_delta",
    }


def test_a_padded_n_on_a_layer_that_needs_none_is_inconsistent(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    lay = make_layer(rng, 128, 64, group_size=64)
    src = write_checkpoint(tmp_path / "src", gptq_tensors("m.l", lay, v1=True), gptq_config(4, 64))
    out = convert(src, tmp_path / "a.safetensors").output

    def edit(manifest: dict, tensors: dict) -> None:
        manifest["layers"][0]["padded_n"] = 64

    rep = verify(rewrite_artifact(Path(out), tmp_path / "bad.safetensors", edit), shapes_only=True)
    assert [p.message for p in rep.problems] == [
        "layer m.l: padded_n 64 is not size_n 64 rounded up to a multiple of 64 (expected absent)"
    ]

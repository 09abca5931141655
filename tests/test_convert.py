"""Narrow codes are stored centred on Marlin's zero 8, exactly and losslessly."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from converter.artifact.reader import open_artifact
from converter.convert import convert
from converter.formats import open_source
from converter.quant_weight import marlin_code_offset
from converter.verify import unpack_layer
from tests.helpers.paths import SAMPLE

INT2_LAYER = "pre.1.attn_qkv"


def test_code_offsets() -> None:
    assert [marlin_code_offset(b) for b in (2, 3, 4)] == [6, 4, 0]


def test_int2_layer_is_centred(tmp_path: Path) -> None:
    out = tmp_path / "s.safetensors"
    convert(SAMPLE, out)
    with open_source(SAMPLE) as src:
        layer = next(lay for lay in src.plan().layers if lay.name == INT2_LAYER)
        qw = src.load_layer(layer)
    assert qw.bits == 2 and int(qw.q.max()) <= 3
    with open_artifact(out) as art:
        rec = art.layers[INT2_LAYER]
        assert rec.code_offset == 6 and rec.bits == 2
        u = unpack_layer(art, rec)
        np.testing.assert_array_equal(u["q"].astype(np.int16), qw.q.astype(np.int16) + 6)
        assert 6 <= int(u["q"].min()) and int(u["q"].max()) <= 9
        # delta = zero + 2 * scale, one fp32 step from the stored fp16 values.
        want = qw.zeros.astype(np.float32) + np.float32(2) * qw.scales.astype(np.float32)
        np.testing.assert_array_equal(u["delta"], want)
        # The artifact reproduces the source weight to fp32 rounding.
        g = np.arange(rec.size_k) // rec.group_size
        w_art = (u["q"].astype(np.float32) - 8) * u["scales"].astype(np.float32)[g] + u["delta"][g]
        np.testing.assert_allclose(w_art, qw.source_weight(), rtol=0, atol=1e-6 * float(np.abs(w_art).max()))
        # Centred, |delta| is no larger than the weights it corrects (uncentred it was ~4x).
        assert float(np.abs(u["delta"]).max()) <= 1.01 * float(np.abs(w_art).max())
        four_bit = art.layers["pre.0.mlp_down"]
        assert four_bit.code_offset == 0


def test_progress_names_the_stages_before_the_slow_work(tmp_path: Path) -> None:
    """The first stage is announced before the input is planned (a multi-GB checkpoint
    plans for a while); the conversion stage counts converted layers and pass-through
    tensors."""
    calls: list[tuple[str, int]] = []
    report = convert(SAMPLE, tmp_path / "s.safetensors", progress=lambda d, n: calls.append((d, n)))
    stages = [(d, n) for d, n in calls if d]
    steps = 15 + 13  # the sample's converted layers and pass-through tensors
    assert (len(report.converted), len(report.passthrough)) == (15, 13)
    assert stages == [("planning sample.tinyloop", 1), ("converting sample.tinyloop", steps)]
    assert calls[0] == stages[0] and calls[1] == ("", 1)
    assert calls[2:] == [stages[1]] + [("", 1)] * steps


def test_a_tinyloop_model_folder_says_no_model_class_loads_it(tmp_path: Path) -> None:
    # from_pretrained on it fails in transformers ("does not recognize this architecture ...
    # upgrade transformers"), which misleads: the conversion says why and what runs it
    from converter.constants import TINYLOOP_MESSAGE

    folder = convert(SAMPLE, tmp_path / "folder")
    assert f"a model folder {TINYLOOP_MESSAGE}" in folder.warnings
    assert not any(TINYLOOP_MESSAGE in w for w in convert(SAMPLE, tmp_path / "one.safetensors").warnings)

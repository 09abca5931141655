"""Real third-party GPTQ checkpoints (shared/realinput): convert, then prove it."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from converter.artifact.reader import open_artifact
from converter.artifact.schema import load_schema
from converter.convert import convert
from converter.verify import unpack_layer, verify

# checkpoint -> (zero convention, symmetric, per-channel, act-order), from realinput/README.md
REAL_GPTQ = {
    "llama-tiny/autoround-gptq-w4g128-asym": ("gptq_v1", False, False, False),
    "llama-tiny/autoround-gptq-w4gchan-asym": ("gptq_v1", False, True, False),
    "llama-tiny/gptqmodel-gptqv2-w4g128-asym": ("gptq_v2", False, False, False),
    "llama-tiny/autogptq-w4g128-sym": ("gptq_v1", True, False, False),
    "llama-tiny/gptqmodel-gptq-w4g128-asym-descact": ("gptq_v1", False, False, True),
    "minilm/minilm-autoround-gptq-w4g128-asym-layers0-1": ("gptq_v1", False, False, False),
}


@pytest.fixture(scope="module")
def artifacts(realinput: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("real")
    arts = {}
    for name in REAL_GPTQ:
        arts[name] = out / (name.replace("/", "_") + ".safetensors")
        convert(realinput / name, arts[name])
    return arts


@pytest.mark.parametrize("name", list(REAL_GPTQ))
def test_real_checkpoint_verifies_exactly(name: str, artifacts: dict[str, Path], realinput: Path) -> None:
    report = verify(artifacts[name], against=realinput / name, gpu=False)
    assert report.ok, [p.message for p in report.problems]
    assert report.layers and all(
        row["codes_exact"] and row["scales_exact"] and row["delta_exact"] for row in report.layers
    )
    assert all(row["cpu_rel_err"] < 1e-5 for row in report.layers)


@pytest.mark.parametrize("name", list(REAL_GPTQ))
def test_real_manifest_records_conventions(name: str, artifacts: dict[str, Path], realinput: Path) -> None:
    convention, symmetric, per_channel, act_order = REAL_GPTQ[name]
    with open_artifact(artifacts[name]) as art:
        jsonschema.validate(art.document.data, load_schema())
        assert art.manifest.source.format == "gptq"
        assert art.manifest.producer.name == "marlin-convert"
        files = {f.name for f in art.manifest.source.files}
        assert any(f.endswith(".safetensors") for f in files)
        assert art.file.metadata["format"] == "pt"
        assert art.file.metadata["marlin.schema_version"] == "2"
        for entry in art.manifest.layers:
            assert entry.zero_convention == convention
            assert entry.symmetric is symmetric
            assert entry.act_order is act_order
            assert (entry.group_size == entry.size_k) is per_channel
            rec = art.layers[entry.name]
            u = unpack_layer(art, rec)
            assert (not np.any(u["delta"])) is symmetric
            if act_order:
                assert sorted(u["perm"].tolist()) == list(range(rec.size_k))


def test_real_sym_checkpoint_keeps_autogptq_zero_bias(artifacts: dict[str, Path]) -> None:
    # AutoGPTQ writes all-zero .bias tensors; they belong to their layers.
    with open_artifact(artifacts["llama-tiny/autogptq-w4g128-sym"]) as art:
        rec = art.layers["model.layers.0.self_attn.q_proj"]
        assert rec.has_bias
        assert not np.any(art.tensor("model.layers.0.self_attn.q_proj.bias"))


def test_minilm_biases_and_shapes(artifacts: dict[str, Path], realinput: Path) -> None:
    name = "minilm/minilm-autoround-gptq-w4g128-asym-layers0-1"
    with open_artifact(artifacts[name]) as art:
        layers = art.manifest.layers
        assert len(layers) == 12
        by_name = {lay.name: lay for lay in layers}
        inter = next(n for n in by_name if n.endswith("intermediate.dense"))
        assert (by_name[inter].size_k, by_name[inter].size_n) == (384, 1536)
        # 384 = 3 x 128: fine for us and our kernel, not for upstream Marlin (N % 256).
        q = next(n for n in by_name if n.endswith("attention.self.query"))
        assert by_name[q].kernel_compatible and not by_name[q].upstream_marlin_compatible
        assert all(lay.has_bias for lay in layers)
        bias = art.tensor(q + ".bias")
        assert bias.dtype == np.float16 and np.any(bias)


def test_gptq_v1_decodes_whole_word_borrows(realinput: Path) -> None:
    # Start from the true zeros of the v2 file, plant a true zero of 0 in the middle
    # of a word, and encode v1 as GPTQModel does: subtract 0x11111111 from whole
    # words, with borrows. Decoding must give the true zeros back.
    from converter.formats import open_source
    from converter.formats.packing import field_ones, pack_words, unpack_words

    with open_source(realinput / "llama-tiny/gptqmodel-gptqv2-w4g128-asym") as src:
        z_true = np.array(src.load_layer(src.plan().layers[0]).zeros)
    z_true[0, 3] = 0
    words = pack_words(z_true, 4, axis=1).view(np.uint32)
    v1 = words - np.uint32(0x11111111)
    naive = unpack_words(v1, 4, axis=1).astype(np.int16) + 1
    assert naive[0, 4] == z_true[0, 4] - 1, "the planted zero must borrow from its neighbour"
    np.testing.assert_array_equal(unpack_words(v1 + field_ones(4), 4, axis=1), z_true)


def test_dry_run_writes_nothing(tmp_path: Path, realinput: Path) -> None:
    out = tmp_path / "a.safetensors"
    report = convert(realinput / "llama-tiny/autoround-gptq-w4g128-asym", out, dry_run=True)
    assert report.dry_run and not out.exists() and not list(tmp_path.iterdir())
    assert len(report.converted) == 7
    assert {p.name for p in report.passthrough} == {
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.norm.weight",
    }
    json.dumps(report.to_json())

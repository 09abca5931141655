"""Every real third-party checkpoint in ../shared/realinput ($MARLIN_SHARED) converts and verifies
exactly (issue 4, "Real input"), and the producers agree with one another.

The cross-producer check is the independent proof for the AWQ and compressed-tensors
readers: the llama-tiny checkpoints quantize the same fp16 base model, so weights
decoded with the right layout and zero convention agree to quantization noise
(~0.15 relative), while a wrong interleave or zero convention gives > 0.3.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from converter.convert import convert
from converter.formats import open_source
from converter.verify import verify

#: checkpoint -> (source format, zero convention recorded per layer, act-order)
EXPECTED = {
    "llama-tiny/autoawq-gemm-w4g128-asym": ("awq", "awq", False),
    "llama-tiny/autogptq-w4g128-sym": ("gptq", "gptq_v1", False),
    "llama-tiny/autoround-gptq-w4g128-asym": ("gptq", "gptq_v1", False),
    "llama-tiny/autoround-gptq-w4gchan-asym": ("gptq", "gptq_v1", False),
    "llama-tiny/gptqmodel-gptq-w4g128-asym-descact": ("gptq", "gptq_v1", True),
    "llama-tiny/gptqmodel-gptqv2-w4g128-asym": ("gptq", "gptq_v2", False),
    "llama-tiny/llmcompressor-packq-w4g128-asym": ("compressed-tensors", "ct_offset8", False),
    "minilm/minilm-autoround-gptq-w4g128-asym-layers0-1": ("gptq", "gptq_v1", False),
}


def test_every_real_checkpoint_is_covered(realinput: Path) -> None:
    found = {
        f"{m.parent.name}/{e['name']}" for m in realinput.glob("*/MANIFEST.json") for e in json.loads(m.read_text())
    }
    assert found == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_checkpoint_converts_and_verifies_exactly(realinput: Path, tmp_path: Path, name: str) -> None:
    src = realinput / name
    fmt, convention, act = EXPECTED[name]
    report = convert(src, tmp_path / "a.safetensors")
    assert report.source_format == fmt and report.converted
    for rec in report.converted:
        assert rec.zero_convention == convention
        assert rec.act_order is act
        assert rec.warnings == ()
    rep = verify(tmp_path / "a.safetensors", against=src, gpu=False)
    assert rep.ok, [p.message for p in rep.problems]
    assert all(row["codes_exact"] and row["scales_exact"] and row["delta_exact"] for row in rep.layers)
    assert all(row["cpu_rel_err"] <= 1e-5 for row in rep.layers)


def _weights(root: Path, name: str) -> dict[str, np.ndarray]:
    out = {}
    with open_source(root / name) as s:
        for layer in s.plan().layers:
            qw = s.load_layer(layer)
            w = qw.source_weight()
            if qw.perm is not None:
                src = np.empty_like(w)
                src[qw.perm] = w
                w = src
            out[layer.name] = w
    return out


def test_producers_agree_on_the_same_base_model(realinput: Path) -> None:
    names = [n for n in EXPECTED if n.startswith("llama-tiny/")]
    ref = _weights(realinput, "llama-tiny/autoround-gptq-w4g128-asym")
    for name in names:
        w = _weights(realinput, name)
        assert w.keys() == ref.keys()
        for layer, a in w.items():
            rel = float(np.linalg.norm(a - ref[layer]) / np.linalg.norm(ref[layer]))
            assert rel < 0.3, f"{name} {layer}: {rel:.3f} from auto-round's decoding"


def test_wrong_awq_interleave_would_be_caught(realinput: Path) -> None:
    """Control for the test above: reading AWQ without the interleave disagrees."""
    ref = _weights(realinput, "llama-tiny/autoround-gptq-w4g128-asym")["model.layers.0.self_attn.q_proj"]
    w = _weights(realinput, "llama-tiny/autoawq-gemm-w4g128-asym")["model.layers.0.self_attn.q_proj"]
    k, n = w.shape
    wrong = w.reshape(k, n // 8, 8)[:, :, [0, 2, 4, 6, 1, 3, 5, 7]].reshape(k, n)
    assert np.linalg.norm(wrong - ref) / np.linalg.norm(ref) > 0.5

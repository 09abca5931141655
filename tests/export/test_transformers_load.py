"""Proof 3 for the real MiniLM (a BERT sentence-transformer): its compressed-tensors
export loads in transformers (CPU) through compressed-tensors' own quantizer, and the
loaded model equals the source's dequantized model.

The llama-tiny producers have the same proof in ``test_compressed_tensors_export.py``
(:func:`test_transformers_loads_export_through_compressed_tensors`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from converter.export import export_compressed_tensors

pytest.importorskip("compressed_tensors")
pytest.importorskip("transformers")

#: The GPTQ tensors that make up one quantized layer in the source (its dense weight is
#: rebuilt from them by ``ct_proof.source_layers``).
_GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")

#: A fixed batch of BERT vocabulary ids: one full row and one padded row, so the
#: attention mask matters ("[CLS] hello world , this is a test . [SEP]", "[CLS] good
#: morning [SEP]" + padding).
_IDS = [
    [101, 7592, 2088, 1010, 2023, 2003, 1037, 3231, 1012, 102],
    [101, 2204, 2851, 102, 0, 0, 0, 0, 0, 0],
]


# Each folder with its config; the reference parameters its source does not hold; and how
# many non-quantized reference tensors the source fills (all the others of BertModel's: the
# full model's 67 = 5 embeddings + 6 x (6 biases + 4 LayerNorm) + 2 pooler). The trimmed
# layers0-1 copy keeps only the encoder layers (config note: "embeddings/cls/pooler dropped
# to save space"), so transformers reports those as missing and initialises them; the test
# takes exactly those from the loaded model, and nothing else.
@pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")
@pytest.mark.parametrize(
    ("name", "absent", "n_plain"),
    [
        ("minilm-autoround-gptq-w4g128-asym-full", (), 67),
        ("minilm-autoround-gptq-w4g128-asym-layers0-1", ("embeddings.", "pooler."), 20),
    ],
)
def test_minilm_loads_through_compressed_tensors(
    realinput: Path, tmp_path: Path, name: str, absent: tuple[str, ...], n_plain: int
) -> None:
    """The exported MiniLM loads with ``AutoModel`` and ``CompressedTensorsConfig(dequantize=True)``
    (compressed-tensors' ``decompress`` builds each dense weight; the default compressed
    load refuses asymmetric pack-quantized checkpoints, see
    ``test_transformers_default_load_same_as_producer``); every quantized layer's dense
    weight is the source's exact dequantization rounded once to fp16, every other tensor
    is the source's, and the last hidden state equals the reference model's."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModel, CompressedTensorsConfig

    from tests.export.ct_proof import source_layers

    src = realinput / "minilm" / name
    if not (src / "config.json").is_file():
        pytest.skip(f"{src} not present")
    out = tmp_path / "out"
    summary = export_compressed_tensors(src, out)
    dtype = torch.float16  # the checkpoint's dtype (config.json) and its scales' dtype

    torch.manual_seed(0)  # the layers0-1 copy's missing embeddings are initialised
    model, info = AutoModel.from_pretrained(
        out,
        device_map="cpu",
        dtype=dtype,
        quantization_config=CompressedTensorsConfig(dequantize=True),
        output_loading_info=True,
    )
    assert type(model).__name__ == "BertModel"
    assert not info["mismatched_keys"] and not info["error_msgs"]
    # the MLM head is not BertModel's; everything else of the export is loaded
    assert all(k.startswith("cls.") for k in info["unexpected_keys"]), info["unexpected_keys"]
    assert set(info["missing_keys"]) == {k for k in model.state_dict() if k.startswith(absent)}

    # --- the reference: the source's architecture, tensors and exact dequantization
    cfg = AutoConfig.from_pretrained(src)
    del cfg.quantization_config  # the plain architecture, not a GPTQ load
    ref = AutoModel.from_config(cfg, dtype=dtype).eval()
    state = ref.state_dict()
    # Source names carry the base model's prefix ("bert.", written by BertForMaskedLM-
    # style producers) except the few auto-round put in model_extra_tensors (pooler,
    # position_ids), which AutoModel's names equal as they are.
    prefix = ref.base_model_prefix + "."
    layers = {k.removeprefix(prefix): v for k, v in source_layers(src).items()}
    assert len(layers) == len(summary.exported) > 0
    quant_parts = {f"{prefix}{n}.{p}" for n in layers for p in _GPTQ_PARTS}

    plain: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        plain.update(load_file(str(f)))
    filled, prefixed, unprefixed, head = set(), 0, 0, 0
    for k, v in plain.items():
        if k in quant_parts:
            continue
        if k.startswith("cls."):  # BertForPreTraining's MLM head: not part of BertModel
            head += 1
            continue
        key = k.removeprefix(prefix)
        prefixed, unprefixed = prefixed + (key != k), unprefixed + (key == k)
        if key == "embeddings.position_ids":  # a non-persistent buffer: must equal the model's
            assert torch.equal(v, ref.embeddings.position_ids), k
            continue
        assert key in state, f"source tensor {k} has no place in {type(ref).__name__}"
        assert state[key].shape == v.shape and key not in filled, k
        state[key].copy_(v.to(dtype))
        filled.add(key)
    for lname, lay in layers.items():
        # the source's exact weight (K, N) f32, rounded once to the model dtype
        dense = torch.from_numpy(lay["w"].T.copy()).to(dtype)
        key = f"{lname}.weight"
        assert key in state and key not in filled, key
        state[key].copy_(dense)
        filled.add(key)
    # no reference parameter is left at its random initialisation, but those the source lacks
    missing = set(state) - filled
    assert missing == set(info["missing_keys"]), sorted(missing)
    for k in missing:
        state[k].copy_(model.state_dict()[k])
    if not absent:
        assert prefixed > 0 and unprefixed > 0 and head > 0  # the full folder mixes both naming forms
    assert len(filled) - len(layers) == n_plain

    # --- the loaded model equals the reference bit for bit, tensor by tensor
    got = model.state_dict()
    assert set(got) == set(state)
    for k, v in state.items():
        assert got[k].dtype == v.dtype, k
        assert torch.equal(got[k].view(torch.int16), v.view(torch.int16)), k

    ids = torch.tensor(_IDS)
    mask = (ids != 0).long()
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        b = ref(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    # Same weights, same fp16 CPU kernels: the measured max difference is 0.0 (|h| <= ~8).
    # The tolerance is one fp16 rounding: eps 2^-10 ~ 9.8e-4 relative, with an absolute
    # floor of the same size for values near 0. A real error is far outside it: doubling
    # one layer's weight moves h by 0.29-3.0, doubling a single scale (one group of 128
    # weights of one output) by 0.009-0.2 (measured on both folders).
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)

"""The two proofs of an export: our reader reads it back exactly, and the
compressed-tensors library decompresses it, with its own code, to the source's exact
dequantization bit for bit in fp32."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from converter.formats import open_source


def source_layers(path: Path) -> dict[str, dict[str, np.ndarray | None]]:
    """Per layer: codes (K, N) in source row order, scales f32, zeros, g_idx, and the exact
    dequantization W (K, N) float32 in source row order, read with our readers."""
    out = {}
    with open_source(path) as src:
        for layer in src.plan(pad=True).layers:
            if not layer.convertible:
                continue
            qw = src.load_layer(layer)
            q, w = qw.q, qw.source_weight()
            if qw.perm is not None:
                q, w = np.empty_like(q), np.empty_like(w)
                q[qw.perm], w[qw.perm] = qw.q, qw.source_weight()
            out[layer.name] = {
                "q": q,
                "marlin_q": qw.q,
                "s": qw.source_scales_f32(),
                "z": np.asarray(qw.zeros),
                "perm": qw.perm,
                "w": w,
                "bits": qw.bits,
                "group_size": qw.group_size,
            }
    return out


def assert_reader_roundtrip(src: Path, export: Path) -> int:
    """Proof 1: our compressed-tensors reader gives the source's codes, scales and zero
    points exactly (layers of bit widths it reads: 2 and 4).  Returns layers compared."""
    a, b = source_layers(src), source_layers(export)
    n = 0
    for name, ref in a.items():
        if ref["bits"] not in (2, 4):
            continue
        got = b[name]
        np.testing.assert_array_equal(got["marlin_q"], ref["marlin_q"], err_msg=name)
        np.testing.assert_array_equal(got["s"].view(np.uint32), ref["s"].view(np.uint32), err_msg=name)
        np.testing.assert_array_equal(got["z"], ref["z"], err_msg=name)
        assert (got["perm"] is None) == (ref["perm"] is None), name
        if ref["perm"] is not None:
            np.testing.assert_array_equal(got["perm"], ref["perm"], err_msg=name)
        n += 1
    return n


def _export_tensors(export: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(export.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def library_dense(export: Path) -> dict[str, np.ndarray]:
    """Proof 2's side: every exported layer decompressed by compressed-tensors itself
    (its QuantizationConfig parses our config, PackedQuantizationCompressor.decompress
    unpacks and dequantizes), as float32 (K, N) in source row order.

    The scales are handed over upcast to float32 (exact) so that the library's
    ``dequantize`` computes and returns fp32.  For act-order layers, which 0.20.1's
    decompress no longer handles (it ignores ``weight_g_idx``), the test applies the
    g_idx the way vLLM does (sort K by g_idx, dequantize the contiguous groups with the
    library's ``dequantize``, unsort); everything else is the library's code.
    """
    import torch
    from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor, unpack_from_int32
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    raw = json.loads((export / "config.json").read_text())["quantization_config"]
    for group in raw["config_groups"].values():  # 0.20.1 refuses "group"; g_idx is applied below
        if group["weights"].get("actorder") == "group":
            group["weights"]["actorder"] = None
    qc = QuantizationConfig.model_validate(raw)
    tensors = _export_tensors(export)
    out = {}
    for scheme in qc.config_groups.values():
        for target in scheme.targets:
            sd = {k[len(target) + 1 :]: v for k, v in tensors.items() if k.startswith(target + ".")}
            sd.pop("bias", None)
            g_idx = sd.pop("weight_g_idx", None)
            sd["weight_scale"] = sd["weight_scale"].to(torch.float32)
            if g_idx is None:
                w = PackedQuantizationCompressor.decompress(sd, scheme)["weight"]
            else:
                bits, shape = scheme.weights.num_bits, sd["weight_shape"]
                codes = unpack_from_int32(sd["weight_packed"], bits, shape)
                zp = unpack_from_int32(sd["weight_zero_point"], bits, (shape[0], sd["weight_scale"].shape[1]), 0)
                order = torch.argsort(g_idx, stable=True)
                wp = dequantize(codes[:, order], sd["weight_scale"], zp, scheme.weights)
                w = torch.empty_like(wp)
                w[:, order] = wp
            assert w.dtype == torch.float32
            out[target] = w.numpy().T
    return out


def assert_library_exact(src: Path, export: Path) -> int:
    """Proof 2: the library's dense weights equal the source's exact dequantization bit
    for bit in fp32.  Returns layers compared."""
    ref = source_layers(src)
    dense = library_dense(export)
    assert set(dense) <= set(ref)
    for name, w in dense.items():
        np.testing.assert_array_equal(w.view(np.uint32), ref[name]["w"].view(np.uint32), err_msg=name)
    return len(dense)


def assert_library_codes(src: Path, export: Path) -> int:
    """Proof 1 for every bit width (3-bit too, which our reader does not read): the
    library's ``unpack_from_int32`` gives the source's codes and zero points exactly."""
    import torch
    from compressed_tensors.compressors.pack_quantized import unpack_from_int32

    ref = source_layers(src)
    tensors = _export_tensors(export)
    n = 0
    for name, lay in ref.items():
        if f"{name}.weight_packed" not in tensors:
            continue
        b, (k, size_n) = lay["bits"], lay["q"].shape
        half = 1 << (b - 1)
        codes = unpack_from_int32(tensors[f"{name}.weight_packed"], b, torch.Size([size_n, k]))
        np.testing.assert_array_equal(codes.numpy().astype(np.int16).T + half, lay["q"], err_msg=name)
        groups = lay["z"].shape[0]
        zp = unpack_from_int32(tensors[f"{name}.weight_zero_point"], b, torch.Size([size_n, groups]), 0)
        np.testing.assert_array_equal(zp.numpy().astype(np.int16).T + half, lay["z"], err_msg=name)
        n += 1
    return n

"""Reference models built from the *source* checkpoint, never from the artifact.

Every quantized layer is dequantized by the source format's own reader
(:func:`~converter.formats.open_source`, ``QuantWeight.source_weight()``: the spec
formula, ``s * (q - z)`` in fp32, act-order undone), so a converter bug cannot cancel
itself out in the comparison. Two precisions:

* ``fp32``: every weight and every pass-through tensor in float32 (the truth);
* ``fp16``: the dequantized weights rounded to fp16 and run as fp16 linears, every
  pass-through tensor in its own dtype: what fp16 weights themselves cost, the bar the
  converted model is held to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..formats.base import Source
from . import ModelError
from .build import (
    ModelClass,
    apply_binding,
    binding_errors,
    check_depth,
    check_skeleton,
    config_dtype,
    hf_config,
    import_stack,
    inventory,
    layer_slot,
    materialize_missing,
    model_class,
    weights_bytes,
)
from .guard import names as name_list
from .guard import offline
from .loader import dequantized_weight
from .names import Binding, bind, missing_names, untie

FP32, FP16 = "fp32", "fp16"


def source_config(source: Source) -> tuple[Path, dict[str, Any]]:
    """``(folder, config.json dict)`` of an HF source checkpoint.

    Raises:
        ModelError: a ``.tinyloop`` source, or an HF checkpoint without ``config.json``.
    """
    ckpt = getattr(source, "ckpt", None)
    if ckpt is None:
        raise ModelError(
            "the source is a .tinyloop checkpoint: TinyLoop models are not a transformers architecture",
            path=getattr(source, "path", None),
        )
    if not ckpt.config:
        raise ModelError("the source checkpoint has no config.json: cannot build its reference model", path=ckpt.folder)
    return ckpt.folder, ckpt.config


def source_binding(source: Source, model: Any, mc: ModelClass, folder: Path) -> tuple[Binding, dict[str, Any]]:
    """Bind a skeleton to the source's layers (every quantized layer, converted or not) and tensors.

    Raises:
        ModelError: as :func:`~converter.model.build.binding_errors`; a quantized layer
            the reader cannot dequantize; a model parameter the source does not hold.
    """
    plans = {lp.name: lp for lp in source.plan().layers}
    bad = [f"{n} ({lp.reason})" for n, lp in plans.items() if lp.size_k <= 0]
    if bad:
        raise ModelError(f"source layer(s) cannot be dequantized: {', '.join(bad)}", path=folder)
    slots = {
        n: layer_slot(
            lp.size_k, lp.size_n, lp.bias is not None, set(lp.source_tensors) | ({lp.bias.name} if lp.bias else set())
        )
        for n, lp in plans.items()
    }
    linears, groups = inventory(model)
    b = bind(
        linears=linears,
        model_tensors=groups,
        layers=slots,
        tensors=source.ckpt.infos,
        prefix=model.base_model_prefix or "",
    )
    binding_errors(b, what="source checkpoint", arch=mc.name, path=folder)
    absent = [m for m in b.missing if not m.endswith(".bias") or m.rsplit(".", 1)[0] not in plans]
    if absent:
        raise ModelError(
            f"the source checkpoint has nothing for {len(absent)} tensor(s) of {mc.name}: {name_list(absent)}",
            path=folder,
        )
    ckpt = source.ckpt
    untie(b, lambda x, y: _same_source_tensor(ckpt, x, y))
    return b, plans


def _same_source_tensor(ckpt: Any, a: str, b: str) -> bool:
    ia, ib = ckpt.info(a), ckpt.info(b)
    if (ia.dtype, tuple(ia.shape)) != (ib.dtype, tuple(ib.shape)):
        return False
    return np.ascontiguousarray(ckpt.array(a)).tobytes() == np.ascontiguousarray(ckpt.array(b)).tobytes()


def build_reference(
    source: Source,
    precision: str,
    device: Any,
    *,
    attn_implementation: str | None = "eager",
    lazy: bool = False,
    half: Any = None,
    dtype: Any = None,
) -> tuple[Any, Binding]:
    """The source model with every quantized weight dequantized exactly.

    Args:
        source: the opened source checkpoint (an HF reader).
        precision: :data:`FP32` (all float32) or :data:`FP16` (fp16 weights, pass-through
            tensors in their own dtype).
        device: a ``torch.device``.
        lazy: dequantize each quantized layer at its call and drop the weight after it
            (:class:`~converter.model.modules.LazyDenseLinear`; ``source`` must stay open
            while the model runs): memory for the rest of the model plus one layer, the
            same outputs bit for bit.
        half: with :data:`FP16`, the 16-bit type of the quantized layers' weights: the
            type the converted model's activations run in (``torch.bfloat16`` where they
            are bf16: its layers then multiply bf16); None: bf16 where the config's dtype
            is, else fp16.
        dtype: with :data:`FP16`, build the model in this torch dtype and load its
            floating-point pass-through tensors in it (as ``load_model(dtype=)``); None:
            config.json's, each tensor in its own.

    Returns:
        ``(model, binding)``: the model in eval mode on ``device``; the binding says which
        module took which source layer.

    Raises:
        ModelError: see :func:`source_config` and :func:`source_binding`.
    """
    torch, _ = import_stack()
    from .modules import DENSE_FP32, DEQUANT_FP16, DenseLinear, LazyDenseLinear, sixteen_bit, to_torch, to_torch_f32

    folder, cfg = source_config(source)
    cfg_path = folder / "config.json"
    with offline(cfg_path):
        check_depth(cfg, source.ckpt.infos, path=cfg_path, what="source checkpoint")
        config = hf_config(cfg, path=cfg_path)
        mc = model_class(config, cfg, path=cfg_path)
        fp32 = precision == FP32
        asked = None if fp32 else dtype
        dtype = torch.float32 if fp32 else (asked or config_dtype(cfg))
        skeleton = mc.build(config, dtype=dtype, attn_implementation=attn_implementation, path=cfg_path, meta=True)
        b, _ = source_binding(source, skeleton, mc, folder)
        check_skeleton(
            skeleton, b.swaps, weight_bytes=weights_bytes(source.ckpt.infos), path=cfg_path, what="source checkpoint"
        )
        del skeleton, b
        model = mc.build(config, dtype=dtype, attn_implementation=attn_implementation, path=cfg_path)
    inventory_groups = inventory(model)[1]
    b, plans = source_binding(source, model, mc, folder)

    def tensor(name: str) -> Any:
        t = source.load_tensor(name)
        if fp32:
            return to_torch_f32(t.data, t.dtype)
        out = to_torch(t.data, t.dtype)
        return out.to(asked) if asked is not None and out.is_floating_point() else out

    # The 16-bit reference's weights are in the activations' 16-bit type: a bf16 model's
    # converted layers run bf16 (the kernels' bf16 forms), so its bar is bf16 weights.
    if half is None:
        half = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16

    def weight(lp: Any) -> Any:
        w = torch.from_numpy(np.ascontiguousarray(dequantized_weight(source, lp).T))
        return w if fp32 else sixteen_bit(w, half)

    def make_layer(module: str, layer: str) -> Any:
        lp = plans[layer]
        bias = None
        if lp.bias:  # in its own dtype, as the converted model keeps it
            t = source.load_tensor(lp.bias.name)
            bias = to_torch_f32(t.data, t.dtype) if fp32 else to_torch(t.data, t.dtype)
        path = DENSE_FP32 if fp32 else DEQUANT_FP16
        if lazy:
            return LazyDenseLinear(layer, lambda: weight(lp), (lp.size_n, lp.size_k), bias, path).to(device)
        return DenseLinear(layer, weight(lp), bias, path).to(device)

    apply_binding(model, b, make_layer=make_layer, load_tensor=tensor, path=folder)
    materialize_missing(model, missing_names(inventory_groups, b.missing))
    model.to(device)
    return model, b

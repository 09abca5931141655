"""The pass rule of ``marlin-verify --model`` (the why: :mod:`converter.model.verify`): its
bounds, the top-1 verdict at decided positions, and the findings it adds to the report.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ..artifact.problems import ProblemCode
from .report import ModelReport

if TYPE_CHECKING:
    from .probe import _LayerProbe

P = ProblemCode

#: The converted model may cost this many times the fp16-dequantized model's error.
ERROR_FACTOR = 1.5
#: ... and lose at most this share of top-1 agreement against fp16's, at decided positions.
TOP1_MARGIN = 0.005
#: A position is decided when fp32's top-1 minus top-2 logit exceeds this many times the
#: fp16 reference's largest logit error there: ``2 * ERROR_FACTOR`` (a flip needs the two
#: logits to close the margin between them, each moving by up to ERROR_FACTOR x fp16's).
DECIDED_FACTOR = 2 * ERROR_FACTOR
#: A layer is flagged above this many times the fp16 linear's error and above LAYER_FLOOR.
LAYER_FACTOR = 4.0
LAYER_FLOOR = 5e-3
#: The 16-bit activation types: a swapped layer given one must give the same back (our
#: kernel, the exact path and the dense pass-through all run them as they are).
HALF_TYPES = ("float16", "bfloat16")


def top1_verdict(
    ref_top: np.ndarray, ref_margin: np.ndarray, f16_top: np.ndarray, f16_err: np.ndarray, conv_top: np.ndarray
) -> dict[str, Any]:
    """Top-1 agreement at the positions where the fp32 reference is decided (see
    :mod:`converter.model.verify`): fp32's top-1 minus top-2 logit above
    ``DECIDED_FACTOR`` x the fp16 reference's largest logit error at that position.

    Returns:
        ``positions``, ``decided`` (how many), ``converted`` and ``fp16`` (agreement with
        fp32 at the decided positions; None when none is decided), ``min`` (fp16's
        minus ``TOP1_MARGIN``) and ``ok``.
    """
    decided = ref_margin > DECIDED_FACTOR * f16_err
    n = int(decided.sum())
    conv = float(np.mean(conv_top[decided] == ref_top[decided])) if n else None
    f16 = float(np.mean(f16_top[decided] == ref_top[decided])) if n else None
    floor = None if f16 is None else f16 - TOP1_MARGIN
    return {
        "positions": int(ref_top.size),
        "decided": n,
        "converted": conv,
        "fp16": f16,
        "min": floor,
        "ok": conv is None or floor is None or conv >= floor,
    }


def _judge(
    report: ModelReport,
    load: Any,
    probe: _LayerProbe,
    plans: dict[str, Any],
    conv: dict[str, Any],
    f16: dict[str, Any],
    ref32: dict[str, Any],
    verdict: dict[str, Any] | None = None,
) -> None:
    if "ppl" in ref32:
        for m in (conv, f16):
            m["ppl_rel_diff"] = abs(m["ppl"] - ref32["ppl"]) / ref32["ppl"] if math.isfinite(m["ppl"]) else math.inf
    report.metrics = {"converted": conv, "fp16_dequant": f16, "fp32": ref32}
    limit = ERROR_FACTOR * max(f16["mean_rel_err"], 1e-7)
    if verdict is not None:
        conv["top1_decided"], f16["top1_decided"] = verdict["converted"], verdict["fp16"]
        conv["decided_positions"] = f16["decided_positions"] = verdict["decided"]
    report.bar = {
        "mean_rel_err_limit": limit,
        "top1_min": None if verdict is None else verdict["min"],
        "top1_rule": None if verdict is None else "decided positions",
        "decided_factor": DECIDED_FACTOR,
        "error_factor": ERROR_FACTOR,
        "top1_margin": TOP1_MARGIN,
        "layer_factor": LAYER_FACTOR,
        "layer_floor": LAYER_FLOOR,
    }
    what = report.output
    if not conv["mean_rel_err"] <= limit:
        report.add(
            P.MODEL_ERROR,
            f"{what}: mean relative error {conv['mean_rel_err']:.3g} "
            "against the fp32 model dequantized from the source "
            f"is above {ERROR_FACTOR:g}x the fp16-dequantized model's {f16['mean_rel_err']:.3g} (limit {limit:.3g})",
        )
    if verdict is not None and not verdict["ok"]:
        report.add(
            P.MODEL_TOP1,
            f"{what}: top-1 agreement with the fp32 model at its {verdict['decided']} decided positions "
            f"(of {verdict['positions']}: top-1 minus top-2 logit above {DECIDED_FACTOR:g}x the fp16-dequantized "
            f"model's largest logit error there) {verdict['converted']:.4f} is below the fp16-dequantized "
            f"model's {verdict['fp16']:.4f} minus {TOP1_MARGIN:g}",
        )
    modules = load.modules
    for layer, path in load.layers.items():
        e, e16 = probe.stats.get(layer, [None, None])
        bad = e is not None and e > LAYER_FACTOR * e16 and e > LAYER_FLOOR
        dts = probe.dtypes.get(layer)
        # a 16-bit input given back in the other 16-bit type went through it (a cast that
        # loses range or bits); an fp32 result is a layer computing wider (dense-fp32)
        cast = dts is not None and dts[0] in HALF_TYPES and dts[1] in HALF_TYPES and dts[1] != dts[0]
        report.layers.append(
            {
                "name": layer,
                "module": modules.get(layer),
                "path": path,
                "rel_err": e,
                "fp16_rel_err": e16,
                "dtypes": None if dts is None else list(dts),
                "ok": not (bad or cast),
            }
        )
        if cast:
            report.add(
                P.LAYER_DTYPE,
                f"layer {layer} (module {modules.get(layer)}): took {dts[0]} activations but gave {dts[1]} "
                "(a 16-bit model's layers run in its own type)",
                layer,
            )
        if layer not in plans:
            report.add(
                P.LAYER_NOT_IN_SOURCE,
                f"layer {layer}: in the artifact, but the source has no such quantized layer",
                layer,
            )
        elif e is None:
            report.add(
                P.LAYER_NOT_RUN,
                f"layer {layer} (module {modules.get(layer)}) never ran in the forward pass",
                layer,
                severity="warning",
            )
        elif bad:
            report.add(
                P.LAYER_ERROR,
                f"layer {layer} (module {modules.get(layer)}): output mean relative error {e:.3g} against the source "
                f"layer on the model's own activations, "
                + (
                    f"{e / e16:.1f}x the 16-bit-dequantized layer's {e16:.3g} "
                    if 0 < e16 < math.inf
                    else f"where the 16-bit-dequantized layer's is {e16:.3g} "
                )
                + f"(limit: above {LAYER_FACTOR:g}x and {LAYER_FLOOR:g})"
                + ("; its output is not finite: an overflow here or in a layer before it" if e == math.inf else ""),
                layer,
            )
    for name in load.missing:
        module, _, attr = name.rpartition(".")
        if attr == "bias" and module in load.layers:
            report.add(
                P.MISSING_BIAS,
                f"{name}: module {load.modules.get(module, module)} has a bias, the converted layer {module} has none "
                "(it runs without)",
                name,
            )
        else:
            report.add(
                P.MISSING_TENSOR,
                f"{name}: the model has this tensor, the artifact nothing to load into it (left as initialised)",
                name,
            )
    for layer, why in load.not_converted.items():
        report.add(
            P.NOT_CONVERTED,
            f"layer {layer} passed through unconverted ({why}); it runs through its exact dequantization "
            f"as an {'fp32' if load.layers.get(layer) == 'dense-fp32' else 'fp16'} linear, not the Marlin kernel",
            layer,
            severity="warning",
        )
    for layer, why in load.kernel_fallback.items():
        report.add(
            P.KERNEL_FALLBACK, f"layer {layer}: {why}; it runs the exact path on the GPU", layer, severity="warning"
        )
    for w in load.warnings:
        report.add(P.TIED_DIFFERS, w, severity="warning")
    if load.unused:
        shown = ", ".join(load.unused[:8]) + (f", ... ({len(load.unused)} tensors)" if len(load.unused) > 8 else "")
        report.add(
            P.UNUSED_TENSORS,
            f"{len(load.unused)} artifact tensor(s) feed no module of {load.architecture}: {shown}",
            severity="warning",
        )

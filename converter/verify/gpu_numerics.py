"""GPU numerics (through ``converter.gpu``, imported only when run): each layer whole,
as the artifact stores it (:func:`unpack_layer`), against the source's weight or the
artifact's own (:func:`artifact_weight`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..artifact.problems import ProblemCode, Report
from ..artifact.reader import Artifact
from ..artifact.schema import LayerEntry
from ..constants import GPU_MEAN_REL_TOLS, KERNEL_K_MULTIPLE, MARLIN_ZERO, Suffix
from ..errors import GpuUnavailableError
from ..formats.base import LayerPlan, Source
from ..marlin.layout import unpack_b, unpermute_scales
from ..quant_weight import QuantWeight
from ..safetensors_io import release_mapped_pages

P = ProblemCode


def unpack_layer(art: Artifact, rec: LayerEntry) -> dict[str, np.ndarray | None]:
    """Exact inverse of the conversion for one whole layer (the GPU check, tests).

    Returns:
        ``q`` uint8 ``(size_k, layout_n)`` in Marlin row order; ``scales`` float16
        ``(num_groups, layout_n)`` natural order; ``delta`` float32; ``perm`` int32 or
        None.  ``layout_n`` is ``padded_n`` for a padded layer: the columns from
        ``size_n`` on are its padding.
    """
    p = rec.name + "."
    return {
        "q": unpack_b(art.tensor(p + Suffix.B.value), rec.layout_n),
        "scales": unpermute_scales(art.tensor(p + Suffix.SCALES.value), single=rec.shape.num_groups == 1),
        "delta": np.asarray(art.tensor(p + Suffix.DELTA.value), dtype=np.float32),
        "perm": np.asarray(art.tensor(p + Suffix.PERM.value)) if rec.act_order else None,
    }


def artifact_weight(u: dict[str, np.ndarray | None], rec: LayerEntry) -> np.ndarray:
    """float32 ``(size_k, size_n)`` = ``(q - 8) * s + delta``, rows in SOURCE channel order
    (the real columns of a padded layer)."""
    g = np.arange(rec.size_k) // rec.group_size
    n = rec.size_n
    w = (u["q"][:, :n].astype(np.float32) - MARLIN_ZERO) * u["scales"][:, :n].astype(np.float32)[g] + u["delta"][g, :n]
    return _to_source_order(w, u["perm"])


def _to_source_order(w: np.ndarray, perm: np.ndarray | None) -> np.ndarray:
    if perm is None:
        return w
    out = np.empty_like(w)
    out[perm] = w
    return out


def _source_weight(qw: QuantWeight) -> np.ndarray:
    return _to_source_order(qw.source_weight(), qw.perm)


def _gpu_numerics(
    art: Artifact,
    source: Source | None,
    compared: dict[str, LayerPlan],
    report: Report,
    rows: dict[str, dict[str, Any]],
    *,
    forced: bool,
    progress: Callable[[str, int], None] | None,
    skip: set[str],
    act: str = "float16",
) -> None:
    try:
        from ..gpu.runtime import require_gpu
        from ..gpu.verify import verify_layer_gpu

        require_gpu()
    except (GpuUnavailableError, ImportError) as exc:
        msg = str(exc) if isinstance(exc, GpuUnavailableError) else f"GPU support is not installed ({exc})"
        if forced:
            report.add(P.GPU, f"GPU numerics required but {msg}")
        else:
            report.checked["gpu_numerics"] = f"skipped: {msg}"
        return
    if progress:
        progress("GPU numerics", len(art.layers))
    for name, rec in art.layers.items():
        if name in skip:
            continue
        if not rec.kernel_compatible:
            rows[name]["gpu"] = f"skipped: layer is outside our kernel's limits (K % {KERNEL_K_MULTIPLE} == 0)"
            report.add(P.GPU_SKIPPED, f"layer {name}: {rows[name]['gpu']}", name, severity="warning")
            continue
        # One layer at a time, its source read again: nothing is held across layers.
        u = unpack_layer(art, rec)
        if source is not None and name in compared:
            w_ref = _source_weight(source.load_layer(compared[name]))
        else:
            w_ref = artifact_weight(u, rec)
        p = name + "."
        res = verify_layer_gpu(
            np.asarray(art.tensor(p + Suffix.B.value)),
            np.asarray(art.tensor(p + Suffix.SCALES.value)),
            u["delta"],
            u["perm"],
            rec.size_k,
            rec.layout_n,
            rec.group_size,
            w_ref,
            n_out=rec.size_n,
            act=act,
        )
        del u, w_ref
        release_mapped_pages()
        if source is not None:
            source.release_pages()
        per_m = {str(m): v for m, v in res.items() if m != "ok"}
        rows[name]["gpu"] = {
            "mean_rel_err": max(max(v["mean_rel_err"], v.get("two_kernel_mean_rel_err", 0.0)) for v in per_m.values()),
            "max_rel_err": max(max(v["max_rel_err"], v.get("two_kernel_max_rel_err", 0.0)) for v in per_m.values()),
            "deterministic": all(
                v["deterministic"] and v.get("two_kernel_deterministic", True) for v in per_m.values()
            ),
            "unit_major_same": all(v.get("unit_major_same", True) for v in per_m.values()),
            "ok": bool(res["ok"]),
            "act": act,
            "per_m": per_m,
        }
        if not res["ok"]:
            g, tol = rows[name]["gpu"], GPU_MEAN_REL_TOLS[act]
            report.add(
                P.GPU_NUMERICS,
                f"layer {name}: GPU mean relative error {g['mean_rel_err']:.3g} in {act} (limit {tol:g}), "
                f"deterministic over repeats: {g['deterministic']}"
                + ("" if g["unit_major_same"] else "; B unit-major (as MarlinLinear serves it) gives other bits"),
                name,
                tol,
                g["mean_rel_err"],
            )
        if progress:
            progress("", 1)
    report.checked["gpu_numerics"] = True
    report.checked["gpu_act"] = act

"""``marlin-verify``'s checks beyond structure: exact comparison with the source
(``--against``), CPU numerics, and (through ``converter.gpu``) GPU numerics.

A padded layer is compared on its ``size_n`` real columns, and its padding columns
must be exactly code 8, scale 1.0 and delta +0.0; numerics use the real columns only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from .artifact.problems import ProblemCode, Report
from .artifact.reader import Artifact, open_artifact
from .artifact.schema import LayerEntry
from .artifact.validate import broken_layers, validate_artifact
from .constants import GPU_MEAN_REL_TOL, KERNEL_K_MULTIPLE, MARLIN_ZERO, PAD_CODE, PAD_DELTA, PAD_SCALE, Suffix
from .errors import ArtifactError, ConverterError, GpuUnavailableError
from .formats import open_source
from .formats.base import Source
from .marlin.layout import unpack_b, unpermute_scales
from .quant_weight import QuantWeight

#: Both sides of the CPU check are fp32; they differ only by fp32 rounding.
CPU_REL_TOL = 1e-5
#: Rows of random activations in the CPU check.
CPU_M = 8
P = ProblemCode


def unpack_layer(art: Artifact, rec: LayerEntry) -> dict[str, np.ndarray | None]:
    """Exact inverse of the conversion for one layer.

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


def _bits(a: np.ndarray) -> np.ndarray:
    # Bitwise comparison for floats: -0.0 vs 0.0 and NaN payloads count as different.
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "f" else a


def _first_diff(a: np.ndarray, b: np.ndarray) -> str:
    bad = np.argwhere(_bits(a) != _bits(b))
    idx = tuple(int(i) for i in bad[0])
    return f"{len(bad)} of {a.size} differ; first at {list(idx)}: {a[idx].item()} vs source {b[idx].item()}"


def compare_against(
    art: Artifact, source: Source, report: Report, layer_rows: dict[str, dict[str, Any]], skip: set[str] = frozenset()
) -> dict[str, QuantWeight]:
    """Compare the artifact with its source exactly; append problems to ``report``.

    Checks that the artifact holds exactly the tensors a conversion of this source
    makes; per layer the manifest facts (sizes, group sizes, padding, bits, zero
    convention, bias), codes (unpacked ``B``), scales (unpermuted, bitwise), ``delta``
    (bitwise) and ``perm`` (a regrouped layer against its source's scales and zeros
    repeated per slice, a padded layer on its real columns, its padding against code
    8, scale 1 and delta 0); the bias and every pass-through tensor byte for byte.
    Layers in ``skip`` (structurally broken, already reported) are not compared.

    The conversion's ``--pad``/``--no-pad`` is read from the artifact: a source layer
    that pads and is not among the artifact's layers means ``--no-pad``.

    Returns:
        ``{layer name: QuantWeight}`` of the source layers (for numerics).
    """
    assert art.manifest is not None  # validate_artifact stops on a manifest that does not fit
    recorded = {f.name: f.sha256 for f in art.manifest.source.files}
    actual = {f["name"]: f["sha256"] for f in source.describe()["files"]}
    changed = sorted(n for n in recorded.keys() & actual.keys() if recorded[n] != actual[n])
    if changed or not recorded.keys() & actual.keys():
        what = ", ".join(changed) if changed else "no file names in common"
        report.add(
            P.SOURCE_DIFFERS,
            f"the source is not the one this artifact was converted from (sha256 differs: {what}); "
            "the comparisons below will show where",
            str(source.path),
        )
    plan = source.plan()
    padded = {lay.name for lay in plan.layers if lay.padded_n is not None}
    if padded and not padded & art.layers.keys():
        plan = source.plan(pad=False)  # converted with --no-pad: those layers passed through
    loaded: dict[str, QuantWeight] = {}
    src_layers = {lay.name: lay for lay in plan.layers if lay.convertible}
    for name in art.layers.keys() - src_layers.keys():
        report.add(P.SOURCE_MISMATCH, f"layer {name} is in the artifact but not converted from the source", name)
    for name in src_layers.keys() - art.layers.keys():
        report.add(P.SOURCE_MISMATCH, f"layer {name} converts from the source but is missing from the artifact", name)
    from .convert import build_layout  # the conversion's own plan of the artifact

    expected = {n for n, _, _ in build_layout(plan, path=source.path)[0]}
    expected |= {i.name for i in plan.tensors} | set(plan.passthrough_reasons)
    for lay in plan.layers:
        if not lay.convertible:
            expected |= set(lay.source_tensors) | ({lay.bias.name} if lay.bias else set())
    present = set(art.file.infos)
    for name in sorted(expected - present):
        report.add(
            P.SOURCE_MISMATCH, f"{name}: a conversion of the source has this tensor; the artifact lacks it", name
        )
    for name in sorted(present - expected):
        report.add(
            P.SOURCE_MISMATCH, f"{name}: in the artifact, but a conversion of the source has no such tensor", name
        )
    for name, rec in art.layers.items():
        if name not in src_layers or name in skip:
            continue
        lay = src_layers[name]
        facts = {
            "size_k": (rec.size_k, lay.size_k),
            "size_n": (rec.size_n, lay.size_n),
            "padded_n": (rec.padded_n, lay.padded_n),
            "group_size": (rec.group_size, lay.group_size),
            "source_group_size": (rec.source_group_size, lay.source_group_size),
            "bits": (rec.bits, lay.bits),
            "zero_convention": (rec.zero_convention.value, lay.zero_convention.value),
            "has_bias": (rec.has_bias, lay.bias is not None),
            "act_order": (rec.act_order, lay.act_order),
        }
        differ = [key for key, (mine, theirs) in facts.items() if mine != theirs]
        for key in differ:
            mine, theirs = facts[key]
            report.add(
                P.SOURCE_MISMATCH,
                f"layer {name}: manifest says {key} = {mine}, the source gives {theirs}",
                name,
                theirs,
                mine,
            )
        if differ:
            continue  # values of differently shaped layers cannot be compared
        qw = source.load_layer(lay)
        loaded[name] = qw
        u = unpack_layer(art, rec)
        n = rec.size_n
        checks = {
            "codes": (u["q"][:, :n], qw.marlin_codes()),
            "scales": (u["scales"][:, :n], np.ascontiguousarray(qw.scales, dtype=np.float16)),
            "delta": (u["delta"][:, :n], np.ascontiguousarray(qw.marlin_delta(), dtype=np.float32)),
        }
        if rec.padded_n is not None:
            layer_rows[name]["padding_exact"] = _check_padding(report, rec, u)
        if (u["perm"] is None) != (qw.perm is None):
            report.add(
                P.SOURCE_MISMATCH,
                f"layer {name}: act-order permutation present in only one of artifact and source",
                name,
            )
        elif u["perm"] is not None:
            checks["perm"] = (u["perm"], qw.perm)
        row = layer_rows[name]
        for what, (mine, theirs) in checks.items():
            if mine.shape != theirs.shape:
                report.add(
                    P.SOURCE_MISMATCH,
                    f"layer {name}: {what} shape {list(mine.shape)} vs source {list(theirs.shape)}",
                    name,
                )
                row[f"{what}_exact"] = False
            elif not np.array_equal(_bits(mine), _bits(theirs)):
                report.add(
                    P.SOURCE_MISMATCH,
                    f"layer {name}: {what} not bit-identical to the source: {_first_diff(mine, theirs)}",
                    name,
                )
                row[f"{what}_exact"] = False
            else:
                row[f"{what}_exact"] = True
        if rec.has_bias:
            bias_name = f"{name}.{Suffix.BIAS.value}"
            if qw.bias is None or bytes(art.file.raw(bias_name)) != np.ascontiguousarray(qw.bias.data).tobytes():
                report.add(P.SOURCE_MISMATCH, f"{bias_name}: bias differs from the source", bias_name)
    for entry in art.manifest.passthrough:
        name = entry.name
        if name not in art.file:
            continue
        try:
            t = source.load_tensor(name)
        except (KeyError, ConverterError):
            report.add(P.SOURCE_MISMATCH, f"{name}: pass-through tensor not found in the source", name)
            continue
        info = art.file.infos[name]
        if (info.dtype, info.shape) != (t.dtype, tuple(t.shape)):
            report.add(
                P.SOURCE_MISMATCH, f"{name}: {info.dtype} {list(info.shape)} vs source {t.dtype} {list(t.shape)}", name
            )
        elif xxhash.xxh3_128_hexdigest(art.file.raw(name)) != xxhash.xxh3_128_hexdigest(
            np.ascontiguousarray(t.data).tobytes()
        ):
            report.add(P.SOURCE_MISMATCH, f"{name}: bytes differ from the source", name)
    return loaded


def _check_padding(report: Report, rec: LayerEntry, u: dict[str, np.ndarray | None]) -> bool:
    """Whether the padding columns of a padded layer are exactly the zero weight (code 8,
    scale 1.0, delta +0.0, bitwise); each part that is not is a ``source_mismatch``."""
    ok = True
    for what, key, value in (("codes", "q", PAD_CODE), ("scales", "scales", PAD_SCALE), ("delta", "delta", PAD_DELTA)):
        a = u[key]
        assert a is not None
        bad = np.argwhere(_bits(a[:, rec.size_n :]) != _bits(np.full_like(a[:, rec.size_n :], value)))
        if bad.size:
            ok = False
            r, c = (int(i) for i in bad[0])
            report.add(
                P.SOURCE_MISMATCH,
                f"layer {rec.name}: padding columns {rec.size_n}..{rec.layout_n - 1} of {what} must all be "
                f"{value:g}; {len(bad)} differ, first at [{r}, {rec.size_n + c}]: {a[r, rec.size_n + c].item()}",
                rec.name,
            )
    return ok


def _source_weight(qw: QuantWeight) -> np.ndarray:
    return _to_source_order(qw.source_weight(), qw.perm)


def cpu_numerics(art: Artifact, rec: LayerEntry, qw: QuantWeight | None, rng: np.random.Generator) -> float:
    """Relative error of the artifact's decomposed product against a reference, fp32.

    The artifact side computes what a Marlin kernel does: gather ``x[:, perm]``,
    multiply by ``(q - 8) * s``, add ``xsum @ delta`` with per-group sums of the
    gathered ``x``.  The reference is ``x @ W_source`` (source formula) when a
    source is given, else ``x @ W`` from the artifact's own exact unpacking.  A padded
    layer is computed over all ``layout_n`` columns, as the kernel does, and compared
    on its ``size_n`` real ones.

    Returns:
        ``||y - y_ref|| / ||y_ref||`` over random ``x`` of shape ``(8, size_k)``.
    """
    u = unpack_layer(art, rec)
    x = rng.standard_normal((CPU_M, rec.size_k), dtype=np.float32)
    xp = x[:, u["perm"]] if u["perm"] is not None else x
    g = np.arange(rec.size_k) // rec.group_size
    w_sym = (u["q"].astype(np.float32) - MARLIN_ZERO) * u["scales"].astype(np.float32)[g]
    xsum = xp.reshape(CPU_M, rec.shape.num_groups, rec.group_size).sum(axis=2)
    y = (xp @ w_sym + xsum @ u["delta"])[:, : rec.size_n]
    w_ref = _source_weight(qw) if qw is not None else artifact_weight(u, rec)
    y_ref = x @ w_ref
    denom = float(np.linalg.norm(y_ref)) or 1.0
    return float(np.linalg.norm(y - y_ref)) / denom


def verify(
    path: str | Path,
    *,
    shapes_only: bool = False,
    against: str | Path | None = None,
    gpu: bool | None = None,
    progress: Callable[[str, int], None] | None = None,
) -> Report:
    """Run ``marlin-verify``'s checks and return every problem found.

    Args:
        path: the artifact.
        shapes_only: structure and checksums only (plus ``against`` if given); no numerics.
        against: the source checkpoint, for exact comparison and a source reference.
        gpu: True forces GPU numerics (a problem if unavailable), False skips them,
            None runs them when CuPy and a GPU are present.
        progress: as for :func:`converter.convert.convert`.

    Raises:
        ConverterError and subclasses: unreadable artifact or source (exit 2); an
            ``ArtifactError`` saying so when ``path`` is a source and ``against`` an
            artifact (the arguments swapped).
    """
    try:
        report, art = validate_artifact(path)
    except ArtifactError:
        if against is not None and _is_artifact(against):
            raise ArtifactError(
                f"not an artifact, but --against {against} is one: the arguments are swapped; "
                f"run marlin-verify {against} --against {path}",
                path=path,
            ) from None
        raise
    with art:
        rows = {
            rec.name: {
                "name": rec.name,
                "size_k": rec.size_k,
                "size_n": rec.size_n,
                "group_size": rec.group_size,
                "bits": rec.bits,
                "symmetric": rec.symmetric,
                "act_order": rec.act_order,
                **({"source_group_size": rec.source_group_size} if rec.source_group_size is not None else {}),
                **({"padded_n": rec.padded_n} if rec.padded_n is not None else {}),
            }
            for rec in art.layers.values()
        }
        report.layers = list(rows.values())
        if any(p.code is P.SCHEMA_VIOLATION for p in report.problems):
            return report
        # Numbers computed from a structurally broken layer would only add noise (or
        # fail on the mismatched shapes): such layers are reported once, above.
        broken = broken_layers(report, set(art.layers))
        for name in broken:
            rows[name]["skipped"] = "structural problems (see problems)"
        source_layers: dict[str, QuantWeight] = {}
        if against is not None:
            with open_source(against) as source:
                source_layers = compare_against(art, source, report, rows, skip=broken)
            report.checked["against"] = str(against)
        if shapes_only:
            return report
        rng = np.random.default_rng(0)
        if progress:
            progress("CPU numerics", len(art.layers))
        for name, rec in art.layers.items():
            if name in broken:
                continue
            err = cpu_numerics(art, rec, source_layers.get(name), rng)
            rows[name]["cpu_rel_err"] = err
            if not err <= CPU_REL_TOL:
                report.add(
                    P.NUMERICS,
                    f"layer {name}: CPU relative error {err:.3g} exceeds {CPU_REL_TOL:g}",
                    name,
                    CPU_REL_TOL,
                    err,
                )
            if progress:
                progress("", 1)
        report.checked["cpu_numerics"] = True
        if gpu is not False:
            _gpu_numerics(art, report, rows, source_layers, forced=bool(gpu), progress=progress, skip=broken)
    return report


def _is_artifact(path: str | Path) -> bool:
    """Whether ``path`` opens as a marlin-convert artifact (for the swapped-arguments hint)."""
    try:
        open_artifact(path).close()
    except ConverterError:
        return False
    return True


def _gpu_numerics(
    art: Artifact,
    report: Report,
    rows: dict[str, dict[str, Any]],
    source_layers: dict[str, QuantWeight],
    *,
    forced: bool,
    progress,
    skip: set[str],
) -> None:
    try:
        from .gpu.runtime import require_gpu
        from .gpu.verify import verify_layer_gpu

        require_gpu()
    except (GpuUnavailableError, ImportError) as exc:
        msg = str(exc) if isinstance(exc, GpuUnavailableError) else f"GPU support is not installed ({exc})"
        if forced:
            report.add(P.GPU, f"--gpu given but {msg}")
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
        u = unpack_layer(art, rec)
        w_ref = _source_weight(source_layers[name]) if name in source_layers else artifact_weight(u, rec)
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
        )
        per_m = {str(m): v for m, v in res.items() if m != "ok"}
        rows[name]["gpu"] = {
            "mean_rel_err": max(max(v["mean_rel_err"], v.get("two_kernel_mean_rel_err", 0.0)) for v in per_m.values()),
            "max_rel_err": max(max(v["max_rel_err"], v.get("two_kernel_max_rel_err", 0.0)) for v in per_m.values()),
            "deterministic": all(
                v["deterministic"] and v.get("two_kernel_deterministic", True) for v in per_m.values()
            ),
            "ok": bool(res["ok"]),
            "per_m": per_m,
        }
        if not res["ok"]:
            g = rows[name]["gpu"]
            report.add(
                P.GPU_NUMERICS,
                f"layer {name}: GPU mean relative error {g['mean_rel_err']:.3g} (limit {GPU_MEAN_REL_TOL:g}), "
                f"deterministic over repeats: {g['deterministic']}",
                name,
                GPU_MEAN_REL_TOL,
                g["mean_rel_err"],
            )
        if progress:
            progress("", 1)
    report.checked["gpu_numerics"] = True

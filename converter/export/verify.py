"""Checking an export against its source (what ``marlin-verify OUT --against SRC`` runs on a
compressed-tensors export): our compressed-tensors reader reads the export back, and every
exported layer's codes, scales (bits of the stored values), zero points and act-order
permutation must equal the source's exactly; the source's files must match the sha256
the export recorded.

Then the CPU numerics, as ``marlin-verify`` runs them on a Marlin artifact
(:mod:`converter.numerics`, the same activations, bound and problem text): per layer,
8 rows of random activations ``x`` (one ``(8, K)`` draw per layer from
``default_rng(0)``, in manifest order) go through the export's layer, evaluated from its
own codes, scales and zero points as a zero-point kernel does (per group ``s * (sum x q -
z * sum x)``, rows gathered by the export's own ``g_idx`` order), and through the
source's exact dequantization ``s * (q - z)`` per weight (rows by the source's order),
both fp32; ``||y - y_ref|| / ||y_ref||`` must be at most
:data:`converter.verify.CPU_REL_TOL`.  Both sides are read in chunks of whole groups
and their mapped pages dropped after each, so memory does not grow with the model.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from ..digests import sha256_files
from ..errors import ConverterError
from ..formats import open_source
from ..formats.base import LayerPlan, Source
from ..formats.compressed_tensors import CONVERTIBLE_BITS, PACK_QUANTIZED, CompressedTensorsSource
from ..numerics import accumulate, relative_error
from ..quant_weight import QuantWeight
from ..safetensors_io import SafetensorsFile, release_mapped_pages
from .compressed_tensors import EXPORT_META_KEY, _names
from .quant_config import _weights_args
from .summary import LayerExport


@dataclasses.dataclass
class ExportCheck:
    """Result of :func:`check_export`: ``problems`` empty means it passed.

    ``cpu_numerics`` says whether the CPU numerics ran; ``layers`` holds, per layer they
    ran on, ``{"name", "cpu_rel_err"}`` (the Marlin artifact's ``--json`` field name)."""

    checked: list[str]
    unchecked: list[str]  # layers our reader does not read back (3-bit), with the reason
    problems: list[str]
    cpu_numerics: bool = False
    layers: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def export_manifest(folder: str | Path) -> dict | None:
    """The export manifest of a compressed-tensors export folder, or None when the folder
    is not one of ours (no ``marlin_convert_export`` metadata). A manifest that is not
    the form :func:`manifest_problems` checks is one error naming its shard."""
    files = sorted(Path(folder).glob("*.safetensors"))
    metas = [(f, SafetensorsFile(f, error=ConverterError).metadata) for f in files]
    found = {m[EXPORT_META_KEY]: f for f, m in metas if EXPORT_META_KEY in m}
    if not found:
        return None
    if len(found) != 1 or any(EXPORT_META_KEY not in m for _, m in metas):
        raise ConverterError("the export's shards carry different manifests", path=folder)
    text, shard = found.popitem()
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        raise ConverterError(f"metadata {EXPORT_META_KEY}: not valid JSON ({exc})", path=shard) from None
    problems = manifest_problems(manifest)
    if problems:
        raise ConverterError(f"metadata {EXPORT_META_KEY}: {'; '.join(problems)}", path=shard)
    return manifest


def manifest_problems(manifest: Any) -> list[str]:
    """Every way ``manifest`` differs from the form the export writes and
    :func:`check_export` reads (its fields' JSON types), as ``<where> <rule>``."""
    if not isinstance(manifest, dict):
        return [f"is a JSON {type(manifest).__name__}, not an object"]
    problems: list[str] = []
    source = manifest.get("source")
    files = source.get("files") if isinstance(source, dict) else None
    if not isinstance(files, list):
        problems.append("source.files is not a list")
    else:
        for i, f in enumerate(files):
            ok = isinstance(f, dict) and isinstance(f.get("name"), str)
            if not ok or not isinstance(f.get("sha256"), (str, type(None))):
                problems.append(f"source.files[{i}] is not an object with a string name and sha256")
    layers = manifest.get("layers")
    if not isinstance(layers, list):
        problems.append("layers is not a list")
        return problems
    for i, rec in enumerate(layers):
        if not isinstance(rec, dict):
            problems.append(f"layers[{i}] is not an object")
            continue
        for key, types in _LAYER_FIELDS.items():
            value = rec.get(key)
            if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
                want = " or ".join(t.__name__ for t in types)
                problems.append(f"layers[{i}].{key} is not {want}")
    return problems


#: The fields of an exported layer's manifest record that the check reads, and their types.
_LAYER_FIELDS: dict[str, tuple[type, ...]] = {
    "name": (str,),
    "exported": (bool,),
    "bits": (int,),
    "strategy": (str,),
    "group_size": (int,),
    "act_order": (bool,),
}


def check_export(export: str | Path, src: str | Path, *, numerics: bool = True) -> ExportCheck:
    """Compare an export with its source exactly and, with ``numerics``, run the CPU
    numerics on every layer read back (module docstring)."""
    from ..verify import CPU_M, CPU_REL_TOL

    manifest = export_manifest(export)
    if manifest is None:
        raise ConverterError("not a marlin-convert compressed-tensors export (no export manifest)", path=export)
    out = ExportCheck([], [], [], cpu_numerics=numerics)
    numeric_problems: list[str] = []
    rng = np.random.default_rng(0)
    with open_source(src) as s, open_source(export) as e:
        recorded = {f["name"]: f.get("sha256") for f in manifest["source"]["files"]}
        actual = {p.name: h for p, h in sha256_files(s.digest_files()).items()}
        for name, digest in recorded.items():
            if actual.get(name) != digest:
                out.problems.append(f"source file {name}: sha256 differs from the one the export recorded")
        out.problems.extend(config_problems(e, [r for r in manifest["layers"] if r["exported"]]))
        splan = {lay.name: lay for lay in s.plan(pad=True).layers}
        eplan = {lay.name: lay for lay in e.plan(pad=True).layers}
        for rec in manifest["layers"]:
            name = rec["name"]
            if not rec["exported"]:
                continue
            if rec["bits"] not in CONVERTIBLE_BITS:
                out.unchecked.append(f"{name}: {rec['bits']}-bit compressed-tensors is not read by our reader")
                continue
            if name not in eplan or not eplan[name].convertible:
                out.problems.append(f"{name}: not readable in the export")
                continue
            if name not in splan or not splan[name].convertible:
                out.problems.append(f"{name}: not a convertible layer of the source")
                continue
            sl, el = splan[name], eplan[name]
            facts = [
                f"{what} {x} vs source {y}"
                for what, x, y in (
                    ("size_k", el.size_k, sl.size_k),
                    ("size_n", el.size_n, sl.size_n),
                    ("group_size", el.group_size, sl.group_size),
                    ("bits", el.bits, sl.bits),
                )
                if x != y
            ]
            if facts:
                out.problems.append(f"{name}: shape or grouping differ from the source ({', '.join(facts)})")
                continue
            # One x per layer read back, drawn in manifest order (as on a Marlin artifact).
            x = rng.standard_normal((CPU_M, sl.size_k), dtype=np.float32) if numerics else None
            diffs, err = _compare_layer(s, sl, e, el, x)
            if diffs:
                out.problems.append(f"{name}: {', '.join(diffs)} differ from the source")
            else:
                out.checked.append(name)
            if err is not None:
                out.layers.append({"name": name, "cpu_rel_err": err})
                if not err <= CPU_REL_TOL:
                    numeric_problems.append(f"layer {name}: CPU relative error {err:.3g} exceeds {CPU_REL_TOL:g}")
    out.problems.extend(numeric_problems)
    out.cpu_numerics = bool(out.layers)  # an all-3-bit export reads no layer back: nothing ran
    return out


def config_problems(export: Source, layers: list[dict[str, Any]]) -> list[str]:
    """Where the export's ``config.json`` would make an engine load an exported layer
    other than as written: no config group, a group whose weights args differ from the
    layer's (``symmetric`` true drops the zero points), listed in ``ignore`` (loaded
    unquantized). Our reader goes by the tensors, so the numbers alone would pass.
    One problem per rule, with the layers it holds for."""
    if not isinstance(export, CompressedTensorsSource):
        return ["config.json: quantization_config is not compressed-tensors"]
    found: dict[str, list[str]] = {}
    for rec in layers:
        name = rec["name"]
        entry = export.ignored(name)
        if entry:  # an engine loads it unquantized
            found.setdefault(f"config.json lists exported layers in quantization_config.ignore ({entry!r})", []).append(
                name
            )
        args = export.args_for(name)
        if args is None:
            found.setdefault("no config group of config.json targets exported layers", []).append(name)
            continue
        lay = LayerExport(name, rec["bits"], 0, 0, rec["group_size"], rec["strategy"], rec["act_order"], True)
        want = {k: v for k, v in _weights_args(lay).items() if k in _CHECKED_ARGS}
        if lay.strategy != "group":
            del want["group_size"]  # channel: compressed-tensors ignores it
        want["format"] = PACK_QUANTIZED
        for key, value in want.items():
            have = getattr(args, key)
            if have != value:
                where = "format" if key == "format" else f"weights.{key}"
                rule = f"config group {args.group}: {where} is {json.dumps(have)}, the layers need {json.dumps(value)}"
                found.setdefault(rule, []).append(name)
    return [f"{rule} ({_names(names)})" for rule, names in found.items()]


#: The weights args an engine's choice of kernel and arithmetic depends on.
_CHECKED_ARGS = ("num_bits", "type", "symmetric", "strategy", "group_size", "actorder")


def _compare_layer(
    s: Source, sl: LayerPlan, e: Source, el: LayerPlan, x: np.ndarray | None
) -> tuple[list[str], float | None]:
    """One layer in chunks of whole groups: what differs from the source exactly, and
    (with ``x``) the CPU numerics' relative error."""
    from ..convert import chunk_rows
    from ..verify import CPU_M

    diffs: set[str] = set()
    size_n = sl.size_n
    width = -(-size_n // 64) * 64  # accumulate's column multiple (an exported N already is one)
    y = y_ref = None
    if x is not None:
        y, y_ref = np.zeros((CPU_M, width), np.float32), np.zeros((CPU_M, width), np.float32)
    step = chunk_rows(sl.size_k, width, sl.source_group_size or sl.group_size)
    for k0 in range(0, sl.size_k, step):
        k1 = min(k0 + step, sl.size_k)
        a, b = s.load_layer(sl, k0, k1), e.load_layer(el, k0, k1)
        for what, u, v in (
            ("codes", a.q, b.q),
            ("scales", a.source_scales_f32().view(np.uint32), b.source_scales_f32().view(np.uint32)),
            ("zero points", np.asarray(a.zeros), np.asarray(b.zeros)),
        ):
            if u.shape != v.shape or not np.array_equal(u, v):
                diffs.add(what)
        if (a.perm is None) != (b.perm is None) or (a.perm is not None and not np.array_equal(a.perm, b.perm)):
            diffs.add("act-order permutation")
        if x is not None and y is not None and y_ref is not None:
            # The export as a zero-point kernel computes it; the source per weight.
            _product(y, x, b, k0, k1, width, factored=True)
            _product(y_ref, x, a, k0, k1, width, factored=False)
        del a, b
        release_mapped_pages()
        s.release_pages()
        e.release_pages()
    order = ("codes", "scales", "zero points", "act-order permutation")
    err = None if y is None or y_ref is None else relative_error(y[:, :size_n], y_ref[:, :size_n])
    return [d for d in order if d in diffs], err


def _product(y: np.ndarray, x: np.ndarray, qw: QuantWeight, k0: int, k1: int, width: int, *, factored: bool) -> None:
    """``y += x[:, rows] @ W`` for one chunk, ``W = s * (q - z)`` from ``qw``'s own codes,
    scales as stored and zero points (:meth:`QuantWeight.source_formula`), its rows
    gathered by its own act-order permutation; columns widened with zeros to ``width``."""
    from ..verify import _widened

    xs = np.ascontiguousarray(x[:, qw.perm[k0:k1]] if qw.perm is not None else x[:, k0:k1])
    q, a, c, b = _widened(qw, width)
    accumulate(y, xs, q, qw.group_size, a, c, b, factored=factored)

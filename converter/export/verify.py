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
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from ..digests import sha256_files
from ..errors import ConverterError
from ..formats import open_source
from ..formats.base import LayerPlan, Source
from ..formats.compressed_tensors import (
    CONVERTIBLE_BITS,
    PACK_QUANTIZED,
    CompressedTensorsSource,
    _is_class_name,
    _Target,
)
from ..jsonio import JsonError, loads
from ..numerics import accumulate, relative_error
from ..quant_weight import QuantWeight
from ..safetensors_io import SafetensorsFile, release_mapped_pages
from .compressed_tensors import EXPORT_META_KEY, _names
from .layer_tensors import layer_tensor_names, scale_dtype_of
from .quant_config import _weights_args, export_config_json
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
    odd = next((f for f, m in metas if m.get(EXPORT_META_KEY) != metas[0][1].get(EXPORT_META_KEY)), None)
    if odd is not None:  # each shard carries the manifest as written, byte for byte
        raise ConverterError(
            f"the export's shards carry different manifests: this one's differs from {metas[0][0].name}'s",
            path=odd,
        )
    text, shard = found.popitem()
    try:  # the house JSON policy: bounded nesting and size, no duplicate keys
        manifest = loads(text)
    except JsonError as exc:
        raise ConverterError(exc.message(f"metadata {EXPORT_META_KEY}"), path=shard) from None
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
        exported = [r for r in manifest["layers"] if r["exported"]]
        listed = Counter(r["name"] for r in exported)
        out.problems.extend(config_problems(e, exported))
        source_plan = s.plan(pad=True)
        splan = {lay.name: lay for lay in source_plan.layers}
        eplan = {lay.name: lay for lay in e.plan(pad=True).layers}
        out.problems.extend(written_config_problems(s, e, source_plan.layers, set(listed)))
        scale_dtypes: dict[str, str] = {}
        # The manifest says what to compare: a layer it leaves out would go unchecked.
        unlisted = [n for n, lay in eplan.items() if lay.convertible and n not in listed]
        twice = sorted(n for n, count in listed.items() if count > 1)
        if unlisted:
            out.problems.append(f"the export packs layers its manifest does not list as exported ({_names(unlisted)})")
        if twice:
            out.problems.append(f"the export manifest lists layers more than once ({_names(twice)})")
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
            diffs, err, scale_dtypes[name] = _compare_layer(s, sl, e, el, x)
            if diffs:
                out.problems.append(f"{name}: {', '.join(diffs)} differ from the source")
            else:
                out.checked.append(name)
            if err is not None:
                out.layers.append({"name": name, "cpu_rel_err": err})
                if not err <= CPU_REL_TOL:
                    numeric_problems.append(f"layer {name}: CPU relative error {err:.3g} exceeds {CPU_REL_TOL:g}")
        out.problems.extend(tensor_problems(s, e, source_plan, set(listed), scale_dtypes))
    out.problems.extend(numeric_problems)
    out.cpu_numerics = bool(out.layers)  # an all-3-bit export reads no layer back: nothing ran
    return out


def tensor_problems(
    s: Source, e: Source, source_plan: Any, exported: set[str], scale_dtypes: dict[str, str]
) -> list[str]:
    """What the export holds besides its layers' own values: every tensor it does not
    compute from a layer (embeddings, norms, biases, a passed-through layer's source
    tensors) must be the source's, bytes, dtype and shape; no tensor may be missing or
    added; a layer's ``weight_scale`` keeps the source's dtype (the read-back compares
    values, which a cast keeps). One problem per rule, with its tensors."""
    if not isinstance(e, CompressedTensorsSource):
        return []  # config_problems says so; every tensor would read as missing
    carried: list[str] = [t.name for t in source_plan.tensors]
    computed: set[str] = set()
    for lay in source_plan.layers:
        bias = [lay.bias.name] if lay.bias is not None else []
        if lay.name in exported:
            computed.update(layer_tensor_names(lay))
            carried += bias
        else:
            carried += [*lay.source_tensors, *bias]
    have = set(e.ckpt.infos)
    found: dict[str, list[str]] = {}
    for name in carried:
        if name not in have:
            found.setdefault("missing from the export", []).append(name)
            continue
        a, b = s.load_tensor(name), e.load_tensor(name)
        if (a.dtype, tuple(a.shape)) != (b.dtype, tuple(b.shape)):
            found.setdefault("dtype or shape differ from the source's", []).append(name)
        elif not _same_bytes(a.data, b.data):
            found.setdefault("bytes differ from the source's", []).append(name)
        del a, b
    for name in sorted(computed - have):
        found.setdefault("missing from the export", []).append(name)
    for layer, dtype in scale_dtypes.items():
        name = f"{layer}.weight_scale"
        if name in have and e.ckpt.infos[name].dtype != dtype:
            found.setdefault(f"stored in another dtype than the source's scales ({dtype})", []).append(name)
    extra = sorted(have - computed - set(carried))
    if extra:
        found["tensors the source does not have"] = extra
    return [f"{rule}: {_names(names)}" for rule, names in found.items()]


def _same_bytes(a: Any, b: Any, chunk: int = 64 * 2**20) -> bool:
    """Whether two stored tensors hold the same bytes, compared a slice at a time with the
    mapped pages dropped after each (an embedding can be gigabytes)."""
    u, v = np.asarray(a).reshape(-1).view(np.uint8), np.asarray(b).reshape(-1).view(np.uint8)
    if u.size != v.size:
        return False
    for i in range(0, u.size, chunk):
        same = np.array_equal(u[i : i + chunk], v[i : i + chunk])
        release_mapped_pages()
        if not same:
            return False
    return True


#: A key one side of a comparison lacks (``None`` is a value).
_GONE = object()


def written_config_problems(s: Source, e: Source, layers: list[LayerPlan], exported: set[str]) -> list[str]:
    """Where the export's ``config.json`` differs from the one the export writes for this
    source, outside the config groups and ``ignore`` (:func:`config_problems` judges those
    as the engines read them): the model's fields and ``quantization_config``'s own
    (``format``, ``quantization_status``, ``kv_cache_scheme``, ...)."""
    if not isinstance(e, CompressedTensorsSource):
        return []  # config_problems says so
    plans = [LayerExport.of(lay, lay.name in exported) for lay in layers]
    want = json.loads(export_config_json(s, plans))
    have = e.ckpt.config
    paths = [
        k
        for k in sorted(set(want) | set(have))
        if k != "quantization_config" and want.get(k, _GONE) != have.get(k, _GONE)
    ]
    wq, hq = want["quantization_config"], have.get("quantization_config") or {}
    paths += [
        f"quantization_config.{k}"
        for k in sorted(set(wq) | set(hq))
        if k not in ("config_groups", "ignore") and wq.get(k, _GONE) != hq.get(k, _GONE)
    ]
    if not paths:
        return []
    return [f"config.json: {', '.join(paths)} differ from what the export writes for this source"]


def config_problems(export: Source, layers: list[dict[str, Any]]) -> list[str]:
    """Where the export's ``config.json`` could make an engine load an exported layer
    other than as written (our reader goes by the tensors, so the numbers alone would
    pass). Read as strictly as the engines differ: a config group or ``ignore`` entry
    counts for a layer when it names the layer, or the module vLLM fuses it into
    (``qkv_proj``, ``gate_up_proj``), exactly or by ``re:`` regex, or is a class-name
    target vLLM or compressed-tensors would apply to a linear layer (``Linear``). Every
    group that counts must hold the layer's scheme as written (``weights`` args raw, as
    :func:`~converter.export.quant_config.quantization_config` writes them, and format
    ``pack-quantized``), so the group order an engine resolves by never matters; at least
    one must count, and no ``ignore`` entry may. One problem per rule, with its layers."""
    if not isinstance(export, CompressedTensorsSource):
        return ["config.json: quantization_config is not compressed-tensors"]
    qc = export.ckpt.quant_config
    top_format = qc.get("format")
    groups = [
        (gname, group, [_Target(t, field=f"config_groups.{gname}.targets", path=export.cfg_path) for t in targets])
        for gname, group in qc["config_groups"].items()
        for targets in [group.get("targets") or []]
    ]
    ignore = [_Target(t, field="ignore", path=export.cfg_path) for t in qc.get("ignore") or []]
    found: dict[str, list[str]] = {}

    def add(rule: str, name: str) -> None:
        found.setdefault(rule, []).append(name)

    for rec in layers:
        name = rec["name"]
        names = _engine_names(name)
        for target in ignore:
            if _counts(target, names):  # an engine loads it unquantized
                add(f"config.json lists exported layers in quantization_config.ignore ({target.entry!r})", name)
        lay = LayerExport(name, rec["bits"], 0, 0, rec["group_size"], rec["strategy"], rec["act_order"], True)
        written = _weights_args(lay)
        want = {k: written.get(k, default) for k, default in _ARG_DEFAULTS.items()}
        matched = False
        for gname, group, targets in groups:
            hit = next((t.entry for t in targets if _counts(t, names)), None)
            if hit is None:
                continue
            matched = True
            # a regex, class name or fused name says why the group applies; a layer's own name needs no saying
            where = f"config group {gname}" + (f" (by {hit!r})" if hit != name else "")
            weights = group.get("weights") if isinstance(group.get("weights"), dict) else {}
            for key, value in want.items():
                have = weights.get(key, _ARG_DEFAULTS[key])
                if have != value or type(have) is not type(value):
                    add(f"{where}: weights.{key} is {json.dumps(have)}, the layers need {json.dumps(value)}", name)
            for key in ("input_activations", "output_activations"):
                if group.get(key) is not None:  # the layers are weight-only: an engine would quantize activations
                    add(f"{where}: {key} is {json.dumps(group.get(key))}, the layers need null", name)
            # vLLM takes a group's own format wherever it is not null ("" included)
            fmt = group.get("format") if group.get("format") is not None else top_format
            if fmt != PACK_QUANTIZED:
                add(f"{where}: format is {json.dumps(fmt)}, the layers need {json.dumps(PACK_QUANTIZED)}", name)
        if not matched:
            add("no config group of config.json targets exported layers", name)
    return [f"{rule} ({_names(names)})" for rule, names in found.items()]


#: The weights args an engine's choice of kernel and arithmetic depends on, and the
#: value compressed-tensors' QuantizationArgs takes for each when the key is absent.
_ARG_DEFAULTS: dict[str, Any] = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "strategy": None,
    "group_size": None,
    "actorder": None,
    "dynamic": False,
    "scale_dtype": None,
    "zp_dtype": None,
}
#: The module vLLM fuses a projection into (its weights loaded into one layer).
_FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
#: vLLM's linear layer classes (lower case): a class-name target counts for a layer when
#: it is a substring of one, as vLLM matches; compressed-tensors matches ``Linear``.
_VLLM_LINEAR_CLASSES = (
    "qkvparallellinear", "mergedcolumnparallellinear", "rowparallellinear", "columnparallellinear", "replicatedlinear",
)  # fmt: skip


def _engine_names(name: str) -> list[str]:
    """The names an engine may match a layer's config entries against: its own, and the
    fused module's where vLLM fuses it."""
    prefix, _, leaf = name.rpartition(".")
    fused = _FUSED.get(leaf)
    return [name, f"{prefix}.{fused}" if prefix else fused] if fused else [name]


def _counts(target: _Target, names: list[str]) -> bool:
    """Whether a ``targets`` or ``ignore`` entry applies to a layer known by ``names``
    (:func:`_engine_names`) in either engine."""
    entry = target.entry
    if _is_class_name(entry):
        return entry == "Linear" or any(entry.lower() in cls for cls in _VLLM_LINEAR_CLASSES)
    return any(target.matches(n) for n in names)


def _compare_layer(
    s: Source, sl: LayerPlan, e: Source, el: LayerPlan, x: np.ndarray | None
) -> tuple[list[str], float | None, str]:
    """One layer in chunks of whole groups: what differs from the source exactly, (with
    ``x``) the CPU numerics' relative error, and the dtype its ``weight_scale`` must have."""
    from ..convert import chunk_rows
    from ..verify import CPU_M

    diffs: set[str] = set()
    size_n = sl.size_n
    width = -(-size_n // 64) * 64  # accumulate's column multiple (an exported N already is one)
    y = y_ref = None
    if x is not None:
        y, y_ref = np.zeros((CPU_M, width), np.float32), np.zeros((CPU_M, width), np.float32)
    scale_dtype = "F16"
    step = chunk_rows(sl.size_k, width, sl.source_group_size or sl.group_size)
    for k0 in range(0, sl.size_k, step):
        k1 = min(k0 + step, sl.size_k)
        a, b = s.load_layer(sl, k0, k1), e.load_layer(el, k0, k1)
        scale_dtype = scale_dtype_of(a)
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
    return [d for d in order if d in diffs], err, scale_dtype


def _product(y: np.ndarray, x: np.ndarray, qw: QuantWeight, k0: int, k1: int, width: int, *, factored: bool) -> None:
    """``y += x[:, rows] @ W`` for one chunk, ``W = s * (q - z)`` from ``qw``'s own codes,
    scales as stored and zero points (:meth:`QuantWeight.source_formula`), its rows
    gathered by its own act-order permutation; columns widened with zeros to ``width``."""
    from ..verify import _widened

    xs = np.ascontiguousarray(x[:, qw.perm[k0:k1]] if qw.perm is not None else x[:, k0:k1])
    q, a, c, b = _widened(qw, width)
    accumulate(y, xs, q, qw.group_size, a, c, b, factored=factored)

"""``load_model``: a converted model folder as a ready-to-run transformers model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..constants import KERNEL_K_MULTIPLE, PRODUCER_NAME, Suffix
from ..errors import ArtifactError, ConverterError, GpuUnavailableError
from ..marlin.layout import unpack_b, unpermute_scales
from ..marlin.shapes import kernel_compatible
from . import ModelError
from .build import (
    apply_binding,
    binding_errors,
    config_dtype,
    hf_config,
    import_stack,
    inventory,
    layer_slot,
    materialize_missing,
    model_class,
)
from .names import bind, missing_names, untie

TINYLOOP_MESSAGE = (
    "converted from a .tinyloop checkpoint: TinyLoop models are not a transformers architecture, so there is "
    "no model to build; run its layers with converter.gpu.api.load_artifact_gpu"
)

#: ``kernel_factory(name, size_k, size_n, group_size, B, scales, delta, perm, bias, *, padded_n)``
#: -> a module taking float16 ``(..., K)`` and returning float16 ``(..., N)`` (the bias
#: applied inside; ``N = size_n``, the true one). Arrays are the artifact's as stored
#: (scales Marlin-permuted, ``B``, scales and delta ``padded_n`` wide, bias float16 or
#: None); ``padded_n`` is ``size_n`` for a layer that is not padded.
KernelFactory = Callable[..., Any]


@dataclasses.dataclass
class LoadReport:
    """What :func:`load_model` did (``model.marlin_report``).

    Attributes:
        folder: the converted model folder.
        device: where the model runs (``"cpu"``, ``"cuda:0"``).
        architecture: the transformers class built (``"LlamaForCausalLM"``).
        kind: ``causal-lm``, ``masked-lm``, ``encoder`` or ``other``.
        layers: ``{artifact layer: path}``, path one of ``marlin-kernel`` (our GPU
            kernel), ``exact`` (exact fp32 from the artifact's tensors) or
            ``dequant-fp16`` (a quantized layer that passed through unconverted).
        modules: ``{artifact layer: model module name}``.
        not_converted: ``{layer: the converter's reason}`` for the ``dequant-fp16`` layers.
        kernel_fallback: ``{layer: reason}`` for converted layers that run ``exact`` on the
            GPU because they are outside the kernel's limits.
        tensors: ``{artifact tensor: [model names]}`` loaded in their own dtype.
        missing: model tensors nothing in the artifact feeds (only with ``strict=False``;
            they keep their initial values), and ``<layer>.bias`` for a layer without the
            bias its module has.
        unused: artifact tensors no module uses (``cls.predictions.*`` when the config
            builds a bare ``BertModel``).
        warnings: tied tensors that differ, and the like.
    """

    folder: str
    device: str
    architecture: str
    kind: str
    layers: dict[str, str] = dataclasses.field(default_factory=dict)
    modules: dict[str, str] = dataclasses.field(default_factory=dict)
    not_converted: dict[str, str] = dataclasses.field(default_factory=dict)
    kernel_fallback: dict[str, str] = dataclasses.field(default_factory=dict)
    tensors: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    missing: list[str] = dataclasses.field(default_factory=list)
    unused: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def read_converted_config(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """``(folder, config.json dict)`` of a converted model folder.

    Raises:
        ConverterError: the path does not exist.
        ModelError: not a folder, no ``config.json``, a ``config.json`` that
            ``marlin-convert`` did not write, or a ``.tinyloop`` conversion.
    """
    from ..formats.hf_checkpoint import read_json_file

    folder = Path(path)
    if not folder.exists():
        raise ConverterError("no such file or directory", path=folder)
    hint = (
        "a model is loaded from the folder that marlin-convert IN OUTDIR/ writes "
        "(config.json, the artifact, the tokenizer)"
    )
    if not folder.is_dir():
        raise ModelError(f"not a converted model folder: {hint}, not from a single file", path=folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ModelError(f"not a converted model folder: no config.json; {hint}", path=folder)
    cfg = read_json_file(cfg_path)
    qc = cfg.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != PRODUCER_NAME:
        raise ModelError(
            f"not a converted model folder: quantization_config.quant_method is {method!r}, not {PRODUCER_NAME!r} "
            "(a source checkpoint? convert it first: marlin-convert IN OUTDIR/)",
            path=cfg_path,
            tensor="quantization_config",
        )
    if cfg.get("model_type") == "tinyloop" or qc.get("source_format") == "tinyloop":
        raise ModelError(TINYLOOP_MESSAGE, path=folder)
    return folder, cfg


def resolve_device(device: Any) -> Any:
    """A ``torch.device``; for CUDA also checks that CuPy, an sm_80+ GPU and torch's CUDA are there.

    Raises:
        GpuUnavailableError: CUDA asked for but not usable (one line saying why).
        ModelError: a device string torch does not parse.
    """
    torch, _ = import_stack()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelError(f"device {device!r} is not a torch device ({exc})") from None
    if dev.type == "cuda":
        from ..gpu.runtime import require_gpu

        require_gpu()
        if not torch.cuda.is_available():
            raise GpuUnavailableError("torch has no CUDA support here (torch.cuda.is_available() is False)")
        dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ModelError(f"device {device!r}: only 'cpu' and 'cuda' are supported")
    return dev


def _marlin_kernel(
    name: str,
    size_k: int,
    size_n: int,
    group_size: int,
    B: np.ndarray,
    scales: np.ndarray,
    delta: np.ndarray,
    perm: np.ndarray | None,
    bias: np.ndarray | None,
    *,
    padded_n: int,
) -> Any:
    """The default kernel factory: :class:`~converter.gpu.api.MarlinLinearModule` on the current GPU."""
    from ..gpu.api import MarlinLinear, MarlinLinearModule

    layer = MarlinLinear(name, size_k, size_n, group_size, B, scales, delta, perm, bias, padded_n=padded_n)
    return MarlinLinearModule(layer)


def _passthrough_quantized(folder: Path, cfg: dict[str, Any], art: Any) -> tuple[Any, dict[str, Any], dict[str, str]]:
    """The reader, plans and reasons of quantized layers that passed through unconverted.

    They still hold their source tensors (``qweight``/``qzeros``/``scales``,
    ``weight_packed``/...), so the source format's own reader, opened on the artifact
    with the source's quant config (kept in ``config.json``), dequantizes them.

    Raises:
        ModelError: the reader cannot plan them, or one cannot be dequantized.
    """
    from ..formats import READERS
    from ..formats.hf import HFSource
    from ..formats.hf_checkpoint import HFCheckpoint

    qc = cfg["quantization_config"]
    fmt = str(qc.get("source_format", ""))
    # A quantized layer that passed through still has its reader's anchor tensor (qweight, ...).
    reader_cls = next((cls for f, cls in READERS.items() if f.value == fmt and issubclass(cls, HFSource)), None)
    marker = f".{reader_cls.anchor}" if reader_cls is not None else None
    reasons = {e.name: e.reason for e in (art.manifest.passthrough if art.manifest else ())}
    if marker is None or not any(n.endswith(marker) for n in reasons):
        return None, {}, {}

    ckpt = HFCheckpoint(folder)
    try:
        ckpt.quant_config = dict(qc.get("source_quantization_config") or {})
        ckpt.quant_config_file = "config.json"
        reader = reader_cls(ckpt)
        plans = {lp.name: lp for lp in reader.plan().layers}
    except ConverterError as exc:
        ckpt.close()
        raise ModelError(f"cannot read the layers that passed through unconverted: {exc}", path=folder) from None
    except BaseException:
        ckpt.close()
        raise
    bad = [f"{n} ({lp.reason})" for n, lp in plans.items() if lp.size_k <= 0]
    if bad:
        ckpt.close()
        raise ModelError(
            f"quantized layer(s) passed through unconverted cannot be dequantized: {', '.join(bad)}", path=folder
        )
    why = {
        n: reasons.get(f"{n}{marker}", lp.reason).removeprefix(f"layer {n} not converted: ") for n, lp in plans.items()
    }
    return reader, plans, why


def dequantized_weight(source: Any, plan: Any) -> np.ndarray:
    """float32 ``(K, N)``, rows in source input-channel order: the layer as its source
    format defines it (``QuantWeight.source_weight``), act-order undone."""
    qw = source.load_layer(plan)
    w = qw.source_weight()
    if qw.perm is None:
        return w
    out = np.empty_like(w)
    out[qw.perm] = w
    return out


def build_converted(
    path: str | Path,
    device: Any = "cuda",
    *,
    strict: bool = True,
    attn_implementation: str | None = None,
    validate: bool = True,
    kernel_factory: KernelFactory | None = None,
) -> tuple[Any, LoadReport]:
    """Build the converted model; see :func:`load_model` (this also returns the report).

    Args:
        validate: run the ``--shapes`` checks first (``marlin-verify --model`` has run them).
        kernel_factory: makes the fast-path module of a converted layer; default our GPU
            kernel when ``device`` is CUDA. Given on the CPU (tests), it replaces the
            exact path so the kernel swap logic runs without a GPU.
    """
    folder, cfg = read_converted_config(path)
    torch, _ = import_stack()
    dev = resolve_device(device)
    from ..artifact.reader import open_artifact
    from ..artifact.validate import validate_artifact
    from .modules import DEQUANT_FP16, EXACT, KERNEL, DenseLinear, ExactMarlinLinear, KernelMarlinLinear, to_torch

    if validate:
        vreport, art = validate_artifact(folder)
        if not vreport.ok:
            first = next(p for p in vreport.problems if p.severity == "error")
            art.close()
            raise ArtifactError(
                f"fails validation ({first.message}); run marlin-verify {folder} --shapes for every problem",
                path=folder,
            )
    else:
        art = open_artifact(folder)
    reader = None
    try:
        config = hf_config(cfg, path=folder / "config.json")
        mc = model_class(config, cfg, path=folder / "config.json")
        use_kernel = kernel_factory is not None or dev.type == "cuda"
        factory = kernel_factory or _marlin_kernel
        if dev.type == "cuda":
            from ..gpu.runtime import cupy_module

            cupy_module().cuda.Device(dev.index).use()
        model = mc.build(config, dtype=config_dtype(cfg), attn_implementation=attn_implementation)
        report = LoadReport(str(folder), str(dev), mc.name, mc.kind)
        reader, dq_plans, dq_reasons = _passthrough_quantized(folder, cfg, art)
        slots = {}
        for name, rec in art.layers.items():
            own = {f"{name}.{s.value}" for s in (Suffix.B, Suffix.SCALES, Suffix.DELTA)}
            own |= {f"{name}.{Suffix.PERM.value}"} if rec.act_order else set()
            own |= {f"{name}.{Suffix.BIAS.value}"} if rec.has_bias else set()
            slots[name] = layer_slot(rec.size_k, rec.size_n, rec.has_bias, own)
        for name, lp in dq_plans.items():
            own = set(lp.source_tensors) | ({lp.bias.name} if lp.bias else set())
            slots[name] = layer_slot(lp.size_k, lp.size_n, lp.bias is not None, own)
        linears, groups = inventory(model)
        b = bind(
            linears=linears,
            model_tensors=groups,
            layers=slots,
            tensors=art.file.infos,
            prefix=model.base_model_prefix or "",
        )
        binding_errors(b, what="artifact", arch=mc.name, path=folder)
        if b.missing and strict:
            raise ModelError(
                f"{len(b.missing)} tensor(s) of {mc.name} have nothing in the artifact to load: {', '.join(b.missing)}",
                path=folder,
            )

        def tensor(name: str) -> Any:
            return to_torch(art.tensor(name), art.file.infos[name].dtype)

        def make_layer(module: str, layer: str) -> Any:
            report.modules[layer] = module
            if layer in dq_plans:
                lp = dq_plans[layer]
                w = torch.from_numpy(np.ascontiguousarray(dequantized_weight(reader, lp).T)).to(torch.float16)
                bias = to_torch(reader.load_tensor(lp.bias.name).data, lp.bias.dtype) if lp.bias else None
                report.layers[layer] = DEQUANT_FP16
                report.not_converted[layer] = dq_reasons.get(layer, "")
                return DenseLinear(layer, w, bias, DEQUANT_FP16).to(dev)
            rec = art.layers[layer]
            p = f"{layer}."
            B, S, D = (np.asarray(art.tensor(p + s.value)) for s in (Suffix.B, Suffix.SCALES, Suffix.DELTA))
            perm = np.asarray(art.tensor(p + Suffix.PERM.value)) if rec.act_order else None
            bias = tensor(p + Suffix.BIAS.value) if rec.has_bias else None
            if use_kernel and kernel_compatible(rec.size_k, rec.layout_n, rec.group_size):
                b16 = None if bias is None else bias.to(torch.float16).numpy()
                kernel = factory(
                    layer, rec.size_k, rec.size_n, rec.group_size, B, S, D, perm, b16, padded_n=rec.layout_n
                )
                report.layers[layer] = KERNEL
                return KernelMarlinLinear(layer, kernel, rec.size_k, rec.size_n)
            if use_kernel:
                report.kernel_fallback[layer] = (
                    f"K = {rec.size_k} is outside the kernel's limits (K % {KERNEL_K_MULTIPLE} == 0)"
                )
            # The exact path keeps the real columns only: the padding is zero weight.
            n = rec.size_n
            q = unpack_b(B, rec.layout_n)[:, :n]
            scales = unpermute_scales(S, single=rec.shape.num_groups == 1)[:, :n]
            report.layers[layer] = EXACT
            return ExactMarlinLinear(layer, q, scales, D[:, :n], perm, bias, rec.group_size).to(dev)

        report.warnings += untie(b, lambda a, o: same_tensor(art.file, a, art.file, o))
        apply_binding(model, b, make_layer=make_layer, load_tensor=tensor, path=folder)
        materialize_missing(model, missing_names(groups, b.missing))
        report.tensors = {t: list(n) for t, n in b.loads.items()}
        report.missing = list(b.missing)
        report.unused = list(b.unused)
        model.to(dev)
    finally:
        art.close()
        if reader is not None:
            reader.close()
    return model, report


def same_tensor(fa: Any, a: str, fb: Any, b: str) -> bool:
    """Whether tensor ``a`` of file ``fa`` and ``b`` of ``fb`` have one dtype, shape and bytes."""
    ia, ib = fa.infos[a], fb.infos[b]
    return (ia.dtype, tuple(ia.shape)) == (ib.dtype, tuple(ib.shape)) and bytes(fa.raw(a)) == bytes(fb.raw(b))


def load_model(
    path: str | Path, device: Any = "cuda", *, strict: bool = True, attn_implementation: str | None = None
) -> Any:
    """Load a converted model folder as a ``transformers`` model, offline.

    The model is built from the folder's ``config.json`` (its ``quantization_config`` is
    ignored) with transformers' own classes (``AutoModelForCausalLM`` / ``AutoModel`` ...
    ``.from_config``, the class ``architectures`` names), no hub access. Then:

    * every converted layer replaces its linear module: on CUDA our Marlin kernel
      (``MarlinLinearModule``; a layer outside its limits runs the exact path and is
      listed), on the CPU an exact path from the artifact's own tensors
      (``(q - 8) * s + delta`` in fp32, act-order gather, fp16 input and output);
    * a quantized layer that passed through unconverted runs through its exact
      dequantization rounded to fp16 (listed: not on the fast path);
    * every other tensor (embeddings, norms, unquantized heads, biases, tied weights)
      loads in its own dtype; a tied weight is one tensor under every tied name.

    Tensor names are matched with and without the model's ``base_model_prefix`` (a
    ``bert.``-prefixed checkpoint loads into ``BertModel``).

    Args:
        path: the converted model folder (``marlin-convert IN OUTDIR/``).
        device: ``"cuda"`` (default, needs CuPy and an sm_80+ GPU) or ``"cpu"``.
        strict: refuse a model parameter the artifact does not feed (default); with
            False it keeps its initial value and is listed in the report's ``missing``.
        attn_implementation: passed to transformers (``"eager"``, ``"sdpa"``); None for its default.

    Returns:
        The model in eval mode, on ``device``; ``model.marlin_report`` is a
        :class:`LoadReport`. Swapped modules take and return activations in any float
        dtype ``(..., K)`` -> ``(..., N)``.

    Raises:
        ModelError: not a converted model folder; a ``.tinyloop`` conversion; an
            architecture or ``model_type`` transformers does not know; layers no module
            matches or quantized modules without a layer (all named); a tensor whose
            shape disagrees with the model; missing tensors (``strict``); transformers
            or torch not installed.
        ArtifactError: the artifact fails ``marlin-verify --shapes``.
        GpuUnavailableError: ``device="cuda"`` without CuPy, a GPU, or torch CUDA.
    """
    model, report = build_converted(path, device, strict=strict, attn_implementation=attn_implementation)
    model.marlin_report = report
    return model

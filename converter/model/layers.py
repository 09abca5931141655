"""A converted folder's quantized layers as torch modules: what :func:`load_model` and the
transformers quantizer (:mod:`converter.model.hf_quantizer`) share, so both build the
same module from the same bytes on the same rule.

:class:`ConvertedLayers` opens the artifact (and the source reader of layers that passed
through unconverted), binds a model skeleton to it, and makes each layer's module on the
device asked for; the caller decides what builds the skeleton and loads the other tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..constants import KERNEL_K_MULTIPLE, Suffix
from ..errors import ArtifactError, ConverterError
from ..formats.scales import FP16_MAX, FP16_RANGE_REASON
from ..marlin.layout import unpack_b, unpermute_scales
from ..marlin.shapes import kernel_compatible
from . import ModelError
from .build import binding_errors, inventory, layer_slot
from .fuse import FusedGroup, plan_fusion
from .guard import names as name_list
from .names import Binding, bind

#: ``kernel_factory(name, size_k, size_n, group_size, B, scales, delta, perm, bias, *, padded_n)``
#: -> a module taking float16 ``(..., K)`` and returning float16 ``(..., N)`` (the bias
#: applied inside; ``N = size_n``, the true one). Arrays are the artifact's as stored
#: (scales Marlin-permuted, ``B``, scales and delta ``padded_n`` wide, bias float16 or
#: None); ``padded_n`` is ``size_n`` for a layer that is not padded.
KernelFactory = Callable[..., Any]


@dataclasses.dataclass
class LoadReport:
    """What :func:`~converter.model.loader.load_model` (or ``from_pretrained``) did: ``model.marlin_report``.

    Attributes:
        folder: the converted model folder.
        device: where the model runs (``"cpu"``, ``"cuda:0"``; several, comma-separated).
        architecture: the transformers class built (``"LlamaForCausalLM"``).
        kind: ``causal-lm``, ``masked-lm``, ``encoder`` or ``other``.
        layers: ``{artifact layer: path}``, path one of ``marlin-kernel`` (our GPU
            kernel), ``exact`` (exact fp32 from the artifact's tensors) or
            ``dequant-fp16`` (a quantized layer that passed through unconverted), or
            ``dense-fp32`` (such a layer whose weight leaves fp16's range, kept in fp32).
        modules: ``{artifact layer: model module name}``.
        not_converted: ``{layer: the converter's reason}`` for the layers that passed through.
        kernel_fallback: ``{layer: reason}`` for converted layers that run ``exact`` on the
            GPU because they are outside the kernel's limits (``K``, or a bias beyond fp16).
        tensors: ``{artifact tensor: [model names]}`` loaded (in their own dtype, or in
            the ``dtype`` given to ``from_pretrained`` where it differs from what ``"auto"``
            resolves to).
        missing: model tensors nothing in the artifact feeds (only with ``strict=False``;
            they keep their initial values), and ``<layer>.bias`` for a layer without the
            bias its module has.
        unused: artifact tensors no module uses (``cls.predictions.*`` when the config
            builds a bare ``BertModel``).
        warnings: tied tensors that differ, and the like.
        fused: ``{group: [layers]}`` for sibling layers that run as one kernel
            (:mod:`converter.model.fuse`); each layer's path is still ``marlin-kernel``.
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
    fused: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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


class ConvertedLayers:
    """The artifact of a converted model folder, open, and every quantized layer in it.

    Args:
        folder, cfg: from :func:`~converter.model.loader.read_converted_config`.
        validate: run the ``--shapes`` checks first (``marlin-verify --model`` has run them).
        tolerate: problem codes of the checks that do not stop the load (a hub download
            holds config.json and the weights, not the tokenizer files the manifest lists).

    Raises:
        ArtifactError: the artifact fails validation.
        ModelError: layers that passed through unconverted cannot be read.
    """

    def __init__(
        self, folder: Path, cfg: dict[str, Any], *, validate: bool = True, tolerate: frozenset[str] = frozenset()
    ) -> None:
        from ..artifact.reader import open_artifact
        from ..artifact.validate import validate_artifact

        self.folder = folder
        if validate:
            vreport, art = validate_artifact(folder)
            errors = [p for p in vreport.problems if p.severity == "error" and p.code.value not in tolerate]
            if errors:
                art.close()
                raise ArtifactError(
                    f"fails validation ({errors[0].message}); run marlin-verify {folder} --shapes for every problem",
                    path=folder,
                )
        else:
            art = open_artifact(folder)
        self.art = art
        try:
            self.reader, self.dq_plans, self.dq_reasons = _passthrough_quantized(folder, cfg, art)
        except BaseException:
            art.close()
            raise
        self.slots = {}
        for name, rec in art.layers.items():
            own = {f"{name}.{s.value}" for s in (Suffix.B, Suffix.SCALES, Suffix.DELTA)}
            own |= {f"{name}.{Suffix.PERM.value}"} if rec.act_order else set()
            own |= {f"{name}.{Suffix.BIAS.value}"} if rec.has_bias else set()
            self.slots[name] = layer_slot(rec.size_k, rec.size_n, rec.has_bias, own)
        for name, lp in self.dq_plans.items():
            own = set(lp.source_tensors) | ({lp.bias.name} if lp.bias else set())
            self.slots[name] = layer_slot(lp.size_k, lp.size_n, lp.bias is not None, own)
        #: ``{model module: FusedGroup}`` (:meth:`plan_fusion`); empty: every layer alone.
        self.fusion: dict[str, FusedGroup] = {}
        self._fused: dict[str, tuple[Any, Any]] = {}
        self._big_bias: dict[str, float | None] = {}  # bias_beyond_fp16's answers: plan_fusion and module ask

    def plan_fusion(self, swaps: Mapping[str, str]) -> None:
        """Fuse the sibling layers of ``swaps`` (``{module: layer}``) that can share one
        kernel (:mod:`converter.model.fuse`); the kernel path of :meth:`module` then
        builds each group once."""
        fits = {m: lay for m, lay in swaps.items() if self.bias_beyond_fp16(lay) is None}
        self.fusion = plan_fusion(fits, self.art.layers)

    def bias_beyond_fp16(self, layer: str) -> float | None:
        """The largest ``|bias|`` of converted layer ``layer`` where it leaves fp16's range
        (the kernels read the bias as fp16: it would be inf), else None."""
        if layer not in self._big_bias:
            rec = self.art.layers.get(layer)
            big = None
            if rec is not None and rec.has_bias:
                b = self.tensor(f"{layer}.{Suffix.BIAS.value}").double().abs()  # its own dtype, bf16 included
                top = float(b.max()) if b.numel() else 0.0
                big = top if not np.isfinite(top) or top > FP16_MAX else None
            self._big_bias[layer] = big
        return self._big_bias[layer]

    def close(self) -> None:
        self.art.close()
        if self.reader is not None:
            self.reader.close()

    def __enter__(self) -> ConvertedLayers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def bind(
        self, model: Any, *, arch: str, strict: bool, ties: Mapping[str, str] | None = None
    ) -> tuple[Binding, list[list[str]]]:
        """Match ``model``'s linears and tensors with the artifact's layers and tensors:
        the binding, and the model's tensor names in groups sharing one tensor.

        Args:
            ties: ``{target: source}`` model names transformers will tie after loading
                (its skeleton is built untied); None where the skeleton is tied already.

        Raises:
            ModelError: layers no module matches, linear modules without a layer or a
                weight, sizes that disagree (all named); with ``strict``, model tensors
                nothing in the artifact feeds.
        """
        linears, groups = inventory(model, ties)
        b = bind(
            linears=linears,
            model_tensors=groups,
            layers=self.slots,
            tensors=self.art.file.infos,
            prefix=model.base_model_prefix or "",
        )
        binding_errors(b, what="artifact", arch=arch, path=self.folder)
        if b.missing and strict:
            raise ModelError(
                f"{len(b.missing)} tensor(s) of {arch} have nothing in the artifact to load: {name_list(b.missing)}",
                path=self.folder,
            )
        return b, groups

    def device_bytes(self, layer: str) -> int:
        """About what ``layer``'s module holds on a GPU, for placing it: the artifact
        tensors it is built from (a layer dequantized to fp16: ``K x N x 2`` and its bias;
        one that passed through for fp16's range is kept in fp32: ``x 4``; one the kernel
        cannot take runs the exact path: a byte a code, int64 group and gather indices)."""
        import math

        from ..safetensors_io import _ITEMSIZE

        if layer in self.dq_plans:
            lp = self.dq_plans[layer]
            item = 4 if self.dq_reasons.get(layer, "").startswith(FP16_RANGE_REASON) else 2
            return item * lp.size_k * lp.size_n + (2 * lp.size_n if lp.bias is not None else 0)
        rec = self.art.layers[layer]
        if not kernel_compatible(rec.size_k, rec.layout_n, rec.group_size) or self.bias_beyond_fp16(layer) is not None:
            k, n, g = rec.size_k, rec.size_n, rec.shape.num_groups
            bias = n * _ITEMSIZE[self.art.file.infos[f"{layer}.{Suffix.BIAS.value}"].dtype] if rec.has_bias else 0
            return k * n + g * n * (2 + 4) + k * 8 * (2 if rec.act_order else 1) + bias
        infos = self.art.file.infos
        return sum(math.prod(infos[t].shape) * _ITEMSIZE[infos[t].dtype] for t in self.slots[layer].tensors)

    def owned_tensors(self, b: Binding) -> set[str]:
        """Every artifact tensor the swapped layers of ``b`` consume (never a model parameter)."""
        return set().union(*(self.slots[layer].tensors for layer in b.swaps.values()))

    def tensor(self, name: str) -> Any:
        """Artifact tensor ``name`` as a CPU torch tensor in its own dtype."""
        from .modules import to_torch

        return to_torch(self.art.tensor(name), self.art.file.infos[name].dtype)

    def module(self, name: str, layer: str, dev: Any, report: LoadReport, factory: KernelFactory | None) -> Any:
        """The swapped module of artifact layer ``layer`` (model module ``name``), its buffers on ``dev``.

        ``factory`` makes the fast path of a converted layer inside the kernel's limits
        (:class:`KernelMarlinLinear` around it); None, or a layer outside the limits,
        gives the exact path. A layer that passed through unconverted runs dequantized
        in fp16, or in fp32 where its weight leaves fp16's range. ``report`` records the
        path taken.
        """
        import torch

        from .modules import (
            DENSE_FP32,
            DEQUANT_FP16,
            EXACT,
            KERNEL,
            DenseLinear,
            ExactMarlinLinear,
            FusedSlice,
            KernelMarlinLinear,
            sixteen_bit,
            to_torch,
        )

        report.modules[layer] = name
        if layer in self.dq_plans:
            lp = self.dq_plans[layer]
            # A layer whose weight leaves fp16's range (one reason it passed through) stays
            # fp32: in fp16 those weights would be inf.
            w32 = torch.from_numpy(np.ascontiguousarray(dequantized_weight(self.reader, lp).T))
            w = sixteen_bit(w32, torch.float16)
            path = DEQUANT_FP16 if w.dtype == torch.float16 else DENSE_FP32
            if path == DENSE_FP32:
                import warnings

                note = (
                    f"layer {layer} runs in fp32: its weights leave fp16's range (largest |w| = "
                    f"{float(w.abs().max()):.6g}), and so may its outputs; fp16 activations would overflow "
                    "after it, so run this model in bf16 (from_pretrained(..., dtype=torch.bfloat16))"
                )
                report.warnings.append(note)
                warnings.warn(note, stacklevel=2)
            bias = to_torch(self.reader.load_tensor(lp.bias.name).data, lp.bias.dtype) if lp.bias else None
            report.layers[layer] = path
            report.not_converted[layer] = self.dq_reasons.get(layer, "")
            return DenseLinear(layer, w, bias, path).to(dev)
        art = self.art
        rec = art.layers[layer]
        group = self.fusion.get(name) if factory is not None else None
        if group is not None:
            fused, fused_dev = self._fused.get(group.name) or self._fuse(group, dev, factory, report)
            if fused_dev == dev:
                start = sum(art.layers[lay].size_n for lay in group.layers[: group.layers.index(layer)])
                report.layers[layer] = KERNEL
                return FusedSlice(layer, fused, start, start + rec.size_n, rec.size_k)
        p = f"{layer}."
        B, S, D = (np.asarray(art.tensor(p + s.value)) for s in (Suffix.B, Suffix.SCALES, Suffix.DELTA))
        perm = np.asarray(art.tensor(p + Suffix.PERM.value)) if rec.act_order else None
        bias = self.tensor(p + Suffix.BIAS.value) if rec.has_bias else None
        big_bias = self.bias_beyond_fp16(layer) if factory is not None else None
        if factory is not None and big_bias is None and kernel_compatible(rec.size_k, rec.layout_n, rec.group_size):
            b16 = None if bias is None else bias.to(torch.float16).numpy()
            kernel = factory(layer, rec.size_k, rec.size_n, rec.group_size, B, S, D, perm, b16, padded_n=rec.layout_n)
            report.layers[layer] = KERNEL
            return KernelMarlinLinear(layer, kernel, rec.size_k, rec.size_n)
        if factory is not None and big_bias is not None:
            report.kernel_fallback[layer] = (
                f"bias not finite or outside float16's range (largest |b| = {big_bias:.6g}, float16's "
                f"{FP16_MAX:g}), which the kernels read"
            )
        elif factory is not None:
            report.kernel_fallback[layer] = (
                f"K = {rec.size_k} is outside the kernel's limits (K % {KERNEL_K_MULTIPLE} == 0)"
            )
        # The exact path keeps the real columns only: the padding is zero weight.
        n = rec.size_n
        q = unpack_b(B, rec.layout_n)[:, :n]
        scales = unpermute_scales(S, single=rec.shape.num_groups == 1)[:, :n]
        report.layers[layer] = EXACT
        return ExactMarlinLinear(layer, q, scales, D[:, :n], perm, bias, rec.group_size).to(dev)

    def _fuse(self, group: FusedGroup, dev: Any, factory: KernelFactory, report: LoadReport) -> tuple[Any, Any]:
        """Build ``group``'s one kernel on ``dev`` from its layers' tensors side by side."""
        import torch

        from .modules import FusedKernel

        art = self.art
        recs = [art.layers[lay] for lay in group.layers]

        def cat(suffix: Suffix) -> np.ndarray:
            return np.concatenate([np.asarray(art.tensor(f"{lay}.{suffix.value}")) for lay in group.layers], axis=1)

        n = sum(r.size_n for r in recs)
        bias = None
        if recs[0].has_bias:
            bias = torch.cat([self.tensor(f"{lay}.{Suffix.BIAS.value}").to(torch.float16) for lay in group.layers])
            bias = bias.numpy()
        B, S, D = cat(Suffix.B), cat(Suffix.SCALES), cat(Suffix.DELTA)
        rec = recs[0]
        kernel = factory(group.name, rec.size_k, n, rec.group_size, B, S, D, None, bias, padded_n=n)
        built = (FusedKernel(group.name, kernel, len(group.layers)), dev)
        self._fused[group.name] = built
        report.fused[group.name] = list(group.layers)
        return built

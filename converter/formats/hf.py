"""What the HF-checkpoint readers (GPTQ, AWQ, compressed-tensors) share.

:class:`HFSource`, their base (describe, load_tensor, close, the companion-tensor and
scale checks, the act-order permutation), the one "already Marlin-packed" refusal, and
the helpers every HF reader's planning uses: typed config fields, the
``modules_to_not_convert`` match, the plan of plain and passed-through tensors, and
the :class:`QuantWeight` of an integer-zero-point layer.  The checkpoint folder itself
(weights, index, configs) is :mod:`converter.formats.hf_checkpoint`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ..constants import MARLIN_ZERO
from ..dtypes import as_f32
from ..errors import ConfigError, SourceFormatError
from ..quant_weight import QuantWeight, Tensor, marlin_code_offset
from ..safetensors_io import SafetensorsFile, release_mapped_pages
from .base import READERS, LayerPlan, Source, SourcePlan, TensorInfo
from .hf_checkpoint import HFCheckpoint
from .packing import act_order_perm
from .scales import FP16_RANGE_REASON, fp16_scales, kernel_range_error, scales_to_fp16


class HFSource(Source):
    """What the HF-checkpoint readers (GPTQ, AWQ, compressed-tensors) share.

    A subclass names the ``quant_method`` values it reads in its class statement,
    beside its format and conventions (see :class:`~converter.formats.base.Source`)::

        class AwqSource(HFSource, format=SourceFormat.AWQ, methods=("awq",),
                        conventions=(ZeroConvention.AWQ,)): ...

    Args:
        ckpt: the opened checkpoint (closed by :meth:`close`).

    Attributes:
        ckpt: the checkpoint.
        path: its folder.
        cfg_path: the file the quant config came from (``config.json`` if none).
    """

    #: ``quant_method`` values (lower case) this reader converts.
    quant_methods: ClassVar[tuple[str, ...]] = ()
    #: The tensor whose presence makes a layer, as :meth:`need` names it.
    anchor: ClassVar[str] = "qweight"
    #: What a companion tensor's expected shape is derived from, as :meth:`need` names it.
    shape_rule: ClassVar[str] = "K, N and group_size"
    #: Appended to :meth:`need`'s "missing tensor" message.
    missing_note: ClassVar[str] = ""

    @property
    def layer_anchor(self) -> str:  # type: ignore[override]
        return f"tensor named *.{self.anchor}"

    def __init_subclass__(cls, *, methods: tuple[str, ...] = (), **kwargs: Any) -> None:
        for other in READERS.values():
            taken = set(methods) & set(getattr(other, "quant_methods", ()))
            if taken:
                raise TypeError(
                    f"{cls.__name__}: quant_method {sorted(taken)[0]!r} is already read by {other.__name__}"
                )
        cls.quant_methods = tuple(methods)
        super().__init_subclass__(**kwargs)

    def __init__(self, ckpt: HFCheckpoint) -> None:
        self.ckpt = ckpt
        self.path = ckpt.folder
        self.cfg_path = ckpt.folder / (ckpt.quant_config_file or "config.json")

    @classmethod
    def claims_checkpoint(cls, ckpt: HFCheckpoint) -> bool:
        """Whether a checkpoint whose quant config names no method is this format
        (legacy configs, configs that are missing altogether)."""
        return False

    def describe(self, *, digests: bool | Mapping[Path, str] = True) -> dict[str, Any]:
        """The manifest's ``source``: format, files (weights, index, configs with sha256), quant config."""
        return {
            "format": self.format.value,
            "files": self.ckpt.describe_files(digests=digests),
            "quant_config": self.ckpt.quant_config,
        }

    def digest_files(self) -> list[Path]:
        return self.ckpt.digest_paths()

    def _plan_layers(self, prefixes: list[str], pad: bool) -> list[LayerPlan]:
        """``_plan_layer`` of each prefix in turn. Planning reads every layer's scales
        (and zeros); the pages it maps are dropped after each layer, or the mapped input
        would stay resident through the whole conversion."""
        layers = []
        for prefix in prefixes:
            dense = f"{prefix}.weight"
            if dense in self.ckpt:  # engines and our loaders would each pick one silently
                raise SourceFormatError(
                    f"layer {prefix} has both {self.anchor} and a dense weight: which one the model uses is "
                    "ambiguous; remove one",
                    path=self.ckpt.file_of(dense),
                    tensor=dense,
                )
            layers.append(self._plan_layer(prefix, pad))  # type: ignore[attr-defined]
            release_mapped_pages()
        return layers

    def load_tensor(self, name: str) -> Tensor:
        return self.ckpt.tensor(name)

    def stored_bytes(self, name: str) -> tuple[SafetensorsFile, int, int] | None:
        return self.ckpt.stored_bytes(name)

    def input_files(self) -> list[Path]:
        return self.ckpt.input_files()

    @property
    def checkpoint_folder(self) -> Path | None:
        return self.ckpt.folder

    def close(self) -> None:
        self.ckpt.close()

    def need(
        self, prefix: str, suffix: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None = None, *, ndim: int = 2
    ) -> TensorInfo:
        """The header facts of layer ``prefix``'s tensor ``suffix``, checked.

        Args:
            prefix, suffix: the tensor is ``<prefix>.<suffix>``.
            dtypes: the dtype codes allowed.
            shape: the exact shape required, or None for any shape of ``ndim`` dimensions.

        Raises:
            SourceFormatError: the tensor is missing, or its dtype or shape is wrong
                (naming the file, the tensor, the expected and the found values).
        """
        name = f"{prefix}.{suffix}"
        if name not in self.ckpt:
            raise SourceFormatError(
                f"layer {prefix} has {self.anchor} but no {suffix}{self.missing_note}{self.ckpt.lone_shard_hint}",
                path=self.ckpt.folder,
                tensor=name,
            )
        info = self.ckpt.info(name)
        path = self.ckpt.file_of(name)
        if info.dtype not in dtypes:
            raise SourceFormatError(f"dtype {info.dtype}, expected {' or '.join(dtypes)}", path=path, tensor=name)
        if (shape is not None and info.shape != shape) or (shape is None and len(info.shape) != ndim):
            want = list(shape) if shape is not None else f"{ndim}-D"
            raise SourceFormatError(
                f"shape {list(info.shape)} disagrees with {self.shape_rule} (expected {want})", path=path, tensor=name
            )
        return info

    def act_order(self, g_idx: str, group_size: int, num_groups: int) -> np.ndarray | None:
        """The act-order permutation of the ``g_idx`` tensor named ``g_idx``, or None when
        it is trivial (:func:`~converter.formats.packing.act_order_perm`).

        Raises:
            SourceFormatError: a value out of range or unequal groups (naming the tensor).
        """
        values = np.asarray(self.ckpt.array(g_idx))
        return act_order_perm(values, group_size, num_groups, path=self.ckpt.file_of(g_idx), tensor=g_idx)

    def check_scales(self, scales: TensorInfo) -> np.ndarray:
        """Check a scale tensor now, so that a scale fp16 cannot hold exactly fails
        before anything is written (:func:`~converter.formats.scales.scales_to_fp16`).

        Returns:
            The scales as stored, in float32 (for :meth:`layer_delta`).

        Raises:
            SourceFormatError: NaN/Inf, a magnitude above the fp16 maximum, or a value
                float16 would round (with the numbers).
        """
        raw = as_f32(self.ckpt.array(scales.name), scales.dtype)
        scales_to_fp16(raw, path=self.ckpt.file_of(scales.name), tensor=scales.name)
        return raw

    def layer_delta(
        self, layer: LayerPlan, z: np.ndarray, scales: TensorInfo, raw: np.ndarray, *, transposed: bool = False
    ) -> np.ndarray:
        """The artifact's ``marlin_delta`` of a whole planned layer, checked against the
        kernels' float16 range (:func:`~converter.formats.scales.kernel_range_error`).

        Args:
            layer: the planned layer (its ``bits`` give the code offset).
            z: uint8 ``(G, N)`` true zero points.
            scales: the scale tensor, ``(G, N)``, or ``(N, G)`` when ``transposed``.
            raw: its values in float32, as :meth:`check_scales` returned them.

        Returns:
            float32 ``(G, N)`` = ``(8 - code_offset - z) * s``, as
            :meth:`QuantWeight.marlin_delta` computes it; ``symmetric`` is ``not any(delta)``
            (a zero scale makes a group symmetric whatever its zero point).

        A layer whose ``delta`` (or a weight its codes form) float16 cannot hold is
        marked not convertible (``reason`` starts with :data:`FP16_RANGE_REASON`): it
        passes through, and the rest of the checkpoint converts.
        """
        s = np.ascontiguousarray(raw.T) if transposed else raw
        off = marlin_code_offset(layer.bits)
        delta = (np.float32(MARLIN_ZERO - off) - z.astype(np.float32)) * s
        why = kernel_range_error(s, delta, off, layer.bits)
        if why:
            # This layer alone cannot run on the kernels: it passes through unchanged,
            # with the reason in the manifest; the rest of the checkpoint converts.
            layer.convertible, layer.reason = False, f"{FP16_RANGE_REASON}: {why}"
        return delta


def already_marlin(subject: str, detail: str, *, advice: str, packing: str = "Marlin-packed") -> str:
    """The refusal of a checkpoint that is already Marlin-packed: converting it would pack twice.

    Args:
        subject: what is packed, with its verb ("checkpoint is").
        detail: how the format says so (the spec section).
        advice: what to do instead.
        packing: how it is packed.
    """
    return f"{subject} already {packing} ({detail}); marlin-convert never packs twice: {advice}"


def config_field(
    cfg: dict[str, Any],
    key: str,
    types: type | tuple[type, ...],
    default: Any,
    *,
    path: Path,
    required: bool = False,
    field: str | None = None,
) -> Any:
    """Read one quant-config field with a type check.

    Args:
        field: how messages name the field (default ``key``; ``dynamic['-:.*'].bits``
            for a field inside a nested object).

    Raises:
        ConfigError: missing while required, or of the wrong type (naming the field,
            the expected type and the value found).
    """
    field = field or key
    if key not in cfg or cfg[key] is None:
        if required:
            raise ConfigError("required field is missing", path=path, tensor=field)
        return default
    value = cfg[key]
    # bool is an int subclass: never accept True for an int field or 1 for a bool one.
    ok = isinstance(value, types) and not (
        isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,))
    )
    if not ok:
        want = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise ConfigError(f"expected {want}, found {json.dumps(value)[:200]}", path=path, tensor=field)
    return value


def module_of(tensor_name: str) -> str:
    """The module prefix of a tensor name: ``a.b.weight`` -> ``a.b``."""
    return tensor_name.rsplit(".", 1)[0] if "." in tensor_name else tensor_name


def not_convert_match(module: str, entries: list[str]) -> str | None:
    """The ``modules_to_not_convert`` entry that excludes ``module``, or None.

    transformers' AWQ/GPTQ integrations skip a module when any entry is a substring
    of its dotted name (``replace_with_awq_linear``), so we match the same way.
    """
    for entry in entries:
        if entry and entry in module:
            return entry
    return None


def string_list(cfg: dict[str, Any], key: str, *, path: Path) -> list[str]:
    """A config field that must be a list of strings (None or absent: empty).

    Raises:
        ConfigError: any other type, naming the field and the value found.
    """
    value = cfg.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"expected a list of strings, found {json.dumps(value)[:200]}", path=path, tensor=key)
    return list(value)


def assemble_plan(layers: list[LayerPlan], infos: dict[str, TensorInfo], rule: Any) -> SourcePlan:
    """The :class:`SourcePlan` of an HF checkpoint from its planned layers.

    Tensors no layer owns (its ``source_tensors`` and bias) are plain; every tensor of
    a layer that does not convert passes through with ``"layer <name> not converted:
    <reason>"``; plain tensors of modules that ``rule(module)`` names get its reason.
    """
    owned: set[str] = set()
    reasons: dict[str, str] = {}
    for layer in layers:
        mine = layer.source_tensors + ((layer.bias.name,) if layer.bias else ())
        owned.update(mine)
        if not layer.convertible:
            for t in mine:
                reasons[t] = f"layer {layer.name} not converted: {layer.reason}"
    plain = [i for n, i in infos.items() if n not in owned]
    tag_excluded(plain, reasons, rule)
    return SourcePlan(layers, plain, reasons)


def integer_zero_weight(
    ckpt: HFCheckpoint,
    layer: LayerPlan,
    *,
    q: np.ndarray,
    z: np.ndarray,
    scales: str,
    g0: int,
    g1: int | None,
    perm: np.ndarray | None = None,
    rows: tuple[int, int],
    scales_transposed: bool = False,
) -> QuantWeight:
    """A :class:`QuantWeight` for formats with integer zero points (``W = s * (q - z)``).

    Args:
        ckpt: the checkpoint holding the scales and bias.
        layer: the planned layer.
        q: uint8 ``(rows, N)`` source codes, Marlin row order (empty for ``load_packed``).
        z: uint8 ``(groups, N)`` true zero points of source groups ``[g0, g1)``.
        scales: name of the scale tensor, ``(G, N)`` or, with ``scales_transposed``,
            ``(N, G)`` (compressed-tensors).
        g0, g1: the source groups the rows cover.
        rows: ``(k_start, k_stop)``, the Marlin rows of the chunk.

    Returns:
        The layer chunk at the artifact's group size (a regrouped layer's source
        scales and zeros repeated for each slice, :meth:`LayerPlan.source_group_rows`),
        with fp16 scales (range-checked) and ``delta = (8 - z) * s`` in float32 from
        the scales as stored (spec 4.6).

    Raises:
        SourceFormatError: a scale is NaN/Inf or overflows fp16.
    """
    info = ckpt.info(scales)
    raw = ckpt.array(scales)
    k_start, k_stop = rows
    slices = layer.source_group_rows(k_start, k_stop)
    if info.dtype == "F16":  # Marlin's scales as they are: only NaN/Inf to refuse, no rounding to check
        s16 = np.ascontiguousarray(raw[:, g0:g1].T) if scales_transposed else np.array(raw[g0:g1])
        if slices is not None:
            z, s16 = z[slices], s16[slices]
        s16 = fp16_scales(s16, path=ckpt.file_of(scales), tensor=scales)
        s_src = s16.astype(np.float32)
    else:
        s_src = as_f32(raw[:, g0:g1], info.dtype).T.copy() if scales_transposed else as_f32(raw[g0:g1], info.dtype)
        if slices is not None:
            z, s_src = z[slices], s_src[slices]
        s16 = scales_to_fp16(s_src, path=ckpt.file_of(scales), tensor=scales)
    return QuantWeight(
        name=layer.name,
        q=q,
        zeros=z,
        group_size=layer.group_size,
        bits=layer.bits,
        scales=s16,
        delta=(np.float32(MARLIN_ZERO) - z.astype(np.float32)) * s_src,
        zero_convention=layer.zero_convention,
        bias=ckpt.tensor(layer.bias.name) if layer.bias else None,
        perm=perm,
        k_offset=k_start,
        size_k=layer.size_k,
        source_scales_dtype=info.dtype,
        source_scales=None if info.dtype == "F16" else s_src,
    )


def tag_excluded(plain: list[TensorInfo], reasons: dict[str, str], rule: Any) -> None:
    """Give every plain tensor whose module a config excludes from quantization its reason.

    Args:
        plain: tensors no quantized layer owns.
        reasons: ``{tensor name: reason}``, filled in place (existing entries kept).
        rule: ``rule(module) -> reason or None``.
    """
    for info in plain:
        if info.name in reasons:
            continue
        why = rule(module_of(info.name))
        if why:
            reasons[info.name] = why

"""compressed-tensors ``pack-quantized`` checkpoints (llm-compressor) in safetensors.

Per Linear ``<prefix>`` (checkpoint-formats.md section 6, ``pack_quantized.py``):

==========================  =======  ======================  ==========================================
tensor                      dtype    shape                   notes
==========================  =======  ======================  ==========================================
``weight_packed``           int32    ``(N, ceil(K*b/32))``   nn.Linear orientation, packed along K,
                                                             LSB-first, zero-padded
``weight_scale``            float    ``(N, G)``              transposed against GPTQ
``weight_zero_point``       int32    ``(ceil(N*b/32), G)``   asymmetric only; packed along **N**
``weight_g_idx``            int32    ``(K,)``                optional (``actorder: group``)
``weight_shape``            int      ``(2,)``                ``[N, K]``
==========================  =======  ======================  ==========================================

Values (zero_convention ``ct_offset8``): quantization produces signed codes in
``[-2^(b-1), 2^(b-1) - 1]`` and packing adds ``2^(b-1)``, to the weights and to the
zero points alike, so both stored values are unsigned and ``W = s * (q_u - z_u)``;
a symmetric layer (no zero-point tensor) has ``z_u = 2^(b-1)``.  Hence
``delta = (8 - z_u) * s``.  A ``weight_g_idx`` that is not ``k // group_size`` is
act-order, handled exactly as for GPTQ (:func:`~converter.formats.packing.act_order_perm`).

Config: ``config_groups`` map a group's ``targets`` (exact module names, ``re:``
regexes, or a class name such as ``Linear``, which we take to mean every layer with a
``weight_packed``) to its ``weights`` QuantizationArgs (``num_bits``, ``type``,
``symmetric``, ``strategy``, ``group_size``, ``actorder``); ``ignore`` (exact names
or ``re:`` regexes) lists modules kept unquantized, which pass through with that reason.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from ..constants import SourceFormat, ZeroConvention
from ..dtypes import FLOAT_DTYPES
from ..errors import ConfigError, SourceFormatError, UnsupportedQuantError
from ..quant_weight import QuantWeight
from .base import LayerPlan, SourcePlan
from .hf import HFSource, assemble_plan, integer_zero_weight
from .hf_checkpoint import HFCheckpoint
from .packing import codes_per_word, gather_rows, symmetric_zero, unpack_words
from .patterns import ConfigPattern

PACK_QUANTIZED = "pack-quantized"
CONVERTIBLE_BITS = (2, 4)
SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx", "weight_shape")


@dataclasses.dataclass(frozen=True)
class WeightArgs:
    """The ``weights`` QuantizationArgs of the config group that targets a layer."""

    group: str
    num_bits: int
    type: str
    symmetric: bool
    strategy: str
    group_size: int | None
    actorder: Any
    format: str
    #: the group's ``input_activations`` QuantizationArgs, in a few words, or None
    input_activations: str | None = None


def _activation_args(value: Any) -> str | None:
    """``input_activations`` of a config group in a few words ("int8 dynamic token"), or
    None when the group leaves activations alone."""
    if not isinstance(value, dict) or not value:
        return None
    bits = value.get("num_bits", 8)
    kind = value.get("type") or "int"
    dynamic = value.get("dynamic")
    how = "dynamic" if dynamic is True else "static" if dynamic is False else str(dynamic)
    strategy = value.get("strategy") or ""
    return " ".join(str(p) for p in (f"{kind}{bits}", how, strategy) if p)


class _Target:
    """One ``targets`` or ``ignore`` entry: an exact module name, or a ``re:`` regex
    (matched with ``re.match`` semantics, in bounded time: :mod:`~converter.formats.patterns`)."""

    def __init__(self, entry: str, *, field: str, path: Path) -> None:
        self.entry = entry
        self._rx = (
            ConfigPattern(entry[3:], entry=repr(entry), field=field, path=path) if entry.startswith("re:") else None
        )

    def matches(self, name: str) -> bool:
        return self._rx.match(name) if self._rx is not None else self.entry == name


def _is_class_name(target: str) -> bool:
    # compressed-tensors also matches targets against module class names; we only see
    # tensors, so a class name ("Linear") is taken to cover every packed layer.
    return not target.startswith("re:") and "." not in target and target[:1].isupper()


def _precedence(target: str) -> int:
    return 2 if _is_class_name(target) else 1 if target.startswith("re:") else 0


class CompressedTensorsSource(
    HFSource,
    format=SourceFormat.COMPRESSED_TENSORS,
    methods=("compressed-tensors",),
    conventions=(ZeroConvention.CT_OFFSET8,),
):
    """Reader for compressed-tensors ``pack-quantized`` checkpoints (module docstring).

    Args:
        ckpt: an opened checkpoint folder.

    Raises:
        ConfigError: a malformed ``config_groups``, ``ignore`` or regex.
        UnsupportedQuantError: a format other than ``pack-quantized`` (e.g.
            ``marlin-24``, ``float-quantized``) or a non-dense sparsity format.
    """

    anchor = "weight_packed"
    shape_rule = "weight_shape, bits and group_size"

    def __init__(self, ckpt: HFCheckpoint) -> None:
        super().__init__(ckpt)
        qc = ckpt.quant_config
        self.top_format = str(qc.get("format") or "")
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ConfigError(
                "expected a non-empty object of quantization groups", path=self.cfg_path, tensor="config_groups"
            )
        self.groups: list[tuple[list[_Target], WeightArgs]] = []
        for gname, group in groups.items():
            self.groups.append(self._parse_group(gname, group))
        formats = {a.format for _, a in self.groups}
        if PACK_QUANTIZED not in formats:
            raise UnsupportedQuantError(
                f"compressed-tensors format {sorted(formats)} is not supported: only 'pack-quantized' "
                "(int weights packed into int32) is read; 'marlin-24' is 2:4-sparse and already Marlin-packed",
                path=self.cfg_path,
                tensor="format",
            )
        sparsity = qc.get("sparsity_config") or {}
        if isinstance(sparsity, dict) and sparsity.get("format") not in (None, "dense"):
            raise UnsupportedQuantError(
                f"sparsity format {sparsity.get('format')!r} is not supported (only dense weights are read)",
                path=self.cfg_path,
                tensor="sparsity_config.format",
            )
        transform = qc.get("transform_config")
        if transform and (not isinstance(transform, dict) or transform.get("config_groups")):
            # An online transform (a Hadamard rotation, say) makes the model x -> (x T) W:
            # Marlin would run W alone, a different model with no error anywhere.
            raise UnsupportedQuantError(
                "online transforms (rotations applied at run time) are not supported: the weights are only "
                "right after the transform, and Marlin would run them without it",
                path=self.cfg_path,
                tensor="transform_config",
            )
        self.status = qc.get("quantization_status")
        ignore = qc.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
            raise ConfigError(
                f"expected a list of strings, found {json.dumps(ignore)[:200]}", path=self.cfg_path, tensor="ignore"
            )
        self.ignore = [_Target(entry, field="ignore", path=self.cfg_path) for entry in ignore]

    def _parse_group(self, gname: str, group: Any) -> tuple[list[_Target], WeightArgs]:
        field = f"config_groups.{gname}"
        if not isinstance(group, dict):
            raise ConfigError("expected an object", path=self.cfg_path, tensor=field)
        raw_targets = group.get("targets") or []
        if not isinstance(raw_targets, list) or not all(isinstance(t, str) for t in raw_targets):
            raise ConfigError(
                f"expected a list of strings, found {json.dumps(raw_targets)[:200]}",
                path=self.cfg_path,
                tensor=f"{field}.targets",
            )
        targets = [_Target(t, field=f"{field}.targets", path=self.cfg_path) for t in raw_targets]
        w = group.get("weights")
        if not isinstance(w, dict):
            raise ConfigError(
                "expected the weights' QuantizationArgs object", path=self.cfg_path, tensor=f"{field}.weights"
            )

        def get(key: str, types: type | tuple[type, ...], default: Any) -> Any:
            value = w.get(key, default)
            if value is None:
                return default
            if not isinstance(value, types) or (isinstance(value, bool) and types is int):
                raise ConfigError(
                    f"expected {getattr(types, '__name__', types)}, found {value!r}",
                    path=self.cfg_path,
                    tensor=f"{field}.weights.{key}",
                )
            return value

        # Defaults are QuantizationArgs' own (spec section 6): 8 bits, int, symmetric.
        args = WeightArgs(
            group=gname,
            num_bits=get("num_bits", int, 8),
            type=get("type", str, "int"),
            symmetric=get("symmetric", bool, True),
            strategy=get("strategy", str, ""),
            group_size=get("group_size", int, None),
            actorder=w.get("actorder"),
            format=str(group.get("format") or self.top_format or "fakequant"),
            input_activations=_activation_args(group.get("input_activations")),
        )
        return targets, args

    def args_for(self, module: str) -> WeightArgs | None:
        """The weights args the engines give ``module``: an exact name before a ``re:``
        target before a class name, each kind in the order its entries first appear, and
        an entry that several groups list takes the last group's args (vLLM and
        compressed-tensors build one target-to-scheme map, a later group overwriting an
        earlier one's entry); None if no target applies."""
        by_entry: dict[str, tuple[_Target, WeightArgs]] = {}
        for targets, args in self.groups:
            for t in targets:
                first = by_entry.get(t.entry, (t, args))[0]
                by_entry[t.entry] = (first, args)
        ranked = sorted(by_entry.values(), key=lambda ta: _precedence(ta[0].entry))  # stable: first-seen order
        for target, args in ranked:
            if _is_class_name(target.entry) or target.matches(module):
                return args
        return None

    def ignored(self, module: str) -> str | None:
        """The ``ignore`` entry that names ``module``, or None."""
        for target in self.ignore:
            if not _is_class_name(target.entry) and target.matches(module):
                return target.entry
        return None

    # -- planning --------------------------------------------------------------------
    def plan(self, *, pad: bool = True) -> SourcePlan:
        """Plan every ``*.weight_packed`` layer (reads the small tensors only).  A short
        last group (compressed-tensors keeps ``ceil(K / group_size)`` groups) is
        regrouped and an ``N % 64`` layer padded (with ``pad``): :meth:`LayerPlan.fit`.

        Raises:
            SourceFormatError: missing companions, wrong dtypes or shapes,
                ``weight_shape`` disagreeing with ``weight_packed``, a bad ``g_idx``,
                NaN/Inf or fp16-overflowing scales.
            UnsupportedQuantError: no packed layer while ``quantization_status`` is
                not ``compressed`` (weights still in float).
        """
        prefixes = [n[: -len(".weight_packed")] for n in self.ckpt.infos if n.endswith(".weight_packed")]
        layers = self._plan_layers(prefixes, pad)
        if not layers and self.status not in (None, "compressed"):
            raise UnsupportedQuantError(
                f"no weight_packed tensors and quantization_status is {self.status!r}, not 'compressed': "
                "the weights were never packed",
                path=self.cfg_path,
                tensor="quantization_status",
            )
        return assemble_plan(layers, self.ckpt.infos, self._plain_reason)

    def _plain_reason(self, module: str) -> str | None:
        entry = self.ignored(module)
        return f"kept unquantized by the producer: listed in quantization_config.ignore ({entry!r})" if entry else None

    def _plan_layer(self, prefix: str, pad: bool) -> LayerPlan:
        packed = self.need(prefix, "weight_packed", ("I32",))
        shape_info = self.need(prefix, "weight_shape", ("I64", "I32"), (2,))
        size_n, size_k = (int(v) for v in np.asarray(self.ckpt.array(shape_info.name)))
        if size_n < 0 or size_k < 0:
            raise SourceFormatError(
                f"weight_shape [N, K] must hold two non-negative sizes, found [{size_n}, {size_k}]",
                path=self.ckpt.file_of(shape_info.name),
                tensor=shape_info.name,
            )
        owned = [packed.name, shape_info.name]
        warnings: list[str] = []
        args = self.args_for(prefix)
        entry = self.ignored(prefix)
        if entry:
            warnings.append(f"config lists this module in ignore ({entry!r}) but it is packed; converted by the data")
        if args and args.input_activations:
            # A W4A8 checkpoint: the weights convert exactly, but Marlin multiplies fp16
            # activations, so the activation quantization the producer calibrated is not run.
            warnings.append(
                f"config group {args.group} also quantizes input activations ({args.input_activations}); "
                "Marlin runs them unquantized in fp16: the converted layer is weight-only"
            )
        base = dict(
            name=prefix,
            size_k=size_k,
            size_n=size_n,
            group_size=size_k,
            bits=args.num_bits if args else 0,
            zero_convention=ZeroConvention.CT_OFFSET8,
            symmetric=False,
            act_order=False,
            warnings=warnings,
        )
        bias = None
        if f"{prefix}.bias" in self.ckpt:
            bias = self.need(prefix, "bias", FLOAT_DTYPES, (size_n,))
        others = tuple(f"{prefix}.{s}" for s in SUFFIXES if f"{prefix}.{s}" in self.ckpt)

        def passthrough(reason: str) -> LayerPlan:
            return LayerPlan(**base, source_tensors=others, bias=bias, convertible=False, reason=reason)

        if args is None:
            return passthrough("no config_groups entry targets this layer, so its quantization is unknown")
        b = args.num_bits
        if args.type != "int":
            return passthrough(f"weights type {args.type!r} (config group {args.group}) is not integer")
        if b not in CONVERTIBLE_BITS:
            return passthrough(f"{b}-bit codes (config group {args.group}) do not convert to Marlin's 4-bit layout")
        if args.format != PACK_QUANTIZED:
            return passthrough(f"config group {args.group} has format {args.format!r}, not pack-quantized")
        per = codes_per_word(b)
        exp_packed = (size_n, -(-size_k // per))
        if packed.shape != exp_packed:
            raise SourceFormatError(
                f"shape {list(packed.shape)} disagrees with weight_shape [N, K] = [{size_n}, {size_k}] at {b} bits "
                f"(expected {list(exp_packed)})",
                path=self.ckpt.file_of(packed.name),
                tensor=packed.name,
            )
        # compressed-tensors: no strategy and group_size -1 (or none) is per channel
        strategy = args.strategy or ("group" if (args.group_size or 0) > 0 else "channel")
        if strategy == "group":
            if not args.group_size or args.group_size <= 0:
                raise ConfigError(
                    f"strategy 'group' needs a positive group_size, found {args.group_size!r}",
                    path=self.cfg_path,
                    tensor=f"config_groups.{args.group}.weights.group_size",
                )
            g = args.group_size
        elif strategy == "channel":
            g = size_k
        else:
            return passthrough(f"strategy {strategy!r} (config group {args.group}) is not group or channel")
        num_groups = -(-size_k // g)
        scale = self.need(prefix, "weight_scale", FLOAT_DTYPES, (size_n, num_groups))
        owned.append(scale.name)
        zp_name = f"{prefix}.weight_zero_point"
        has_zp = zp_name in self.ckpt
        if has_zp:
            self.need(prefix, "weight_zero_point", ("I32",), (-(-size_n // per), num_groups))
            owned.append(zp_name)
        elif not args.symmetric:
            raise SourceFormatError(
                f"config group {args.group} is asymmetric but the layer has no weight_zero_point",
                path=self.ckpt.folder,
                tensor=zp_name,
            )
        perm = None
        gi_name = f"{prefix}.weight_g_idx"
        if gi_name in self.ckpt:
            gi = self.need(prefix, "weight_g_idx", ("I32", "I64"), (size_k,))
            owned.append(gi.name)
            perm = self.act_order(gi.name, g, num_groups)
        s32 = self.check_scales(scale)
        layer = LayerPlan(
            name=prefix,
            size_k=size_k,
            size_n=size_n,
            group_size=g,
            bits=b,
            zero_convention=ZeroConvention.CT_OFFSET8,
            symmetric=False,
            act_order=perm is not None,
            source_tensors=tuple(owned),
            bias=bias,
            warnings=warnings,
            extra={"config_group": args.group, "actorder": args.actorder, "strategy": strategy},
        )
        if not layer.fit(pad):
            return layer
        z = self._zeros(layer)
        # Artifact delta == 0: b-bit codes are stored centred on 8 (marlin_code_offset), or s == 0.
        layer.symmetric = not bool(np.any(self.layer_delta(layer, z, scale, s32, transposed=True)))
        if args.symmetric and has_zp and not bool(np.all(z == symmetric_zero(b))):
            layer.warnings.append(
                f"config group {args.group} says symmetric but weight_zero_point varies; "
                "converted with delta (data wins)"
            )
        return layer

    def _zeros(self, layer: LayerPlan, g0: int = 0, g1: int | None = None) -> np.ndarray:
        """Unsigned zeros ``z_u`` uint8 ``(groups, N)`` of source groups ``[g0, g1)``: the
        stored values, or ``2^(b-1)`` when symmetric."""
        name = f"{layer.name}.weight_zero_point"
        if name not in self.ckpt:
            g1 = layer.source_groups[1] if g1 is None else g1
            return np.full((g1 - g0, layer.size_n), symmetric_zero(layer.bits), dtype=np.uint8)
        words = np.asarray(self.ckpt.array(name)[:, g0:g1])
        return np.ascontiguousarray(unpack_words(words, layer.bits, axis=0)[: layer.size_n].T)

    # -- loading ---------------------------------------------------------------------
    def load_layer(self, layer: LayerPlan, k_start: int = 0, k_stop: int | None = None) -> QuantWeight:
        """Read Marlin rows ``[k_start, k_stop)`` (multiples of the source's group size, or
        K; act-order rows via ``perm``), at the artifact's group size.

        Returns codes uint8 ``(rows, N)`` (``weight_packed`` unpacked along K and
        transposed to ``(K, N)``), fp16 scales ``(groups, N)`` (``weight_scale``
        transposed), unsigned zeros ``z_u``, ``delta = (8 - z_u) * s`` float32.

        Raises:
            SourceFormatError: a scale overflows fp16 or is not finite.
        """
        k_stop = layer.size_k if k_stop is None else k_stop
        (g, num_groups), b = layer.source_groups, layer.bits
        per = codes_per_word(b)
        packed = self.ckpt.array(f"{layer.name}.weight_packed")
        perm = None
        if layer.act_order:
            perm = self.act_order(f"{layer.name}.weight_g_idx", g, num_groups)
            assert perm is not None
            # The transposed view makes K the packed row axis, as in GPTQ's qweight.
            q = gather_rows(packed.T, perm[k_start:k_stop], b)
        elif k_start % per == 0:
            w1 = -(-k_stop // per)
            codes = unpack_words(np.asarray(packed[:, k_start // per : w1]), b, axis=1)
            q = np.ascontiguousarray(codes[:, : k_stop - k_start].T)
        else:
            q = gather_rows(packed.T, np.arange(k_start, k_stop), b)
        g0, g1 = k_start // g, -(-k_stop // g)
        z = self._zeros(layer, g0, g1)
        return integer_zero_weight(
            self.ckpt,
            layer,
            q=q,
            z=z,
            scales=f"{layer.name}.weight_scale",
            g0=g0,
            g1=g1,
            perm=perm,
            rows=(k_start, k_stop),
            scales_transposed=True,
        )

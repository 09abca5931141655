"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum, auto-round) in safetensors.

Per layer ``<prefix>`` (checkpoint-formats.md section 1): ``qweight`` int32
``(K*b/32, N)`` packed down K, ``qzeros`` int32 ``(G, N*b/32)`` packed along N,
``scales`` ``(G, N)`` (fp16, sometimes bf16 or f32), optional ``g_idx`` int32 ``(K,)``
and ``bias`` ``(N,)``.  ``W = s * (q - z)`` with ``z = stored + 1`` for v1
(``checkpoint_format``/``format`` absent or ``gptq``) and ``z = stored`` for v2
(``gptq_v2``); see :func:`~converter.formats.packing.decode_gptq_zeros`.

What the data decides rather than the config (spec 1.6, 1.8, section 2):

* the act-order permutation comes from the actual ``g_idx`` (``static_groups`` files
  say ``desc_act: true`` with a trivial ``g_idx``);
* for a layer whose stored zeros are all the symmetric value of one convention
  (all 7s = v1, all 8s = v2 for 4-bit; 1/2 for 2-bit; 3/4 for 3-bit; 127/128 for
  8-bit), that convention is used, with a layer warning when it contradicts the
  config (vLLM PR 38966 reports ``gptq``-labelled files with v2 zeros);
* ``sym: true`` with varying zeros converts with ``delta`` and a warning;
* ``K`` from ``qweight`` and ``bits`` must agree with the length of ``g_idx``.

Per-module configuration: GPTQModel's ``dynamic`` map (regex keys; ``-:`` excludes
matching modules from quantization, ``+:`` or a bare key overrides ``bits``,
``group_size``, ``sym``, ``desc_act`` for them; first match wins, as in GPTQModel's
``dynamic_get``), HF's ``modules_to_not_convert`` (substring match, as in
transformers) and GPTQModel's ``lm_head`` flag.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from ..constants import MARLIN_TILE, SourceFormat, ZeroConvention
from ..dtypes import FLOAT_DTYPES
from ..errors import ConfigError, SourceFormatError, UnsupportedQuantError
from ..marlin.layout import pack_b_from_gptq4
from ..quant_weight import QuantWeight
from .base import LayerPlan, SourcePlan, TensorInfo
from .hf import (
    HFSource,
    already_marlin,
    assemble_plan,
    config_field,
    integer_zero_weight,
    not_convert_match,
    string_list,
)
from .hf_checkpoint import HFCheckpoint
from .packing import (
    codes_per_word,
    decode_gptq_zeros,
    field_ones,
    gather_rows,
    packed_len,
    symmetric_zero,
    unpack_words,
    unpacked_len,
)
from .patterns import ConfigPattern

GPTQ_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "bias")
#: Bit widths whose codes convert to Marlin 4-bit losslessly: a b-bit code is a valid
#: 4-bit code and ``delta`` absorbs the offset (issue 4, "Bit widths").
CONVERTIBLE_BITS = (2, 3, 4)
PASSTHROUGH_BITS = (8,)
#: ``checkpoint_format`` values that mean "already Marlin-packed" (spec 5.1).
MARLIN_FORMATS = ("marlin",)
#: Keys a ``dynamic`` override may set that change how we read a layer.
DYNAMIC_KEYS = ("bits", "group_size", "sym", "desc_act")
LM_HEAD = "lm_head"


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """The quantization settings that apply to one module after ``dynamic`` overrides.

    ``skip`` is the reason a config excludes the module from quantization ("" if not).
    """

    bits: int
    group_size: int
    sym: bool
    desc_act: bool
    skip: str = ""
    rule: str = ""


class GptqSource(
    HFSource, format=SourceFormat.GPTQ, methods=("gptq",), conventions=(ZeroConvention.GPTQ_V1, ZeroConvention.GPTQ_V2)
):
    """Reader for HF GPTQ checkpoints; see the module docstring for the conventions.

    Args:
        ckpt: an opened checkpoint folder.

    Raises:
        ConfigError: missing or mistyped config fields, a bad ``dynamic`` regex.
        UnsupportedQuantError: ``pack_dtype`` other than int32, an already
            Marlin-packed or planar (``gptq_p``) format, or bits outside 2/3/4/8.
    """

    shape_rule = "K, N, bits and group_size"

    @classmethod
    def claims_checkpoint(cls, ckpt: HFCheckpoint) -> bool:
        """A checkpoint with no quant config at all whose tensors are GPTQ's (``.qweight`` and ``.g_idx``)."""
        if ckpt.quant_config:
            return False
        return any(n.endswith(".qweight") for n in ckpt.infos) and any(n.endswith(".g_idx") for n in ckpt.infos)

    def __init__(self, ckpt: HFCheckpoint) -> None:
        super().__init__(ckpt)
        qc = ckpt.quant_config
        cfg_path = self.cfg_path
        if not qc:
            raise ConfigError(
                "no GPTQ quantization config found (looked for quantize_config.json, "
                "quantization_config.json, quant_config.json, config.json[quantization_config])",
                path=ckpt.folder,
            )
        self.bits = config_field(qc, "bits", int, None, path=cfg_path, required=True)
        self.group_size = config_field(qc, "group_size", int, None, path=cfg_path, required=True)
        self.sym = config_field(qc, "sym", bool, True, path=cfg_path)
        self.desc_act = config_field(qc, "desc_act", bool, False, path=cfg_path)
        if config_field(qc, "is_marlin_format", bool, False, path=cfg_path):
            raise UnsupportedQuantError(_ALREADY_MARLIN, path=cfg_path, tensor="is_marlin_format")
        fmt = config_field(qc, "checkpoint_format", str, None, path=cfg_path)
        fmt = config_field(qc, "format", str, "gptq", path=cfg_path) if fmt is None else fmt
        fmt = fmt.lower()
        pack_dtype = config_field(qc, "pack_dtype", str, "int32", path=cfg_path)
        if pack_dtype not in ("int32", "torch.int32"):
            raise UnsupportedQuantError(
                f"pack_dtype {pack_dtype!r} is not supported: only int32 words are read "
                "(GPTQModel pack_dtype int8/int16/int64 change the word size; spec 1.1)",
                path=cfg_path,
                tensor="pack_dtype",
            )
        if fmt in MARLIN_FORMATS:
            raise UnsupportedQuantError(_ALREADY_MARLIN, path=cfg_path, tensor="checkpoint_format")
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedQuantError(
                f"checkpoint_format {fmt!r} is not a GPTQ layout this tool reads (expected gptq or gptq_v2)",
                path=cfg_path,
                tensor="checkpoint_format",
            )
        if self.group_size != -1 and self.group_size <= 0:
            raise ConfigError(f"must be -1 or positive, found {self.group_size}", path=cfg_path, tensor="group_size")
        if self.bits not in (*CONVERTIBLE_BITS, *PASSTHROUGH_BITS):
            raise UnsupportedQuantError(
                f"{self.bits}-bit GPTQ is not supported (supported: 2, 3, 4; 8 passes through)",
                path=cfg_path,
                tensor="bits",
            )
        self.convention = ZeroConvention.GPTQ_V2 if fmt == "gptq_v2" else ZeroConvention.GPTQ_V1
        #: ``(sidecar's format, config.json's)`` when the two configs disagree on v1 / v2.
        self.format_conflict = self._format_conflict(fmt)
        self.lm_head = config_field(qc, "lm_head", bool, None, path=cfg_path)
        self.not_convert = string_list(qc, "modules_to_not_convert", path=cfg_path)
        self.dynamic = self._parse_dynamic(qc.get("dynamic"))

    def _format_conflict(self, fmt: str) -> tuple[str, str] | None:
        inner = self.ckpt.config.get("quantization_config")
        if self.ckpt.quant_config_file in (None, "config.json") or not isinstance(inner, dict):
            return None
        if str(inner.get("quant_method", "gptq")).lower() != "gptq":
            return None
        other = inner.get("checkpoint_format") or inner.get("format") or "gptq"
        other = other.lower() if isinstance(other, str) else other
        if other in ("gptq", "gptq_v2") and other != fmt:
            return fmt, other
        return None

    def _settle_format(self, prefixes: list[str]) -> ZeroConvention:
        """The zero convention when the two configs disagree: what the data shows.

        A layer whose stored zeros are all the symmetric value of one convention shows
        it (spec 1.6); every such layer must show the same one, and there must be one.

        Raises:
            ConfigError: no layer's zeros tell v1 from v2, or two layers disagree.
        """
        assert self.format_conflict is not None
        mine, theirs = self.format_conflict
        said = f"{self.ckpt.quant_config_file} says checkpoint_format {mine!r} but config.json says {theirs!r}"
        shown: dict[ZeroConvention, str] = {}
        for prefix in prefixes:
            bits = self.layer_config(prefix).bits
            if bits not in (*CONVERTIBLE_BITS, *PASSTHROUGH_BITS) or f"{prefix}.qzeros" not in self.ckpt:
                continue
            data = _zeros_show(self._stored_zeros(prefix, bits), bits)
            if data is not None:
                shown.setdefault(data, prefix)
        if len(shown) == 1:
            ((convention, layer),) = shown.items()
            self._conflict_note = (
                f"{said}; the zeros of {layer} (all the symmetric value of {convention.value}) decide: "
                f"decoded as {convention.value} (data wins)"
            )
            return convention
        why = (
            "and layers' zeros show both (" + ", ".join(f"{c.value}: {n}" for c, n in shown.items()) + ")"
            if shown
            else "and no layer's zeros tell v1 from v2 (none is all the symmetric value)"
        )
        raise ConfigError(
            f"{said}, {why}; correct the config that is wrong", path=self.cfg_path, tensor="checkpoint_format"
        )

    def _stored_zeros(self, prefix: str, bits: int) -> np.ndarray:
        """A layer's ``qzeros`` fields as stored (uint8 ``(G, N)``, no convention applied)."""
        return unpack_words(np.asarray(self.ckpt.array(f"{prefix}.qzeros")), bits, axis=1)

    def _parse_dynamic(self, dyn: Any) -> list[tuple[str, ConfigPattern, dict[str, Any]]]:
        if dyn is None:
            return []
        if not isinstance(dyn, dict):
            raise ConfigError(
                f"expected an object of regex -> overrides, found {type(dyn).__name__}",
                path=self.cfg_path,
                tensor="dynamic",
            )
        rules = []
        for key, overrides in dyn.items():
            pattern = key[2:] if key.startswith(("-:", "+:")) else key
            rx = ConfigPattern(pattern, entry=f"key {key!r}", field="dynamic", path=self.cfg_path)
            if not isinstance(overrides, dict):
                raise ConfigError(
                    f"value of {key!r} must be an object of overrides, found {json.dumps(overrides)[:200]}",
                    path=self.cfg_path,
                    tensor="dynamic",
                )
            for k in DYNAMIC_KEYS:
                if k in overrides:
                    want = bool if k in ("sym", "desc_act") else int
                    config_field(overrides, k, want, None, path=self.cfg_path, field=f"dynamic[{key!r}].{k}")
            rules.append((key, rx, overrides))
        return rules

    def layer_config(self, module: str) -> LayerConfig:
        """The settings for ``module`` after ``dynamic`` and ``modules_to_not_convert``.

        ``dynamic`` follows GPTQModel's ``dynamic_get``: keys are tried in order with
        ``re.match``; the first match wins; ``-:`` means "not quantized".
        """
        base = LayerConfig(self.bits, self.group_size, self.sym, self.desc_act)
        entry = not_convert_match(module, self.not_convert)
        if entry is not None:
            return dataclasses.replace(base, skip=f"module matches modules_to_not_convert entry {entry!r}", rule=entry)
        for key, rx, overrides in self.dynamic:
            if not rx.match(module):
                continue
            if key.startswith("-:"):
                return dataclasses.replace(base, skip=f"excluded from quantization by dynamic rule {key!r}", rule=key)
            return LayerConfig(
                bits=overrides.get("bits", base.bits),
                group_size=overrides.get("group_size", base.group_size),
                sym=overrides.get("sym", base.sym),
                desc_act=overrides.get("desc_act", base.desc_act),
                rule=key,
            )
        return base

    # -- planning --------------------------------------------------------------------
    def plan(self, *, pad: bool = True) -> SourcePlan:
        """Plan every ``*.qweight`` layer from headers, configs and the small tensors
        (qzeros, scales, g_idx); the checks that can fail on the input all run here.
        A short last group (``K % group_size``, GPTQModel's and AutoGPTQ's ``g_idx = k //
        group_size`` with ``ceil(K / group_size)`` scale rows) is regrouped and an
        ``N % 64`` layer padded (with ``pad``): :meth:`LayerPlan.fit`.

        Raises:
            SourceFormatError: a missing companion tensor, a wrong dtype or shape,
                3-bit rows not in whole 3-word blocks, a bad ``g_idx``, NaN/Inf or
                fp16-overflowing scales (named by tensor).
            ConfigError: ``bits`` contradicting ``qweight`` and ``g_idx``.
        """
        self._refuse_marlin_tensors()
        prefixes = [n[: -len(".qweight")] for n in self.ckpt.infos if n.endswith(".qweight")]
        if self.format_conflict is not None:
            self.convention = self._settle_format(prefixes)
        layers = [self._plan_layer(prefix, pad) for prefix in prefixes]
        plan = assemble_plan(layers, self.ckpt.infos, self._plain_reason)
        for info in plan.tensors:
            prefix, _, suffix = info.name.rpartition(".")
            if suffix in ("qzeros", "g_idx"):
                # Carrying these over as plain tensors would silently drop a layer.
                hint = self.ckpt.lone_shard_hint or (
                    "; a single shard given alone? pass the index or the folder" if len(self.ckpt.files) == 1 else ""
                )
                raise SourceFormatError(
                    f"layer {prefix} has {suffix} but no qweight{hint}",
                    path=self.ckpt.file_of(info.name),
                    tensor=info.name,
                )
        return plan

    def _refuse_marlin_tensors(self) -> None:
        """Marlin's own ``<layer>.B`` (int32) and ``<layer>.s`` under a GPTQ label: the data
        says the checkpoint is already Marlin-packed, whatever the config says (spec 5.1)."""
        infos = self.ckpt.infos
        for name, info in infos.items():
            prefix = name[: -len(".B")]
            if name.endswith(".B") and info.dtype == "I32" and len(info.shape) == 2 and f"{prefix}.s" in infos:
                raise UnsupportedQuantError(
                    already_marlin(
                        "checkpoint is",
                        f"tensors {name} and {prefix}.s are AutoGPTQ's Marlin format, though the config says "
                        "checkpoint_format gptq; spec 5.1",
                        advice="use the file as it is, or convert from the original GPTQ checkpoint",
                    ),
                    path=self.ckpt.file_of(name),
                    tensor=name,
                )

    def _plain_reason(self, module: str) -> str | None:
        cfg = self.layer_config(module)
        if cfg.skip:
            return f"kept unquantized by the producer: {cfg.skip}"
        if module.split(".")[-1] == LM_HEAD and self.lm_head:
            return "config says lm_head: true but the checkpoint stores lm_head unquantized; carried over as stored"
        return None

    def _plan_layer(self, prefix: str, pad: bool) -> LayerPlan:
        cfg = self.layer_config(prefix)
        b = cfg.bits
        warnings: list[str] = []
        if cfg.skip:
            # The config says this module is not quantized, yet it has a qweight: the
            # data wins; read it with the global settings and say so.
            warnings.append(
                f"config says this module is not quantized ({cfg.skip}) but it has a qweight; converted by the data"
            )
            cfg = dataclasses.replace(cfg, skip="")
        if prefix.split(".")[-1] == LM_HEAD and self.lm_head is False:
            warnings.append("config says lm_head: false but lm_head is quantized; converted by the data")
        qw = self.ckpt.info(f"{prefix}.qweight")
        qw_path = self.ckpt.file_of(qw.name)
        if qw.dtype != "I32" or len(qw.shape) != 2:
            raise SourceFormatError(
                f"expected 2-D I32, found {qw.dtype} {list(qw.shape)}", path=qw_path, tensor=qw.name
            )
        size_n = qw.shape[1]
        where = f" (dynamic rule {cfg.rule!r})" if cfg.rule else ""
        if b not in (*CONVERTIBLE_BITS, *PASSTHROUGH_BITS):
            return self._unreadable(
                prefix, qw, f"{b}-bit GPTQ{where} is not supported (2, 3, 4 convert; 8 passes through)", warnings
            )
        size_k = unpacked_len(qw.shape[0], b)
        if size_k is None:
            rule = f"{qw.shape[0]} rows cannot hold 3-bit codes: 3-bit packs 32 codes into every 3 rows (spec 1.2)"
            fits = self._bits_that_fit(prefix, qw)
            if fits:
                # the other tensors agree on another width: the config is what is wrong
                raise ConfigError(
                    f"bits={b}{where}, but qweight's {rule}; bits={fits[0]} would fit",
                    path=self.cfg_path,
                    tensor=f"{prefix} bits",
                )
            raise SourceFormatError(rule, path=qw_path, tensor=qw.name)
        gi_name = f"{prefix}.g_idx"
        if gi_name in self.ckpt:
            gi = self.ckpt.info(gi_name)
            if len(gi.shape) == 1 and gi.shape[0] != size_k:
                fits = [c for c in (2, 3, 4, 8) if unpacked_len(qw.shape[0], c) == gi.shape[0]]
                hint = f"; bits={fits[0]} would fit" if fits else ""
                raise ConfigError(
                    f"bits={b}{where} gives K = {size_k} from qweight's {qw.shape[0]} rows, "
                    f"but g_idx has {gi.shape[0]} entries{hint}",
                    path=self.cfg_path,
                    tensor=f"{prefix} bits",
                )
        g = size_k if cfg.group_size == -1 else cfg.group_size
        if g <= 0:
            raise ConfigError(
                f"group_size must be -1 or positive, found {g}", path=self.cfg_path, tensor=f"{prefix} group_size"
            )
        num_groups = -(-size_k // g) if size_k else 0
        scales = self.need(prefix, "scales", FLOAT_DTYPES, (num_groups, size_n))
        zeros_width = packed_len(size_n, b)
        if zeros_width is None:
            raise SourceFormatError(
                f"size_n = {size_n} cannot be packed into whole {b}-bit qzeros words",
                path=qw_path,
                tensor=f"{prefix}.qzeros",
            )
        qzeros = self.need(prefix, "qzeros", ("I32",), (num_groups, zeros_width))
        owned = [qw.name, qzeros.name, scales.name]
        bias = None
        if f"{prefix}.bias" in self.ckpt:
            bias = self.need(prefix, "bias", FLOAT_DTYPES, (size_n,))
        perm = None
        if gi_name in self.ckpt:
            gi = self.need(prefix, "g_idx", ("I32",), (size_k,))
            owned.append(gi.name)
            perm = self.act_order(gi.name, g, num_groups)
        s32 = self.check_scales(scales)
        convention, zwarn = self._layer_convention(prefix, b)
        warnings += zwarn
        if self.format_conflict is not None:
            warnings.append(self._conflict_note)
        layer = LayerPlan(
            name=prefix,
            size_k=size_k,
            size_n=size_n,
            group_size=g,
            bits=b,
            zero_convention=convention,
            symmetric=False,
            act_order=perm is not None,
            source_tensors=tuple(owned),
            bias=bias,
            warnings=warnings,
            extra={"checkpoint_format": "gptq_v2" if convention is ZeroConvention.GPTQ_V2 else "gptq"},
        )
        if b in PASSTHROUGH_BITS:
            layer.convertible, layer.reason = False, f"{b}-bit codes do not fit Marlin's 4-bit layout"
            return layer
        if not layer.fit(pad):
            return layer
        z = self._decode_zeros(prefix, b, convention)
        # "symmetric" in the manifest means the artifact's delta == 0: z == 2^(b-1) (b-bit
        # codes are stored centred on Marlin's 8, quant_weight.marlin_code_offset) or s == 0.
        layer.symmetric = not bool(np.any(self.layer_delta(layer, z, scales, s32)))
        if cfg.sym and not bool(np.all(z == symmetric_zero(b))):
            n_bad = int(np.count_nonzero(z != symmetric_zero(b)))
            layer.warnings.append(
                f"config says sym: true but {n_bad} of {z.size} zero points differ from {symmetric_zero(b)}; "
                "converted with delta (data wins)"
            )
        return layer

    def _bits_that_fit(self, prefix: str, qw: TensorInfo) -> list[int]:
        """The code widths (2, 3, 4, 8) that qweight's rows and every other witness the
        layer has agree on: g_idx's length (K) and qzeros' width (N codes a row). Empty
        when no witness exists or none agrees."""
        gi = self.ckpt.info(f"{prefix}.g_idx") if f"{prefix}.g_idx" in self.ckpt else None
        qz = self.ckpt.info(f"{prefix}.qzeros") if f"{prefix}.qzeros" in self.ckpt else None
        if (gi is None or len(gi.shape) != 1) and (qz is None or len(qz.shape) != 2):
            return []
        fits = []
        for c in (2, 3, 4, 8):
            k = unpacked_len(qw.shape[0], c)
            if k is None:
                continue
            if gi is not None and len(gi.shape) == 1 and gi.shape[0] != k:
                continue
            if qz is not None and len(qz.shape) == 2 and packed_len(qw.shape[1], c) != qz.shape[1]:
                continue
            fits.append(c)
        return fits

    def _unreadable(self, prefix: str, qw: TensorInfo, reason: str, warnings: list[str]) -> LayerPlan:
        owned = [n for n in (f"{prefix}.{s}" for s in GPTQ_SUFFIXES if s != "bias") if n in self.ckpt]
        bias = self.ckpt.info(f"{prefix}.bias") if f"{prefix}.bias" in self.ckpt else None
        return LayerPlan(
            name=prefix,
            size_k=0,
            size_n=qw.shape[1],
            group_size=1,
            bits=self.bits,
            zero_convention=self.convention,
            symmetric=False,
            act_order=False,
            source_tensors=tuple(owned),
            bias=bias,
            convertible=False,
            reason=reason,
            warnings=warnings,
        )

    def _layer_convention(self, prefix: str, bits: int) -> tuple[ZeroConvention, list[str]]:
        """The zero convention of one layer: the config's, unless the stored zeros are
        all the symmetric value of the other convention (spec 1.6 table and trap)."""
        warnings: list[str] = []
        stored = self._stored_zeros(prefix, bits)
        data = _zeros_show(stored, bits)
        if data is not None and data is not self.convention:
            label = {
                ZeroConvention.GPTQ_V1: "gptq (v1: stored = z - 1)",
                ZeroConvention.GPTQ_V2: "gptq_v2 (stored = z)",
            }
            value = symmetric_zero(bits) - (data is ZeroConvention.GPTQ_V1)
            warnings.append(
                f"config says checkpoint_format {label[self.convention]} but every stored zero is {value}, "
                f"the symmetric value of {label[data]}; decoded as {data.value} (data wins)"
            )
            return data, warnings
        convention = self.convention
        if convention is ZeroConvention.GPTQ_V1:
            wrapped = int(np.count_nonzero(stored == (1 << bits) - 1))
            if wrapped:
                how = (
                    "decoded per field as (stored + 1) mod 8 (GPTQModel's 3-bit rule)"
                    if bits == 3
                    else f"decoded by the whole-word add of 0x{int(field_ones(bits)):08X}, "
                    "which undoes GPTQModel's borrow"
                )
                warnings.append(
                    f"{wrapped} v1 zero field(s) store {(1 << bits) - 1}, i.e. z - 1 = -1: a true zero of 0 that "
                    f"decodes out of range per field; {how}; a producer that clamped or wrapped it otherwise "
                    "would need a different reading"
                )
        return convention, warnings

    def _decode_zeros(
        self, prefix: str, bits: int, convention: ZeroConvention, g0: int = 0, g1: int | None = None
    ) -> np.ndarray:
        words = np.asarray(self.ckpt.array(f"{prefix}.qzeros")[g0:g1])
        return decode_gptq_zeros(words, bits, v1=convention is ZeroConvention.GPTQ_V1)

    # -- loading ---------------------------------------------------------------------
    def load_layer(
        self, layer: LayerPlan, k_start: int = 0, k_stop: int | None = None, *, codes: bool = True
    ) -> QuantWeight:
        """Read Marlin rows ``[k_start, k_stop)`` of a convertible layer.

        ``k_start``/``k_stop`` are multiples of the source's group size (or of 32 for a
        per-channel layer, so 3-bit blocks are never split; ``k_stop`` may be K).
        Returns codes uint8 ``(rows, N)`` in Marlin row order (act-order rows gathered
        by ``perm``: source groups in order, the short one last), fp16 scales, true
        zeros uint8, ``delta = (8 - z) * s`` in float32 from the scales as stored
        (spec 4.6), at the artifact's group size.

        Raises:
            SourceFormatError: a scale overflows fp16 (bf16 sources) or is not finite.
        """
        k_stop = layer.size_k if k_stop is None else k_stop
        g, num_groups = layer.source_groups
        b = layer.bits
        qweight = self.ckpt.array(f"{layer.name}.qweight")
        perm = None
        if layer.act_order:
            perm = self.act_order(f"{layer.name}.g_idx", g, num_groups)
            assert perm is not None
            q = gather_rows(qweight, perm[k_start:k_stop], b) if codes else np.zeros((0, layer.size_n), np.uint8)
        elif not codes:  # load_packed: B is made from the words directly
            q = np.zeros((0, layer.size_n), np.uint8)
        else:
            w0, w1 = packed_len(k_start, b), packed_len(k_stop, b)
            if w0 is None or w1 is None:
                q = gather_rows(qweight, np.arange(k_start, k_stop), b)
            else:
                q = unpack_words(np.asarray(qweight[w0:w1]), b, axis=0)
        g0, g1 = k_start // g, -(-k_stop // g)
        z = self._decode_zeros(layer.name, b, layer.zero_convention, g0, g1)
        return integer_zero_weight(
            self.ckpt, layer, q=q, z=z, scales=f"{layer.name}.scales", g0=g0, g1=g1, perm=perm, rows=(k_start, k_stop)
        )

    def load_packed(
        self, layer: LayerPlan, k_start: int = 0, k_stop: int | None = None
    ) -> tuple[np.ndarray, QuantWeight] | None:
        """:meth:`Source.load_packed`: Marlin ``B`` for rows ``[k_start, k_stop)`` made
        straight from the 4-bit ``qweight`` words (:func:`pack_b_from_gptq4`), plus the
        chunk's scales and delta (its ``q`` is empty).  None where it does not apply
        (not 4-bit, act-order, rows not on 16-row tiles, a padded layer: the converter
        pads the codes of :meth:`load_layer`).
        """
        k_stop = layer.size_k if k_stop is None else k_stop
        if layer.bits != 4 or layer.act_order or layer.padded_n or k_start % MARLIN_TILE or k_stop % MARLIN_TILE:
            return None
        per = codes_per_word(4)
        words = np.asarray(self.ckpt.array(f"{layer.name}.qweight")[k_start // per : k_stop // per])
        return pack_b_from_gptq4(words), self.load_layer(layer, k_start, k_stop, codes=False)

    def load_words(
        self, layer: LayerPlan, k_start: int = 0, k_stop: int | None = None
    ) -> tuple[np.ndarray, QuantWeight] | None:
        """:meth:`Source.load_words`: the 4-bit ``qweight`` words of rows ``[k_start,
        k_stop)`` as stored (a view of the file), plus the chunk's scales and delta (its
        ``q`` is empty).  None where it does not apply (not 4-bit, act-order, a padded
        layer, rows not on whole words)."""
        k_stop = layer.size_k if k_stop is None else k_stop
        per = codes_per_word(4)
        if layer.bits != 4 or layer.act_order or layer.padded_n or k_start % per or k_stop % per:
            return None
        words = np.asarray(self.ckpt.array(f"{layer.name}.qweight")[k_start // per : k_stop // per])
        return words, self.load_layer(layer, k_start, k_stop, codes=False)


_ALREADY_MARLIN = already_marlin(
    "checkpoint is",
    "AutoGPTQ checkpoint_format 'marlin': tensors B and s, symmetric only, spec 5.1",
    advice="use the file as it is, or convert from the original GPTQ checkpoint",
)


def _zeros_show(stored: np.ndarray, bits: int) -> ZeroConvention | None:
    """The convention a layer's stored zeros show by being all one symmetric value, or None."""
    if not stored.size or not np.all(stored == stored.flat[0]):
        return None
    sym = symmetric_zero(bits)
    return {sym - 1: ZeroConvention.GPTQ_V1, sym: ZeroConvention.GPTQ_V2}.get(int(stored.flat[0]))

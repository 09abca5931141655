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

The reader's parts: :mod:`~converter.formats.gptq_config` (per-module settings),
:mod:`~converter.formats.gptq_zeros` (zero conventions), :mod:`~converter.formats.gptq_load`
(reading a planned layer).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..constants import SourceFormat, ZeroConvention
from ..dtypes import FLOAT_DTYPES
from ..errors import ConfigError, SourceFormatError, UnsupportedQuantError
from .base import LayerPlan, SourcePlan, TensorInfo
from .gptq_config import (
    CONVERTIBLE_BITS,
    DYNAMIC_KEYS,
    LM_HEAD,
    MARLIN_FORMATS,
    PASSTHROUGH_BITS,
    GptqLayerConfigs,
    LayerConfig,
)
from .gptq_load import GptqLoading
from .gptq_zeros import GptqZeroConventions, _zeros_show
from .hf import (
    HFSource,
    already_marlin,
    assemble_plan,
    config_field,
    string_list,
)
from .hf_checkpoint import HFCheckpoint
from .packing import packed_len, symmetric_zero, unpacked_len

# Everything this module defined before the split (issue 39) stays importable from here.
__all__ = [
    "CONVERTIBLE_BITS",
    "DYNAMIC_KEYS",
    "GPTQ_SUFFIXES",
    "LM_HEAD",
    "MARLIN_FORMATS",
    "PASSTHROUGH_BITS",
    "GptqSource",
    "LayerConfig",
    "_ALREADY_MARLIN",
    "_zeros_show",
]

GPTQ_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "bias")


# The mixins come before HFSource so that their load_packed and load_words replace Source's defaults.
class GptqSource(
    GptqLoading,
    GptqZeroConventions,
    GptqLayerConfigs,
    HFSource,
    format=SourceFormat.GPTQ,
    methods=("gptq",),
    conventions=(ZeroConvention.GPTQ_V1, ZeroConvention.GPTQ_V2),
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
        layers = self._plan_layers(prefixes, pad)
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
                if not fits:  # no width explains it: the g_idx itself is what is wrong
                    raise SourceFormatError(
                        f"g_idx has {gi.shape[0]} entries, but qweight's {qw.shape[0]} rows hold K = {size_k} "
                        f"{b}-bit codes (one entry per row of K)",
                        path=self.ckpt.file_of(gi_name),
                        tensor=gi_name,
                    )
                raise ConfigError(
                    f"bits={b}{where} gives K = {size_k} from qweight's {qw.shape[0]} rows, "
                    f"but g_idx has {gi.shape[0]} entries; bits={fits[0]} would fit",
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


_ALREADY_MARLIN = already_marlin(
    "checkpoint is",
    "AutoGPTQ checkpoint_format 'marlin': tensors B and s, symmetric only, spec 5.1",
    advice="use the file as it is, or convert from the original GPTQ checkpoint",
)

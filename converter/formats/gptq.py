"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum, auto-round) in safetensors.

Per layer ``<prefix>``: ``qweight`` int32 ``(K*b/32, N)`` packed down K, ``qzeros``
int32 ``(G, N*b/32)`` packed along N, ``scales`` ``(G, N)``, optional ``g_idx`` int32
``(K,)`` and ``bias`` ``(N,)`` (checkpoint-formats.md section 1).  ``W = s * (q - z)``
with ``z = stored + 1`` for v1 (``checkpoint_format`` absent or ``gptq``; decoded by a
whole-word add that undoes GPTQModel's borrows, section 1.5) and ``z = stored`` for
v2 (``gptq_v2``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..constants import MARLIN_ZERO, SourceFormat, ZeroConvention
from ..errors import ConfigError, SourceFormatError, UnsupportedQuantError
from ..marlin.shapes import check_convertible
from ..quant_weight import QuantWeight
from .base import LayerPlan, Source, SourcePlan, TensorInfo
from .hf import HFCheckpoint, config_field
from .packing import field_ones, unpack_words
from .scales import scales_to_fp16

GPTQ_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "bias")
#: Bit widths whose codes convert to Marlin 4-bit losslessly.
CONVERTIBLE_BITS = (2, 4)
PASSTHROUGH_BITS = (8,)


def _is_gptq_config(qc: dict[str, Any]) -> bool:
    method = str(qc.get("quant_method", qc.get("method", ""))).lower()
    return method == "gptq"


def sniff(ckpt: HFCheckpoint) -> bool:
    """True when the checkpoint's quant config says GPTQ, or it has ``.qzeros``+``.g_idx``."""
    if ckpt.quant_config:
        return _is_gptq_config(ckpt.quant_config)
    return any(n.endswith(".qweight") for n in ckpt.infos) and any(n.endswith(".g_idx") for n in ckpt.infos)


class GptqSource(Source):
    """Reader for HF GPTQ checkpoints; see the module docstring for the conventions.

    Args:
        ckpt: an opened checkpoint folder.

    Raises:
        ConfigError: missing or mistyped config fields, ``pack_dtype`` other than int32.
    """

    format = SourceFormat.GPTQ

    def __init__(self, ckpt: HFCheckpoint) -> None:
        self.ckpt = ckpt
        self.path = ckpt.folder
        qc = ckpt.quant_config
        cfg_path = ckpt.folder / (ckpt.quant_config_file or "config.json")
        if not qc:
            raise ConfigError(
                "no GPTQ quantization config found (looked for quantize_config.json, "
                "quantization_config.json, quant_config.json, config.json[quantization_config])",
                path=ckpt.folder,
            )
        self.cfg_path = cfg_path
        self.bits = config_field(qc, "bits", int, None, path=cfg_path, required=True)
        self.group_size = config_field(qc, "group_size", int, None, path=cfg_path, required=True)
        self.sym = config_field(qc, "sym", bool, True, path=cfg_path)
        self.desc_act = config_field(qc, "desc_act", bool, False, path=cfg_path)
        fmt = config_field(qc, "checkpoint_format", str, None, path=cfg_path)
        fmt = config_field(qc, "format", str, fmt or "gptq", path=cfg_path) if fmt is None else fmt
        pack_dtype = config_field(qc, "pack_dtype", str, "int32", path=cfg_path)
        if pack_dtype not in ("int32", "torch.int32"):
            raise UnsupportedQuantError(f"pack_dtype {pack_dtype!r} is not supported; only int32 packing is", path=cfg_path, tensor="pack_dtype")
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedQuantError(
                f"checkpoint_format {fmt!r} is not a GPTQ zero convention this tool reads (gptq or gptq_v2)",
                path=cfg_path, tensor="checkpoint_format",
            )
        if self.group_size != -1 and self.group_size <= 0:
            raise ConfigError(f"must be -1 or positive, found {self.group_size}", path=cfg_path, tensor="group_size")
        if self.bits not in (*CONVERTIBLE_BITS, *PASSTHROUGH_BITS):
            raise UnsupportedQuantError(f"{self.bits}-bit GPTQ is not supported (supported: 2, 4; 8 passes through)", path=cfg_path, tensor="bits")
        self.convention = ZeroConvention.GPTQ_V2 if fmt == "gptq_v2" else ZeroConvention.GPTQ_V1

    def describe(self) -> dict[str, Any]:
        return {
            "format": self.format.value,
            "files": self.ckpt.describe_files(),
            "quant_config": self.ckpt.quant_config,
        }

    # -- planning --------------------------------------------------------------------
    def plan(self) -> SourcePlan:
        infos = self.ckpt.infos
        prefixes = [n[: -len(".qweight")] for n in infos if n.endswith(".qweight")]
        owned: set[str] = set()
        layers: list[LayerPlan] = []
        reasons: dict[str, str] = {}
        for prefix in prefixes:
            layer = self._plan_layer(prefix)
            layers.append(layer)
            owned.update(layer.source_tensors)
            if layer.bias:
                owned.add(layer.bias.name)
            if not layer.convertible:
                for t in layer.source_tensors + ((layer.bias.name,) if layer.bias else ()):
                    reasons[t] = f"layer {prefix} not converted: {layer.reason}"
        tensors = [i for n, i in infos.items() if n not in owned]
        return SourcePlan(layers, tensors, reasons)

    def _need(self, prefix: str, suffix: str, dtypes: tuple[str, ...], shape: tuple[int, ...]) -> TensorInfo:
        name = f"{prefix}.{suffix}"
        if name not in self.ckpt:
            raise SourceFormatError(f"layer {prefix} has qweight but no {suffix}", path=self.ckpt.folder, tensor=name)
        info = self.ckpt.info(name)
        path = self.ckpt.file_of(name)
        if info.dtype not in dtypes:
            raise SourceFormatError(f"dtype {info.dtype}, expected {' or '.join(dtypes)}", path=path, tensor=name)
        if info.shape != shape:
            raise SourceFormatError(
                f"shape {list(info.shape)} disagrees with K, N and group_size (expected {list(shape)})",
                path=path, tensor=name,
            )
        return info

    def _plan_layer(self, prefix: str) -> LayerPlan:
        b = self.bits
        qw = self.ckpt.info(f"{prefix}.qweight")
        qw_path = self.ckpt.file_of(qw.name)
        if qw.dtype != "I32" or len(qw.shape) != 2:
            raise SourceFormatError(f"expected 2-D I32, found {qw.dtype} {list(qw.shape)}", path=qw_path, tensor=qw.name)
        size_k, size_n = qw.shape[0] * 32 // b, qw.shape[1]
        g = size_k if self.group_size == -1 else self.group_size
        num_groups = -(-size_k // g) if size_k else 0
        scales = self._need(prefix, "scales", ("F16", "BF16", "F32"), (num_groups, size_n))
        if size_n * b % 32:
            raise SourceFormatError(f"size_n = {size_n} cannot be packed {32 // b} per word", path=qw_path, tensor=f"{prefix}.qzeros")
        qzeros = self._need(prefix, "qzeros", ("I32",), (num_groups, size_n * b // 32))
        owned = [qw.name, qzeros.name, scales.name]
        bias = None
        if f"{prefix}.bias" in self.ckpt:
            bias = self._need(prefix, "bias", ("F16", "BF16", "F32"), (size_n,))
        perm = None
        if f"{prefix}.g_idx" in self.ckpt:
            gi = self._need(prefix, "g_idx", ("I32",), (size_k,))
            owned.append(gi.name)
            perm = self._perm_from_g_idx(prefix, self.ckpt.array(gi.name), g, num_groups)
        self._check_finite(scales.name)
        layer = LayerPlan(
            name=prefix, size_k=size_k, size_n=size_n, group_size=g, bits=b,
            zero_convention=self.convention, symmetric=False, act_order=perm is not None,
            source_tensors=tuple(owned), bias=bias,
            extra={"checkpoint_format": "gptq_v2" if self.convention is ZeroConvention.GPTQ_V2 else "gptq"},
        )
        if b in PASSTHROUGH_BITS:
            layer.convertible, layer.reason = False, f"{b}-bit codes do not fit Marlin's 4-bit layout"
            return layer
        ok, reason = check_convertible(size_k, size_n, g)
        if not ok:
            layer.convertible, layer.reason = False, reason
            return layer
        z = self._decode_zeros(prefix)
        layer.symmetric = bool(np.all(z == MARLIN_ZERO))
        stored = unpack_words(self.ckpt.array(qzeros.name), b, axis=1)
        if self.convention is ZeroConvention.GPTQ_V1 and np.any(stored == (1 << b) - 1):
            layer.warnings.append(
                "v1 zeros contain the all-ones field, which decodes as a borrow from a true zero of 0 "
                "(GPTQModel); a producer that wrapped per field would need a different reading"
            )
        if self.sym and not layer.symmetric:
            layer.warnings.append("config says sym: true but the zero points vary; converted with delta (data wins)")
        return layer

    def _perm_from_g_idx(self, prefix: str, g_idx: np.ndarray, g: int, num_groups: int) -> np.ndarray | None:
        name = f"{prefix}.g_idx"
        path = self.ckpt.file_of(name)
        if g_idx.size and (int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups):
            raise SourceFormatError(
                f"values must lie in [0, {num_groups}), found [{int(g_idx.min())}, {int(g_idx.max())}]",
                path=path, tensor=name,
            )
        trivial = np.arange(g_idx.size) // g
        if np.array_equal(g_idx, trivial):
            return None
        counts = np.bincount(g_idx, minlength=num_groups)
        full = np.full(num_groups, g)
        full[-1] = g_idx.size - g * (num_groups - 1)
        if not np.array_equal(counts, full):
            bad = int(np.flatnonzero(counts != full)[0])
            raise SourceFormatError(
                f"act-order groups must each have group_size={g} members; group {bad} has {int(counts[bad])}",
                path=path, tensor=name,
            )
        return np.argsort(g_idx, kind="stable").astype(np.int32)

    def _check_finite(self, name: str) -> None:
        arr = self.ckpt.array(name)
        info = self.ckpt.info(name)
        vals = _as_f32(arr, info.dtype)
        if not np.all(np.isfinite(vals)):
            bad = int(np.count_nonzero(~np.isfinite(vals)))
            raise SourceFormatError(f"{bad} NaN or Inf values in scales", path=self.ckpt.file_of(name), tensor=name)

    def _decode_zeros(self, prefix: str, g0: int = 0, g1: int | None = None) -> np.ndarray:
        words = np.array(self.ckpt.array(f"{prefix}.qzeros")[g0:g1]).view(np.uint32)
        if self.convention is ZeroConvention.GPTQ_V1:
            # Whole-word add with carries: undoes GPTQModel's whole-word subtract with
            # borrows exactly, and equals "+1 per field" wherever no borrow happened.
            words = words + field_ones(self.bits)
        return unpack_words(words, self.bits, axis=1)

    # -- loading ---------------------------------------------------------------------
    def load_layer(self, layer: LayerPlan, k_start: int = 0, k_stop: int | None = None) -> QuantWeight:
        k_stop = layer.size_k if k_stop is None else k_stop
        g = layer.group_size
        b = layer.bits
        per = 32 // b
        qweight = self.ckpt.array(f"{layer.name}.qweight")
        if layer.act_order:
            perm = self._perm_from_g_idx(layer.name, self.ckpt.array(f"{layer.name}.g_idx"), g, layer.num_groups)
            assert perm is not None
            rows = perm[k_start:k_stop]
            words = np.asarray(qweight[rows // per]).view(np.uint32)
            shift = (rows % per).astype(np.uint32)[:, None] * np.uint32(b)
            q = ((words >> shift) & np.uint32((1 << b) - 1)).astype(np.uint8)
        else:
            perm = None
            q = unpack_words(np.asarray(qweight[k_start // per : k_stop // per]), b, axis=0)
        g0, g1 = k_start // g, -(-k_stop // g)
        z = self._decode_zeros(layer.name, g0, g1)
        sname = f"{layer.name}.scales"
        sinfo = self.ckpt.info(sname)
        s_src = _as_f32(self.ckpt.array(sname)[g0:g1], sinfo.dtype)
        s16 = scales_to_fp16(s_src, path=self.ckpt.file_of(sname), tensor=sname)
        delta = (np.float32(MARLIN_ZERO) - z.astype(np.float32)) * s_src
        return QuantWeight(
            name=layer.name, q=q, scales=s16, zeros=z, delta=delta, group_size=g, bits=b,
            zero_convention=layer.zero_convention,
            bias=self.ckpt.tensor(layer.bias.name) if layer.bias else None,
            perm=perm, k_offset=k_start, size_k=layer.size_k, source_scales_dtype=sinfo.dtype,
            source_scales=None if sinfo.dtype == "F16" else s_src,
        )

    def load_tensor(self, name: str):
        return self.ckpt.tensor(name)

    def close(self) -> None:
        self.ckpt.close()


def _as_f32(arr: np.ndarray, dtype: str) -> np.ndarray:
    """float32 copy of an F16/BF16/F32 array (BF16 stored as raw uint16 bits)."""
    if dtype == "BF16":
        return (np.asarray(arr, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(arr, dtype=np.float32)


def open_gptq(path: Path) -> GptqSource:
    """Open a GPTQ checkpoint folder or file (see :class:`HFCheckpoint`)."""
    return GptqSource(HFCheckpoint(path))

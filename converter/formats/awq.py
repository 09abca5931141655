"""AutoAWQ GEMM checkpoints (``quant_method: awq``, ``version: gemm``) in safetensors.

Per layer ``<prefix>`` (checkpoint-formats.md section 3, AutoAWQ ``WQLinear_GEMM``):
``qweight`` int32 ``(K, N/8)`` packed along **N** with the interleave
``[0,2,4,6,1,3,5,7]``; ``qzeros`` int32 ``(G, N/8)``, same packing, zeros stored
as they are (no -1); ``scales`` ``(G, N)``; optional ``bias`` ``(N,)``.  No
``g_idx``.  ``W = (q - z) * s``, so ``delta = (8 - z) * s`` (spec 4.6).  AWQ GEMM
is 4-bit only; ``group_size: -1`` means one group of K.

Refused with a message, never converted:

* ``version: marlin`` (AutoAWQ ``WQLinear_Marlin``): already upstream-Marlin
  packed, symmetric, under the names ``qweight`` ``(K/16, 2N)`` and ``scales``
  (permuted); repacking would pack twice.  A file labelled ``gemm`` whose
  ``qweight`` has Marlin's ``(K/16, 2N)`` shape is refused the same way.
* ``gemv``/``gemv_fast`` and any other version: different packings.

``modules_to_not_convert`` (transformers substring match) is honoured: those
modules are stored unquantized and pass through with that reason.
"""

from __future__ import annotations

import numpy as np

from ..constants import SourceFormat, ZeroConvention
from ..dtypes import FLOAT_DTYPES
from ..errors import ConfigError, SourceFormatError, UnsupportedQuantError
from ..quant_weight import QuantWeight
from .base import LayerPlan, SourcePlan
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
from .packing import codes_per_word, unpack_awq

AWQ_BITS = 4
#: Codes per int32 word (AWQ GEMM packs 4-bit codes along N).
AWQ_PACK = codes_per_word(AWQ_BITS)
READ_VERSIONS = ("gemm",)


class AwqSource(HFSource, format=SourceFormat.AWQ, methods=("awq",), conventions=(ZeroConvention.AWQ,)):
    """Reader for AutoAWQ GEMM checkpoints; conventions in the module docstring.

    Args:
        ckpt: an opened checkpoint folder.

    Raises:
        ConfigError: a missing or mistyped config field.
        UnsupportedQuantError: ``version`` other than ``gemm`` (``marlin`` with its
            own message), bits other than 4.
    """

    missing_note = " (AWQ GEMM always stores zeros and scales)"

    @classmethod
    def claims_checkpoint(cls, ckpt: HFCheckpoint) -> bool:
        """AutoAWQ's legacy ``quant_config.json``: ``w_bit``/``q_group_size``/``version``
        and no ``quant_method`` (spec section 3)."""
        qc = ckpt.quant_config
        return "w_bit" in qc or ("version" in qc and "zero_point" in qc)

    def __init__(self, ckpt: HFCheckpoint) -> None:
        super().__init__(ckpt)
        qc = ckpt.quant_config
        cfg_path = self.cfg_path
        # AutoAWQ's own quant_config.json spells them w_bit / q_group_size (spec section 3).
        bits_key = "bits" if "bits" in qc else "w_bit"
        group_key = "group_size" if "group_size" in qc else "q_group_size"
        self.bits = config_field(qc, bits_key, int, AWQ_BITS, path=cfg_path)
        self.group_size = config_field(qc, group_key, int, 128, path=cfg_path)
        self.version = str(config_field(qc, "version", str, "gemm", path=cfg_path)).lower()
        self.zero_point = config_field(qc, "zero_point", bool, True, path=cfg_path)
        self.not_convert = string_list(qc, "modules_to_not_convert", path=cfg_path)
        if self.version == "marlin":
            raise UnsupportedQuantError(ALREADY_MARLIN, path=cfg_path, tensor="version")
        if self.version not in READ_VERSIONS:
            raise UnsupportedQuantError(
                f"AWQ version {self.version!r} is not supported: only 'gemm' (qweight [K, N/8] packed along N) "
                "is read; gemv/gemv_fast store other packings; re-export the model as AWQ GEMM",
                path=cfg_path,
                tensor="version",
            )
        if self.bits != AWQ_BITS:
            raise UnsupportedQuantError(
                f"{self.bits}-bit AWQ is not supported (AWQ GEMM is 4-bit only)", path=cfg_path, tensor=bits_key
            )
        if self.group_size != -1 and self.group_size <= 0:
            raise ConfigError(f"must be -1 or positive, found {self.group_size}", path=cfg_path, tensor=group_key)

    # -- planning --------------------------------------------------------------------
    def plan(self, *, pad: bool = True) -> SourcePlan:
        """Plan every ``*.qweight`` layer; reads qzeros and scales (small) only.  A short
        last group (``ceil(K / group_size)`` scale rows; AutoAWQ itself needs K % group_size
        == 0, but the rows say what the layer is) is regrouped and an ``N % 64`` layer
        padded (with ``pad``): :meth:`LayerPlan.fit`.

        Raises:
            SourceFormatError: a missing companion tensor, a wrong dtype or shape,
                NaN/Inf or fp16-overflowing scales.
            UnsupportedQuantError: a Marlin-packed ``qweight`` under a gemm label.
        """
        layers = self._plan_layers([n[: -len(".qweight")] for n in self.ckpt.infos if n.endswith(".qweight")], pad)
        return assemble_plan(layers, self.ckpt.infos, self._plain_reason)

    def _plain_reason(self, module: str) -> str | None:
        entry = not_convert_match(module, self.not_convert)
        return (
            f"kept unquantized by the producer: module matches modules_to_not_convert entry {entry!r}"
            if entry
            else None
        )

    def _plan_layer(self, prefix: str, pad: bool) -> LayerPlan:
        qw = self.need(prefix, "qweight", ("I32",))
        qw_path = self.ckpt.file_of(qw.name)
        scales = self.need(prefix, "scales", FLOAT_DTYPES)
        num_groups, size_n = scales.shape
        size_k = qw.shape[0]
        if qw.shape[1] != size_n // AWQ_PACK or size_n % AWQ_PACK:
            if qw.shape[1] == 2 * size_n:
                # Marlin's B is (K/16, 2N): the file is Marlin-packed whatever its label says.
                raise UnsupportedQuantError(
                    f"qweight shape {list(qw.shape)} is Marlin's (K/16, 2N) for N = {size_n}, not AWQ GEMM's (K, N/8): "
                    + ALREADY_MARLIN,
                    path=qw_path,
                    tensor=qw.name,
                )
            raise SourceFormatError(
                f"shape {list(qw.shape)} is not AWQ GEMM's (K, N/8) for N = {size_n} taken from {scales.name}",
                path=qw_path,
                tensor=qw.name,
            )
        g = size_k if self.group_size == -1 else self.group_size
        expect_groups = -(-size_k // g) if size_k else 0
        if num_groups != expect_groups:
            raise SourceFormatError(
                f"shape {list(scales.shape)} has {num_groups} groups, expected {expect_groups} for K = {size_k} "
                f"and group_size = {self.group_size}",
                path=self.ckpt.file_of(scales.name),
                tensor=scales.name,
            )
        qzeros = self.need(prefix, "qzeros", ("I32",), (num_groups, size_n // AWQ_PACK))
        bias = self.need(prefix, "bias", FLOAT_DTYPES, (size_n,)) if f"{prefix}.bias" in self.ckpt else None
        s32 = self.check_scales(scales)
        warnings = []
        entry = not_convert_match(prefix, self.not_convert)
        if entry:
            warnings.append(
                f"config lists this module in modules_to_not_convert ({entry!r}) but it is quantized; "
                "converted by the data"
            )
        layer = LayerPlan(
            name=prefix,
            size_k=size_k,
            size_n=size_n,
            group_size=g,
            bits=AWQ_BITS,
            zero_convention=ZeroConvention.AWQ,
            symmetric=False,
            act_order=False,
            source_tensors=(qw.name, qzeros.name, scales.name),
            bias=bias,
            warnings=warnings,
            extra={"version": self.version},
        )
        if not layer.fit(pad):
            return layer
        z = unpack_awq(np.asarray(self.ckpt.array(qzeros.name)))
        # The artifact's delta is zero: z == 8, or s == 0.
        layer.symmetric = not bool(np.any(self.layer_delta(layer, z, scales, s32)))
        return layer

    # -- loading ---------------------------------------------------------------------
    def load_layer(self, layer: LayerPlan, k_start: int = 0, k_stop: int | None = None) -> QuantWeight:
        """Read input rows ``[k_start, k_stop)`` (multiples of the source's group size, or
        any 16-row boundary when per-channel; ``k_stop`` may be K), at the artifact's
        group size.

        Returns codes uint8 ``(rows, N)`` de-interleaved, fp16 scales, true zeros
        uint8 ``(groups, N)``, ``delta = (8 - z) * s`` float32 from the scales as stored.

        Raises:
            SourceFormatError: a scale overflows fp16 or is not finite.
        """
        k_stop = layer.size_k if k_stop is None else k_stop
        g, _ = layer.source_groups
        q = unpack_awq(np.asarray(self.ckpt.array(f"{layer.name}.qweight")[k_start:k_stop]))
        g0, g1 = k_start // g, -(-k_stop // g)
        z = unpack_awq(np.asarray(self.ckpt.array(f"{layer.name}.qzeros")[g0:g1]))
        return integer_zero_weight(
            self.ckpt, layer, q=q, z=z, scales=f"{layer.name}.scales", g0=g0, g1=g1, rows=(k_start, k_stop)
        )


ALREADY_MARLIN = already_marlin(
    "AutoAWQ 'marlin' checkpoints are",
    "qweight is Marlin B [K/16, 2N], scales are Marlin-permuted; spec section 3",
    packing="upstream-Marlin packed and symmetric",
    advice="serve the file as it is, or convert from the AWQ GEMM checkpoint",
)

"""What an export reports: each layer's fate, the summary (text and JSON), and which vLLM
kernels can serve an exported layer (advice from the vLLM sources it cites).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..formats.base import LayerPlan

#: Where :func:`vllm_kernels` takes its rules from (advice, not a guarantee).
VLLM_SOURCES = (
    "vllm-project/vllm vllm/model_executor/layers/quantization/utils/marlin_utils.py @ 007d500 "
    "(MARLIN_SUPPORTED_GROUP_SIZES = [-1, 32, 64, 128]; has_zp -> uint4 only; "
    "N % 64, K % 128, K_part % group_size)",
    "vllm-project/vllm vllm/model_executor/layers/quantization/kernels/mixed_precision/marlin.py @ 04aa528 "
    "(MarlinLinearKernel.can_implement, sm_80+, g_idx sorted at load)",
    "vllm-project/vllm vllm/model_executor/layers/quantization/utils/machete_utils.py @ 0531c22 "
    "(MACHETE_SUPPORTED_GROUP_SIZES = [-1, 128]; zero points -> uint4/uint8; K % 64, N % 128)",
    "vllm-project/vllm vllm/model_executor/layers/quantization/kernels/mixed_precision/machete.py @ 0065de9 "
    "(sm_90 only; act-order not with K split across tensor-parallel ranks; no bias in the kernel)",
)
#: safetensors dtype codes of the scales as the engines' ``--dtype`` names them.
TORCH_DTYPE_NAMES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}
VLLM_VERSION_NOTE = (
    "vLLM main of late 2025 / 2026 (v0.11 and later, the files cited in VLLM_SOURCES); "
    "compressed-tensors W{4,8}A16 only (WNA16_SUPPORTED_BITS = [4, 8])"
)


@dataclasses.dataclass
class LayerExport:
    """One source layer in the export."""

    name: str
    bits: int
    size_k: int
    size_n: int
    group_size: int
    strategy: str
    act_order: bool
    exported: bool
    reason: str = ""
    kernels: list[str] = dataclasses.field(default_factory=list)
    #: the exported ``weight_scale``'s dtype (the source's, exact); "" when not exported
    scale_dtype: str = ""

    @classmethod
    def of(cls, layer: LayerPlan, exported: bool) -> LayerExport:
        """A source layer as the export writes it (its source group size; per-channel
        when one group spans K)."""
        g = layer.source_group_size or layer.group_size
        strategy = "channel" if g >= layer.size_k else "group"
        return cls(layer.name, layer.bits, layer.size_k, layer.size_n, g, strategy, layer.act_order, exported)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ExportSummary:
    """What :func:`export_compressed_tensors` wrote."""

    source: str
    output: str
    source_format: str
    layers: list[LayerExport]
    passthrough: list[str]
    files: list[str]
    source_files: list[dict[str, Any]]
    warnings: list[str]

    @property
    def exported(self) -> list[LayerExport]:
        return [lay for lay in self.layers if lay.exported]

    @property
    def serve_dtype(self) -> str | None:
        """The ``--dtype`` to serve the export with: vLLM and SGLang allocate ``weight_scale``
        in the model dtype, so only the scales' own dtype keeps them exact (None: the layers'
        scales differ in dtype, or none was exported)."""
        kinds = {lay.scale_dtype for lay in self.exported}
        return kinds.pop() if len(kinds) == 1 else None

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": True,  # as every other document of both commands (an error's says false)
            "source": self.source,
            "output": self.output,
            "source_format": self.source_format,
            "to": "compressed-tensors",
            "layers": [lay.to_json() for lay in self.layers],
            "passthrough": self.passthrough,
            "files": self.files,
            "source_files": self.source_files,
            "warnings": self.warnings,
            "serve_dtype": self.serve_dtype,
            "kernel_advice": {"sources": list(VLLM_SOURCES), "vllm_version": VLLM_VERSION_NOTE},
        }

    def text(self) -> str:
        """A short human summary: one line per exported layer, with its vLLM kernels."""
        lines = [f"exported {len(self.exported)} layers to {self.output} (compressed-tensors pack-quantized, asym)"]
        for lay in self.layers:
            if lay.exported:
                g = "channel" if lay.strategy == "channel" else f"g{lay.group_size}"
                ao = ", act-order" if lay.act_order else ""
                lines.append(f"  {lay.name}: w{lay.bits} {g}{ao}; vLLM: {', '.join(lay.kernels) or 'none'}")
            else:
                lines.append(f"  {lay.name}: passed through unconverted ({lay.reason})")
        if self.serve_dtype:
            lines.append(f"scales are {self.serve_dtype}: serve with --dtype {self.serve_dtype} (vLLM, SGLang)")
        elif self.exported:
            kinds = ", ".join(sorted({lay.scale_dtype for lay in self.exported}))
            lines.append(f"scales are {kinds} by layer: no one --dtype keeps them all exact")
        lines += [f"warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def vllm_kernels(bits: int, group_size: int, size_k: int, size_n: int, act_order: bool) -> list[str]:
    """Which vLLM kernels can serve an asymmetric (zero-point) compressed-tensors layer.

    Derived from the vLLM files in :data:`VLLM_SOURCES` (version: :data:`VLLM_VERSION_NOTE`),
    for one GPU (no tensor parallelism: a split K adds ``K_part % group_size == 0`` and
    Machete refuses act-order).  Advice, not a guarantee.

    Args:
        group_size: rows per group; ``size_k`` (or -1) for per-channel.
    """
    if bits not in (4, 8):
        return []  # compressed_tensors_wNa16: WNA16_SUPPORTED_BITS = [4, 8]
    g = -1 if group_size in (-1, size_k) else group_size
    out = []
    # Marlin with zero points: uint4 only (query_marlin_supported_quant_types(has_zp=True)).
    if bits == 4 and g in (-1, 32, 64, 128) and size_n % 64 == 0 and size_k % 128 == 0 and (g == -1 or size_k % g == 0):
        out.append("Marlin (uint4 with zero points, sm_80+" + (", act-order via g_idx sort" if act_order else "") + ")")
    # Machete with zero points: uint4 / uint8, sm_90 only.
    if g in (-1, 128) and size_k % 64 == 0 and size_n % 128 == 0:
        out.append("Machete (Hopper sm_90" + (", act-order" if act_order else "") + ")")
    return out

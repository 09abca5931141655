"""Exports of a source checkpoint into other serving formats (issue 41).

:func:`export_compressed_tensors` writes an exact asymmetric compressed-tensors
``pack-quantized`` model folder (docs/export.md).
"""

from __future__ import annotations

from .compressed_tensors import ExportSummary, LayerExport, export_compressed_tensors, vllm_kernels
from .verify import ExportCheck, check_export, export_manifest

__all__ = [
    "ExportCheck",
    "ExportSummary",
    "LayerExport",
    "check_export",
    "export_compressed_tensors",
    "export_manifest",
    "vllm_kernels",
]

"""Source formats: sniff a path and open the right reader.

One module per on-disk format, every reader yielding the same
:class:`~converter.quant_weight.QuantWeight`.  Readers register themselves when their
class is defined (:class:`~converter.formats.base.Source`); every module of this
package is imported below, so adding a format is one module with one reader class
(plus its :class:`~converter.constants.SourceFormat` and
:class:`~converter.constants.ZeroConvention` members).  What the rest of the package
needs to know about formats is derived from that registry here.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from types import MappingProxyType

from ..constants import META_SCHEMA_VERSION
from ..errors import ConverterError, UnsupportedQuantError
from .base import READERS, LayerPlan, Source, SourcePlan, TensorInfo
from .hf import HFSource, already_marlin
from .hf_checkpoint import HFCheckpoint

__all__ = [
    "CONVENTIONS",
    "HF_READERS",
    "LayerPlan",
    "READABLE_METHODS",
    "READERS",
    "Source",
    "SourcePlan",
    "TensorInfo",
    "open_source",
]

# Importing a module is what registers its reader: import them all, so that a new
# format needs no line here.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

#: quant_method (lower case) -> the reader of HF-style checkpoints that converts it.
HF_READERS: MappingProxyType[str, type[HFSource]] = MappingProxyType(
    {m: cls for cls in READERS.values() if issubclass(cls, HFSource) for m in cls.quant_methods}
)
#: The quant methods that convert, sorted.
READABLE_METHODS = tuple(sorted(HF_READERS))
#: Source format (JSON value) -> the zero conventions its reader records (JSON values).
CONVENTIONS: MappingProxyType[str, frozenset[str]] = MappingProxyType(
    {fmt.value: frozenset(c.value for c in cls.zero_conventions) for fmt, cls in READERS.items()}
)
#: quant_method values refused with the reason instead of "not supported".
REFUSED_METHODS = {
    # AutoGPTQ's legacy ``quant_method: marlin`` (spec 5.1, 5.3): B and s are stored
    # already Marlin-packed and symmetric.
    "marlin": already_marlin(
        "quant_method 'marlin' checkpoints are",
        "tensors B and s, symmetric only; spec 5.1",
        advice="use the file as it is, or convert from the original GPTQ checkpoint",
    ),
}


def _named_method(cfg: dict) -> str:
    return str(cfg.get("quant_method", cfg.get("method", ""))).lower()


def _sniff_method(ckpt: HFCheckpoint) -> str:
    """The quant method of a checkpoint whose quant config names none.

    A reader may claim it (AutoAWQ's legacy ``quant_config.json``; GPTQ tensors with
    no config); else a sidecar file may shadow a ``config.json`` whose
    ``quantization_config`` does name the method.
    """
    for method, cls in HF_READERS.items():
        if cls.claims_checkpoint(ckpt):
            return method
    inner = ckpt.config.get("quantization_config")
    return _named_method(inner) if isinstance(inner, dict) else ""


def open_source(path: str | Path) -> Source:
    """Detect the input format and open its reader.

    Args:
        path: a ``.tinyloop`` file; an HF checkpoint folder; a ``.safetensors`` file
            beside its configs; or a ``model.safetensors.index.json``.

    Returns:
        An opened :class:`Source` (close it, or use it as a context manager).

    Raises:
        ConverterError: the path does not exist or cannot be read.
        SourceFormatError: the file is malformed (see each reader).
        UnsupportedQuantError: a quantization method this tool does not read.
    """
    path = Path(path)
    if not path.exists():
        raise ConverterError("no such file or directory", path=path)
    if path.is_file():
        for cls in READERS.values():
            if cls.claims(path):
                return cls(path)  # type: ignore[call-arg]  # single-file readers take the path
    ckpt = HFCheckpoint(path)
    try:
        # Before the quant config: a converted model folder's config.json names our own
        # quant_method, which is no input format.
        if any(META_SCHEMA_VERSION in f.metadata for f in ckpt.shards):
            raise UnsupportedQuantError(
                "this is already a marlin-convert artifact, not a source checkpoint; check it with marlin-verify",
                path=path,
            )
        qc = ckpt.quant_config
        method = (_named_method(qc) if qc else "") or _sniff_method(ckpt)
        if not method:
            raise UnsupportedQuantError(
                "no quantization config found (looked for quantize_config.json, quantization_config.json, "
                "quant_config.json and config.json[quantization_config]); is this a quantized checkpoint?",
                path=ckpt.folder,
            )
        where = ckpt.folder / (ckpt.quant_config_file or "config.json")
        if method in REFUSED_METHODS:
            raise UnsupportedQuantError(REFUSED_METHODS[method], path=where, tensor="quant_method")
        if method not in HF_READERS:
            raise UnsupportedQuantError(
                f"{method!r} is not supported (supported: {', '.join(READABLE_METHODS)})",
                path=where,
                tensor="quant_method",
            )
        return HF_READERS[method](ckpt)
    except BaseException:
        ckpt.close()
        raise

"""Source formats: sniff a path and open the right reader.

One module per on-disk format; every reader yields the same
:class:`~converter.quant_weight.QuantWeight`.  Adding a format means adding a module
and one entry in :data:`HF_READERS` (or a sniff branch for a container of its own).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..constants import META_SCHEMA_VERSION
from ..errors import ConverterError, UnsupportedQuantError
from .base import LayerPlan, Source, SourcePlan, TensorInfo
from .hf import HFCheckpoint

__all__ = ["LayerPlan", "Source", "SourcePlan", "TensorInfo", "open_source", "HF_READERS"]


def _gptq(ckpt: HFCheckpoint) -> Source:
    from .gptq import GptqSource

    return GptqSource(ckpt)


def _awq(ckpt: HFCheckpoint) -> Source:
    from .awq import AwqSource

    return AwqSource(ckpt)


def _compressed_tensors(ckpt: HFCheckpoint) -> Source:
    from .compressed_tensors import CompressedTensorsSource

    return CompressedTensorsSource(ckpt)


def _already_marlin(ckpt: HFCheckpoint) -> Source:
    # AutoGPTQ's legacy ``quant_method: marlin`` (spec 5.1, 5.3): B and s are stored
    # already Marlin-packed and symmetric; say so instead of "not supported".
    raise UnsupportedQuantError(
        "quant_method 'marlin' checkpoints are already Marlin-packed (tensors B and s, symmetric only; "
        "spec 5.1); marlin-convert never packs twice: use the file as it is, or convert from the "
        "original GPTQ checkpoint",
        path=ckpt.folder / (ckpt.quant_config_file or "config.json"), tensor="quant_method",
    )


#: quant_method (lower-case) -> reader factory for HF-style checkpoints.
HF_READERS: dict[str, Callable[[HFCheckpoint], Source]] = {
    "gptq": _gptq,
    "awq": _awq,
    "compressed-tensors": _compressed_tensors,
    "marlin": _already_marlin,
}
#: The methods that actually convert (HF_READERS also has refusals with a message).
READABLE_METHODS = ("gptq", "awq", "compressed-tensors")


def _sniff_method(ckpt: HFCheckpoint) -> str:
    """The quant method of a config that does not name one.

    AutoAWQ's legacy ``quant_config.json`` has ``w_bit``/``q_group_size``/``version``
    and no ``quant_method`` (spec section 3); a sidecar file may also shadow a
    ``config.json`` whose ``quantization_config`` does name the method.
    """
    qc = ckpt.quant_config
    if "w_bit" in qc or ("version" in qc and "zero_point" in qc):
        return "awq"
    inner = ckpt.config.get("quantization_config")
    if isinstance(inner, dict):
        named = str(inner.get("quant_method", inner.get("method", ""))).lower()
        if named:
            return named
    from .gptq import sniff

    return "gptq" if sniff(ckpt) else ""


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
        from .tinyloop import TinyloopSource, sniff

        if path.suffix == ".tinyloop" or sniff(path):
            return TinyloopSource(path)
    ckpt = HFCheckpoint(path)
    try:
        qc = ckpt.quant_config
        method = str(qc.get("quant_method", qc.get("method", ""))).lower() if qc else ""
        if not method:
            method = _sniff_method(ckpt)
        if not method and any(META_SCHEMA_VERSION in f.metadata for f in ckpt.shards):
            raise UnsupportedQuantError(
                "this is already a marlin-convert artifact; check it with marlin-verify", path=path
            )
        if not method:
            raise UnsupportedQuantError(
                "no quantization config found (looked for quantize_config.json, quantization_config.json, "
                "quant_config.json and config.json[quantization_config]); is this a quantized checkpoint?",
                path=ckpt.folder,
            )
        if method not in HF_READERS:
            where = ckpt.quant_config_file or "config.json"
            raise UnsupportedQuantError(
                f"{method!r} is not supported (supported: {', '.join(sorted(READABLE_METHODS))})",
                path=ckpt.folder / where, tensor="quant_method",
            )
        return HF_READERS[method](ckpt)
    except BaseException:
        ckpt.close()
        raise

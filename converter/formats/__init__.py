"""Source formats: sniff a path and open the right reader.

One module per on-disk format; every reader yields the same
:class:`~converter.quant_weight.QuantWeight`.  Adding a format means adding a module
and one entry in :data:`HF_READERS` (or a sniff branch for a container of its own).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

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


#: quant_method (lower-case) -> reader factory for HF-style checkpoints.
HF_READERS: dict[str, Callable[[HFCheckpoint], Source]] = {
    "gptq": _gptq,
    "awq": _awq,
    "compressed-tensors": _compressed_tensors,
}


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
            from .gptq import sniff

            method = "gptq" if sniff(ckpt) else ""
        if method not in HF_READERS:
            where = ckpt.quant_config_file or "config.json"
            found = repr(method) if method else "no quantization config"
            raise UnsupportedQuantError(
                f"{found} is not supported (supported: {', '.join(sorted(HF_READERS))})",
                path=ckpt.folder / where, tensor="quant_method",
            )
        return HF_READERS[method](ckpt)
    except BaseException:
        ckpt.close()
        raise

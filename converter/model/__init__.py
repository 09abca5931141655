"""Whole-model use of a converted model folder: load it as a ``transformers`` model, and
prove that it gives the same answers as its source (``marlin-verify OUTDIR --model``).

Modules (torch and transformers are imported only when a function here is called, so
``marlin-convert`` and ``marlin-verify --shapes`` never need them):

    names:     which artifact layer and tensor feeds which module and parameter (pure Python).
    modules:   the ``torch.nn.Module`` linears swapped into the model.
    config:    the transformers config from ``config.json``, its fields checked first.
    skeleton:  the model class, its skeleton (meta weights) and the bound on what it allocates.
    build:     the inventory and the binding: module swap, tensor loading (re-exports the two above).
    layers:    a converted folder's layers as modules: what the two loaders below share.
    loader:    :func:`load_model` (the converted folder).
    hf_quantizer: transformers' ``from_pretrained`` on the folder (``quant_method:
               "marlin-convert"``, registered by ``import converter``; docs/serving.md).
    reference: fp32 / fp16 reference models dequantized from the *source* checkpoint.
    inputs:    the tokens the models run on (the fixed input, or ``--text``).
    metrics:   a model's output against the fp32 reference's, in numbers.
    probe:     per-layer outputs and pass-through tensors of the converted model against the source.
    judge:     the pass rule and its findings.
    verify:    :func:`verify_model`: the three models, stage by stage.
    report:    the report's data classes and the CLI rendering.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConverterError


class ModelError(ConverterError):
    """A converted model folder (or its source) cannot be built into a transformers model.

    Raised for: a folder that is not a converted model; a ``.tinyloop`` conversion (not a
    transformers architecture); a ``model_type`` or architecture transformers does not
    know; artifact layers no module matches, or quantized modules left without a layer
    (all named); a tensor whose shape disagrees with the model; ``transformers`` or
    ``torch`` not installed; a ``config.json`` that names remote code or a hub id, asks
    for more layers or memory than the weights justify, or that transformers cannot
    build (converter/model/guard.py). Exit code 2 in the CLI.

    The message is one line of at most ``MESSAGE_LIMIT`` characters: a longer one (a
    model with a thousand unmatched layers) is cut, keeping its length and a hash.
    """

    MESSAGE_LIMIT = 2000

    def __init__(self, message: str, *, path: str | Path | None = None, tensor: str | None = None) -> None:
        message = " ".join(str(message).split("\n"))
        if len(message) > self.MESSAGE_LIMIT:
            import hashlib

            digest = hashlib.sha256(message.encode("utf-8", "surrogatepass")).hexdigest()[:12]
            message = f"{message[: self.MESSAGE_LIMIT]}...[{len(message)} chars, sha256 {digest}]"
        if tensor is not None and len(tensor) > 200:
            import hashlib

            digest = hashlib.sha256(tensor.encode("utf-8", "surrogatepass")).hexdigest()[:12]
            tensor = f"{tensor[:100]}...[{len(tensor)} chars, sha256 {digest}]"
        super().__init__(message, path=path, tensor=tensor)


def load_model(
    path: str | Path,
    device: Any = "cuda",
    *,
    strict: bool = True,
    attn_implementation: str | None = None,
    fuse: bool | None = None,
    dtype: Any = None,
) -> Any:
    """Load a converted model folder (``marlin-convert IN OUTDIR``) as a transformers model.

    See :func:`converter.model.loader.load_model` for the full contract. Imports torch
    and transformers on first call.
    """
    from .loader import load_model as _load

    return _load(path, device, strict=strict, attn_implementation=attn_implementation, fuse=fuse, dtype=dtype)


def verify_model(path: str | Path, against: str | Path, **kwargs: Any) -> Any:
    """Whole-model parity of a converted folder against its source; see
    :func:`converter.model.verify.verify_model`."""
    from .verify import verify_model as _verify

    return _verify(path, against, **kwargs)


__all__ = ["ModelError", "load_model", "verify_model"]

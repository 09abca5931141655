"""The model skeleton: which transformers class ``config.json`` names, building it
(on the meta device, or with meta weights), bounding what it allocates, and its kind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from . import ModelError
from .config import construction_error, import_stack, quiet_transformers
from .guard import names as name_list
from .guard import offline, short

#: Auto classes tried, in order, for the class that ``config.json["architectures"][0]`` names.
_AUTO_CLASSES = (
    "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForSeq2SeqLM", "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification", "AutoModelForQuestionAnswering", "AutoModel",
)  # fmt: skip
CAUSAL_LM, MASKED_LM, ENCODER, OTHER = "causal-lm", "masked-lm", "encoder", "other"


@dataclasses.dataclass(frozen=True)
class ModelClass:
    """How to build the model: ``auto`` (an Auto class, or None) or ``cls`` directly, and its ``kind``."""

    name: str
    auto: Any
    cls: Any
    kind: str

    def build(
        self, config: Any, *, dtype: Any, attn_implementation: str | None, path: Path | None = None, meta: bool = False
    ) -> Any:
        """The model skeleton, in eval mode, without gradients, built offline with
        ``trust_remote_code=False``.

        Args:
            meta: every tensor on the meta device (nothing allocated: what
                :func:`check_skeleton` compares); else its ``nn.Linear`` and
                ``nn.Embedding`` weights only (see :func:`meta_weights`).

        Raises:
            ModelError: any exception out of transformers' construction, one line.
        """
        import torch

        kwargs: dict[str, Any] = {"dtype": dtype}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        where = path or Path("config.json")
        try:
            with quiet_transformers(), offline(where), torch.device("meta") if meta else meta_weights():
                model = (
                    self.auto.from_config(config, trust_remote_code=False, **kwargs)
                    if self.auto is not None
                    else self.cls._from_config(config, **kwargs)
                )
        except Exception as exc:  # any failure of transformers' construction is the input's
            raise construction_error(
                exc, config.to_dict() if hasattr(config, "to_dict") else {}, path=where, doing=f"build {self.name}"
            ) from None
        model.eval()
        model.requires_grad_(False)
        return model


_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}


def weights_bytes(infos: Mapping[str, Any]) -> int:
    """Bytes of a checkpoint's tensors, from their header facts (dtype, shape)."""
    return sum(math.prod(i.shape) * _ITEMSIZE.get(i.dtype, 1) for i in infos.values())


#: Bytes a skeleton may allocate beyond the weights' own (buffers, norms, unfed parameters).
SKELETON_SLACK = 256 << 20


def check_skeleton(model: Any, swapped: Any, *, weight_bytes: int, path: Path, what: str) -> None:
    """Bound what the real build will allocate, on the meta skeleton (after the binding
    compared its names and shapes with the weights): every parameter and buffer, but the
    weights of swapped modules, at most the weights' own bytes plus the larger of
    ``SKELETON_SLACK`` and those bytes again.

    Raises:
        ModelError: naming the largest tensors and the bound.
    """
    swapped = set(swapped)
    seen: set[int] = set()
    sizes: list[tuple[int, str]] = []
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        if mod_name in swapped:
            continue
        for table in (mod._parameters, mod._buffers):
            for attr, t in table.items():
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                sizes.append((t.numel() * t.element_size(), f"{mod_name}.{attr}" if mod_name else attr))
    total = sum(n for n, _ in sizes)
    limit = weight_bytes + max(SKELETON_SLACK, weight_bytes)
    if total > limit:
        top = sorted(sizes, reverse=True)[:3]
        raise ModelError(
            f"the model config.json describes needs {total} bytes of parameters and buffers, above the {limit} "
            f"that the {what}'s {weight_bytes} bytes of weights justify (largest: "
            f"{name_list([f'{n} {b} bytes' for b, n in top])}); refused before allocating anything",
            path=path,
        )


@contextlib.contextmanager
def meta_weights() -> Iterator[None]:
    """``nn.Linear`` and ``nn.Embedding`` made while this is active put their weights on
    the meta device (no memory, no initialisation).

    Every such weight of a skeleton is either swapped out with its layer or replaced by
    a checkpoint tensor (or reported missing), so allocating and randomly initialising
    them would only cost time and, transiently, a whole model's memory (a 70B model's
    fp16 skeleton alone is 140 GB). Norms, buffers (rotary frequencies, position ids)
    and any other parameter are built as transformers builds them.
    """
    from torch import nn

    saved = {cls: cls.__init__ for cls in (nn.Linear, nn.Embedding)}

    def patch(cls: type, orig: Any) -> None:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("device", "meta")
            orig(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[method-assign]

    try:
        for cls, orig in saved.items():
            patch(cls, orig)
        yield
    finally:
        for cls, orig in saved.items():
            cls.__init__ = orig  # type: ignore[method-assign]


def model_class(config: Any, cfg: dict[str, Any], *, path: Path) -> ModelClass:
    """The transformers class named by ``config.json["architectures"][0]`` (``AutoModel``'s
    class for the config when it names none).

    Raises:
        ModelError: ``architectures`` is not a list of class names; the architecture is not
            a transformers class, or not one for this config.
    """
    _, transformers = import_stack()
    archs = cfg.get("architectures")
    # A malformed list is refused, not read as naming none: that built AutoModel's class
    # (LlamaModel, hidden states) for "architectures": "LlamaForCausalLM" or [5], silently.
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) and a for a in archs)):
        raise ModelError(
            f"{short(repr(archs), 60)} is not a list of model class names", path=path, tensor="architectures"
        )
    arch = archs[0] if archs else None
    for auto_name in _AUTO_CLASSES:
        auto = getattr(transformers, auto_name, None)
        mapping = getattr(auto, "_model_mapping", None)
        if mapping is None or type(config) not in mapping:
            continue
        cls = mapping[type(config)]
        for c in cls if isinstance(cls, (tuple, list)) else (cls,):
            if (arch is None and auto_name == "AutoModel") or c.__name__ == arch:
                return ModelClass(c.__name__, auto if c is cls else None, c, _kind(auto_name))
    cls = getattr(transformers, arch, None) if arch else None
    if cls is not None and isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel):
        if getattr(cls, "config_class", None) not in (None, type(config)):
            raise ModelError(
                f"architecture {short(arch)} does not take a {type(config).__name__}", path=path, tensor="architectures"
            )
        return ModelClass(arch, None, cls, OTHER)
    raise ModelError(
        f"architecture {short(repr(arch))} is not a transformers {transformers.__version__} model class",
        path=path,
        tensor="architectures",
    )


def _kind(auto_name: str) -> str:
    return {"AutoModelForCausalLM": CAUSAL_LM, "AutoModelForMaskedLM": MASKED_LM, "AutoModel": ENCODER}.get(
        auto_name, OTHER
    )


def model_kind(model: Any) -> str:
    """``causal-lm`` / ``masked-lm`` / ``encoder`` / ``other``: the first Auto class (in
    :data:`_AUTO_CLASSES` order) whose mapping gives ``model``'s class for its config."""
    import transformers

    for auto_name in _AUTO_CLASSES:
        mapping = getattr(getattr(transformers, auto_name, None), "_model_mapping", None)
        if mapping is None or type(model.config) not in mapping:
            continue
        cls = mapping[type(model.config)]
        if type(model) in (cls if isinstance(cls, (tuple, list)) else (cls,)):
            return _kind(auto_name)
    return OTHER

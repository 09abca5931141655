"""A transformers config from a ``config.json`` dict: the fields refused before
transformers sees them, its errors as one line, and the dtype the model is built in.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..constants import HF_WEIGHTS_KEY
from ..dtypes import DTYPE_ALIASES
from ..jsonio import non_finite_path
from . import ModelError
from .guard import check_config, offline, short


def model_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` without what is ours, not the model's: ``quantization_config`` and folder
    mode's guard against a plain from_pretrained (``transformers_weights``)."""
    return {k: v for k, v in cfg.items() if k not in ("quantization_config", HF_WEIGHTS_KEY)}


def edited_fields(written: dict[str, Any], source: dict[str, Any]) -> list[tuple[str, str]]:
    """``(field, what differs)`` for every model field of a folder's ``config.json`` that
    is not the source's (marlin-convert copies them as they are)."""
    mine, theirs = model_fields(written), model_fields(source)
    missing = object()

    def show(v: Any) -> str:
        return "absent" if v is missing else short(json.dumps(v, sort_keys=True, default=str), 80)

    out = []
    for key in sorted(mine.keys() | theirs.keys(), key=str):
        a, b = mine.get(key, missing), theirs.get(key, missing)
        if a != b:
            out.append((short(key), f"{show(a)} where the source's config.json has {show(b)}"))
    return out


def import_stack() -> tuple[Any, Any]:
    """``(torch, transformers)``.

    Raises:
        ModelError: either is not installed (names the extra to install).
    """
    try:
        import torch
        import transformers
    except ImportError as exc:
        raise ModelError(
            f"whole-model use needs torch and transformers ({exc}); "
            "install the extra from the checkout: pip install -e '.[model]' torch==2.13.0 (torch's CPU build; "
            "a GPU machine keeps its own CUDA torch)"
        ) from None
    return torch, transformers


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' own logging at error level only while we build (no hub advice on stderr)."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)


#: Fields that must be positive integers when present.
_POSITIVE_INTS = (
    "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "vocab_size", "max_position_embeddings", "head_dim", "num_layers", "n_layer", "n_embd", "n_head", "n_inner",
    "n_positions", "type_vocab_size", "encoder_layers", "decoder_layers", "d_model", "num_heads", "d_ff",
)  # fmt: skip
#: Fields that must be finite numbers when present.
_NUMBERS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "initializer_range")
#: Fields that name an activation transformers must know.
_ACTIVATIONS = ("hidden_act", "hidden_activation", "activation_function")
#: Fields that must be a token id inside the vocabulary (or null).
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")
#: Layer-count fields, bounded by the layers the weights hold (:func:`check_depth`).
_DEPTHS = ("num_hidden_layers", "num_layers", "n_layer", "encoder_layers", "decoder_layers")
#: The dtypes a model may be built in.
_DTYPES = ("float32", "float16", "bfloat16")
#: Ceiling of a field whose value transformers turns into a tensor size (before any weight is compared).
_SIZE_CEILING = 1 << 40


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_fields(cfg: dict[str, Any], *, path: Path) -> None:
    """Refuse, one line naming the field, what transformers would crash on or fetch:
    remote code and hub ids (:func:`~converter.model.guard.check_config`), sizes that are
    not positive integers, norms' epsilons that are not numbers, NaN or an infinity at
    any depth (``rope_parameters.rope_theta``), an unknown activation,
    a token id outside the vocabulary, a dtype other than float32 / float16 / bfloat16.

    Raises:
        ModelError: the first such field.
    """
    from transformers.activations import ACT2FN

    check_config(cfg, path=path)
    for key in _POSITIVE_INTS:
        v = cfg.get(key)
        if v is not None and not (_is_int(v) and 0 < v <= _SIZE_CEILING):
            raise ModelError(f"{short(repr(v), 40)} is not a positive integer (at most 2**40)", path=path, tensor=key)
    for key in _NUMBERS:
        v = cfg.get(key)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
            raise ModelError(f"{short(repr(v), 40)} is not a finite number", path=path, tensor=key)
    # Nested numbers too: transformers takes them as they are (a NaN rope_theta gave NaN
    # rotary frequencies and wrong logits, silently), and marlin-convert never writes one.
    where = non_finite_path(cfg)
    if where is not None:
        raise ModelError(
            "is NaN or infinite: a config.json holds finite numbers only (marlin-convert writes standard JSON)",
            path=path,
            tensor=short(where),
        )
    for key in _ACTIVATIONS:
        v = cfg.get(key)
        if v is not None and not (isinstance(v, str) and v in ACT2FN):
            raise ModelError(f"{short(repr(v), 40)} is not an activation transformers knows", path=path, tensor=key)
    vocab = cfg.get("vocab_size")
    for key in _TOKEN_IDS:
        v = cfg.get(key)
        for tid in v if isinstance(v, list) else [v]:
            if tid is None:
                continue
            if not _is_int(tid) or tid < 0 or (_is_int(vocab) and tid >= vocab):
                raise ModelError(
                    f"{short(repr(tid), 40)} is not a token id of the vocabulary (vocab_size {vocab})",
                    path=path,
                    tensor=key,
                )
    for key in ("dtype", "torch_dtype"):
        v = cfg.get(key)
        if v is not None and str(v).replace("torch.", "") not in _DTYPES:
            raise ModelError(
                f"{short(repr(v), 40)} is not a dtype a model is built in ({', '.join(_DTYPES)})", path=path, tensor=key
            )
    attn = cfg.get("attn_implementation", cfg.get("_attn_implementation"))
    if attn is not None and attn not in ("eager", "sdpa"):
        raise ModelError(
            f"{short(repr(attn), 40)}: only 'eager' and 'sdpa' are built from a model folder",
            path=path,
            tensor="attn_implementation",
        )


def check_depth(cfg: dict[str, Any], tensor_names: Any, *, path: Path, what: str) -> None:
    """Refuse a layer count above the layers the weights hold, before anything is built.

    The weights' depth is one more than the largest integer component of any tensor
    name (``model.layers.3.mlp...`` -> 4); a config may ask for fewer layers, never more.

    Raises:
        ModelError: naming the field, its value and the weights' depth.
    """
    depth = 0
    for n in tensor_names:
        for part in str(n).split("."):
            if part.isdigit() and len(part) < 10:
                depth = max(depth, int(part) + 1)
    for key in _DEPTHS:
        v = cfg.get(key)
        if _is_int(v) and v > max(depth, 1):
            raise ModelError(
                f"is {v}, but the {what} holds {depth} layer(s): refused before building anything",
                path=path,
                tensor=key,
            )


def _field_of(exc: BaseException, cfg: dict[str, Any]) -> str | None:
    """The config field an exception's message names (its key, or its value), if any."""
    text = str(exc)
    for key in sorted(cfg, key=lambda k: -len(str(k))):
        if str(key) in text:
            return str(key)
    for key, v in cfg.items():
        if isinstance(v, (str, int, float)) and not isinstance(v, bool) and len(str(v)) > 2 and str(v) in text:
            return str(key)
    return None


def construction_error(exc: BaseException, cfg: dict[str, Any], *, path: Path, doing: str) -> ModelError:
    """One :class:`ModelError` line for any exception out of transformers' config or model
    construction, naming the file and (when its message tells) the field."""
    if isinstance(exc, ModelError):
        return exc
    first = " ".join(str(exc).split())
    field = _field_of(exc, cfg)
    return ModelError(
        f"transformers cannot {doing}: {type(exc).__name__}: {short(first, 300)}",
        path=path,
        tensor=short(field) if field else None,
    )


def hf_config(cfg: dict[str, Any], *, path: Path) -> Any:
    """A transformers config from a ``config.json`` dict, without its ``quantization_config``
    (and ``transformers_weights``), offline, after :func:`check_fields`.

    Raises:
        ModelError: no ``model_type``, or one transformers does not know; a field
            :func:`check_fields` refuses; any exception out of transformers' config
            class (one line, naming the file and the field where its message tells).
    """
    _, transformers = import_stack()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    d = model_fields(cfg)
    model_type = d.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelError(
            "config.json has no model_type: cannot tell which architecture to build", path=path, tensor="model_type"
        )
    if model_type not in CONFIG_MAPPING:
        raise ModelError(
            f"model_type {short(repr(model_type), 60)} is not an architecture transformers "
            f"{transformers.__version__} knows",
            path=path,
            tensor="model_type",
        )
    check_fields(d, path=path)
    try:
        with quiet_transformers(), offline(path):
            return CONFIG_MAPPING[model_type].from_dict(d)
    except Exception as exc:  # any failure of transformers' config class is the input's
        raise construction_error(exc, d, path=path, doing=f"read this {model_type} config") from None


def torch_dtype(dtype: Any) -> Any:
    """A torch dtype, or None, from a torch dtype, its name or an alias (``"bf16"``);
    None and ``"auto"`` give None (each tensor its own dtype, as ``from_pretrained``'s default).

    Raises:
        ModelError: anything but float32, float16 or bfloat16.
    """
    if dtype is None or dtype == "auto":
        return None
    import torch

    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        dt = getattr(torch, DTYPE_ALIASES.get(name, name), None)
    else:
        dt = dtype
    if dt not in (torch.float32, torch.float16, torch.bfloat16):
        raise ModelError(f"dtype {dtype!r}: a model loads in float32, float16 or bfloat16")
    return dt


def config_dtype(cfg: dict[str, Any]) -> Any:
    """The torch dtype ``config.json`` declares (``dtype`` or ``torch_dtype``), float32 if none
    (:func:`check_fields` has refused any other than float32, float16, bfloat16)."""
    import torch

    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    return dt if dt in (torch.float32, torch.float16, torch.bfloat16) else torch.float32

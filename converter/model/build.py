"""What the converted model and the reference models share: the transformers config and
skeleton, the inventory of its linears and parameters, the swap and the tensor loading.

The skeleton is built with transformers' own classes (``AutoModelForCausalLM`` /
``AutoModel`` ... ``.from_config``) from a ``config.json`` dict, never from the hub.
The config's ``quantization_config`` is dropped first: in a converted folder it
describes our artifact (``quant_method: marlin-convert``), in a source it describes the
producer's format, and either way transformers must not try to apply a quantizer: the
quantized linears are swapped for our own modules here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ..constants import HF_WEIGHTS_KEY
from . import ModelError
from .guard import check_config, offline, short
from .guard import names as name_list
from .names import Binding, LayerSlot, LinearSlot, tie_groups

#: Auto classes tried, in order, for the class that ``config.json["architectures"][0]`` names.
_AUTO_CLASSES = (
    "AutoModelForCausalLM", "AutoModelForMaskedLM", "AutoModelForSeq2SeqLM", "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification", "AutoModelForQuestionAnswering", "AutoModel",
)  # fmt: skip
CAUSAL_LM, MASKED_LM, ENCODER, OTHER = "causal-lm", "masked-lm", "encoder", "other"


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
    not positive integers, norms' epsilons that are not numbers, an unknown activation,
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

    # transformers_weights is folder mode's guard against a plain from_pretrained (hf_config.py), no model field.
    d = {k: v for k, v in cfg.items() if k not in ("quantization_config", HF_WEIGHTS_KEY)}
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


def materialize_missing(model: Any, missing: list[str]) -> None:
    """Give every parameter still on the meta device (one the checkpoint did not feed,
    reported in ``missing``) real zeros on the CPU.

    Raises:
        ModelError: a meta tensor that no finding explains (a bug here, not the input's).
    """
    import torch

    stray = []
    for mod_name, mod in model.named_modules():
        for attr, p in list(mod._parameters.items()):
            if p is not None and p.device.type == "meta":
                name = f"{mod_name}.{attr}" if mod_name else attr
                if name not in missing:
                    stray.append(name)
                mod._parameters[attr] = torch.nn.Parameter(torch.zeros(p.shape, dtype=p.dtype), requires_grad=False)
    if stray:
        raise ModelError(f"internal: parameters left unloaded on the meta device: {name_list(stray)}")


def model_class(config: Any, cfg: dict[str, Any], *, path: Path) -> ModelClass:
    """The transformers class named by ``config.json["architectures"][0]`` (``AutoModel``'s
    class for the config when it names none).

    Raises:
        ModelError: the architecture is not a transformers class, or not one for this config.
    """
    _, transformers = import_stack()
    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
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


def config_dtype(cfg: dict[str, Any]) -> Any:
    """The torch dtype ``config.json`` declares (``dtype`` or ``torch_dtype``), float32 if none
    (:func:`check_fields` has refused any other than float32, float16, bfloat16)."""
    import torch

    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    return dt if dt in (torch.float32, torch.float16, torch.bfloat16) else torch.float32


# --------------------------------------------------------------------------- inventory


def _is_linear(module: Any) -> tuple[int, int] | None:
    """(K, N) of an ``nn.Linear`` or transformers ``Conv1D`` (weight ``(K, N)``), else None."""
    from torch import nn

    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None and module.weight.dim() == 2:
        return int(module.weight.shape[0]), int(module.weight.shape[1])
    return None


def inventory(model: Any, ties: Mapping[str, str] | None = None) -> tuple[dict[str, LinearSlot], list[list[str]]]:
    """The model's linear modules, and its parameters and persistent buffers as groups of
    names sharing one tensor (tied weights), in the model's order.

    Args:
        ties: ``{target: source}`` names to group as well: ``from_pretrained`` builds its
            skeleton untied and ties after loading (``model.all_tied_weights_keys``).
    """
    linears: dict[str, LinearSlot] = {}
    for name, mod in model.named_modules():
        kn = _is_linear(mod)
        if kn is not None and name:
            linears[name] = LinearSlot(kn[0], kn[1], getattr(mod, "bias", None) is not None)
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for bname, b in mod._buffers.items():
            if b is None or bname in mod._non_persistent_buffers_set:
                continue
            groups.setdefault(id(b), []).append(f"{mod_name}.{bname}" if mod_name else bname)
    return linears, tie_groups([list(dict.fromkeys(g)) for g in groups.values()], ties or {})


def binding_errors(b: Binding, *, what: str, arch: str, path: Path) -> None:
    """Raise for the findings that leave no model to run: all of them, in one line.

    Raises:
        ModelError: layers no module matches, linear modules with no layer and no
            weight, or a layer whose sizes disagree with its module.
    """
    parts = []
    if b.unmatched_layers:
        parts.append(
            f"{len(b.unmatched_layers)} layer(s) in the {what} match no module of {arch}: "
            f"{name_list(b.unmatched_layers)}"
        )
    if b.unbound_modules:
        parts.append(
            f"{len(b.unbound_modules)} linear module(s) of {arch} have no layer in the {what} "
            f"(neither converted nor a weight): {name_list(b.unbound_modules)}"
        )
    if b.shape_errors:
        more = len(b.shape_errors) - 4
        parts += [short(e, 300) for e in b.shape_errors[:4]] + ([f"... ({more} more)"] if more > 0 else [])
    if parts:
        raise ModelError("; ".join(parts), path=path)


def _set_tensor(model: Any, name: str, tensor: Any) -> None:
    import torch

    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if isinstance(tensor, torch.nn.Parameter):
        mod._parameters[attr] = tensor
    else:
        mod._buffers[attr] = tensor


def apply_binding(
    model: Any, b: Binding, *, make_layer: Callable[[str, str], Any], load_tensor: Callable[[str], Any], path: Path
) -> None:
    """Swap every bound linear for ``make_layer(module name, layer name)`` and load every
    bound tensor with ``load_tensor(tensor name)`` (tied names get the same parameter).

    The swaps come first, so each skeleton weight is freed as its layer arrives (peak:
    the skeleton plus one layer). Plain linear modules left in the model (an unquantized
    head, a pooler) compute in the promoted dtype of their input and weight
    (:func:`~converter.model.modules.promoting_linear_forward`), since their weights
    keep their own dtype.

    Raises:
        ModelError: a tensor's shape differs from the parameter it loads into.
    """
    import torch

    from ..safetensors_io import release_mapped_pages

    # Shapes only: holding the skeleton's tensors here would keep them alive.
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    is_param = set(shapes)
    shapes.update({n: tuple(t.shape) for n, t in model.named_buffers(remove_duplicate=False) if n not in shapes})
    for module, layer in b.swaps.items():
        parent_name, _, child = module.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make_layer(module, layer))
        release_mapped_pages()  # the layer is copied: its pages of the checkpoint need not stay resident
    for tensor_name, names in b.loads.items():
        t = load_tensor(tensor_name)
        for name in names:
            if name in shapes and shapes[name] != tuple(t.shape):
                raise ModelError(
                    f"shape {list(t.shape)}, but {name} of the model is {list(shapes[name])}",
                    path=path,
                    tensor=tensor_name,
                )
        param = torch.nn.Parameter(t, requires_grad=False) if any(n in is_param for n in names) else None
        for name in names:
            _set_tensor(model, name, param if name in is_param else t)
        del t, param
        release_mapped_pages()
    promote_plain_linears(model)


def promote_plain_linears(model: Any) -> None:
    """Plain ``nn.Linear`` modules left in the model compute in the promoted dtype of their
    input and weight (:func:`~converter.model.modules.promoting_linear_forward`): their
    weights keep their own dtype, which plain ``F.linear`` would refuse to mix."""
    import torch

    from .modules import promoting_linear_forward

    for _, mod in model.named_modules():
        if type(mod) is torch.nn.Linear:
            mod.forward = types.MethodType(promoting_linear_forward, mod)


def layer_slot(size_k: int, size_n: int, has_bias: bool, tensors: set[str] | frozenset[str]) -> LayerSlot:
    return LayerSlot(size_k, size_n, has_bias, frozenset(tensors))

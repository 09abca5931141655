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

import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from . import ModelError
from .config import (
    check_depth,
    check_fields,
    config_dtype,
    construction_error,
    hf_config,
    import_stack,
    quiet_transformers,
)
from .guard import names as name_list
from .guard import short
from .names import Binding, LayerSlot, LinearSlot, tie_groups
from .skeleton import (
    CAUSAL_LM,
    ENCODER,
    MASKED_LM,
    OTHER,
    SKELETON_SLACK,
    ModelClass,
    check_skeleton,
    meta_weights,
    model_class,
    model_kind,
    weights_bytes,
)

# Re-exported: the loaders, the references and callers import these from here (defined in config and skeleton).
__all__ = [
    "CAUSAL_LM",
    "ENCODER",
    "MASKED_LM",
    "OTHER",
    "SKELETON_SLACK",
    "ModelClass",
    "apply_binding",
    "binding_errors",
    "check_depth",
    "check_fields",
    "check_skeleton",
    "config_dtype",
    "construction_error",
    "hf_config",
    "import_stack",
    "inventory",
    "layer_slot",
    "materialize_missing",
    "meta_weights",
    "model_class",
    "model_kind",
    "promote_plain_linears",
    "quiet_transformers",
    "weights_bytes",
]


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
                raise shape_error(tensor_name, tuple(t.shape), name, shapes[name], path=path)
        param = torch.nn.Parameter(t, requires_grad=False) if any(n in is_param for n in names) else None
        for name in names:
            _set_tensor(model, name, param if name in is_param else t)
        del t, param
        release_mapped_pages()
    promote_plain_linears(model)


def shape_error(
    tensor: str, shape: tuple[int, ...], name: str, model_shape: tuple[int, ...], *, path: Path
) -> ModelError:
    """The one line for an artifact tensor whose shape is not its model tensor's."""
    return ModelError(f"shape {list(shape)}, but {name} of the model is {list(model_shape)}", path=path, tensor=tensor)


def check_load_shapes(model: Any, b: Binding, infos: Mapping[str, Any], *, path: Path) -> None:
    """Every bound tensor's shape (its artifact header's) against the model's, before
    anything is loaded: ``from_pretrained`` would otherwise stop on transformers' own
    size-mismatch table and a ``RuntimeError``.

    Raises:
        ModelError: the first tensor whose shape differs (:func:`shape_error`).
    """
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    shapes.update({n: tuple(t.shape) for n, t in model.named_buffers(remove_duplicate=False) if n not in shapes})
    for tensor_name, names in b.loads.items():
        shape = tuple(infos[tensor_name].shape)
        for name in names:
            if name in shapes and shapes[name] != shape:
                raise shape_error(tensor_name, shape, name, shapes[name], path=path)


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

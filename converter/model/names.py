"""Which artifact layer feeds which module, and which tensor feeds which parameter.

Pure Python (no torch), so the rules are testable on their own. Tensor names in a
checkpoint and parameter names in the model built from its ``config.json`` need not
agree on the base-model prefix: the real all-MiniLM-L6-v2 stores ``bert.encoder.*``
(a ``BertForMaskedLM`` checkpoint) while its config says ``BertModel``, whose own names
are ``encoder.*``; a ``LlamaModel`` checkpoint loaded as ``LlamaForCausalLM`` lacks the
``model.`` prefix. A model name is therefore looked up as itself first, then with the
model's ``base_model_prefix`` added (or removed, when it starts with it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping


@dataclasses.dataclass(frozen=True)
class LinearSlot:
    """A linear module of the model: ``in_features`` (K), ``out_features`` (N), whether it has a bias."""

    in_features: int
    out_features: int
    has_bias: bool


@dataclasses.dataclass(frozen=True)
class LayerSlot:
    """A quantized layer of the checkpoint: ``size_k``, ``size_n``, whether it carries a bias,
    and every tensor name it owns (consumed by the swap, never loaded as a parameter)."""

    size_k: int
    size_n: int
    has_bias: bool
    tensors: frozenset[str]


@dataclasses.dataclass
class Binding:
    """The outcome of :func:`bind`.

    Attributes:
        swaps: ``{module name: layer name}``: linear modules replaced by the layer.
        loads: ``{checkpoint tensor name: [model names]}``: every model parameter or
            persistent buffer loaded from that tensor (several names: tied weights).
        aliases: ``[(model name, tensor name, other tensor name)]``: a tied group whose
            members resolve to different checkpoint tensors; the first one is loaded,
            the loader checks the other holds the same data.
        missing: model tensor names nothing feeds (a bias, a norm ...), canonical name
            of each tied group, plus ``<layer>.bias`` for a swapped layer without the
            bias its module has.
        unbound_modules: linear modules with neither a layer nor a weight tensor.
        unmatched_layers: checkpoint layers that no linear module matches.
        shape_errors: one message per swapped pair whose sizes disagree.
        unused: checkpoint tensors nothing uses (sorted).
    """

    swaps: dict[str, str] = dataclasses.field(default_factory=dict)
    loads: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    aliases: list[tuple[str, str, str]] = dataclasses.field(default_factory=list)
    missing: list[str] = dataclasses.field(default_factory=list)
    unbound_modules: list[str] = dataclasses.field(default_factory=list)
    unmatched_layers: list[str] = dataclasses.field(default_factory=list)
    shape_errors: list[str] = dataclasses.field(default_factory=list)
    unused: list[str] = dataclasses.field(default_factory=list)


def candidates(name: str, prefix: str) -> list[str]:
    """Checkpoint names to try for model name ``name``, in order.

    ``candidates("encoder.layer.0.x", "bert") == ["encoder.layer.0.x", "bert.encoder.layer.0.x"]``;
    ``candidates("model.norm.weight", "model") == ["model.norm.weight", "norm.weight"]``.
    """
    out = [name]
    if prefix:
        if name.startswith(prefix + "."):
            out.append(name[len(prefix) + 1 :])
        else:
            out.append(f"{prefix}.{name}")
    return out


def resolve(name: str, pool: Mapping[str, object] | set[str] | frozenset[str], prefix: str) -> str | None:
    """The first of :func:`candidates` present in ``pool``, or None."""
    for c in candidates(name, prefix):
        if c in pool:
            return c
    return None


def _module_of(tensor: str) -> str:
    return tensor.rsplit(".", 1)[0] if "." in tensor else ""


def bind(
    *,
    linears: Mapping[str, LinearSlot],
    model_tensors: Iterable[Iterable[str]],
    layers: Mapping[str, LayerSlot],
    tensors: Iterable[str],
    prefix: str,
) -> Binding:
    """Match a model's modules and parameters with a checkpoint's layers and tensors.

    Args:
        linears: the model's linear modules by name.
        model_tensors: the model's parameters and persistent buffers, as groups of names
            that share one storage (a tied embedding and head form one group; every
            other name is a group of one), in the model's order.
        layers: the checkpoint's quantized layers (converted, or passed through
            unconverted) by name.
        tensors: every tensor name of the checkpoint (layers' tensors included).
        prefix: the model's ``base_model_prefix`` ("" for none).

    Returns:
        The :class:`Binding`; nothing here raises, the caller decides which findings
        are errors.
    """
    out = Binding()
    all_tensors = set(tensors)
    claimed: set[str] = set()
    misfit: set[str] = set()  # modules whose layer has other sizes (reported once, as a shape error)
    for module, slot in linears.items():
        layer = resolve(module, layers, prefix)
        if layer is None or layer in claimed:
            continue
        claimed.add(layer)
        lay = layers[layer]
        if (lay.size_k, lay.size_n) != (slot.in_features, slot.out_features):
            out.shape_errors.append(
                f"layer {layer} is {lay.size_k} -> {lay.size_n} (K -> N), module {module} is "
                f"{slot.in_features} -> {slot.out_features}"
            )
            misfit.add(module)
            continue
        out.swaps[module] = layer
        if slot.has_bias and not lay.has_bias:
            out.missing.append(f"{layer}.bias")
    out.unmatched_layers = sorted(set(layers) - claimed)
    swapped_params = {f"{m}.{p}" for m in (*out.swaps, *misfit) for p in ("weight", "bias")}
    used = set().union(*(layers[lay].tensors for lay in out.swaps.values())) if out.swaps else set()
    plain = all_tensors - set().union(*(s.tensors for s in layers.values())) if layers else all_tensors
    for group in model_tensors:
        members = [n for n in group if n not in swapped_params]
        if not members:
            continue
        hits = [(m, resolve(m, plain, prefix)) for m in members]
        found = [(m, t) for m, t in hits if t is not None]
        if not found:
            others = [m for m in members if not (m.endswith(".weight") and _module_of(m) in linears)]
            if others:  # e.g. an embedding (with the head tied to it): name the embedding
                out.missing.append(others[0])
            else:
                out.unbound_modules.extend(_module_of(m) for m in members)
            continue
        first_model, first_tensor = found[0]
        out.loads.setdefault(first_tensor, []).extend(members)
        used.add(first_tensor)
        for m, t in found[1:]:
            if t != first_tensor:
                out.aliases.append((m, first_tensor, t))
                used.add(t)
    out.unused = sorted(all_tensors - used)
    return out


def untie(b: Binding, same: Callable[[str, str], bool]) -> list[str]:
    """Load tied names separately where their checkpoint tensors differ, as
    transformers' ``from_pretrained`` does (it ties only identical tensors).

    Args:
        b: the binding; its ``loads`` are edited in place.
        same: ``same(tensor a, tensor b)``: equal dtype, shape and bytes.

    Returns:
        One warning per untied name.
    """
    out = []
    for model_name, first, other in b.aliases:
        if same(first, other):
            continue
        b.loads[first].remove(model_name)
        b.loads.setdefault(other, []).append(model_name)
        out.append(
            f"{model_name} is tied to {b.loads[first][0]} by the config, but the checkpoint's {other} differs from "
            f"{first}: loaded untied, as transformers does"
        )
    return out


def missing_names(groups: Iterable[Iterable[str]], missing: Iterable[str]) -> set[str]:
    """Every model name (tied aliases included) of the groups a missing name belongs to."""
    miss = set(missing)
    return {n for g in groups for n in g if miss.intersection(g)}


def tie_groups(groups: list[list[str]], ties: Mapping[str, str]) -> list[list[str]]:
    """``groups`` with the groups of each tie's target and source merged (where the first
    of them was), for a skeleton whose ties are not made yet.

    ``tie_groups([["embed.w"], ["norm.w"], ["head.w"]], {"head.w": "embed.w"}) ==
    [["embed.w", "head.w"], ["norm.w"]]``; a tie naming something not in ``groups`` is ignored.
    """
    if not ties:
        return groups
    where = {n: i for i, g in enumerate(groups) for n in g}
    parent = list(range(len(groups)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for target, source in ties.items():
        if target in where and source in where:
            a, b = root(where[source]), root(where[target])
            if a != b:
                parent[max(a, b)] = min(a, b)
    merged: dict[int, list[str]] = {}
    for i, g in enumerate(groups):
        merged.setdefault(root(i), []).extend(g)
    return list(merged.values())

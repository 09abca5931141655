"""Sibling projections that read one input, run as one GEMM on the GPU.

At decode a small GEMM costs more in launch and ramp-up than in bytes, and a Llama block
calls three of them (``q_proj``, ``k_proj``, ``v_proj``) on one tensor, then two more
(``gate_proj``, ``up_proj``) on another. Marlin's ``B``, its permuted scales and the
delta are laid out in blocks of 64 columns that do not mix, so the column-wise
concatenation of converted layers is the converted concatenation: one kernel streams all
of them and each sibling returns its columns of the one result
(``docs/serving.md``, "Fused siblings").

A group fuses only where the result cannot change in meaning: every member converted and
inside the kernel's limits, one ``K``, one group size, no act-order (each layer has its
own ``perm``), no padded columns, and a bias on all or on none. The siblings share the
result through their group (:class:`~converter.model.modules.FusedKernel`): the first
sibling called with a tensor runs the kernel, the others called with that same tensor
take their columns, and a call with any other tensor runs the kernel again, so a model
that calls the siblings on different inputs (cross-attention) is still right.

``MARLIN_FUSE=0`` (or ``load_model(..., fuse=False)``) loads every layer on its own.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

#: Child modules, under one parent, that the model calls on one tensor.
SIBLINGS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("query", "key", "value"),
)

#: The environment switch: ``"0"`` turns fusion off for every load.
ENV = "MARLIN_FUSE"


@dataclasses.dataclass(frozen=True)
class FusedGroup:
    """Sibling layers run as one kernel.

    Attributes:
        name: the parent module and the members (``model.layers.0.self_attn.q_proj+k_proj+v_proj``).
        modules: the members' model module names, in column order.
        layers: their artifact layer names, in the same order.
    """

    name: str
    modules: tuple[str, ...]
    layers: tuple[str, ...]


def enabled(fuse: bool | None) -> bool:
    """``fuse`` if given, else the environment's ``MARLIN_FUSE`` (default on)."""
    return os.environ.get(ENV, "1") != "0" if fuse is None else bool(fuse)


def fusable(recs: list[Any]) -> bool:
    """Whether artifact layer records ``recs`` can share one kernel without changing a result."""
    from ..marlin.shapes import kernel_compatible

    first = recs[0]
    return all(
        r.size_k == first.size_k
        and r.group_size == first.group_size
        and r.has_bias == first.has_bias
        and not r.act_order
        and r.layout_n == r.size_n
        and kernel_compatible(r.size_k, r.size_n, r.group_size)
        for r in recs
    )


def plan_fusion(swaps: Mapping[str, str], records: Mapping[str, Any]) -> dict[str, FusedGroup]:
    """``{model module: its group}`` for every module of ``swaps`` (``{module: layer}``)
    that fuses with its siblings; ``records`` are the artifact's layer records (a layer
    not among them passed through unconverted and never fuses)."""
    by_parent: dict[str, dict[str, str]] = {}
    for module, layer in swaps.items():
        parent, _, child = module.rpartition(".")
        by_parent.setdefault(parent, {})[child] = layer
    groups: dict[str, FusedGroup] = {}
    for parent, children in by_parent.items():
        for names in SIBLINGS:
            layers = [children.get(n) for n in names]
            if any(lay not in records for lay in layers) or not fusable([records[lay] for lay in layers]):
                continue
            modules = tuple(f"{parent}.{n}" if parent else n for n in names)
            group = FusedGroup(f"{modules[0]}+{'+'.join(names[1:])}", modules, tuple(layers))  # type: ignore[arg-type]
            groups.update(dict.fromkeys(modules, group))
    return groups

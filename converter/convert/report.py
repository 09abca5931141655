"""What a conversion reports: :class:`ConvertReport`, its :class:`NotConverted` layers,
and the type of the progress callback it is given."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..artifact.schema import LayerEntry, Passthrough

Progress = Callable[[str, int], None]


@dataclasses.dataclass(frozen=True)
class NotConverted:
    """A quantized layer that passes through: its name, why (the shape or format rule
    with the numbers), and its tensors (bias included), each listed in ``passthrough``."""

    name: str
    reason: str
    tensors: tuple[str, ...]


@dataclasses.dataclass
class ConvertReport:
    """What a conversion did (or, for a dry run, would do).

    Attributes:
        source: input path; output: artifact path (planned, for a dry run).
        source_format: detected format.
        converted: manifest records of the converted layers (``source_group_size`` set on a
            regrouped layer, ``padded_n`` on a padded one).
        passthrough: every carried-over tensor, with its reason.
        not_converted: the quantized layers among them.
        tensors: ``[(name, dtype, shape)]`` of the artifact.
        bytes_out: size of the tensor data written (or planned).
        dry_run: True when nothing was written.
        files: ``[{"name", "bytes"}]`` of every file written (or planned): the shards,
            folder mode's extra files, the index last.
        warnings: findings about the conversion as a whole.
    """

    source: str
    output: str | None
    source_format: str
    converted: list[LayerEntry]
    passthrough: list[Passthrough]
    tensors: list[tuple[str, str, tuple[int, ...]]]
    bytes_out: int
    dry_run: bool
    not_converted: list[NotConverted] = dataclasses.field(default_factory=list)
    files: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        # asdict would first deep-copy the per-tensor lists, replaced just below.
        d = dataclasses.asdict(dataclasses.replace(self, converted=[], passthrough=[], tensors=[], not_converted=[]))
        d["converted"] = [lay.to_json() for lay in self.converted]
        d["passthrough"] = [p.to_json() for p in self.passthrough]
        d["not_converted"] = [
            {"name": s.name, "reason": s.reason, "tensors": list(s.tensors)} for s in self.not_converted
        ]
        d["tensors"] = [{"name": n, "dtype": t, "shape": list(s)} for n, t, s in self.tensors]
        d["ok"] = True
        return d

"""What every source reader provides: a plan from metadata, then data on demand.

A reader is two-phase so conversion can stream: :meth:`Source.plan` looks only at
headers, configs and the small per-layer tensors (zeros, ``g_idx``), and decides
what converts and what passes through; :meth:`Source.load_layer` and
:meth:`Source.load_tensor` then read one layer or tensor at a time.
"""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import Any

from ..constants import SourceFormat, ZeroConvention
from ..quant_weight import QuantWeight, Tensor, TensorInfo  # noqa: F401 (re-exported)


@dataclasses.dataclass
class LayerPlan:
    """One quantized linear layer as planned from metadata and small tensors.

    Attributes:
        name: layer prefix (the source's module or linear name).
        size_k, size_n: in- and out-features.
        group_size: rows per group; ``size_k`` for per-channel.
        bits: source bit width.
        zero_convention: how the source stores the offset.
        symmetric: derived from the data (all zeros at the symmetric point), not flags.
        act_order: a non-trivial ``g_idx``: the artifact gets ``marlin_perm``.
        source_tensors: the source tensors this layer owns, except the bias.
        bias: the bias tensor's info, or None.
        convertible: False means its ``source_tensors`` pass through unchanged.
        reason: why it does not convert ("" when it does).
        warnings: data-versus-config findings worth telling the user.
        extra: format-specific facts for the manifest (JSON-serialisable).
    """

    name: str
    size_k: int
    size_n: int
    group_size: int
    bits: int
    zero_convention: ZeroConvention
    symmetric: bool
    act_order: bool
    source_tensors: tuple[str, ...]
    bias: TensorInfo | None = None
    convertible: bool = True
    reason: str = ""
    warnings: list[str] = dataclasses.field(default_factory=list)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def num_groups(self) -> int:
        return self.size_k // self.group_size


@dataclasses.dataclass
class SourcePlan:
    """Everything a conversion will do, decided before any large read.

    Attributes:
        layers: quantized linears, convertible or not.
        tensors: plain tensors that no layer owns, carried over unchanged.
        passthrough_reasons: ``{tensor name: reason}`` for carried-over tensors with a
            reason of their own: those of a layer that did not convert, and side
            channels in ``tensors`` (``.tinyloop`` ``frac4``); others get a default.
    """

    layers: list[LayerPlan]
    tensors: list[TensorInfo]
    passthrough_reasons: dict[str, str] = dataclasses.field(default_factory=dict)


class Source(abc.ABC):
    """A readable checkpoint.  Subclasses live one per format in ``formats/``."""

    format: SourceFormat
    path: Path

    @abc.abstractmethod
    def describe(self) -> dict[str, Any]:
        """The manifest's ``source`` object: format, files (name, bytes, sha256), quant config."""

    @abc.abstractmethod
    def plan(self) -> SourcePlan:
        """Read metadata and small tensors; raise on malformed input, never on large reads."""

    @abc.abstractmethod
    def load_layer(self, layer: LayerPlan, k_start: int = 0, k_stop: int | None = None) -> QuantWeight:
        """Read one convertible layer, optionally only Marlin rows ``[k_start, k_stop)``.

        ``k_start`` and ``k_stop`` are multiples of ``group_size`` (or of 16 for a
        per-channel layer).  The returned ``QuantWeight`` holds just those rows and the
        groups they cover, with ``k_offset = k_start``.
        """

    @abc.abstractmethod
    def load_tensor(self, name: str) -> Tensor:
        """Read one source tensor as stored."""

    def input_files(self) -> list[Path]:
        """Every file this reader reads, or folder mode copies; no output may touch them."""
        return [self.path]

    @property
    def checkpoint_folder(self) -> Path | None:
        """The folder a later read of this input would glob for weights (HF checkpoints);
        None for a single-file format. No output may be written into it."""
        return None

    def release_pages(self) -> None:  # noqa: B027 - optional hook
        """Drop input pages this reader touched from RSS (called per chunk while streaming).

        Safetensors inputs are covered by
        :func:`converter.safetensors_io.release_mapped_pages`; readers with maps of
        their own override this.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release file handles and maps."""

    def __enter__(self) -> Source:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

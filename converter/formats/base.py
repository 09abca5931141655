"""What every source reader provides: a plan from metadata, then data on demand.

A reader is two-phase so conversion can stream: :meth:`Source.plan` looks only at
headers, configs and the small per-layer tensors (zeros, ``g_idx``), and decides
what converts and what passes through; :meth:`Source.load_layer` and
:meth:`Source.load_tensor` then read one layer or tensor at a time.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ..constants import SourceFormat, ZeroConvention
from ..marlin.shapes import LayerFit, fit_layer, regroup_rows
from ..quant_weight import QuantWeight, Tensor, TensorInfo

if TYPE_CHECKING:
    from ..safetensors_io import SafetensorsFile


@dataclasses.dataclass
class LayerPlan:
    """One quantized linear layer as planned from metadata and small tensors.

    Attributes:
        name: layer prefix (the source's module or linear name).
        size_k, size_n: in- and out-features (``size_n`` the true N, padded or not).
        group_size: rows per group of the artifact, and of the :class:`QuantWeight`
            :meth:`Source.load_layer` returns; ``size_k`` for per-channel.
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
        source_group_size: the source's group size when the layer is regrouped (its
            last group is short; :func:`~converter.marlin.shapes.fit_layer`), else None.
        padded_n: the layout's N when N is padded to a multiple of 64, else None.
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
    source_group_size: int | None = None
    padded_n: int | None = None

    @property
    def num_groups(self) -> int:
        return self.size_k // self.group_size

    @property
    def source_groups(self) -> tuple[int, int]:
        """``(group size, number of groups)`` as the source stores them: ``ceil(K / g)``
        groups, the last one short when the layer is regrouped."""
        gs = self.source_group_size or self.group_size
        return gs, -(-self.size_k // gs)

    @property
    def layout_n(self) -> int:
        """Columns of the artifact's ``B``, scales and ``delta``: ``padded_n``, else ``size_n``."""
        return self.size_n if self.padded_n is None else self.padded_n

    def fit(self, pad: bool) -> bool:
        """Apply :func:`~converter.marlin.shapes.fit_layer` to this layer, planned at its
        source's group size: set ``group_size``, ``source_group_size`` and ``padded_n``,
        or ``convertible = False`` with the reason.  Returns whether it converts."""
        fit: LayerFit = fit_layer(self.size_k, self.size_n, self.group_size, pad=pad)
        if not fit.ok:
            self.convertible, self.reason = False, fit.reason
            return False
        self.group_size, self.source_group_size, self.padded_n = fit.group_size, fit.source_group_size, fit.padded_n
        return True

    def source_group_rows(self, k_start: int, k_stop: int) -> np.ndarray | None:
        """For a regrouped layer, the source group (counted from ``k_start``'s) of each
        artifact group of rows ``[k_start, k_stop)``: the rows that turn the chunk's
        source scales and zeros into the artifact's; None when not regrouped."""
        if self.source_group_size is None:
            return None
        return np.asarray(regroup_rows(k_start, k_stop, self.group_size, self.source_group_size), dtype=np.intp)


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
    """A readable checkpoint.  Subclasses live one per format in ``formats/``.

    A reader registers itself when its class is defined, by naming its format and the
    zero conventions it produces in the class statement::

        class TinyloopSource(Source, format=SourceFormat.TINYLOOP,
                             conventions=(ZeroConvention.TINYLOOP_ADDITIVE,)): ...

    :data:`READERS` (and what ``converter.formats`` derives from it: the HF quant
    methods, the conventions each format may record) is that registry; a test checks
    it against the enums and the artifact schema.  A class without ``format`` (a base
    such as ``HFSource``) registers nothing.
    """

    format: ClassVar[SourceFormat]
    #: The ``zero_convention`` values this reader records in the manifest.
    zero_conventions: ClassVar[tuple[ZeroConvention, ...]]
    #: What a quantized layer of this format has, as "no quantized layers" names it.
    layer_anchor: ClassVar[str] = "quantized layer"
    path: Path

    def __init_subclass__(
        cls, *, format: SourceFormat | None = None, conventions: tuple[ZeroConvention, ...] = (), **kwargs: Any
    ) -> None:
        super().__init_subclass__(**kwargs)
        if format is None:
            return
        if not conventions:
            raise TypeError(f"{cls.__name__}: a reader must name the zero conventions it produces")
        if format in READERS:
            raise TypeError(f"{cls.__name__}: format {format.value!r} is already read by {READERS[format].__name__}")
        cls.format = format
        cls.zero_conventions = tuple(conventions)
        READERS[format] = cls

    @classmethod
    def claims(cls, path: Path) -> bool:
        """Whether ``path``, a single file, is in this reader's own container format
        (``.tinyloop``); HF checkpoints are claimed by their quant config instead."""
        return False

    @abc.abstractmethod
    def describe(self, *, digests: bool | Mapping[Path, str] = True) -> dict[str, Any]:
        """The manifest's ``source`` object: format, files (name, bytes, sha256), quant config.

        Args:
            digests: True hashes the files here; False gives placeholder sha256 values of
                the same length without reading them (the output's size is known before
                the input is hashed); a mapping gives the sha256 of every file of
                :meth:`digest_files`, computed elsewhere
                (:class:`converter.digests.FileDigests`, on a thread of its own).
        """

    def digest_files(self) -> list[Path]:
        """The files whose sha256 :meth:`describe` records, in its order."""
        return [self.path]

    @abc.abstractmethod
    def plan(self, *, pad: bool = True) -> SourcePlan:
        """Read metadata and small tensors; raise on malformed input, never on large reads.

        Each layer's shape decision is :meth:`LayerPlan.fit`: with ``pad`` an ``N % 64
        != 0`` layer converts padded (``padded_n``), without it it passes through.
        """

    @abc.abstractmethod
    def load_layer(self, layer: LayerPlan, k_start: int = 0, k_stop: int | None = None) -> QuantWeight:
        """Read one convertible layer, optionally only Marlin rows ``[k_start, k_stop)``.

        ``k_start`` is a multiple of the source's group size (``LayerPlan.source_groups``;
        of 16 for a per-channel layer) and ``k_stop`` one too, or ``size_k``.  The
        returned ``QuantWeight`` holds just those rows and the groups they cover, at
        the artifact's ``group_size`` (a regrouped layer's source scales and zeros
        repeated per slice), ``size_n`` columns (padding is the converter's), with
        ``k_offset = k_start``.
        """

    def load_packed(
        self, layer: LayerPlan, k_start: int = 0, k_stop: int | None = None
    ) -> tuple[np.ndarray, QuantWeight] | None:
        """Optional conversion fast path: Marlin ``B`` (int32 ``(rows // 16, 2N)``) for
        rows ``[k_start, k_stop)`` made straight from the source's packed words, and
        the chunk's :class:`QuantWeight` with an empty ``q`` (scales, delta, bias, perm).

        Returns None where the reader has none (the default) or it does not apply to
        this layer; the converter then packs ``load_layer(...).marlin_codes()``, which
        must give the same bits.
        """
        return None

    def load_words(
        self, layer: LayerPlan, k_start: int = 0, k_stop: int | None = None
    ) -> tuple[np.ndarray, QuantWeight] | None:
        """Optional verification fast path: the source's packed 4-bit code words for
        rows ``[k_start, k_stop)`` (int32 ``(rows // 8, N)``, each word holding 8
        consecutive rows of one column, lowest nibble first, as
        :func:`~converter.formats.packing.unpack_words` reads them with ``axis=0``), and
        the chunk's :class:`QuantWeight` with an empty ``q``.

        Returns None where the reader has none (the default) or it does not apply to the
        layer (not 4-bit, act-order, padded); ``marlin-verify`` then compares
        ``load_layer(...).marlin_codes()``.  Where it applies, the words' codes are
        exactly ``load_layer(...).marlin_codes()``.
        """
        return None

    def stored_bytes(self, name: str) -> tuple[SafetensorsFile, int, int] | None:
        """Optional conversion fast path for a pass-through tensor: the safetensors file
        that stores its bytes exactly as :meth:`load_tensor` returns them, and their
        ``[begin, end)`` file offsets, so that the converter can copy them file to file
        (``copy_file_range``).  None (the default) where the reader has no such file."""
        return None

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


#: Every reader, by the format it reads, in definition order (see :class:`Source`).
READERS: dict[SourceFormat, type[Source]] = {}

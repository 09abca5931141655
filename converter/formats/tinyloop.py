"""Reader for ``.tinyloop`` v1 containers (``docs/spec/tinyloop-v1.md``).

The whole container is validated when the file is opened, from the preamble and the
JSON header alone: every offset, shape and size is checked against the file's real
length before any tensor byte is read or anything sized by the file is allocated.  :meth:`TinyloopSource.plan` then
reads the small per-layer tensors (``scale``, ``zero``) to check their values and to
derive ``symmetric`` from the data; :meth:`TinyloopSource.load_layer` and
:meth:`TinyloopSource.load_tensor` read one layer or tensor at a time from a
read-only memory map.

Every problem with the bytes of the file is reported as a
:class:`~converter.errors.SourceFormatError` (or
:class:`~converter.errors.UnsupportedQuantError` for a well-formed layer whose bit
width we do not convert) naming the file, the tensor or field, and the rule with the
expected and found values.  No other exception type escapes for any byte content.

One limit of the implementation, not of the spec: tensors have at most
:data:`MAX_NDIM` dimensions.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import stat
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from .. import jsonio
from ..constants import (
    MARLIN_ZERO,
    TINYLOOP_ALIGNMENT,
    TINYLOOP_DTYPES,
    TINYLOOP_EXTRA_CHANNELS,
    TINYLOOP_MAGIC,
    TINYLOOP_MAX_HEADER_BYTES,
    TINYLOOP_PREAMBLE_FORMAT,
    TINYLOOP_PREAMBLE_SIZE,
    TINYLOOP_SUPPORTED_BITS,
    TINYLOOP_SUPPORTED_VERSIONS,
    SourceFormat,
    ZeroConvention,
)
from ..digests import PLACEHOLDER, sha256_files
from ..errors import ConverterError, SourceFormatError, UnsupportedQuantError
from ..jsonio import JsonRule, json_type
from ..quant_weight import QuantWeight, Tensor, marlin_code_offset
from ..safetensors_io import drop_pages, register_map_owner
from .base import LayerPlan, Source, SourcePlan, TensorInfo
from .scales import FP16_RANGE_REASON, kernel_range_error

__all__ = ["CHANNEL_REASONS", "EXACT_INT4_REASON", "MAX_NDIM", "TinyloopSource", "sniff", "unpack_codes"]

#: Implementation limit on tensor rank (numpy's own limit is 32 or 64 by version).
MAX_NDIM = 32
#: Reason recorded for a layer flagged ``exact_int4`` (spec, "Header", LINEAR table).
EXACT_INT4_REASON = "exact_int4: stays on TinyLoop's exact integer path"
#: Reason recorded for each extra channel of a converted layer, keyed by channel.
CHANNEL_REASONS = {
    ch: f"{ch}: TinyLoop stochastic-rounding channel; Marlin ignores it" for ch in TINYLOOP_EXTRA_CHANNELS
}
_MiB = 1024 * 1024
_LINEAR_INT_FIELDS = ("bits", "in_features", "out_features", "group_size")
_LINEAR_REQUIRED_TENSORS = ("qweight", "scale", "zero")


def sniff(path: str | Path) -> bool:
    """Whether ``path`` starts with the ``.tinyloop`` magic (spec, "Byte layout").

    Args:
        path: any path.

    Returns:
        True when the first 8 bytes are ``b"TINYLOOP"``; False otherwise, including
        when the path cannot be read (the caller reports that with its own error).
    """
    try:
        # O_NONBLOCK and regular files only: opening or reading a FIFO would wait forever.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.pread(fd, len(TINYLOOP_MAGIC), 0) == TINYLOOP_MAGIC
    except OSError:
        return False
    finally:
        os.close(fd)


def unpack_codes(packed: np.ndarray, bits: int, k_start: int, k_stop: int) -> np.ndarray:
    """Unpack ``.tinyloop`` codes for input rows ``[k_start, k_stop)``, transposed.

    The bit order is the spec's ("Codes and weights"): for 4 bits, row ``k`` is in
    byte ``k // 2``, bits 0-3 for even ``k`` and 4-7 for odd ``k``; for 2 bits, byte
    ``k // 4``, bits ``2*(k % 4)`` and ``2*(k % 4) + 1``.

    Args:
        packed: uint8 ``(N, nb)``: columns ``[k_start * bits // 8, ...)`` of the
            ``qweight`` tensor ``(N, K * bits / 8)``, i.e. starting at the byte that
            holds row ``k_start`` and covering at least row ``k_stop - 1``.
        bits: 2 or 4.
        k_start, k_stop: the rows wanted, ``0 <= k_start <= k_stop``.

    Returns:
        uint8 ``(k_stop - k_start, N)`` codes in ``[0, 2**bits - 1]``, C-contiguous,
        in the ``[K, N]`` orientation of :class:`~converter.quant_weight.QuantWeight`.
    """
    per_byte = 8 // bits
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits).astype(np.uint8)
    mask = np.uint8((1 << bits) - 1)
    n = packed.shape[0]
    codes = (packed[:, :, None] >> shifts) & mask  # (N, nb, per_byte): k = per_byte*byte + slot
    codes = codes.reshape(n, -1)
    first = k_start - (k_start * bits // 8) * per_byte
    return np.ascontiguousarray(codes[:, first : first + (k_stop - k_start)].T)


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One validated row of the tensor table (spec, "Byte layout" and "Header")."""

    name: str
    dtype: str  # .tinyloop code: "u8", "f16", ...
    shape: tuple[int, ...]
    offset: int  # relative to data_start
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclasses.dataclass(frozen=True)
class _Linear:
    """One validated LINEAR entry (spec, "Header", LINEAR table)."""

    name: str
    bits: int
    size_k: int
    size_n: int
    group_size: int
    qweight: str
    scale: str
    zero: str
    bias: str | None
    exact_int4: bool
    channels: dict[str, str]  # extra channel key -> tensor name

    def tensors(self) -> tuple[str, ...]:
        core = (self.qweight, self.scale, self.zero) + ((self.bias,) if self.bias else ())
        return core + tuple(self.channels.values())


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _is_int(x: object) -> bool:
    # JSON true/false arrive as bool, a subclass of int: never a valid size.
    return type(x) is int


def _capped_numel(shape: tuple[int, ...], cap: int) -> int | None:
    """``prod(shape)``, or None as soon as it exceeds ``cap``, so a hostile shape never
    builds a huge integer (all dimensions are already known to be ints >= 0)."""
    if 0 in shape:
        return 0
    n = 1
    for d in shape:
        n *= d
        if n > cap:
            return None
    return n


class TinyloopSource(Source, format=SourceFormat.TINYLOOP, conventions=(ZeroConvention.TINYLOOP_ADDITIVE,)):
    """A ``.tinyloop`` v1 file, validated on open and read through a read-only mmap.

    Args:
        path: the ``.tinyloop`` file.

    Raises:
        SourceFormatError: the file cannot be opened, or breaks any container, header
            or tensor-table rule of the spec; the message names the file, the tensor
            or field, and the rule with expected and found values.
        UnsupportedQuantError: a linear uses a bit width other than 2 or 4.
    """

    layer_anchor = "entry in its header's linears"

    @classmethod
    def claims(cls, path: Path) -> bool:
        """A ``.tinyloop`` name, or the magic (:func:`sniff`)."""
        return path.suffix == ".tinyloop" or sniff(path)

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._mm: mmap.mmap | None = None
        try:
            # A FIFO or device would block or lie about its length: regular files only.
            if not stat.S_ISREG(os.stat(self.path).st_mode):
                self._fail("not a regular file")
            with open(self.path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                self._size = size
                self._check_size(size)
                self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:
            self._fail(f"cannot open for reading: {exc.strerror or exc}")
        except (ValueError, OverflowError) as exc:  # mmap of an odd file (pipe, device)
            self._fail(f"cannot memory-map: {exc}")
        register_map_owner(self)
        try:
            header_len = self._read_preamble()
            self._header = self._read_header(header_len)
            self._data_start = _round_up(TINYLOOP_PREAMBLE_SIZE + header_len, TINYLOOP_ALIGNMENT)
            self._check_header_padding(header_len)
            self._model = self._parse_model()
            self._entries = self._parse_tensor_table()
            self._linears = self._parse_linears()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ public API

    def describe(self, *, digests: bool | Mapping[Path, str] = True) -> dict[str, Any]:
        """The manifest's ``source`` object.

        Args:
            digests: True hashes the file here (:func:`~converter.digests.sha256_files`); False gives
                a placeholder of 64 zeros; a mapping ``{path: sha256}`` computed elsewhere.

        Returns:
            ``{"format": "tinyloop", "files": [{"name": basename, "bytes": int,
            "sha256": hex}], "quant_config": {"model": header["model"]}}``.

        Raises:
            SourceFormatError: its name is not UTF-8.
            ConverterError: the file can no longer be read for its sha256.
        """
        if isinstance(digests, Mapping):
            sha = digests[self.path]
        elif digests:
            sha = sha256_files([self.path])[self.path]
        else:
            sha = PLACEHOLDER
        try:
            self.path.name.encode("utf-8")
        except UnicodeEncodeError:
            self._fail(f"file name {ascii(self.path.name)} is not valid UTF-8, so the manifest cannot record it")
        return {
            "format": SourceFormat.TINYLOOP.value,
            "files": [{"name": self.path.name, "bytes": self._size, "sha256": sha}],
            "quant_config": {"model": self._model},
        }

    def plan(self, *, pad: bool = True) -> SourcePlan:
        """Plan every linear and plain tensor; reads only the ``scale``/``zero`` tensors.

        A linear converts when it is not ``exact_int4`` and :meth:`LayerPlan.fit`
        accepts ``(K, N, group_size)`` (with ``pad``, an ``N % 64`` layer such as a
        50257-vocabulary head converts padded; the spec's group size always divides
        K, so no layer is regrouped).  Its ``frac4`` /
        ``sign_bit`` channels are not part of the converted layer: they go to
        ``SourcePlan.tensors`` and are carried over unchanged, with their reason in
        ``passthrough_reasons``.  A linear that does not convert keeps all its tensors
        (channels included) in ``LayerPlan.source_tensors``, and each of them (bias
        included) gets ``"layer <name> not converted: <reason>"`` in
        ``passthrough_reasons``.  As for every reader, ``source_tensors`` leaves out the
        bias, which is ``LayerPlan.bias``.  ``symmetric`` is derived from the data:
        ``delta = zero + 8 * scale`` (spec, "Relation to Marlin") is 0 everywhere.

        Returns:
            :class:`SourcePlan` with layers in header order.

        Raises:
            SourceFormatError: NaN or Inf in a ``scale`` or ``zero`` tensor (names the
                tensor and the first bad ``[group, column]``).
        """
        layers: list[LayerPlan] = []
        reasons: dict[str, str] = {}
        channel_infos: list[TensorInfo] = []
        for lin in self._linears.values():
            scale = self._checked_finite(lin.scale)
            zero = self._checked_finite(lin.zero)
            # The artifact's delta: codes are stored centred on 8, so it is
            # zero + 2^(bits-1) * scale (quant_weight.marlin_code_offset).
            delta = zero.astype(np.float32) + np.float32(1 << (lin.bits - 1)) * scale.astype(np.float32)
            # As in every reader, source_tensors leaves the bias out: it is LayerPlan.bias.
            layer = LayerPlan(
                name=lin.name,
                size_k=lin.size_k,
                size_n=lin.size_n,
                group_size=lin.group_size,
                bits=lin.bits,
                zero_convention=ZeroConvention.TINYLOOP_ADDITIVE,
                symmetric=not bool(np.any(delta)),
                act_order=False,
                source_tensors=(lin.qweight, lin.scale, lin.zero),
                bias=self._info(lin.bias) if lin.bias else None,
                extra={"exact_int4": lin.exact_int4, "channels": dict(lin.channels)},
            )
            if lin.exact_int4:
                layer.convertible, layer.reason = False, EXACT_INT4_REASON
            if layer.convertible and layer.fit(pad):
                why = kernel_range_error(np.asarray(scale), delta, marlin_code_offset(lin.bits), lin.bits)
                if why:  # this layer alone passes through, with the reason; the rest converts
                    layer.convertible, layer.reason = False, f"{FP16_RANGE_REASON}: {why}"
            if layer.convertible:
                for ch, tname in lin.channels.items():
                    reasons[tname] = CHANNEL_REASONS[ch]
                    channel_infos.append(self._info(tname))
            else:
                layer.source_tensors += tuple(lin.channels.values())
                for tname in lin.tensors():
                    reasons[tname] = f"layer {lin.name} not converted: {layer.reason}"
            layers.append(layer)
        owned = {t for lin in self._linears.values() for t in lin.tensors()}
        plain = [self._info(name) for name in self._entries if name not in owned]
        return SourcePlan(layers=layers, tensors=plain + channel_infos, passthrough_reasons=reasons)

    def load_layer(self, layer: LayerPlan, k_start: int = 0, k_stop: int | None = None) -> QuantWeight:
        """Read one linear's input rows ``[k_start, k_stop)`` as a :class:`QuantWeight`.

        Reads only the ``qweight`` bytes that hold those rows and the scale/zero groups
        they cover.  Layers that do not convert (``exact_int4``, odd shapes) load too.

        Args:
            layer: a plan entry of this source (only ``layer.name`` is used).
            k_start: first row; a multiple of ``group_size`` unless the layer is
                per-channel (``group_size == K``).
            k_stop: one past the last row, ``<= K``; None means ``K``.

        Returns:
            ``q`` uint8 ``(rows, N)`` (unpacked and transposed from ``qweight``
            ``[N, K*bits/8]``); ``scales`` float16 ``(groups, N)`` = ``scale`` as
            stored; ``zeros`` float16 = ``zero`` as stored; ``delta`` float32 =
            ``zero + 8 * scale`` in float32 (spec, "Relation to Marlin");
            ``zero_convention`` ``TINYLOOP_ADDITIVE``; ``bias`` float16 ``(N,)``
            or None; ``k_offset = k_start``; ``size_k = K``.

        Raises:
            ConverterError: ``layer.name`` is not a linear of this file, or the row
                range is out of bounds or not on a group boundary.
            SourceFormatError: NaN or Inf in the scale or zero groups read.
        """
        lin = self._linears.get(layer.name)
        if lin is None:
            raise ConverterError(f"no linear named {layer.name!r} in this file", path=self.path, tensor=layer.name)
        size_k, group = lin.size_k, lin.group_size
        k_stop = size_k if k_stop is None else k_stop
        if not (_is_int(k_start) and _is_int(k_stop) and 0 <= k_start < k_stop <= size_k):
            raise ConverterError(
                f"row range [{k_start}, {k_stop}) is not inside [0, {size_k})", path=self.path, tensor=lin.name
            )
        if group != size_k and k_start % group:
            raise ConverterError(
                f"k_start = {k_start} is not a multiple of group_size = {group}", path=self.path, tensor=lin.name
            )
        b0 = k_start * lin.bits // 8
        b1 = _round_up(k_stop * lin.bits, 8) // 8
        qweight = self._view(lin.qweight)
        q = unpack_codes(qweight[:, b0:b1], lin.bits, k_start, k_stop)
        g0, g1 = k_start // group, _round_up(k_stop, group) // group
        scale = self._checked_finite(lin.scale, g0, g1)
        zero = self._checked_finite(lin.zero, g0, g1)
        bias = self.load_tensor(lin.bias) if lin.bias else None
        return QuantWeight(
            name=lin.name,
            q=q,
            scales=np.array(scale, dtype=np.float16),
            zeros=np.array(zero, dtype=np.float16),
            delta=self._delta(scale, zero),
            group_size=group,
            bits=lin.bits,
            zero_convention=ZeroConvention.TINYLOOP_ADDITIVE,
            bias=bias,
            k_offset=k_start,
            size_k=size_k,
            source_scales_dtype="F16",
        )

    def load_tensor(self, name: str) -> Tensor:
        """Read one tensor as stored.

        Args:
            name: a tensor-table name.

        Returns:
            :class:`~converter.quant_weight.Tensor` with the safetensors dtype code
            (``TINYLOOP_DTYPES``), the shape, and a read-only view of the memory map in
            the storage dtype (bf16 as raw ``uint16``).

        Raises:
            ConverterError: no tensor of that name.
        """
        if name not in self._entries:
            raise ConverterError("no tensor of this name in the file", path=self.path, tensor=name)
        e = self._entries[name]
        return Tensor(name=name, dtype=TINYLOOP_DTYPES[e.dtype][1], shape=e.shape, data=self._view(name))

    def release_pages(self) -> None:
        """Drop the pages of the file this reader touched from RSS (see ``drop_pages``)."""
        drop_pages(self._mm)

    def shrunk_path(self) -> Path | None:
        """The file, if it is now shorter than when it was mapped (see :mod:`converter.faults`)."""
        try:
            return self.path if self._mm is not None and self._mm.size() < self._size else None
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        """Drop the memory map.  Views handed out earlier keep it alive until freed."""
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # arrays still export the buffer; the map goes when they do

    # ------------------------------------------------------------------ helpers

    def _fail(self, rule: str, tensor: str | None = None, cls: type[ConverterError] = SourceFormatError) -> NoReturn:
        raise cls(rule, path=self.path, tensor=tensor)

    def _info(self, name: str) -> TensorInfo:
        e = self._entries[name]
        return TensorInfo(name=name, dtype=TINYLOOP_DTYPES[e.dtype][1], shape=e.shape)

    def _view(self, name: str) -> np.ndarray:
        # Every entry was checked against the file length on open, so this cannot
        # read outside the map.
        e = self._entries[name]
        dtype = np.dtype(TINYLOOP_DTYPES[e.dtype][0])
        if e.nbytes == 0:
            arr = np.zeros(e.shape, dtype=dtype)
            arr.flags.writeable = False
            return arr
        if self._mm is None:
            raise ConverterError("source is closed", path=self.path, tensor=name)
        # Before touching pages: a read past the end of a truncated mapped file is a SIGBUS.
        size = self._mm.size()
        if size < self._size:
            self._fail(
                f"shrank from {self._size} to {size} bytes while being read (truncated by another program?); "
                "nothing was written",
                name,
            )
        count, start = e.nbytes // dtype.itemsize, self._data_start + e.offset
        flat = np.frombuffer(self._mm, dtype=dtype, count=count, offset=start)
        return flat.reshape(e.shape)

    @staticmethod
    def _delta(scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
        return zero.astype(np.float32) + np.float32(MARLIN_ZERO) * scale.astype(np.float32)

    def _checked_finite(self, name: str, g0: int = 0, g1: int | None = None) -> np.ndarray:
        arr = self._view(name)[g0:g1]
        bad = ~np.isfinite(arr)
        if bad.any():
            g, n = (int(i) for i in np.argwhere(bad)[0])
            self._fail(
                f"values must be finite (spec: W = q * scale + zero); found {float(arr[g, n])} "
                f"at [group {g + g0}, column {n}] ({int(bad.sum())} non-finite in total)",
                name,
            )
        return arr

    # --- container -----------------------------------------------------------------

    def _check_size(self, size: int) -> None:
        if size == 0:
            self._fail(f"empty file: expected at least the {TINYLOOP_PREAMBLE_SIZE}-byte preamble, found 0 bytes")
        if size < TINYLOOP_PREAMBLE_SIZE:
            self._fail(
                f"file is {size} bytes, shorter than the {TINYLOOP_PREAMBLE_SIZE}-byte preamble "
                "(magic, version, reserved, header length)"
            )

    def _read_preamble(self) -> int:
        assert self._mm is not None
        magic, version, reserved, header_len = struct.unpack_from(TINYLOOP_PREAMBLE_FORMAT, self._mm, 0)
        if magic != TINYLOOP_MAGIC:
            self._fail(f"bad magic: expected {TINYLOOP_MAGIC!r}, found {magic!r}; not a .tinyloop file", "magic")
        if version not in TINYLOOP_SUPPORTED_VERSIONS:
            self._fail(
                f"format version {version} is not supported: this reader knows versions "
                f"{list(TINYLOOP_SUPPORTED_VERSIONS)}",
                "version",
            )
        if reserved != 0:
            self._fail(f"reserved field must be 0, found {reserved}", "reserved")
        if header_len > TINYLOOP_MAX_HEADER_BYTES:
            self._fail(
                f"header length {header_len} bytes exceeds the limit of "
                f"{TINYLOOP_MAX_HEADER_BYTES} bytes ({TINYLOOP_MAX_HEADER_BYTES // _MiB} MiB)",
                "header_length",
            )
        if TINYLOOP_PREAMBLE_SIZE + header_len > self._size:
            self._fail(
                f"header length {header_len} runs past end of file: header would end at byte "
                f"{TINYLOOP_PREAMBLE_SIZE + header_len}, file is {self._size} bytes",
                "header_length",
            )
        return int(header_len)

    def _read_header(self, header_len: int) -> dict[str, Any]:
        assert self._mm is not None
        raw = self._mm[TINYLOOP_PREAMBLE_SIZE : TINYLOOP_PREAMBLE_SIZE + header_len]
        try:
            # Spec numbers are finite: NaN, Infinity and overflowing floats are refused.
            return jsonio.loads(raw, object_required=True, finite_numbers=True, max_bytes=TINYLOOP_MAX_HEADER_BYTES)
        except jsonio.JsonError as exc:
            if exc.rule is JsonRule.NOT_UTF8:
                self._fail(f"header is not UTF-8: invalid byte at header offset {exc.offset}", "header")
            if exc.rule is JsonRule.NOT_OBJECT:
                self._fail(f"header must be a JSON object, found a JSON {exc.detail}", "header")
            if exc.rule is JsonRule.DUPLICATE_KEY:
                # Python's dict keeps the last value: a name appearing twice is ambiguous.
                what = {("tensors",): "tensor name", ("linears",): "linear name"}.get(exc.where, "key")
                self._fail(f"duplicate {what} {exc.key!r} in header JSON; names must be unique", exc.key)
            self._fail(exc.message("header"), "header")

    def _check_header_padding(self, header_len: int) -> None:
        assert self._mm is not None
        start = TINYLOOP_PREAMBLE_SIZE + header_len
        pad = self._mm[start : min(self._data_start, self._size)]
        if pad.strip(b"\0"):
            self._fail(f"padding bytes [{start}, {self._data_start}) after the header must be zero", "header_padding")

    def _parse_model(self) -> dict[str, Any]:
        model = self._header.get("model", {})
        if not isinstance(model, dict):
            self._fail(f"'model' must be a JSON object, found a JSON {json_type(model)}", "model")
        return model

    def _section(self, key: str) -> dict[str, Any]:
        if key not in self._header:
            self._fail(f"header has no {key!r} object (required by the spec)", key)
        section = self._header[key]
        if not isinstance(section, dict):
            self._fail(f"{key!r} must be a JSON object, found a JSON {json_type(section)}", key)
        return section

    # --- tensor table --------------------------------------------------------------

    def _parse_tensor_table(self) -> dict[str, _Entry]:
        entries: dict[str, _Entry] = {}
        for name, raw in self._section("tensors").items():
            entries[name] = self._parse_entry(name, raw)
        self._check_overlaps(entries)
        data_end = self._data_start + max((e.end for e in entries.values()), default=0)
        allowed = _round_up(data_end, TINYLOOP_ALIGNMENT)
        if self._size > allowed:
            self._fail(
                f"trailing bytes: file is {self._size} bytes but tensor data ends at byte {data_end} "
                f"(at most {allowed} with padding to {TINYLOOP_ALIGNMENT}); "
                f"{self._size - allowed} extra bytes",
                "file_length",
            )
        return entries

    def _parse_entry(self, name: str, raw: Any) -> _Entry:
        if not name:
            self._fail("tensor names must be non-empty strings", "tensors")
        if not isinstance(raw, dict):
            self._fail(f"tensor entry must be a JSON object, found a JSON {json_type(raw)}", name)
        for key in ("dtype", "shape", "offset", "nbytes"):
            if key not in raw:
                self._fail(f"tensor entry has no {key!r} field (required: dtype, shape, offset, nbytes)", name)
        dtype = raw["dtype"]
        if not isinstance(dtype, str) or dtype not in TINYLOOP_DTYPES:
            self._fail(f"unknown dtype {dtype!r}: expected one of {sorted(TINYLOOP_DTYPES)}", name)
        shape = raw["shape"]
        if not isinstance(shape, list):
            self._fail(f"shape must be a JSON array of ints, found a JSON {json_type(shape)}", name)
        if len(shape) > MAX_NDIM:
            self._fail(f"shape has {len(shape)} dimensions; this reader allows at most {MAX_NDIM}", name)
        for d in shape:
            if not _is_int(d) or d < 0:
                self._fail(f"shape {shape} must hold non-negative integers, found {d!r}", name)
        offset, nbytes = raw["offset"], raw["nbytes"]
        for key, value in (("offset", offset), ("nbytes", nbytes)):
            if not _is_int(value) or value < 0:
                self._fail(f"{key} must be a non-negative integer, found {value!r}", name)
        itemsize = np.dtype(TINYLOOP_DTYPES[dtype][0]).itemsize
        # NumPy refuses any shape whose non-zero dimensions multiply past its index
        # range, even when a zero dimension makes the tensor empty.
        if 0 in shape and math.prod(max(d, 1) for d in shape) * itemsize >= 2**62:
            self._fail(
                f"shape {shape} is too large for any array (non-zero dimensions multiply past 2**62 bytes)", name
            )
        # Bound the product by the file size: a shape that needs more bytes than the
        # file holds can never match a valid nbytes.
        numel = _capped_numel(tuple(shape), self._size // itemsize + 1)
        if numel is None or numel * itemsize != nbytes:
            expected = "more than the whole file" if numel is None else f"{numel * itemsize}"
            self._fail(
                f"nbytes = {nbytes} disagrees with shape {shape} and dtype {dtype}: "
                f"prod(shape) * {itemsize} = {expected}",
                name,
            )
        if offset % TINYLOOP_ALIGNMENT:
            self._fail(f"offset {offset} is not a multiple of {TINYLOOP_ALIGNMENT}", name)
        start = self._data_start + offset
        if start + nbytes > self._size:
            self._fail(
                f"region [{start}, {start + nbytes}) (data_start {self._data_start} + offset {offset}, "
                f"nbytes {nbytes}) runs past end of file at {self._size} bytes: truncated file?",
                name,
            )
        return _Entry(name=name, dtype=dtype, shape=tuple(shape), offset=offset, nbytes=nbytes)

    def _check_overlaps(self, entries: dict[str, _Entry]) -> None:
        # Empty tensors own no bytes, so they cannot overlap anything.
        spans = sorted((e for e in entries.values() if e.nbytes), key=lambda e: (e.offset, e.end))
        prev: _Entry | None = None
        for e in spans:
            if prev is not None and e.offset < prev.end:
                self._fail(
                    f"region [{e.offset}, {e.end}) overlaps tensor {prev.name!r} at "
                    f"[{prev.offset}, {prev.end}) (offsets relative to data_start)",
                    e.name,
                )
            if prev is None or e.end > prev.end:
                prev = e

    # --- linears -------------------------------------------------------------------

    def _parse_linears(self) -> dict[str, _Linear]:
        linears: dict[str, _Linear] = {}
        owner: dict[str, str] = {}
        for name, raw in self._section("linears").items():
            lin = self._parse_linear(name, raw)
            for tname in lin.tensors():
                if tname in owner:
                    self._fail(
                        f"tensor is named by linear {owner[tname]!r} and by linear {name!r}; "
                        "every tensor a linear names belongs to that linear alone",
                        tname,
                    )
                owner[tname] = name
            linears[name] = lin
        return linears

    def _parse_linear(self, name: str, raw: Any) -> _Linear:
        if not name:
            self._fail("linear names must be non-empty strings", "linears")
        if not isinstance(raw, dict):
            self._fail(f"linear entry must be a JSON object, found a JSON {json_type(raw)}", name)
        for key in (*_LINEAR_INT_FIELDS, *_LINEAR_REQUIRED_TENSORS):
            if key not in raw:
                self._fail(
                    f"linear has no {key!r} field (required: "
                    f"{', '.join((*_LINEAR_INT_FIELDS, *_LINEAR_REQUIRED_TENSORS))})",
                    name,
                )
        for key in _LINEAR_INT_FIELDS:
            if not _is_int(raw[key]):
                self._fail(f"field {key!r} must be an integer, found {raw[key]!r}", name)
        bits, size_k, size_n, group = (raw[k] for k in _LINEAR_INT_FIELDS)
        if bits not in TINYLOOP_SUPPORTED_BITS:
            self._fail(
                f"bits = {bits} is not supported: expected one of {list(TINYLOOP_SUPPORTED_BITS)}",
                name,
                UnsupportedQuantError,
            )
        for key, value in (("in_features", size_k), ("out_features", size_n), ("group_size", group)):
            if value <= 0:
                self._fail(f"field {key!r} must be positive, found {value}", name)
        if size_k % group:
            self._fail(
                f"group_size = {group} does not divide in_features K = {size_k} (the spec has no short last group)",
                name,
            )
        if size_k * bits % 8:
            self._fail(f"in_features K = {size_k} times bits = {bits} is not a whole number of bytes", name)
        if "exact_int4" in raw and not isinstance(raw["exact_int4"], bool):
            self._fail(f"field 'exact_int4' must be true or false, found {raw['exact_int4']!r}", name)

        refs: dict[str, str] = {}
        for key in (*_LINEAR_REQUIRED_TENSORS, "bias", *TINYLOOP_EXTRA_CHANNELS):
            value = raw.get(key)
            if value is None and key not in _LINEAR_REQUIRED_TENSORS:
                continue  # optional and absent (or null)
            if not isinstance(value, str):
                self._fail(f"field {key!r} must name a tensor (a string), found {value!r}", name)
            if value not in self._entries:
                self._fail(f"field {key!r} names tensor {value!r}, which is not in the tensor table", name)
            if value in refs.values():
                self._fail(f"field {key!r} names tensor {value!r}, already used by another field", name)
            refs[key] = value

        groups = size_k // group
        self._expect(refs["qweight"], "u8", (size_n, size_k * bits // 8), name, "qweight", "[N, K*bits/8]")
        self._expect(refs["scale"], "f16", (groups, size_n), name, "scale", "[K/G, N]")
        self._expect(refs["zero"], "f16", (groups, size_n), name, "zero", "[K/G, N]")
        if "bias" in refs:
            self._expect(refs["bias"], "f16", (size_n,), name, "bias", "[N]")
        for ch in TINYLOOP_EXTRA_CHANNELS:
            if ch in refs:
                self._expect(refs[ch], "u8", None, name, ch, "")
        return _Linear(
            name=name,
            bits=bits,
            size_k=size_k,
            size_n=size_n,
            group_size=group,
            qweight=refs["qweight"],
            scale=refs["scale"],
            zero=refs["zero"],
            bias=refs.get("bias"),
            exact_int4=bool(raw.get("exact_int4", False)),
            channels={ch: refs[ch] for ch in TINYLOOP_EXTRA_CHANNELS if ch in refs},
        )

    def _expect(
        self, tname: str, dtype: str, shape: tuple[int, ...] | None, linear: str, field: str, formula: str
    ) -> None:
        e = self._entries[tname]
        if e.dtype != dtype:
            self._fail(f"{field} of linear {linear!r} must be {dtype}, found {e.dtype}", tname)
        if shape is not None and e.shape != shape:
            self._fail(
                f"{field} of linear {linear!r} must have shape {formula} = {list(shape)}, found {list(e.shape)}",
                tname,
            )

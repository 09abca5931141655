"""Strict, memory-mapped safetensors reading and streaming, atomic writing.

Why our own code beside the ``safetensors`` package: its NumPy reader cannot hand
out BF16 tensors (we carry them over bit-exactly), it reports bad headers with
generic messages that name neither tensor nor rule, and it has no streaming writer
(it needs every tensor in memory at once).  The container rules follow the
reference implementation (shared/spec/checkpoint-formats.md section 7); tests check
that ``safetensors.safe_open`` reads what we write.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import stat
import struct
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from .atomic import fsync_dir, open_temporary, remove_stale_temporaries, temporary_name
from .constants import SAFETENSORS_DTYPES, SAFETENSORS_MAX_HEADER_BYTES, SAFETENSORS_METADATA_KEY
from .errors import ConverterError, SourceFormatError
from .jsonio import parse_object
from .quant_weight import Tensor, TensorInfo

#: Array limits (NumPy's): at most 64 dimensions, each below 2**63.
MAX_NDIM = 64
MAX_DIM = 2**63 - 1


class SafetensorsFile:
    """A validated, memory-mapped safetensors file.

    Validation (before any tensor is handed out): header length within the file and
    at most 100 MB; header is a UTF-8 JSON object without duplicate names;
    ``__metadata__`` is a string-to-string map; each entry has a known dtype, a
    shape of non-negative ints and ``data_offsets`` with ``end - begin ==
    prod(shape) * itemsize``; sorted by offset the tensors tile the data buffer from
    0 with no gap or overlap, ending exactly at the end of the file.

    Args:
        path: the file.
        error: exception class raised for content problems (SourceFormatError for
            inputs, ArtifactError for artifacts).

    Raises:
        error: any rule above, naming the file, the tensor and the rule.
        ConverterError: the file cannot be opened.
    """

    def __init__(self, path: str | Path, *, error: type[ConverterError] = SourceFormatError) -> None:
        self.path = Path(path)
        self._error = error
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer; only regular files
            # are read (a FIFO or device would block or lie about its length).
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise ConverterError(f"cannot open: {exc.strerror}", path=self.path) from None
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            what = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, device or socket)"
            raise self._error(f"{what}, cannot be read as safetensors", path=self.path)
        self._fh = os.fdopen(fd, "rb")
        try:
            self.file_size = os.fstat(self._fh.fileno()).st_size
            self._parse_header()
            self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ) if self.file_size else None
        except BaseException:
            self._fh.close()
            raise
        _OPEN_FILES.add(self)

    # -- header ---------------------------------------------------------------------
    def _fail(self, message: str, tensor: str | None = None) -> None:
        raise self._error(message, path=self.path, tensor=tensor)

    def _parse_header(self) -> None:
        if self.file_size < 8:
            self._fail(f"not a safetensors file: {self.file_size} bytes, need at least 8 for the header length")
        (n,) = struct.unpack("<Q", self._fh.read(8))
        if n > SAFETENSORS_MAX_HEADER_BYTES:
            self._fail(
                f"not a safetensors file: header length {n} exceeds the {SAFETENSORS_MAX_HEADER_BYTES}-byte limit"
            )
        if 8 + n > self.file_size:
            self._fail(f"header length {n} runs past the end of the file ({self.file_size} bytes)")
        raw = self._fh.read(n)
        header = parse_object(
            raw, path=self.path, what="safetensors header", error=self._error, max_bytes=SAFETENSORS_MAX_HEADER_BYTES
        )
        #: Whitespace after the JSON object (writers pad with spaces to align the data).
        #: Readers of our own artifacts treat anything but spaces here as corruption.
        self.header_padding = raw[len(raw.rstrip(b" \t\r\n")) :]
        self.header_size = n
        self.data_start = 8 + n
        meta = header.pop(SAFETENSORS_METADATA_KEY, None)
        if meta is not None and (not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())):
            self._fail("__metadata__ must be a map of strings to strings", SAFETENSORS_METADATA_KEY)
        self.metadata: dict[str, str] = dict(meta or {})
        self._infos: dict[str, TensorInfo] = {}
        self._offsets: dict[str, tuple[int, int]] = {}
        data_len = self.file_size - self.data_start
        for name, entry in header.items():
            self._infos[name], self._offsets[name] = self._parse_entry(name, entry, data_len)
        expect = 0
        for name, (begin, end) in sorted(self._offsets.items(), key=lambda kv: kv[1]):
            if begin != expect:
                kind = "overlaps the previous tensor" if begin < expect else "leaves a gap after the previous tensor"
                self._fail(f"data_offsets [{begin}, {end}) {kind} (expected begin {expect})", name)
            expect = end
        if expect != data_len:
            self._fail(
                f"{data_len - expect} trailing bytes after the last tensor "
                f"(data ends at {expect}, buffer is {data_len})"
            )

    def _parse_entry(self, name: str, entry: object, data_len: int) -> tuple[TensorInfo, tuple[int, int]]:
        if not isinstance(entry, dict):
            self._fail("header entry must be an object with dtype, shape, data_offsets", name)
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
            self._fail(f"unknown dtype {dtype!r} (known: {', '.join(SAFETENSORS_DTYPES)})", name)
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            self._fail(f"shape must be a list of non-negative integers, found {shape!r}", name)
        # What an array can have (NumPy): a zero-size tensor could otherwise claim any dims.
        if len(shape) > MAX_NDIM or any(d > MAX_DIM for d in shape):
            self._fail(f"shape {shape!r} exceeds {MAX_NDIM} dimensions or {MAX_DIM} elements per dimension", name)
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]
        ):
            self._fail(f"data_offsets must be [begin, end] with 0 <= begin <= end, found {offsets!r}", name)
        begin, end = offsets
        if end > data_len:
            self._fail(
                f"data_offsets end {end} is past the end of the data buffer ({data_len} bytes; file truncated?)", name
            )
        itemsize = np.dtype(SAFETENSORS_DTYPES[dtype]).itemsize
        nbytes = math.prod(shape) * itemsize
        if nbytes != end - begin:
            self._fail(f"shape {shape} of {dtype} needs {nbytes} bytes, data_offsets span {end - begin}", name)
        return TensorInfo(name, dtype, tuple(shape)), (begin, end)

    # -- access ---------------------------------------------------------------------
    @property
    def infos(self) -> dict[str, TensorInfo]:
        """``{name: TensorInfo}`` in header order."""
        return self._infos

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def byte_range(self, name: str) -> tuple[int, int]:
        """Absolute ``[begin, end)`` file offsets of a tensor's bytes."""
        begin, end = self._offsets[name]
        return self.data_start + begin, self.data_start + end

    def array(self, name: str) -> np.ndarray:
        """Read-only array view of one tensor in its storage dtype (BF16 as uint16).

        Raises:
            KeyError: no such tensor (callers check ``in`` first and raise their own error).
        """
        info = self._infos[name]
        begin, end = self.byte_range(name)
        dt = np.dtype(SAFETENSORS_DTYPES[info.dtype])
        if end == begin or self._mm is None:
            return np.zeros(info.shape, dtype=dt)
        return np.frombuffer(self._mm, dtype=dt, count=(end - begin) // dt.itemsize, offset=begin).reshape(info.shape)

    def raw(self, name: str) -> memoryview:
        """The tensor's raw little-endian bytes (zero-copy)."""
        begin, end = self.byte_range(name)
        if self._mm is None or end == begin:
            return memoryview(b"")
        return memoryview(self._mm)[begin:end]

    def tensor(self, name: str) -> Tensor:
        """One tensor as a :class:`Tensor` (memory-mapped)."""
        info = self._infos[name]
        return Tensor(name, info.dtype, info.shape, self.array(name))

    def release_pages(self) -> None:
        """Drop this process's mapping of every page touched so far (``MADV_DONTNEED``).

        File-backed pages a process has touched count in its RSS until unmapped, so a
        streaming pass over a 2 GB input would otherwise end with 2 GB resident.  The
        data stays valid: a later access faults the page back in from the page cache.
        """
        drop_pages(self._mm)

    def close(self) -> None:
        # Views may still reference the map; let garbage collection unmap it then.
        self._fh.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Every SafetensorsFile still alive, for :func:`release_mapped_pages`.
_OPEN_FILES: weakref.WeakSet[SafetensorsFile] = weakref.WeakSet()


def drop_pages(mm: mmap.mmap | None) -> None:
    """``MADV_DONTNEED`` on a read-only map: its touched pages leave this process's RSS.

    The data stays valid; a later access faults pages back in from the page cache.
    """
    if mm is not None and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        try:
            mm.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):  # closed map, or a platform without it: only RSS is affected
            pass


def release_mapped_pages() -> None:
    """Call :meth:`SafetensorsFile.release_pages` on every open file (bounds RSS while streaming)."""
    for f in list(_OPEN_FILES):
        f.release_pages()


# -- writing ------------------------------------------------------------------------
def _header_bytes(entries: Mapping[str, dict], metadata: Mapping[str, str], reserve: int = 0) -> bytes:
    header = {SAFETENSORS_METADATA_KEY: dict(metadata), **entries}
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    size = max(len(raw), reserve)
    size += -size % 8  # keep tensor data 8-byte aligned, as the reference writer does
    return raw + b" " * (size - len(raw))


class StreamingWriter:
    """Writes a safetensors file tensor by tensor, in bounded memory, atomically.

    The layout (names, dtypes, shapes, offsets) is fixed up front; tensors may then
    be written in any order, in row chunks, with :meth:`write`.  The header is
    written last (:meth:`finish`), so metadata may depend on the data (checksums),
    provided its length does not exceed ``header_reserve`` bytes.  Everything goes
    to a temporary file in the target folder, which is fsynced and renamed over
    ``path`` only by :meth:`finish`; :meth:`abort` (or leaving the ``with`` block
    on an exception) deletes it, so no half-written output ever exists.  A writer
    killed outright (SIGKILL, power loss) leaves its ``.<name>.*.incomplete`` file
    behind, never a file at ``path``; the next writer to the same ``path`` deletes
    such leftovers (:func:`remove_stale_temporaries`: unlocked means dead).

    Args:
        path: final output path.
        layout: ``[(name, dtype code, shape), ...]``; data is laid out with
            8-byte-itemsize tensors first, then 4, 2, 1 (stable), so every tensor is
            aligned to its itemsize.
        header_reserve: bytes reserved for the header JSON.

    Raises:
        ConverterError: the folder is not writable.
    """

    def __init__(
        self, path: str | Path, layout: Iterable[tuple[str, str, tuple[int, ...]]], *, header_reserve: int
    ) -> None:
        self.path = Path(path)
        items = list(layout)
        order = sorted(range(len(items)), key=lambda i: -np.dtype(SAFETENSORS_DTYPES[items[i][1]]).itemsize)
        self.entries: dict[str, dict] = {}
        self._spans: dict[str, tuple[int, int, np.dtype]] = {}
        offset = 0
        for i in order:
            name, dtype, shape = items[i]
            dt = np.dtype(SAFETENSORS_DTYPES[dtype])
            nbytes = math.prod(shape) * dt.itemsize
            self.entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._spans[name] = (offset, nbytes, dt)
            offset += nbytes
        self.data_size = offset
        self.header_reserve = header_reserve + (-header_reserve % 8)
        self.data_start = 8 + self.header_reserve
        remove_stale_temporaries(self.path)
        # The lock is held until the file is renamed or deleted (converter.atomic).
        self.tmp_path = temporary_name(self.path)
        self._fd = -1
        self._done = False
        size = self.data_start + self.data_size
        try:
            self._fd = fd = open_temporary(self.tmp_path, self.path)
            os.ftruncate(fd, size)
            if size:
                # Reserve the blocks now: a full disk fails here, before any work, and
                # pwrite into allocated extents is several times faster on ext4 than
                # into a sparse file (docs/performance-cpu.md).
                os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                self.abort()
                need = f" (needs {size} bytes)" if exc.errno == errno.ENOSPC else ""
                raise ConverterError(f"cannot allocate the output file: {exc.strerror}{need}", path=self.path) from None
        except BaseException:  # SIGTERM/Ctrl-C during a long fallocate: no temporary may stay
            self.abort()
            raise

    def write(self, name: str, data: np.ndarray, row_start: int = 0) -> None:
        """Write ``data`` into tensor ``name`` starting at row ``row_start``.

        Args:
            name: a tensor of the layout.
            data: array whose dtype matches the tensor's storage dtype; its rows
                replace rows ``[row_start, row_start + len(data))`` (flat for 1-D).

        Raises:
            ValueError: dtype mismatch or the rows fall outside the tensor.
        """
        offset, nbytes, dt = self._spans[name]
        data = np.ascontiguousarray(data)
        if data.dtype.newbyteorder("<") != dt.newbyteorder("<") and not (
            data.dtype.kind == dt.kind and data.dtype.itemsize == dt.itemsize
        ):
            raise ValueError(f"{name}: dtype {data.dtype} does not match {dt}")
        shape = self.entries[name]["shape"]
        row_bytes = dt.itemsize * math.prod(shape[1:]) if len(shape) > 1 else dt.itemsize
        start = offset + row_start * row_bytes
        if row_start < 0 or start + data.nbytes > offset + nbytes:
            raise ValueError(f"{name}: rows [{row_start}, +{len(data)}) fall outside shape {shape}")
        self._pwrite(data, start)

    def write_flat(self, name: str, data: np.ndarray, elem_start: int) -> None:
        """Write a 1-D slice of tensor ``name``'s flattened elements at ``elem_start``."""
        offset, nbytes, dt = self._spans[name]
        data = np.ascontiguousarray(data)
        start = offset + elem_start * dt.itemsize
        if data.dtype.itemsize != dt.itemsize or start + data.nbytes > offset + nbytes:
            raise ValueError(f"{name}: flat write of {data.nbytes} bytes at element {elem_start} does not fit")
        self._pwrite(data, start)

    def _pwrite(self, data: np.ndarray, start: int) -> None:
        view = memoryview(data.view(np.uint8).reshape(-1)) if data.nbytes else memoryview(b"")
        pos = self.data_start + start
        while view:
            done = os.pwrite(self._fd, view, pos)
            view, pos = view[done:], pos + done

    def finish(self, metadata: Mapping[str, str]) -> Path:
        """Write the header, fsync, and atomically rename onto ``path``.

        Raises:
            ValueError: the header outgrew ``header_reserve``.
        """
        raw = _header_bytes(self.entries, metadata, self.header_reserve)
        if len(raw) != self.header_reserve:
            self.abort()
            raise ValueError(f"header needs {len(raw)} bytes, only {self.header_reserve} reserved")
        os.pwrite(self._fd, struct.pack("<Q", len(raw)) + raw, 0)
        os.fsync(self._fd)
        # Rename while still holding the lock, so no cleaner can take the file first.
        os.replace(self.tmp_path, self.path)
        os.close(self._fd)
        fsync_dir(self.path.parent)
        self._done = True
        return self.path

    def abort(self) -> None:
        """Delete the temporary file; the target path is left as it was."""
        if not self._done:
            self._done = True
            if self._fd >= 0:
                try:
                    os.close(self._fd)
                except OSError:
                    pass
            self.tmp_path.unlink(missing_ok=True)

    def __enter__(self) -> StreamingWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if not self._done:
            self.abort()


def header_size_for(entries_layout: Iterable[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str]) -> int:
    """Bytes the header will take for this layout and metadata (offsets at worst-case width)."""
    big = 10**15
    entries = {n: {"dtype": d, "shape": list(s), "data_offsets": [big, big]} for n, d, s in entries_layout}
    return len(_header_bytes(entries, metadata))

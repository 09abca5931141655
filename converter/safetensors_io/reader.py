"""The strict reader: a safetensors file is validated whole before any tensor is handed
out, so that a bad header fails with one line naming the file, the tensor and the rule,
and a file that shrinks or is replaced while mapped is caught before a read faults.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import struct
from pathlib import Path

import numpy as np

from ..constants import SAFETENSORS_DTYPES, SAFETENSORS_MAX_HEADER_BYTES, SAFETENSORS_METADATA_KEY
from ..errors import ConverterError, SourceFormatError
from ..jsonio import not_regular, parse_object
from ..quant_weight import Tensor, TensorInfo
from .mapped_files import _OPEN_FILES, _POOL, drop_pages

#: Each dtype code once (a header's copies of ``"F16"`` are replaced by these), and its itemsize.
_DTYPE_CODES = {code: code for code in SAFETENSORS_DTYPES}
_DTYPES = {code: np.dtype(t) for code, t in SAFETENSORS_DTYPES.items()}
_ITEMSIZE = {code: dt.itemsize for code, dt in _DTYPES.items()}
#: Array limits (NumPy's): at most 64 dimensions, each below 2**63.
MAX_NDIM = 64
MAX_DIM = 2**63 - 1


class SafetensorsFile:
    """A validated, memory-mapped safetensors file.

    Validation (before any tensor is handed out): header length within the file and
    at most 100 MB; header is a UTF-8 JSON object without duplicate names;
    ``__metadata__`` is a string-to-string map; each entry has a known dtype, a
    shape of non-negative ints (whose non-zero dimensions multiply to less than
    2**62 bytes, so that even a zero-size tensor is an array NumPy can make) and
    ``data_offsets`` with ``end - begin == prod(shape) * itemsize``; sorted by offset
    the tensors tile the data buffer from 0 with no gap or overlap, ending exactly at
    the end of the file.

    Files are opened lazily and boundedly: the header is read and the file closed; the
    data is memory-mapped on first access, and at most :data:`MAX_MAPPED_FILES` files
    are mapped at once (the least recently used map is dropped), so a checkpoint of
    thousands of shards stays within the open-files limit.  Each access first checks
    that the file has not shrunk (a read past the end of a mapped file is a SIGBUS),
    and a file mapped again must be the one whose header was read (device, inode,
    size and modification time).

    Args:
        path: the file.
        error: exception class raised for content problems (SourceFormatError for
            inputs, ArtifactError for artifacts).

    Raises:
        error: any rule above, naming the file, the tensor and the rule; on access, a
            file that changed since its header was read.
        ConverterError: the file cannot be opened.
    """

    def __init__(
        self, path: str | Path, *, error: type[ConverterError] = SourceFormatError, hold: bool = False
    ) -> None:
        self.path = Path(path)
        self._error = error
        self._mm: mmap.mmap | None = None
        #: ``hold``: the descriptor the header was read from, kept until :meth:`close`,
        #: so that every later read is of that same file even if the path is replaced
        #: meanwhile (an atomic replace is then either before the open or after).
        self._held: int | None = None
        fd = self._open()
        try:
            st = os.fstat(fd)
            self.file_size = st.st_size
            self._identity = _identity(st)
            self._parse_header(fd)
        except BaseException:
            os.close(fd)
            raise
        if hold:
            self._held = fd
        else:
            os.close(fd)
        _OPEN_FILES.add(self)

    def _open(self) -> int:
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer; only regular files
            # are read (a FIFO or device would block or lie about its length).
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise ConverterError(f"cannot open: {exc.strerror}", path=self.path) from None
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise self._error(f"{not_regular(mode)}, cannot be read as safetensors", path=self.path)
        return fd

    def open_data(self) -> int:
        """A new read-only descriptor of the file (the caller closes it), after checking
        that it is still the file whose header was read.

        Raises:
            error: it changed since (device, inode, size or modification time).
            ConverterError: it cannot be opened.
        """
        if self._held is not None:
            return os.dup(self._held)
        fd = self._open()
        try:
            now = _identity(os.fstat(fd))
            if now != self._identity:
                self._fail(
                    f"changed since its header was read ({_change(self._identity, now)}); "
                    "was it rewritten while being converted?"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _map(self) -> mmap.mmap | None:
        """The file's map (made on first use), after checking the file did not shrink."""
        mm = self._mm
        if mm is None and self.file_size:
            fd = self.open_data()
            try:
                # mmap keeps a duplicate of the descriptor; ours is closed right away.
                mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            finally:
                os.close(fd)
            self._mm = mm
        if mm is not None:
            _POOL.use(self)
            self.check_size(mm.size())  # fstat of the map's own descriptor: the file's size now
        return mm

    def check_size(self, size: int) -> None:
        """Raise the error for a file found ``size`` bytes long, when that is shorter than
        when it was opened (another program truncated it).

        Raises:
            error: naming the file and both sizes.
        """
        if size < self.file_size:
            self._fail(
                f"shrank from {self.file_size} to {size} bytes while being read (truncated by another "
                "program?); nothing was written"
            )

    def shrunk(self) -> bool:
        """Whether a mapped file is now shorter than when it was opened (a read past
        its new end raises SIGBUS: :mod:`converter.faults` reports it by name)."""
        mm = self._mm
        try:
            return mm is not None and mm.size() < self.file_size
        except (OSError, ValueError):
            return False

    def _unmap(self) -> None:
        # Views handed out keep the map (and its descriptor) alive until they are freed.
        self._mm = None

    # -- header ---------------------------------------------------------------------
    def _fail(self, message: str, tensor: str | None = None) -> None:
        raise self._error(message, path=self.path, tensor=tensor)

    def _parse_header(self, fd: int) -> None:
        if self.file_size < 8:
            self._fail(f"not a safetensors file: {self.file_size} bytes, need at least 8 for the header length")
        (n,) = struct.unpack("<Q", _pread_exact(fd, 8, 0, self))
        if n > SAFETENSORS_MAX_HEADER_BYTES:
            self._fail(
                f"not a safetensors file: header length {n} exceeds the {SAFETENSORS_MAX_HEADER_BYTES}-byte limit"
            )
        if 8 + n > self.file_size:
            self._fail(f"header length {n} runs past the end of the file ({self.file_size} bytes)")
        raw = _pread_exact(fd, n, 8, self)
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
        # Per tensor only its TensorInfo (dtype code and shape shared with the other
        # tensors of the same dtype and shape) and its begin offset are kept: a header of
        # many tiny tensors costs little beyond its own size (issue 42).
        self._infos: dict[str, TensorInfo] = {}
        self._offsets: dict[str, int] = {}
        shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
        data_len = self.file_size - self.data_start
        for name in list(header):
            info, begin, end = self._parse_entry(name, header.pop(name), data_len, shapes)
            self._infos[name] = info
            self._offsets[name] = begin
        del header
        expect = 0
        for name in sorted(self._offsets, key=self._span):  # stable: ties in header order
            begin, end = self._span(name)
            if begin != expect:
                kind = "overlaps the previous tensor" if begin < expect else "leaves a gap after the previous tensor"
                self._fail(f"data_offsets [{begin}, {end}) {kind} (expected begin {expect})", name)
            expect = end
        if expect != data_len:
            self._fail(
                f"{data_len - expect} trailing bytes after the last tensor "
                f"(data ends at {expect}, buffer is {data_len})"
            )

    def _parse_entry(
        self, name: str, entry: object, data_len: int, shapes: dict[tuple[int, ...], tuple[int, ...]]
    ) -> tuple[TensorInfo, int, int]:
        """``(info, begin, end)`` of one header entry; ``shapes`` interns the shape tuples."""
        if not isinstance(entry, dict):
            self._fail("header entry must be an object with dtype, shape, data_offsets", name)
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
            self._fail(f"unknown dtype {dtype!r} (known: {', '.join(SAFETENSORS_DTYPES)})", name)
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            self._fail(f"shape must be a list of non-negative integers, found {shape!r}", name)
        # What an array can have (NumPy): a zero-size tensor could otherwise claim any dims.
        if len(shape) > MAX_NDIM or any(d > MAX_DIM for d in shape):
            self._fail(f"shape {_short(shape)} exceeds {MAX_NDIM} dimensions or {MAX_DIM} elements per dimension", name)
        itemsize = np.dtype(SAFETENSORS_DTYPES[dtype]).itemsize
        # NumPy refuses an array whose non-zero dimensions multiply past its index range,
        # even when a zero dimension makes it empty.
        if 0 in shape and math.prod(max(d, 1) for d in shape) * itemsize >= MAX_ARRAY_BYTES:
            self._fail(
                f"shape {_short(shape)} is too large for any array: its non-zero dimensions multiply past "
                f"2**62 bytes (a zero-size tensor may not claim such dimensions)",
                name,
            )
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
        nbytes = math.prod(shape) * itemsize
        if nbytes != end - begin:
            self._fail(f"shape {shape} of {dtype} needs {nbytes} bytes, data_offsets span {end - begin}", name)
        shape_t = tuple(shape)
        return TensorInfo(name, _DTYPE_CODES[dtype], shapes.setdefault(shape_t, shape_t)), begin, end

    def _span(self, name: str) -> tuple[int, int]:
        """``[begin, end)`` of a tensor's bytes in the data buffer."""
        begin = self._offsets[name]
        info = self._infos[name]
        return begin, begin + math.prod(info.shape) * _ITEMSIZE[info.dtype]

    # -- access ---------------------------------------------------------------------
    @property
    def infos(self) -> dict[str, TensorInfo]:
        """``{name: TensorInfo}`` in header order."""
        return self._infos

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def byte_range(self, name: str) -> tuple[int, int]:
        """Absolute ``[begin, end)`` file offsets of a tensor's bytes."""
        begin, end = self._span(name)
        return self.data_start + begin, self.data_start + end

    def array(self, name: str) -> np.ndarray:
        """Read-only array view of one tensor in its storage dtype (BF16 as uint16).

        Raises:
            KeyError: no such tensor (callers check ``in`` first and raise their own error).
        """
        info = self._infos[name]
        begin, end = self.byte_range(name)
        dt = np.dtype(SAFETENSORS_DTYPES[info.dtype])
        if end == begin:
            return np.zeros(info.shape, dtype=dt)
        mm = self._map()
        return np.frombuffer(mm, dtype=dt, count=(end - begin) // dt.itemsize, offset=begin).reshape(info.shape)

    def raw(self, name: str) -> memoryview:
        """The tensor's raw little-endian bytes (zero-copy)."""
        begin, end = self.byte_range(name)
        if end == begin:
            return memoryview(b"")
        return memoryview(self._map())[begin:end]

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
        _POOL.discard(self)
        self._unmap()
        held, self._held = self._held, None
        if held is not None:
            os.close(held)

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: NumPy's bound on an array's bytes (its index type), with a factor 2 of headroom.
MAX_ARRAY_BYTES = 2**62


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _change(old: tuple[int, int, int, int], new: tuple[int, int, int, int]) -> str:
    if old[:2] != new[:2]:
        return "it was replaced by another file"
    if old[2] != new[2]:
        return f"size {old[2]} -> {new[2]} bytes"
    return "its modification time changed"


def _pread_exact(fd: int, n: int, offset: int, f: SafetensorsFile) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        f._fail(f"shrank while its header was being read ({offset + len(data)} bytes left, needed {offset + n})")
    return data


def _short(value: object, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 5] + " ...]"

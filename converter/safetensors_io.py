"""Strict, memory-mapped safetensors reading and streaming, atomic writing.

Why our own code beside the ``safetensors`` package: its NumPy reader cannot hand
out BF16 tensors (we carry them over bit-exactly), it reports bad headers with
generic messages that name neither tensor nor rule, and it has no streaming writer
(it needs every tensor in memory at once).  The container rules follow the
reference implementation (docs/spec/checkpoint-formats.md section 7); tests check
that ``safetensors.safe_open`` reads what we write.
"""

from __future__ import annotations

import array
import errno
import fcntl
import json
import math
import mmap
import os
import stat
import struct
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np

from .atomic import (
    WriteBack,
    fsync_dir,
    open_temporary,
    output_write_error,
    remove_stale_temporaries,
    splice_write,
    temporary_name,
    track,
    untrack,
)
from .constants import SAFETENSORS_DTYPES, SAFETENSORS_MAX_HEADER_BYTES, SAFETENSORS_METADATA_KEY
from .errors import ConverterError, SourceFormatError
from .jsonio import not_regular, parse_object
from .quant_weight import Tensor, TensorInfo

#: Each dtype code once (a header's copies of ``"F16"`` are replaced by these), and its itemsize.
_DTYPE_CODES = {code: code for code in SAFETENSORS_DTYPES}
_DTYPES = {code: np.dtype(t) for code, t in SAFETENSORS_DTYPES.items()}
_ITEMSIZE = {code: dt.itemsize for code, dt in _DTYPES.items()}
#: Array limits (NumPy's): at most 64 dimensions, each below 2**63.
MAX_NDIM = 64
MAX_DIM = 2**63 - 1
#: Bytes a :class:`StreamingWriter` lets the kernel hold unwritten (:class:`~converter.atomic.WriteBack`)
#: when the output is dropped from the page cache behind the write front.
WRITEBACK_WINDOW = 128 << 20


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


#: Every SafetensorsFile still alive, for :func:`release_mapped_pages`.
_OPEN_FILES: weakref.WeakSet[SafetensorsFile] = weakref.WeakSet()
#: Most files mapped at once.  Each map holds one descriptor; 64 stays far below the
#: usual 1024 open files with room for the output shards being written.
MAX_MAPPED_FILES = 64
#: NumPy's bound on an array's bytes (its index type), with a factor 2 of headroom.
MAX_ARRAY_BYTES = 2**62


class _MapPool:
    """The mapped files, least recently used first; mapping one more past the bound
    drops the oldest map (it is made again, checked, on its file's next access)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lru: OrderedDict[int, weakref.ref[SafetensorsFile]] = OrderedDict()
        # Re-entrant: a file freed by the garbage collector while the lock is held
        # removes itself through _forget.
        self._lock = threading.RLock()

    def _forget(self, ref: weakref.ref[SafetensorsFile]) -> None:
        with self._lock:
            for key, entry in list(self._lru.items()):
                if entry is ref:
                    del self._lru[key]

    def use(self, f: SafetensorsFile) -> None:
        with self._lock:
            key = id(f)
            entry = self._lru.get(key)
            if entry is not None and entry() is f:
                self._lru.move_to_end(key)
                return
            self._lru[key] = weakref.ref(f, self._forget)
            while len(self._lru) > self.limit:
                _, ref = self._lru.popitem(last=False)
                old = ref()
                if old is not None:
                    old._unmap()

    def discard(self, f: SafetensorsFile) -> None:
        with self._lock:
            self._lru.pop(id(f), None)


_POOL = _MapPool(MAX_MAPPED_FILES)


def set_map_limit(limit: int) -> None:
    """Map at most ``limit`` files at once (default :data:`MAX_MAPPED_FILES`): for a
    process whose open-files limit leaves less room (``ensure_open_files``)."""
    _POOL.limit = max(1, min(limit, MAX_MAPPED_FILES))


def shrunk_files() -> list[Path]:
    """Mapped files that are now shorter than when they were opened (see :func:`converter.faults`)."""
    return [f.path for f in list(_OPEN_FILES) if f.shrunk()] + [
        p for owner in list(_MAP_OWNERS) if (p := owner.shrunk_path()) is not None
    ]


#: Other readers with maps of their own (``.tinyloop``), for :func:`shrunk_files`.
_MAP_OWNERS: weakref.WeakSet = weakref.WeakSet()


def register_map_owner(owner: object) -> None:
    """Let :func:`shrunk_files` ask ``owner.shrunk_path()`` (a reader with its own map)."""
    _MAP_OWNERS.add(owner)


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
#: Characters of header JSON gathered before they are encoded and written (or counted).
HEADER_CHUNK_CHARS = 1 << 18
_encode_str = json.encoder.encode_basestring  # the string encoder of json.dumps(ensure_ascii=False)


def _json_text(value: object) -> Iterator[str]:
    """``value`` as ``json.dumps(value, separators=(",", ":"), ensure_ascii=False)``
    writes it, a long string in slices (each character is escaped on its own, so the
    slices' escapes join into the whole's)."""
    if type(value) is not str or len(value) <= HEADER_CHUNK_CHARS:
        yield json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        return
    yield '"'
    for i in range(0, len(value), HEADER_CHUNK_CHARS):
        yield _encode_str(value[i : i + HEADER_CHUNK_CHARS])[1:-1]
    yield '"'


def _header_text(
    items: Iterable[tuple[str, str, tuple[int, ...]]], offsets: Iterable[int] | None, metadata: Mapping[str, str]
) -> Iterator[str]:
    """The header JSON in pieces: exactly ``json.dumps({"__metadata__": dict(metadata),
    **entries}, separators=(",", ":"), ensure_ascii=False)`` for the entries
    ``{name: {"dtype", "shape", "data_offsets"}}`` of ``items`` in order, without building
    that map or the whole text (a header of 100 k tensors was built three times over).

    Args:
        items: ``(name, dtype, shape)`` in data order.
        offsets: each tensor's begin and, after the last, the end of the data; None puts
            the widest offsets (10**15) everywhere (what :func:`header_size_for` reserves).
    """
    yield '{"' + SAFETENSORS_METADATA_KEY + '":{'
    for i, (key, value) in enumerate(dict(metadata).items()):
        yield ("," if i else "") + _encode_str(key) + ":"
        yield from _json_text(value)
    yield "}"
    if offsets is None:
        for name, dtype, shape in items:
            yield (
                f',{_encode_str(name)}:{{"dtype":{_encode_str(dtype)},"shape":[{",".join(map(str, shape))}],'
                f'"data_offsets":[{_WIDEST},{_WIDEST}]}}'
            )
    else:
        it = iter(offsets)
        begin = next(it, 0)
        for (name, dtype, shape), end in zip(items, it, strict=True):
            yield (
                f',{_encode_str(name)}:{{"dtype":{_encode_str(dtype)},"shape":[{",".join(map(str, shape))}],'
                f'"data_offsets":[{begin},{end}]}}'
            )
            begin = end
    yield "}"


#: The offset :func:`header_size_for` reserves room for (a petabyte: 16 digits).
_WIDEST = 10**15


def _encoded_chunks(pieces: Iterable[str]) -> Iterator[bytes]:
    """UTF-8 bytes of ``pieces`` joined, in chunks of about :data:`HEADER_CHUNK_CHARS`
    characters (a lone surrogate in a name raises UnicodeEncodeError, as ``str.encode`` does)."""
    buf: list[str] = []
    size = 0
    for piece in pieces:
        buf.append(piece)
        size += len(piece)
        if size >= HEADER_CHUNK_CHARS:
            yield "".join(buf).encode("utf-8")
            buf, size = [], 0
    if buf:
        yield "".join(buf).encode("utf-8")


def _padded_size(size: int) -> int:
    return size + (-size % 8)  # keep tensor data 8-byte aligned, as the reference writer does


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
        error_path: the output's name in error messages, when ``path`` is a multi-file
            commit's hidden placeholder (default ``path``).

    Raises:
        ConverterError: the folder is not writable, or the file does not fit (a full
            disk names the needed and free bytes).
    """

    def __init__(
        self,
        path: str | Path,
        layout: Iterable[tuple[str, str, tuple[int, ...]]],
        *,
        header_reserve: int,
        error_path: Path | None = None,
    ) -> None:
        self.path = Path(path)
        self._error_path = Path(error_path) if error_path is not None else self.path
        # Per tensor: the caller's (name, dtype, shape) tuple, its position and its offset
        # (8 bytes); the header is written from these by :meth:`finish` (issue 42).
        items = sorted(layout, key=lambda item: -_ITEMSIZE[item[1]])  # stable
        #: ``(name, dtype, shape)`` in data order
        self._items = items
        #: ``{name: position in _items}``
        self._index = {item[0]: i for i, item in enumerate(items)}
        if len(self._index) != len(items) or SAFETENSORS_METADATA_KEY in self._index:
            raise ValueError(f"tensor names must be unique and not {SAFETENSORS_METADATA_KEY!r}")
        #: each tensor's begin in the data buffer, then the buffer's size
        self._offsets = array.array("q", [0]) * (len(items) + 1)
        offset = 0
        for i, (_, dtype, shape) in enumerate(items):
            offset += math.prod(shape) * _ITEMSIZE[dtype]
            self._offsets[i + 1] = offset
        self.data_size = offset
        self.header_reserve = _padded_size(header_reserve)
        self.data_start = 8 + self.header_reserve
        remove_stale_temporaries(self.path)
        # The lock is held until the file is renamed or deleted (converter.atomic).
        self.tmp_path = temporary_name(self.path)
        self._fd = -1
        self._done = False
        self.file_size = size = self.data_start + self.data_size
        track(self, self.abort)
        try:
            self._fd = fd = open_temporary(self.tmp_path, self.path)
            # Each write's range is started at once.  Only an output dropped from the page
            # cache behind the write front (larger than half the available memory) has
            # its ranges waited for, as it must be before the drop; one that stays cached
            # is left to the kernel's dirty limits and the final fsync: on the CI-class
            # VM waiting cost the writer thread (the conversion's slowest) ~0.3 s per
            # 2.1 GB output (median of 5 conversions 2.52 s against 2.25 s without the
            # waits), and the final fsync still found almost nothing left (0.0-0.1 s).
            drop = size > _cache_budget()
            self._drop = drop
            self._writeback = WriteBack(fd, WRITEBACK_WINDOW if drop else size + 1, drop=drop)
            os.ftruncate(fd, size)
            if size:
                # Reserve the blocks now: a full disk fails here, before any work, and
                # pwrite into allocated extents is several times faster on ext4 than
                # into a sparse file (docs/performance-cpu.md).
                os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                self.abort()
                raise output_write_error(exc, self._error_path, size) from None
        except BaseException:  # SIGTERM/Ctrl-C during a long fallocate: no temporary may stay
            self.abort()
            raise

    def _span(self, name: str) -> tuple[int, int, np.dtype, tuple[int, ...]]:
        """``(offset in the data, bytes, storage dtype, shape)`` of tensor ``name``.

        Raises:
            KeyError: not a tensor of the layout.
        """
        i = self._index[name]
        _, dtype, shape = self._items[i]
        offset = self._offsets[i]
        return offset, self._offsets[i + 1] - offset, _DTYPES[dtype], shape

    @property
    def entries(self) -> dict[str, dict]:
        """The header's tensor entries, ``{name: {"dtype", "shape", "data_offsets"}}`` in
        data order (built on each call: for tests and tools, not the write path)."""
        off = self._offsets
        return {
            name: {"dtype": dtype, "shape": list(shape), "data_offsets": [off[i], off[i + 1]]}
            for i, (name, dtype, shape) in enumerate(self._items)
        }

    @property
    def parked(self) -> bool:
        """Whether :meth:`park` closed the descriptor (the next write reopens it)."""
        return self._fd < 0 and not self._done

    def park(self) -> None:
        """Close the temporary's descriptor (and with it its lock) until the next write or
        :meth:`finish` reopens it: a writer of hundreds of shards keeps only a few open
        (the open-files limit).  Only for a caller that holds a lock on the whole output
        (:class:`~converter.atomic.OutputLock`), which keeps every cleaner away meanwhile."""
        if self._fd >= 0 and not self._done:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def _ensure_open(self) -> None:
        if self._fd >= 0 or self._done:
            return
        try:
            fd = os.open(self.tmp_path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | os.O_NOFOLLOW)
        except OSError as exc:
            raise output_write_error(exc, self._error_path, self.file_size) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        drop = getattr(self, "_drop", False)
        self._writeback = WriteBack(fd, WRITEBACK_WINDOW if drop else self.file_size + 1, drop=drop)

    def write(self, name: str, data: np.ndarray, row_start: int = 0) -> None:
        """Write ``data`` into tensor ``name`` starting at row ``row_start``.

        Args:
            name: a tensor of the layout.
            data: array whose dtype matches the tensor's storage dtype; its rows
                replace rows ``[row_start, row_start + len(data))`` (flat for 1-D).

        Raises:
            ValueError: dtype mismatch or the rows fall outside the tensor.
        """
        offset, nbytes, dt, shape = self._span(name)
        data = np.ascontiguousarray(data)
        if data.dtype.newbyteorder("<") != dt.newbyteorder("<") and not (
            data.dtype.kind == dt.kind and data.dtype.itemsize == dt.itemsize
        ):
            raise ValueError(f"{name}: dtype {data.dtype} does not match {dt}")
        row_bytes = dt.itemsize * math.prod(shape[1:]) if len(shape) > 1 else dt.itemsize
        start = offset + row_start * row_bytes
        if row_start < 0 or start + data.nbytes > offset + nbytes:
            raise ValueError(f"{name}: rows [{row_start}, +{len(data)}) fall outside shape {list(shape)}")
        self._pwrite(data, start)

    def write_flat(self, name: str, data: np.ndarray, elem_start: int) -> None:
        """Write a 1-D slice of tensor ``name``'s flattened elements at ``elem_start``."""
        offset, nbytes, dt, _ = self._span(name)
        data = np.ascontiguousarray(data)
        start = offset + elem_start * dt.itemsize
        if data.dtype.itemsize != dt.itemsize or start + data.nbytes > offset + nbytes:
            raise ValueError(f"{name}: flat write of {data.nbytes} bytes at element {elem_start} does not fit")
        # Flat writes are pass-through bytes, views of an input's map: pwrite keeps a
        # truncated input a SIGBUS that names it (converter.faults), not a write error.
        self._pwrite(data, start, splice=False)

    def copy_flat(self, name: str, fd: int, src_offset: int, byte_start: int, nbytes: int) -> int | None:
        """Copy ``nbytes`` bytes of the file ``fd`` from ``src_offset`` into tensor
        ``name`` at byte ``byte_start`` of its data, inside the kernel
        (``os.copy_file_range``: no copy through this process, as ``cp`` does).

        Returns:
            The bytes copied: ``nbytes``; less when ``fd``'s file ends early (another
            program truncated it; the caller reports it); None when the kernel or the
            file systems cannot copy this way (no ``os.copy_file_range``, or ``EXDEV``,
            ``EINVAL``, ``ENOSYS``, ``EOPNOTSUPP`` before a byte was copied), and the
            caller writes the bytes itself.

        Raises:
            ValueError: the bytes fall outside the tensor.
            ConverterError: the output's disk is full, or another write error.
        """
        offset, size, _, _ = self._span(name)
        if byte_start < 0 or byte_start + nbytes > size:
            raise ValueError(f"{name}: copy of {nbytes} bytes at byte {byte_start} does not fit")
        copy = getattr(os, "copy_file_range", None)
        if copy is None:
            return None
        self._ensure_open()
        pos = first = self.data_start + offset + byte_start
        src, end = src_offset, src_offset + nbytes
        try:
            while src < end:
                done = copy(fd, self._fd, end - src, src, pos)
                if not done:
                    break  # the source ends here
                src, pos = src + done, pos + done
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) or pos != first:
                raise output_write_error(exc, self._error_path, self.file_size) from None
            return None
        self._writeback.wrote(first, pos - first)
        return pos - first

    def _pwrite(self, data: np.ndarray, start: int, *, splice: bool = True) -> None:
        # Computed chunks are spliced (atomic.splice_write: the kernel's copy from a
        # buffer is the writer's largest cost otherwise); what the kernel will not splice,
        # and data in a file's map (splice=False), is written with pwrite.
        self._ensure_open()
        view = memoryview(data.view(np.uint8).reshape(-1)) if data.nbytes else memoryview(b"")
        pos = first = self.data_start + start
        try:
            if splice and data.nbytes:
                done = splice_write(self._fd, data.ctypes.data, data.nbytes, pos)
                view, pos = view[done:], pos + done
            while view:
                done = os.pwrite(self._fd, view, pos)
                view, pos = view[done:], pos + done
        except OSError as exc:  # a filesystem without fallocate can still fill up here
            raise output_write_error(exc, self._error_path, self.file_size) from None
        self._writeback.wrote(first, pos - first)

    def finish(self, metadata: Mapping[str, str]) -> Path:
        """Write the header, fsync, and atomically rename onto ``path``.

        Raises:
            ValueError: the header outgrew ``header_reserve``.
        """
        try:
            self._write_header(metadata)
            os.fsync(self._fd)
        except OSError as exc:
            self.abort()
            raise output_write_error(exc, self._error_path, self.file_size) from None
        except BaseException:
            self.abort()
            raise
        # Rename while still holding the lock, so no cleaner can take the file first.
        os.replace(self.tmp_path, self.path)
        os.close(self._fd)
        fsync_dir(self.path.parent)
        self._done = True
        untrack(self)
        return self.path

    def _write_header(self, metadata: Mapping[str, str]) -> None:
        """Write the 8-byte length and the header (JSON padded with spaces to the
        reserve) chunk by chunk (:func:`_header_text`); the reserve is checked before
        each chunk, so a header that outgrows it never reaches the tensor data.

        Raises:
            ValueError: the header outgrew ``header_reserve``.
        """
        self._ensure_open()
        reserve = self.header_reserve
        pos = 0
        for chunk in _encoded_chunks(_header_text(self._items, self._offsets, metadata)):
            if pos + len(chunk) > reserve:
                rest = sum(map(len, _encoded_chunks(_header_text(self._items, self._offsets, metadata))))
                raise ValueError(f"header needs {_padded_size(rest)} bytes, only {reserve} reserved")
            self._pwrite_all(chunk, 8 + pos)
            pos += len(chunk)
        while pos < reserve:
            pad = min(reserve - pos, HEADER_CHUNK_CHARS)
            self._pwrite_all(b" " * pad, 8 + pos)
            pos += pad
        self._pwrite_all(struct.pack("<Q", reserve), 0)

    def _pwrite_all(self, data: bytes, pos: int) -> None:
        view = memoryview(data)
        while view:
            done = os.pwrite(self._fd, view, pos)
            view, pos = view[done:], pos + done

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
            untrack(self)

    def __enter__(self) -> StreamingWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if not self._done:
            self.abort()


def _cache_budget() -> int:
    """Half the memory the kernel says is available (``MemAvailable``): an output larger
    than that would not stay cached anyway, so :class:`WriteBack` drops it behind the
    write front; a smaller one stays cached for the ``marlin-verify`` that usually follows."""
    try:
        with open("/proc/meminfo", "rb") as fh:
            for line in fh:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024 // 2
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (OSError, ValueError, AttributeError):
        return 1 << 62


def header_size_for(entries_layout: Iterable[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str]) -> int:
    """Bytes the header will take for this layout and metadata (offsets at worst-case width)."""
    size = sum(len(chunk) for chunk in _encoded_chunks(_header_text(entries_layout, None, metadata)))
    return _padded_size(size)

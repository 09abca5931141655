"""The streaming writer: an output larger than memory is written tensor by tensor
(in row chunks, any order) into a locked temporary, and appears under its name only
complete and fsynced.
"""

from __future__ import annotations

import array
import errno
import fcntl
import math
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from ..atomic import (
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
from ..constants import SAFETENSORS_METADATA_KEY
from .header_json import HEADER_CHUNK_CHARS, _encoded_chunks, _header_text, _padded_size

# The dtype tables are the reader's: one definition of each code's NumPy dtype and itemsize.
from .reader import _DTYPES, _ITEMSIZE

#: Bytes a :class:`StreamingWriter` lets the kernel hold unwritten (:class:`~converter.atomic.WriteBack`)
#: when the output is dropped from the page cache behind the write front.
WRITEBACK_WINDOW = 128 << 20


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

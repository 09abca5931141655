"""Bounded write-back of a big output: the disk works while the writer computes instead
of all at the final fsync, and an output larger than memory does not push the input's
pages out of the page cache.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections import deque
from collections.abc import Callable

#: ``sync_file_range`` flags (linux/fs.h).
_SYNC_WAIT_BEFORE, _SYNC_WRITE, _SYNC_WAIT_AFTER = 1, 2, 4


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    # Not in the os module; glibc and musl export it on Linux.  ctypes releases the GIL
    # for the call, so a writer thread waiting on the disk does not stall the others.
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _sync_file_range()


class WriteBack:
    """Keeps a big output's unwritten data bounded while it is being written.

    After each write the kernel is asked to start writing that range to disk
    (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait), so the disk works
    while the writer computes instead of all at the final ``fsync``.  Once more than
    ``window`` bytes are in flight, the oldest ranges are waited for, so the final
    ``fsync`` has at most ``window`` bytes left; with ``drop`` they are also dropped from
    the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)``), so that an output larger
    than memory does not push the input's pages out of it.  Durability still comes from
    that ``fsync`` alone; this only moves work earlier.  Where ``sync_file_range`` does
    not exist (not Linux) every call is a no-op.

    Args:
        fd: the file being written.
        window: bytes written but not yet waited for, at most.
        drop: drop ranges from the page cache once waited for.
    """

    #: Adjacent ranges are recorded (and later waited for) as one up to this many bytes.
    MERGE_BYTES = 8 << 20

    def __init__(self, fd: int, window: int, *, drop: bool = False) -> None:
        self.fd = fd
        self.window = window
        self.drop = drop
        self._merge = min(self.MERGE_BYTES, window // 16)
        self._ranges: deque[tuple[int, int]] = deque()
        self._inflight = 0
        self._lock = threading.Lock()  # several writer threads report their ranges

    def wrote(self, offset: int, length: int) -> None:
        """Record that ``[offset, offset + length)`` was just written (thread-safe)."""
        if _SYNC_FILE_RANGE is None or length <= 0:
            return
        # Errors (EINVAL on file systems without write-back, such as some FUSE ones)
        # only lose the overlap; the final fsync reports real I/O errors.
        _SYNC_FILE_RANGE(self.fd, offset, length, _SYNC_WRITE)
        with self._lock:
            ranges = self._ranges
            # A write that continues the last range extends it, up to a sixteenth of the
            # window (so ranges are still waited for a little at a time) and MERGE_BYTES:
            # 100 k tiny tensors written one after another keep a few records, not 100 k
            # (issue 42).
            last = ranges[-1] if ranges else None
            if last is not None and last[0] + last[1] == offset and last[1] + length <= self._merge:
                ranges[-1] = (last[0], last[1] + length)
            else:
                ranges.append((offset, length))
            self._inflight += length
            due = []
            while self._inflight > self.window and self._ranges:
                old, n = self._ranges.popleft()
                self._inflight -= n
                due.append((old, n))
        for old, n in due:
            _SYNC_FILE_RANGE(self.fd, old, n, _SYNC_WAIT_BEFORE | _SYNC_WRITE | _SYNC_WAIT_AFTER)
            if self.drop:
                try:
                    os.posix_fadvise(self.fd, old, n, os.POSIX_FADV_DONTNEED)
                except (OSError, AttributeError):
                    pass

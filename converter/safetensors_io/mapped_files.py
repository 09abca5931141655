"""The bound on mapped inputs and what a fault handler asks of them: at most
:data:`MAX_MAPPED_FILES` maps at once (a checkpoint of thousands of shards stays within
the open-files limit), the pages a streaming pass touched dropped from this process's
RSS, and which mapped file shrank when a read faults (SIGBUS, :mod:`converter.faults`).
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .reader import SafetensorsFile

#: Every SafetensorsFile still alive, for :func:`release_mapped_pages`.
_OPEN_FILES: weakref.WeakSet[SafetensorsFile] = weakref.WeakSet()
#: Most files mapped at once.  Each map holds one descriptor; 64 stays far below the
#: usual 1024 open files with room for the output shards being written.
MAX_MAPPED_FILES = 64


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

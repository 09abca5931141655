"""A failed output write, told in the user's terms: the output's name (never a hidden
temporary's) and, when the disk is full, the bytes needed and free or the lack of inodes.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from ..errors import ConverterError


def free_bytes(folder: Path) -> int | None:
    """Bytes this process may still write in ``folder``'s filesystem (None if unknown).

    ``f_bavail`` for ordinary users; root may also use the blocks the filesystem
    reserves for it (``f_bfree``).
    """
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    return blocks * st.f_frsize


def stores_files(folder: Path) -> bool:
    """False for a filesystem of no blocks at all (``/proc``, ``/sys``): no free space
    there means nowhere to write, not a full disk."""
    try:
        return os.statvfs(folder).f_blocks > 0
    except OSError:
        return True  # unknown: the write itself will say


def _no_free_inodes(folder: Path) -> bool:
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_files > 0 and (st.f_ffree if os.geteuid() == 0 else st.f_favail) == 0


def output_write_error(exc: OSError, path: Path, need: int | None = None) -> ConverterError:
    """The one-line error for a failed write of the output ``path`` (the user's name for
    it, not the temporary's): the reason, and for a full disk the needed and free bytes."""
    why = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(path.parent)
        parts = [f"needs {need} bytes" if need is not None else "", f"{free} free" if free is not None else ""]
        if _no_free_inodes(path.parent):  # room for the bytes, none for one more file
            parts.append("no free inodes: the filesystem cannot create another file")
        detail = ", ".join(p for p in parts if p)
        why = f"{why} ({detail})" if detail else why
    return ConverterError(f"cannot write the output: {why}; nothing was written", path=path)

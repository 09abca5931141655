"""Hidden, locked temporaries: nothing half-written ever appears under a final name, and
the leftovers of a writer that died (its lock gone with it) are told from a live
concurrent writer's files and removed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ..errors import ConverterError
from .disk_space import _no_free_inodes

#: A writer's temporary, locked while its writer lives.
TEMP_SUFFIX = ".incomplete"
#: A multi-file commit's placeholder for one final file (its writer's temporary is
#: ``..<name>.<random>.staged.<random>.incomplete``).
STAGED_SUFFIX = ".staged"
#: Staged files older than this process cannot be a live sibling's (see remove_stale_temporaries).
_PROCESS_START = time.time()


def target_mode(path: Path) -> int:
    """File mode for an output at ``path``: that of the file it replaces, else ``0o666 & ~umask``.

    ``mkstemp`` creates 0600 files; an artifact should get the mode a plain ``open()``
    would give it.
    """
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def fsync_dir(folder: Path) -> None:
    """fsync a folder, making renames in it durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


#: Longest file name (bytes) kept whole in a temporary's name: ``.<name>.<12 hex><suffix>``
#: must stay within NAME_MAX (255) for every suffix used here.
_TEMP_STEM_MAX = 255 - 25


def temp_stem(name: str) -> str:
    """The part of a temporary's name derived from the final file ``name``: ``name``
    itself while short enough, else ``~`` and a hash of it (16 hex digits), so that every
    legal output name (up to 255 bytes) gets a legal temporary; the same name always
    gives the same stem, which is how stale temporaries are found again."""
    if len(os.fsencode(name)) <= _TEMP_STEM_MAX:
        return name
    import xxhash

    return "~" + xxhash.xxh3_64_hexdigest(os.fsencode(name))


def temporary_name(path: Path, suffix: str = TEMP_SUFFIX) -> Path:
    """A fresh hidden name beside ``path``: ``.<stem>.<random><suffix>``, ``<stem>``
    being :func:`temp_stem` of its name.

    Callers record the name *before* :func:`open_temporary` creates the file, so that an
    interrupt (SIGTERM, Ctrl-C) landing between the two still finds it to delete.
    """
    return path.parent / f".{temp_stem(path.name)}.{secrets.token_hex(6)}{suffix}"


def open_temporary(tmp: Path, path: Path) -> int:
    """Create ``tmp`` (exclusively), lock it, and give it the mode ``path`` will have.

    Returns:
        The fd; the exclusive ``flock`` on it lasts until it is closed.

    Raises:
        ConverterError: the folder is not writable.
    """
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as exc:
        why = exc.strerror
        if exc.errno in (errno.ENOSPC, errno.EDQUOT) and _no_free_inodes(path.parent):
            why = f"{why} (no free inodes: the filesystem cannot create another file)"
        raise ConverterError(f"cannot write to the output folder: {why}", path=path.parent) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.fchmod(fd, target_mode(path))
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return fd


def write_atomically(
    path: Path, write: Callable[[BinaryIO], None], *, check: Callable[[Path], None] | None = None
) -> Path:
    """Write a file through a locked temporary: ``write(fh)``, fsync, ``check(temporary)``, rename.

    Args:
        path: the final file.
        write: writes the whole content to the binary file object it is given.
        check: called with the complete temporary before the rename; whatever it
            raises leaves ``path`` as it was.

    Returns:
        ``path``.

    Raises:
        ConverterError: the folder is not writable; anything ``write`` or ``check``
            raises (the temporary is deleted first).
    """
    tmp = temporary_name(path)
    fd = -1
    try:
        fd = open_temporary(tmp, path)
        with os.fdopen(fd, "wb", closefd=False) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        if check is not None:
            check(tmp)
        # Rename while still holding the lock, so no cleaner can take the file first.
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        if fd >= 0:
            os.close(fd)
    fsync_dir(path.parent)
    return path


def write_durably(path: Path, content: bytes) -> None:
    """Write ``content`` to an existing placeholder ``path`` and fsync it."""
    with open(path, "wb") as fh:
        fh.write(content)
        fh.flush()
        os.fsync(fh.fileno())


def stage_placeholder(folder: Path, name: str, created: list[Path]) -> Path:
    """An empty hidden placeholder ``.<name>.<random>.staged`` in ``folder`` for a multi-file commit.

    The hidden name keeps loaders from picking it up; :func:`remove_stale_temporaries`
    removes it if its process dies before the commit.  Its path is appended to
    ``created`` before the file exists, so an interrupt cannot orphan it.
    """
    tmp = temporary_name(folder / name, STAGED_SUFFIX)
    created.append(tmp)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    return tmp


def remove_stale_temporaries(path: str | Path, keep: Callable[[Path], bool] | None = None) -> list[Path]:
    """Delete temporaries that killed writers left next to the output ``path``.

    Two kinds exist: a writer's ``.<name>.*.incomplete`` (:func:`open_temporary`)
    and a multi-file commit's ``.<name>.*.staged`` placeholder (whose own writer temp
    is ``..<name>.*.staged.*.incomplete``).  An ``.incomplete`` file whose lock can
    be taken belongs to no live writer and is removed; a locked one (a concurrent
    conversion to the same name) is kept.  A ``.staged`` file is removed when no
    locked ``.incomplete`` file belongs to it and it is older than this process.
    A file for which ``keep`` is true (an input file that merely has such a name) is
    never removed.

    Returns:
        The files removed.
    """
    path = Path(path)
    prefix = f".{temp_stem(path.name)}."
    removed: list[Path] = []
    try:
        every = list(os.scandir(path.parent))
        ours = [e for e in every if e.name.startswith(prefix)]
        # a staged placeholder's own writer temporary: named after the placeholder
        inner = {f".{temp_stem(e.name)}." for e in ours if e.name.endswith(STAGED_SUFFIX)}
        entries = ours + [e for e in every if not e.name.startswith(prefix) and e.name.startswith(tuple(inner))]
        if keep is not None:
            entries = [e for e in entries if not keep(Path(e.path))]
    except OSError:
        return removed
    live: set[str] = set()
    for entry in entries:
        if entry.name.endswith(TEMP_SUFFIX) and entry.is_file(follow_symlinks=False):
            fd = _lock_if_free(entry.path)
            if fd is None:
                live.add(entry.name)
                continue
            try:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
            except OSError:
                pass
            finally:
                os.close(fd)
    for entry in entries:
        if not (entry.name.endswith(STAGED_SUFFIX) and entry.name.startswith(prefix)) or not entry.is_file(
            follow_symlinks=False
        ):
            continue
        if any(n.startswith(f".{temp_stem(entry.name)}.") for n in live):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_mtime < _PROCESS_START:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
        except OSError:
            pass
    return removed


def _lock_if_free(path: str) -> int | None:
    """An open fd holding the file's exclusive lock, or None if a live writer holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd

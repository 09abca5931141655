"""All-or-nothing outputs of several files: one lock per output from the first staged
file to the commit (no two runs mix their files), and renames that are all undone when
one fails.
"""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
from pathlib import Path

from ..errors import ConverterError
from .temporaries import fsync_dir, temp_stem

#: An existing final file, kept during a multi-file commit so that it can be undone.
BACKUP_SUFFIX = ".backup"


def commit_all(pairs: list[tuple[Path, Path]], folder: Path) -> None:
    """Rename every staged file onto its final name: all of them, or none.

    Each final name that exists is first hard-linked to a hidden backup in the same
    folder (renamed there where the filesystem has no hard links), so the rename
    itself stays atomic. If a rename fails, the ones already done are undone in reverse
    order (backups renamed back, new names removed) and the error says so; if undoing
    fails too, the error names exactly the files that now hold the new artifact.

    Args:
        pairs: ``(staged, final)`` in commit order.
        folder: the folder holding all of them.

    Raises:
        ConverterError: a rename failed (the message states what was left).
    """
    for _, final in pairs:
        # A folder under a final name cannot be replaced by a file (nor backed up and
        # restored as one): refused before the first rename, so nothing is committed.
        if os.path.isdir(final) and not os.path.islink(final):
            raise ConverterError(
                "is a folder where the output writes a file; --force replaces files only: move it away; "
                "nothing was written",
                path=final,
            )
    done: list[tuple[Path, Path | None]] = []
    pending: tuple[Path, Path, bool] | None = None  # (final, backup, moved away)
    try:
        for tmp, final in pairs:
            backup = None
            if os.path.lexists(final):
                fd, name = tempfile.mkstemp(prefix=f".{temp_stem(final.name)}.", suffix=BACKUP_SUFFIX, dir=folder)
                os.close(fd)
                backup = Path(name)
                try:
                    os.unlink(backup)
                    os.link(final, backup, follow_symlinks=False)
                    pending = (final, backup, False)
                except OSError:
                    os.replace(final, backup)
                    pending = (final, backup, True)
            os.replace(tmp, final)
            pending = None
            done.append((final, backup))
    except BaseException as exc:
        lost: list[Path] = []
        if pending is not None:
            final, backup, moved = pending
            try:
                if moved:
                    os.replace(backup, final)
                else:
                    backup.unlink()
            except OSError:
                lost.append(final)
        for final, backup in reversed(done):
            try:
                if backup is not None:
                    os.replace(backup, final)
                else:
                    final.unlink()
            except OSError:
                lost.append(final)
        fsync_dir(folder)
        if isinstance(exc, KeyboardInterrupt):
            raise
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        if lost:
            raise ConverterError(
                f"could not rename the new artifact into place ({why}), and undoing the renames failed: "
                f"{', '.join(str(p) for p in lost)} now hold the new artifact, every other output file is as "
                "it was; re-run with --force",
                path=folder,
            ) from None
        raise ConverterError(
            f"could not rename the new artifact into place ({why}); every output file is as it was", path=folder
        ) from None
    fsync_dir(folder)
    for _, backup in done:
        if backup is not None:
            backup.unlink(missing_ok=True)


#: The lock file of one output, held from staging to commit (see :class:`OutputLock`).
LOCK_SUFFIX = ".marlin-lock"


class OutputLock:
    """An exclusive lock on one output (a file, or a model folder's artifact), held
    from the first staged file to the commit: a second conversion to the same output
    refuses with one line instead of mixing two models' files, and no run's stale-file
    cleanup can meet another live run's temporaries.

    The lock is ``flock`` on a hidden ``.<stem>.marlin-lock`` beside the output, deleted on
    release (while still held; a waiter that opened the deleted file sees that its
    inode is gone and refuses too).  The kernel drops it when the process dies, so a
    killed run never blocks the next one.

    Raises:
        ConverterError: another process holds it (naming the output), or the folder is
            not writable.
    """

    def __init__(self, folder: Path, stem: str, output: Path) -> None:
        self.path = folder / f".{temp_stem(stem)}{LOCK_SUFFIX}"
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0) | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise ConverterError(f"cannot write to the output folder: {exc.strerror}", path=folder) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            st = os.stat(self.path, follow_symlinks=False)
            if (st.st_dev, st.st_ino) != (os.fstat(fd).st_dev, os.fstat(fd).st_ino):
                raise BlockingIOError(errno.EAGAIN, "lock file replaced")
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES, errno.ENOENT):
                raise ConverterError(
                    "another conversion is writing this output now; wait for it to finish, or choose another output",
                    path=output,
                ) from None
            raise
        self.fd: int | None = fd

    def release(self) -> None:
        """Delete the lock file and drop the lock (idempotent)."""
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

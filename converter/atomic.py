"""Crash-safe files: hidden temporaries, their locks, fsync, stale-file cleanup, and
the all-or-nothing rename of several files.

Every output is first written under a hidden name in its target folder (same
filesystem, so the final ``os.replace`` is atomic) and renamed only when complete and
fsynced; nothing half-written ever appears under a final name.  A writer holds an
exclusive ``flock`` on its temporary (``.<name>.<random>.incomplete``) for as long as
it lives; the kernel drops the lock when the process dies, however it dies (SIGKILL,
power loss), which is how :func:`remove_stale_temporaries` tells a dead writer's
leftovers from a live concurrent writer's file.

Every writer with temporaries on disk is listed (:func:`track`), so that a fatal
signal that unwinds no stack (:mod:`converter.faults`) can still delete them
(:func:`abort_all`).  Errors of the environment (a full disk, a file-size limit) name
the user's output and, for a full disk, the free and the needed bytes
(:func:`output_write_error`), never a hidden temporary.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import secrets
import signal
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from .errors import ConverterError

#: A writer's temporary, locked while its writer lives.
TEMP_SUFFIX = ".incomplete"
#: A multi-file commit's placeholder for one final file (its writer's temporary is
#: ``..<name>.<random>.staged.<random>.incomplete``).
STAGED_SUFFIX = ".staged"
#: An existing final file, kept during a multi-file commit so that it can be undone.
BACKUP_SUFFIX = ".backup"
#: Staged files older than this process cannot be a live sibling's (see remove_stale_temporaries).
_PROCESS_START = time.time()
#: Writers whose temporaries exist now, by id: their abort functions (see abort_all).
_LIVE: dict[int, Callable[[], None]] = {}
#: Every output this process committed (see note_committed).
_COMMITTED: list[Path] = []


def track(owner: object, abort: Callable[[], None]) -> None:
    """List a writer whose temporaries exist until it commits or aborts (:func:`untrack`)."""
    _LIVE[id(owner)] = abort


def untrack(owner: object) -> None:
    _LIVE.pop(id(owner), None)


def abort_all() -> None:
    """Abort every tracked writer (delete its temporaries); for a fatal signal, where no
    ``finally`` block will run.  Never raises."""
    for abort in list(_LIVE.values()):
        try:
            abort()
        except BaseException:  # best effort on the way out
            pass
    _LIVE.clear()


#: The signals that interrupt a command (the CLI maps SIGTERM and SIGHUP to Ctrl-C).
_INTERRUPTS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP until the block ends, then act on those that came,
    in order (each one's previous handler is called: the CLI's raise KeyboardInterrupt;
    an ignored one is skipped).

    For the commit of a multi-file output: an interrupt between a rename and the
    bookkeeping after it would leave a mix of old and new files that the undo cannot
    see, and one after the renames would claim that nothing was written. When the block
    raises (a failed commit, with its message of what was left), that error stands and
    the held signals are dropped: the command ends anyway. Python runs signal handlers
    only in the main thread, so elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = {s: signal.getsignal(s) for s in _INTERRUPTS}
    held = [s for s in _INTERRUPTS if previous[s] is not None]  # None: a C-level handler, left alone

    def restore() -> None:
        # blocked while the handlers go back, so that none fires halfway through the loop
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            for s in held:
                signal.signal(s, previous[s])
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    for s in held:
        signal.signal(s, lambda signum, frame: came.append(signum))
    try:
        yield
    except BaseException:
        restore()
        raise
    restore()
    for s in came:
        handler = previous[s]
        if callable(handler):
            handler(s, None)
        elif handler == signal.SIG_DFL:
            os.kill(os.getpid(), s)


def note_committed(path: Path) -> None:
    """Record that the output ``path`` is complete: an interrupt after the commit (while
    cleaning up) must not claim that nothing was written."""
    _COMMITTED.append(path)


def committed_outputs() -> list[Path]:
    """The outputs :func:`note_committed` recorded in this process, in order."""
    return list(_COMMITTED)


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


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _vmsplice() -> Callable[..., int] | None:
    # Not in the os module (os.splice is); glibc and musl export it on Linux.
    if not sys.platform.startswith("linux") or not hasattr(os, "splice"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).vmsplice
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_uint]
    fn.restype = ctypes.c_ssize_t
    return fn


_VMSPLICE = _vmsplice()
#: Bytes moved per vmsplice/splice pair: Linux's default limit for a pipe's size
#: (/proc/sys/fs/pipe-max-size).
SPLICE_PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = 1031
#: Errors that mean "this kernel or file system cannot splice": the caller writes instead.
_NO_SPLICE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM, errno.EBADF)


def splice_write(fd: int, address: int, nbytes: int, offset: int) -> int:
    """Write ``nbytes`` bytes of this process's memory from ``address`` into ``fd`` at
    ``offset`` through a pipe: ``vmsplice`` hands
    the buffer's pages to the pipe (no copy), ``splice`` copies them into the file.

    Why not ``pwrite``: on the CI-class VM the kernel's copy from a process's buffer into
    the page cache (``copy_folio_from_iter_atomic``) cost 2.4-5.4 s of CPU per 2.1 GB
    written from a hot 12 MB buffer, the same bytes spliced 0.56-0.80 s (alternating
    runs): the copy from the pipe's pages is the kernel copying kernel pages, like ``cp``'s
    ``copy_file_range``.  The pipe is drained before this returns, so the caller may
    reuse the buffer at once (and must keep it alive until then).

    Args:
        fd: the output, open for writing.
        address, nbytes: the bytes, in this process's own memory (not a map of a file
            that may shrink: a fault there would be an error here, not the reader's SIGBUS).
        offset: where the first byte goes.

    Returns:
        The bytes written from ``address`` on: all of them, or fewer (none at all
        where splicing is unavailable) when the kernel or file system refuses to splice
        (``EINVAL``, ``ENOSYS``, ...); the caller writes the rest with ``pwrite``.

    Raises:
        OSError: any other error (``ENOSPC``...), for the caller to report.
    """
    total, base = nbytes, address
    if _VMSPLICE is None or not total:
        return 0
    r, w = os.pipe()
    done = 0
    try:
        try:
            step = max(fcntl.fcntl(w, _F_SETPIPE_SZ, SPLICE_PIPE_BYTES), 1 << 12)
        except OSError:
            step = 1 << 16  # the default pipe size
        while done < total:
            iov = _IoVec(base + done, min(step, total - done))
            moved = _VMSPLICE(w, ctypes.byref(iov), 1, 0)
            if moved < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                if err in _NO_SPLICE:
                    return done
                raise OSError(err, os.strerror(err))
            sent = 0
            while sent < moved:
                try:
                    sent += os.splice(r, fd, moved - sent, offset_dst=offset + done + sent)
                except OSError as exc:
                    if exc.errno in _NO_SPLICE:
                        return done + sent  # what the pipe still holds is written by the caller
                    raise
            done += moved
    finally:
        os.close(r)
        os.close(w)
    return done


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

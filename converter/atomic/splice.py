"""Writes without the kernel's copy from a process buffer (``vmsplice`` then ``splice``):
that copy was the writer's largest cost; where splicing is refused the caller falls
back to ``pwrite``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import sys
from collections.abc import Callable


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

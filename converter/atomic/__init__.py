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

One module a job: ``temporaries`` (names, locks, single-file writes, cleanup),
``commit`` (the multi-file commit and its lock), ``interrupts`` (what a signal must
find), ``disk_space`` (write errors, free bytes), ``writeback`` (:class:`WriteBack`),
``splice`` (:func:`splice_write`).  Every name stays importable from here.  Rebinding
one here (a test's monkeypatch) does not reach the module that uses it: patch that
module (``converter.atomic.splice``...).
"""

from .commit import BACKUP_SUFFIX, LOCK_SUFFIX, OutputLock, commit_all
from .disk_space import _no_free_inodes, free_bytes, output_write_error, stores_files
from .interrupts import (
    _COMMITTED,
    _INTERRUPTS,
    _LIVE,
    abort_all,
    committed_outputs,
    interrupts_deferred,
    note_committed,
    track,
    untrack,
)
from .splice import _F_SETPIPE_SZ, _NO_SPLICE, _VMSPLICE, SPLICE_PIPE_BYTES, _IoVec, _vmsplice, splice_write
from .temporaries import (
    _PROCESS_START,
    _TEMP_STEM_MAX,
    STAGED_SUFFIX,
    TEMP_SUFFIX,
    _lock_if_free,
    fsync_dir,
    open_temporary,
    remove_stale_temporaries,
    stage_placeholder,
    target_mode,
    temp_stem,
    temporary_name,
    write_atomically,
    write_durably,
)
from .writeback import _SYNC_FILE_RANGE, _SYNC_WAIT_AFTER, _SYNC_WAIT_BEFORE, _SYNC_WRITE, WriteBack, _sync_file_range

__all__ = [
    "BACKUP_SUFFIX",
    "LOCK_SUFFIX",
    "SPLICE_PIPE_BYTES",
    "STAGED_SUFFIX",
    "TEMP_SUFFIX",
    "_COMMITTED",
    "_F_SETPIPE_SZ",
    "_INTERRUPTS",
    "_LIVE",
    "_NO_SPLICE",
    "_PROCESS_START",
    "_SYNC_FILE_RANGE",
    "_SYNC_WAIT_AFTER",
    "_SYNC_WAIT_BEFORE",
    "_SYNC_WRITE",
    "_TEMP_STEM_MAX",
    "_VMSPLICE",
    "OutputLock",
    "WriteBack",
    "_IoVec",
    "_lock_if_free",
    "_no_free_inodes",
    "_sync_file_range",
    "_vmsplice",
    "abort_all",
    "commit_all",
    "committed_outputs",
    "fsync_dir",
    "free_bytes",
    "stores_files",
    "interrupts_deferred",
    "note_committed",
    "open_temporary",
    "output_write_error",
    "remove_stale_temporaries",
    "splice_write",
    "stage_placeholder",
    "target_mode",
    "temp_stem",
    "temporary_name",
    "track",
    "untrack",
    "write_atomically",
    "write_durably",
]

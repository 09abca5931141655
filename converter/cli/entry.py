"""The console scripts: the process's setup (standard streams, the heap, NumPy's huge
pages), then a command run with usage errors, interrupts and failed streams mapped to
exit statuses."""

from __future__ import annotations

import ctypes
import signal
import sys

import typer

from ..faults import INTERRUPTED_EXIT, error_document, interrupted_message, set_command, wants_json
from . import output
from .convert_cmd import convert_app
from .streams import _standard_streams, _stream_failed, _StreamError, err_console
from .verify_cmd import verify_app


def _main(app: typer.Typer, prog: str) -> None:
    """Run a command.  With ``--json`` a usage error (an unknown option, a missing
    argument, a path that does not exist) is a JSON error document on stdout too, with
    exit 2, not click's text on stderr.

    Standard streams: a closed stdin, stdout or stderr gets ``/dev/null`` in its place
    first (else the first file opened would take its descriptor, and a message could
    land in the output); a reader that went away (``| head``) ends the command quietly
    with :data:`BROKEN_PIPE_EXIT`; a stream that cannot be written (``> /dev/full``)
    gives one line on stderr (the output, if one was committed, is complete and valid)
    and exit 2; a stream that cannot encode a character gets it escaped."""
    _standard_streams()
    set_command(prog)
    try:
        code = _run(app, prog, wants_json(sys.argv[1:]))
        # Said and done: an interrupt while the process flushes and shuts down would only
        # turn the status into a bare 130 (or a traceback from threading's shutdown).
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except _StreamError as exc:
        _stream_failed(exc.error)
    except OSError as exc:
        _stream_failed(exc)
    sys.exit(code)


def _run(app: typer.Typer, prog: str, as_json: bool) -> int:
    output._failed[0] = False
    try:
        code = app(prog_name=prog, standalone_mode=False)
        if code == INTERRUPTED_EXIT and not output._failed[0]:
            # typer's own exit for a Ctrl-C outside our handlers: the work was done and its
            # result was printing, so say what stands instead of a silent 130
            if as_json:
                print(error_document("KeyboardInterrupt", interrupted_message()))
            else:
                err_console.print(interrupted_message(), soft_wrap=True, highlight=False, markup=False)
    except typer.Abort:
        if not as_json:
            err_console.print("Aborted!")
            return 1
        print(error_document("KeyboardInterrupt", interrupted_message()))
        return INTERRUPTED_EXIT
    except _USAGE_ERRORS as exc:
        if not as_json:
            exc.show()  # type: ignore[attr-defined]
            return int(getattr(exc, "exit_code", 2))
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        print(error_document("UsageError", message))
        return 2
    return code if isinstance(code, int) else 0


def _usage_errors() -> tuple[type[BaseException], ...]:
    """Click's usage errors: typer >= 0.22 vendors click (its errors derive from
    ``typer.TyperException``), older typer uses click itself."""
    found: list[type[BaseException]] = []
    if hasattr(typer, "TyperException"):
        found.append(typer.TyperException)
    try:
        import click

        found.append(click.ClickException)
    except ImportError:
        pass
    return tuple(found)


_USAGE_ERRORS = _usage_errors()


#: glibc ``mallopt`` parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _reuse_freed_chunks() -> None:
    """Let this process's heap keep the freed buffers of streaming for the next chunk.

    Both tools allocate arrays of a chunk's size (~24 MB) over and over.  glibc serves
    blocks that large with a fresh ``mmap`` and returns them on free (its dynamic
    threshold stops at 32 MiB, and it trims more than twice that from the heap top), so
    every chunk paid page faults and the kernel's zeroing of new pages: ``marlin-verify
    --against`` of a 2 GB model spent 1.4 s of system time, 0.8 s with blocks up to 64
    MiB taken from the heap and up to 256 MiB of free heap kept (measured on 2 cores).
    Only the command-line processes do this; elsewhere (musl, macOS) it is skipped.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, 64 << 20)
    mallopt(_M_TRIM_THRESHOLD, 256 << 20)


def _no_huge_pages_for_arrays() -> bool:
    """Stop NumPy from asking for transparent huge pages for its arrays; returns whether
    this NumPy has the switch (a private one, ``_set_madvise_hugepage``; without it
    nothing changes).

    NumPy ``madvise(MADV_HUGEPAGE)``s every large array.  The chunk buffers that the
    writer threads ``pwrite`` from are such arrays, and the kernel's copy out of them was
    the slower for it: on the 2-core CI-class VM, converting the 2.1 GB benchmark
    checkpoint spent 0.69-1.11 s of CPU in ``pwrite`` without huge pages against
    1.04-1.26 s (once 3.3 s) with them, in alternating runs (2.03-2.37 s against
    2.21-2.47 s wall); writing 2.1 GB from one 24 MB buffer took 0.50 s of system time
    from a plain ``mmap`` and 0.85 s from one advised for huge pages.  Only the
    command-line processes do this, as with :func:`_reuse_freed_chunks`.
    """
    import numpy as np  # loaded already (the package imports it)

    switch = getattr(getattr(np, "_core", None), "multiarray", None)
    setter = getattr(switch, "_set_madvise_hugepage", None)
    if setter is None:
        return False
    setter(False)
    return True


def main_convert() -> None:
    _reuse_freed_chunks()
    _no_huge_pages_for_arrays()
    _main(convert_app, "marlin-convert")


def main_verify() -> None:
    _reuse_freed_chunks()
    _no_huge_pages_for_arrays()
    _main(verify_app, "marlin-verify")

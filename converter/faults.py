"""Signals that would otherwise end the commands with a traceback or a core dump.

* **SIGBUS** from a memory-mapped input that another program truncated while it was
  being read.  The readers check a file's size before touching its pages
  (:class:`~converter.safetensors_io.SafetensorsFile`, ``TinyloopSource``), so this
  only happens when the file shrinks between that check and the read.  Python cannot
  catch the signal: its own handler only sets a flag and returns, the faulting
  instruction runs again, and the process spins.  :func:`sigbus_as_error` installs a
  C-level handler (through :mod:`ctypes`) that runs in the faulting thread and never
  returns into the faulting code: it deletes every live temporary
  (:func:`converter.atomic.abort_all`), reports one line naming the file that shrank,
  and exits with status 2.
* **SIGINT**, **SIGTERM** or **SIGHUP** while the commands are still importing (a second
  or so on a cold start), before any handler of theirs is in place:
  :func:`quiet_interrupt_until_ready` makes it exit 130 with one line (or JSON document)
  instead of a traceback or a silent death.  No output exists yet then.
"""

from __future__ import annotations

import os
import signal
import sys

#: The commands' status when interrupted (128 + SIGINT, as shells report it).
INTERRUPTED_EXIT = 130
#: The line an interrupted command prints (the CLI's, and the early handler's).
INTERRUPTED = "interrupted; no output was written"
#: marlin-verify's, which writes nothing (its results are what it would have printed).
INTERRUPTED_CHECK = "interrupted; the check did not finish"
#: The command this process runs (set by the console scripts' entry); picks the line.
_command = [os.path.basename(sys.argv[0]) if sys.argv else ""]


def set_command(prog: str) -> None:
    _command[0] = prog


def write_fd(fd: int, text: str) -> None:
    """Write ``text`` to ``fd`` whole, without Python's buffered streams (safe in a signal
    handler); undecodable characters are escaped, and a closed descriptor is ignored."""
    data = text.encode("utf-8", "backslashreplace")
    while data:
        try:
            n = os.write(fd, data)
        except OSError:
            return
        data = data[n:]


def wants_json(argv: list[str]) -> bool:
    """Whether the command line asks for ``--json`` output, seen before click parses it
    (``--json=1`` too: its usage error is then a JSON document as well)."""
    return any(a == "--json" or a.startswith("--json=") for a in argv)


def is_command() -> bool:
    """Whether this process is ``marlin-convert`` or ``marlin-verify`` (the console
    scripts name themselves in ``argv[0]``)."""
    return bool(sys.argv) and os.path.basename(sys.argv[0]) in ("marlin-convert", "marlin-verify")


def quiet_interrupt_until_ready(as_json: bool) -> None:
    """Make Ctrl-C exit 130 with one line (a JSON document with ``as_json``) until the
    command installs its own handling (:func:`restore_interrupt`).  Only called when the
    process is one of the two commands (by this module, as it is imported)."""

    # Built now, without json (not imported yet, or half imported when the signal lands):
    # the document error_document writes for this constant ASCII line.
    said = INTERRUPTED_CHECK if _command[0] == "marlin-verify" else INTERRUPTED
    doc = (
        f'{{"ok": false, "error": {{"type": "KeyboardInterrupt", "message": "{said}", "file": null, "tensor": null}}}}'
    )
    fd, line = (1, doc) if as_json else (2, said)

    def handler(signum: int, frame: object) -> None:
        write_fd(fd, line + "\n")
        os._exit(INTERRUPTED_EXIT)

    # SIGTERM and SIGHUP too: the CLI maps them to the same exit once it runs; before
    # that their default action would kill the process silently (no JSON document).
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


if is_command():  # the console scripts import this package, and so this module, first: the
    # handler goes in before anything else is imported (typing alone is milliseconds)
    quiet_interrupt_until_ready(wants_json(sys.argv[1:]))

from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from typing import Any  # noqa: E402


def interrupted_message() -> str:
    """The interrupt line: :data:`INTERRUPTED`, or, once an output was committed (the
    interrupt landed after the rename, while cleaning up), which output is complete."""
    from .atomic import committed_outputs

    done = committed_outputs()
    if not done:
        return INTERRUPTED_CHECK if _command[0] == "marlin-verify" else INTERRUPTED
    return f"interrupted after the output was written: {done[-1]} is complete"


_keep: list[Any] = []  # the installed C callback: it must outlive its installation


def error_document(kind: str, message: str, file: object = None, tensor: str | None = None) -> str:
    """The commands' ``--json`` document for a failure: ``{"ok": false, "error": {...}}``;
    every string valid Unicode (:func:`converter.errors.json_text`), an empty ``file`` or
    ``tensor`` null."""
    import json

    from .errors import json_text

    def text(value: object) -> str | None:
        return json_text(str(value)) if value else None

    error = {"type": kind, "message": json_text(message), "file": text(file), "tensor": text(tensor)}
    return json.dumps({"ok": False, "error": error})


def restore_interrupt() -> None:
    """Ctrl-C raises KeyboardInterrupt again, so that writers unwind and delete their temporaries."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def sigbus_message() -> str:
    """The one line for a SIGBUS: the mapped input files that shrank (by name)."""
    from .safetensors_io import shrunk_files

    try:
        files = shrunk_files()
    except BaseException:  # reporting must not fail on the way out
        files = []
    where = ", ".join(str(p) for p in files) if files else "a memory-mapped input file"
    return (
        f"{where}: shrank while being read (truncated by another program?); reading past its new end "
        "raised SIGBUS; no output was written"
    )


@contextmanager
def sigbus_as_error(report: Callable[[str], None]) -> Iterator[None]:
    """While the block runs, a SIGBUS deletes the live temporaries, calls
    ``report(message)`` and exits with status 2 (see the module docstring).

    Where ctypes or ``signal()`` is unavailable, the block runs unguarded.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        install = libc.signal
    except (ImportError, OSError, AttributeError):
        yield
        return
    handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int)

    def on_sigbus(signum: int) -> None:
        # Runs inside the signal handler, in the thread whose read faulted; it must not
        # return (the read would fault again), so everything ends in os._exit.
        try:
            from .atomic import abort_all

            abort_all()
            report(sigbus_message())
        finally:
            os._exit(2)

    callback = handler_type(on_sigbus)
    install.restype = ctypes.c_void_p
    install.argtypes = [ctypes.c_int, ctypes.c_void_p]
    previous = install(signal.SIGBUS, ctypes.cast(callback, ctypes.c_void_p))
    _keep.append(callback)
    try:
        yield
    finally:
        install(signal.SIGBUS, previous)
        _keep.remove(callback)

"""The standard streams of the two commands: the lazily made rich consoles, and what
happens when stdout or stderr cannot be written (a reader that went away, a full disk)."""

from __future__ import annotations

import errno
import functools
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from rich.console import Console

from ..atomic import committed_outputs
from ..faults import write_fd

#: The exit status when stdout or stderr is a pipe whose reader went away (``| head``):
#: 128 + SIGPIPE, what a shell reports for a command that SIGPIPE ended; never 1, which
#: means "problems found" (or a bug).  Nothing more is printed then.
BROKEN_PIPE_EXIT = 141


class _StreamError(Exception):
    """stdout or stderr failed (a broken pipe, a full disk) while a command printed: an
    ``OSError`` that click would turn into exit 1 (see :func:`_stream_failed`)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


def _guard_streams(fn: Callable[..., None]) -> Callable[..., None]:
    """A command whose ``OSError`` escapes (its own are mapped by :func:`_errors_to_exit`,
    so what is left failed to print) raises :class:`_StreamError` instead."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except OSError as exc:
            raise _StreamError(exc) from None

    return run


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream is not None and stream.isatty())
    except (OSError, ValueError, AttributeError):
        return False


class _Console(Console):
    """rich's console, except that a broken pipe raises (for :func:`_stream_failed`),
    instead of rich's own exit with status 1 ("problems found")."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


#: The width of a console that is not a terminal: no line is ever wrapped there.
UNWRAPPED_WIDTH = 1 << 20


class _LazyConsole:
    """A rich :class:`Console` made on first use, not at import: a closed stdout or stderr
    (``sys.stdout`` None) must not fail the import.  Output that is not a terminal (logs,
    CI, a pipe) is never wrapped: tables at their natural width, every line whole (a grep
    finds it), and no padding to a width."""

    def __init__(self, stderr: bool) -> None:
        self._stderr = stderr
        self._console: _Console | None = None

    def get(self) -> Console:
        if self._console is None:
            stream = sys.stderr if self._stderr else sys.stdout
            tty = _isatty(stream)
            self._console = _Console(
                stderr=self._stderr, highlight=False, width=None if tty else UNWRAPPED_WIDTH, soft_wrap=not tty
            )
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)


def _real(console: Any) -> Console:
    """The rich console behind a lazy one (made now), for code that wants a real one."""
    return console.get() if isinstance(console, _LazyConsole) else console


err_console: Any = _LazyConsole(stderr=True)
out_console: Any = _LazyConsole(stderr=False)


def _can_encode(console: Any, text: str) -> bool:
    """Whether ``console``'s stream can encode ``text`` (an ASCII terminal cannot encode a check mark)."""
    try:
        text.encode(console.encoding or "utf-8")
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def _standard_streams() -> None:
    """Put ``/dev/null`` on a closed descriptor 0, 1 or 2, and make the streams escape
    what their encoding cannot hold (``PYTHONIOENCODING=ascii``) instead of failing."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            pass


def _stream_failed(exc: OSError) -> NoReturn:
    """stdout or stderr failed: a broken pipe exits quietly; anything else (a full
    disk) is one line on stderr, if stderr can take it.  Either way the streams then
    point at ``/dev/null``, so the interpreter's last flush cannot fail again."""
    null = os.open(os.devnull, os.O_WRONLY)
    broken = exc.errno == errno.EPIPE
    if not broken:
        done = committed_outputs()
        after = f"; {done[-1]} was written and is complete" if done else ""
        write_fd(2, f"error: cannot write to standard output: {exc.strerror or exc}{after}\n")
    os.dup2(null, 1)
    if broken:
        os.dup2(null, 2)
    os.close(null)
    sys.exit(BROKEN_PIPE_EXIT if broken else 2)

"""What a signal must find, since a fatal one unwinds no stack and an interrupt can land
between two renames: the writers whose temporaries exist (to delete them), the outputs
already committed (never to claim nothing was written), and the commit that must not
be cut in half (signals held until it ends).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

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

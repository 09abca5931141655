"""What both commands print through: names escaped for the console, the ``--json``
document, an error as one line (or one JSON document) with its exit status, progress."""

from __future__ import annotations

import json
import os
import signal
import traceback
import warnings as pywarnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..errors import ConverterError, json_text, printable
from ..faults import (
    INTERRUPTED_EXIT,
    error_document,
    interrupted_message,
    restore_interrupt,
    sigbus_as_error,
    write_fd,
)
from .streams import _real, err_console


def _show(text: str) -> str:
    """A name or message from a file, safe for a rich console: escaped markup and control characters."""
    return escape(printable(str(text)))


def _exit_on_signal(signum: int, frame: object) -> None:
    # SIGTERM/SIGHUP unwind like Ctrl-C, so the writers delete their temporary files.
    raise KeyboardInterrupt


def _print_json(doc: Any) -> None:
    print(json.dumps(_json_safe(doc), default=_jsonable))


def _json_safe(obj: Any) -> Any:
    """Every string valid Unicode (see :func:`converter.errors.json_text`)."""
    if isinstance(obj, str):
        return json_text(obj)
    if isinstance(obj, dict):
        return {_json_safe(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


#: Whether this invocation printed its error line (an interrupt's included); an exit 130
#: without one is typer's own, for a Ctrl-C that landed outside our handlers.
_failed = [False]


def _fail(
    message: str,
    as_json: bool,
    *,
    kind: str = "UsageError",
    code: int = 2,
    file: object = None,
    tensor: str | None = None,
    tag: str = "[bold red]error:[/] ",
) -> NoReturn:
    """One error line on stderr, or (``--json``) one error document on stdout; then exit."""
    _failed[0] = True
    if as_json:
        print(error_document(kind, message, file, tensor))
    else:
        err_console.print(f"{tag}{_show(message)}", soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def _errors_to_exit(debug: bool, as_json: bool) -> Iterator[None]:
    """Map our errors to one stderr line (or, with ``--json``, one JSON error document
    on stdout and nothing on stderr) and exit 2; interrupts exit 130."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    restore_interrupt()  # from here on Ctrl-C unwinds, so the writers delete their temporaries

    def on_sigbus(message: str) -> None:
        out = error_document("SigbusError", message) if as_json else f"error: {printable(message)}"
        write_fd(1 if as_json else 2, out + "\n")

    debugging = debug or bool(os.environ.get("MARLIN_DEBUG"))
    try:
        with sigbus_as_error(on_sigbus), pywarnings.catch_warnings():
            if as_json:  # stderr stays empty: a library's warning would land there
                pywarnings.simplefilter("ignore")
            yield
    except ConverterError as exc:
        if debugging:
            traceback.print_exc()
            raise typer.Exit(exc.exit_code) from None
        _fail(str(exc), as_json, kind=type(exc).__name__, code=exc.exit_code, file=exc.path, tensor=exc.tensor)
    except OSError as exc:
        # The environment, not the input's content (disk full, folder vanished): one
        # line and exit 2 as well; the temporary output was already removed.
        if debugging:
            traceback.print_exc()
            raise typer.Exit(2) from None
        where = f"{exc.filename}: " if exc.filename else ""
        msg = f"{where}{exc.strerror or exc}"
        _fail(msg, as_json, kind=type(exc).__name__, file=exc.filename)
    except KeyboardInterrupt:
        _fail(interrupted_message(), as_json, kind="KeyboardInterrupt", code=INTERRUPTED_EXIT, tag="")
    except (typer.Exit, typer.Abort):
        raise
    except Exception as exc:
        # A bug, not bad input: the traceback is what to report, except where stdout
        # must stay one JSON document (then it is one line, and --debug shows the rest).
        if not as_json or debugging:
            raise
        _fail(
            f"internal error {type(exc).__name__}: {exc}; this is a bug, rerun with --debug for the traceback",
            as_json,
            kind="InternalError",
            code=1,
        )


@contextmanager
def _progress(enabled: bool) -> Iterator[Callable[[str, int], None] | None]:
    if not enabled:
        yield None
        return
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=_real(err_console),
        transient=True,
    )
    task: list[Any] = []

    def step(desc: str, n: int) -> None:
        if desc:
            if task:
                bar.update(task[0], completed=bar.tasks[0].total)
                bar.remove_task(task.pop())
            task.append(bar.add_task(desc, total=n))
        elif task:
            bar.advance(task[0], n)

    with bar:
        yield step


def _show_progress(quiet: bool, as_json: bool) -> bool:
    return not (quiet or as_json) and err_console.is_terminal


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(type(obj).__name__)


def _group_cell(group_size: int, size_k: int, source_group_size: int | None, act_order: bool) -> str:
    """The ``group`` cell of both commands' tables: ``128``, ``chan``, ``64 (from 128)``, ``... act-order``."""
    group = "chan" if group_size == size_k else str(group_size)
    return (
        group
        + (f" (from {source_group_size})" if source_group_size is not None else "")
        + (" act-order" if act_order else "")
    )

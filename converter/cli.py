"""The ``marlin-convert`` and ``marlin-verify`` commands (thin: parse, call, render).

Exit codes: 0 success; 1 verification found problems; 2 bad input, bad usage or an
unreadable file (one line on stderr naming the file, the tensor and the rule; the
traceback only with ``--debug`` or ``MARLIN_DEBUG=1``); 130 interrupted (Ctrl-C,
SIGTERM, SIGHUP), with every temporary file removed; 141 (:data:`BROKEN_PIPE_EXIT`) the
reader of stdout went away (``| head``), quietly.

One output policy for both: results (the summary or verification table, the problems
found, the status line, ``--json``'s document) go to stdout; progress, notes, warnings
and errors to stderr.  ``-q`` prints nothing but errors (with ``--json``, the document
too), except that ``marlin-verify`` also prints the problems that fail the check and the
status line when it fails; ``-v`` the long form.  With ``--json``, stdout is exactly one JSON document and
stderr stays empty, for usage errors and interrupts too.  Names that come from files
(tensors, layers, file names) are printed with control characters escaped
(:func:`converter.errors.printable`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import functools
import glob
import json
import os
import re
import shutil
import signal
import sys
import traceback
import warnings as pywarnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import __version__
from .artifact.problems import Report
from .artifact.shards import human_size
from .atomic import committed_outputs
from .errors import ConverterError, json_text, printable, short_name
from .faults import (
    INTERRUPTED_EXIT,
    error_document,
    interrupted_message,
    restore_interrupt,
    sigbus_as_error,
    wants_json,
    write_fd,
)

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


InPath = Annotated[
    Path,
    typer.Argument(
        metavar="IN",
        help="Input: a .tinyloop file, or a GPTQ / AWQ (gemm) / compressed-tensors (pack-quantized) "
        "checkpoint folder / .safetensors / index.json.",
        show_default=False,
    ),
]
# str, not Path: a trailing "/" (folder mode) must survive parsing.
OutPath = Annotated[
    str,
    typer.Argument(
        metavar="OUT",
        help="Output: a .safetensors file; any other path is a model folder (as save_pretrained writes: "
        "model.safetensors + config.json + tokenizer files; created if missing).",
        show_default=False,
    ),
]
ArtPath = Annotated[
    Path,
    typer.Argument(
        metavar="ART",
        help="Artifact to verify: a .safetensors file, a sharded artifact's index.json, or its folder.",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")]
QuietOpt = Annotated[
    bool,
    typer.Option("--quiet", "-q", help="Print nothing but errors (with --json, the JSON document too)."),
]
VerifyQuietOpt = Annotated[
    bool,
    typer.Option(
        "--quiet",
        "-q",
        help="Print only what fails: errors, and when the check fails its failing problems and the status line; "
        "nothing when all is good (with --json, the JSON document too).",
    ),
]


def _version_option(prog: str) -> Any:
    """``--version``: ``<prog> <version>``, or with ``--json`` one JSON document."""

    def show(value: bool) -> None:
        if value:
            if wants_json(sys.argv[1:]):  # eager: --json may not be parsed yet, and stdout stays one document
                sys.stdout.write(json.dumps({"ok": True, "program": prog, "version": __version__}) + "\n")
            else:
                out_console.print(f"{prog} {__version__}")
            raise typer.Exit(0)

    return typer.Option("--version", callback=show, is_eager=True, help="Show the version and exit.")


def nvidia_gpu_present() -> bool:
    """Whether this machine has an NVIDIA GPU (its device nodes, driver or ``nvidia-smi``),
    CuPy or not: only there can installing the GPU extra help."""
    return bool(
        glob.glob("/dev/nvidia[0-9]*")
        or glob.glob("/proc/driver/nvidia/gpus/*")
        or shutil.which("nvidia-smi") is not None
    )


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


class _Command(typer.core.TyperCommand):
    """Usage as man pages and the README write it: ``marlin-convert [OPTIONS] IN OUT``
    (typer writes a required argument as ``{IN}``)."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [re.sub(r"^\{(.*)\}$", r"\1", piece) for piece in super().collect_usage_pieces(ctx)]


# Plain tracebacks (with --debug) that paste cleanly into a bug report.
convert_app = typer.Typer(add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False)


@convert_app.command(
    cls=_Command,
    help="Convert an asymmetric 4-bit checkpoint (.tinyloop, GPTQ, AWQ, compressed-tensors) into a Marlin "
    "safetensors artifact: one file (OUT ends in .safetensors), HF shards with --max-shard-size, or a model "
    "folder (any other OUT).\n\n"
    "The summary goes to stdout; progress, warnings and errors to stderr.\n\n"
    "Exit codes: 0 ok; 1 a bug (InternalError, traceback with --debug); 2 bad input or usage (nothing is "
    "written); 130 interrupted (nothing is written); 141 stdout's reader went away (| head).",
    epilog="Example: marlin-convert model.tinyloop model.marlin.safetensors",
)
@_guard_streams
def convert_cmd(
    source: InPath,
    output: OutPath,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing output.")] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print what would be converted and written; write nothing.")
    ] = False,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    max_shard_size: Annotated[
        str | None,
        typer.Option(
            "--max-shard-size",
            help="Split the output into HF shards of at most this much tensor data, plus an index; the unit is "
            "required (e.g. 5GB, 500MiB; 5B for bytes). A layer larger than that gets a shard of its own, "
            "with a warning.",
            show_default=False,
        ),
    ] = None,
    pad: Annotated[
        bool,
        typer.Option(
            "--pad/--no-pad",
            help="Convert a layer whose N is not a multiple of 64 with N padded by zero columns (recorded as "
            "padded_n; the kernels return exactly N columns). --no-pad passes such layers through.",
        ),
    ] = True,
    verbose: Annotated[
        bool,
        typer.Option("--verbose", "-v", help="The long summary: every layer, every passed-through tensor, every file."),
    ] = False,
    to: Annotated[
        str,
        typer.Option(
            "--to",
            help="Output format: 'marlin' (the Marlin artifact, default) or 'compressed-tensors' (an exact "
            "asymmetric pack-quantized model folder that vLLM and SGLang load; docs/export.md).",
        ),
    ] = "marlin",
    allow_passthrough: Annotated[
        bool,
        typer.Option(
            "--allow-passthrough",
            help="With --to compressed-tensors: copy layers that have no exact compressed-tensors form "
            "unconverted (listed in 'ignore') instead of refusing.",
        ),
    ] = False,
    legacy_act_order: Annotated[
        bool,
        typer.Option(
            "--legacy-act-order",
            help="With --to compressed-tensors: write act-order layers with weight_g_idx (actorder: group), "
            "which compressed-tensors 0.20 no longer reads but vLLM's Marlin path applies.",
        ),
    ] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", hidden=True)] = False,
    debug: DebugOpt = False,
    version: Annotated[bool, _version_option("marlin-convert")] = False,
) -> None:
    if overwrite:  # the name other tools use: point at ours
        _fail("no such option: --overwrite; to replace an existing output, pass --force", as_json)
    if to not in EXPORT_FORMATS:
        _fail(f"--to {to!r}: one of {', '.join(EXPORT_FORMATS)}", as_json)
    if to != "marlin":
        _export_cmd(source, output, to, force, dry_run, as_json, quiet, max_shard_size, pad, debug,
                    allow_passthrough=allow_passthrough, legacy_act_order=legacy_act_order)  # fmt: skip
        return
    if allow_passthrough or legacy_act_order:
        _fail("--allow-passthrough and --legacy-act-order go with --to compressed-tensors", as_json)
    with _errors_to_exit(debug, as_json), _progress(_show_progress(quiet, as_json)) as prog:
        from .convert import convert

        report = convert(
            source, output, force=force, dry_run=dry_run, progress=prog, max_shard_size=max_shard_size, pad=pad
        )
    if as_json:
        _print_json(report.to_json())
    elif not quiet:
        _render_convert(report, verbose)


#: What ``--to`` accepts: the Marlin artifact, or an exact export (converter.export).
EXPORT_FORMATS = ("marlin", "compressed-tensors")


def _export_cmd(
    source: Path,
    output: Path,
    to: str,
    force: bool,
    dry_run: bool,
    as_json: bool,
    quiet: bool,
    max_shard_size: str | None,
    pad: bool,
    debug: bool,
    *,
    allow_passthrough: bool,
    legacy_act_order: bool,
) -> None:
    """``marlin-convert IN OUT --to compressed-tensors``: :func:`converter.export.export_compressed_tensors`."""
    if dry_run or not pad:
        _fail(f"--dry-run and --no-pad are for the Marlin artifact, not --to {to}", as_json)
    with _errors_to_exit(debug, as_json):
        from .artifact.shards import parse_size
        from .export import export_compressed_tensors

        summary = export_compressed_tensors(
            source,
            output,
            allow_passthrough=allow_passthrough,
            max_shard_size=None if max_shard_size is None else parse_size(max_shard_size),
            force=force,
            legacy_act_order=legacy_act_order,
        )
    if as_json:
        _print_json(summary.to_json())
    elif not quiet:
        for line in summary.text().splitlines():
            out_console.print(_show(line), soft_wrap=True, highlight=False)


#: Lines of "not converted" groups, and of warnings, shown before "... more" (``--verbose``: all).
SUMMARY_LINES = 12
#: File names the ``files:`` line shows before "... N more" (``--verbose``: all).
FILES_SHOWN = 4
_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)")
#: What the summary's ``upstream`` column means, printed under a table where it says "no".
UPSTREAM_LEGEND = (
    "upstream: whether upstream IST-DASLab Marlin (K % 128, N % 256, group 128 or per-channel) could run the layer "
    'too; "no" is not an error'
)


def name_patterns(names: Iterable[str]) -> list[tuple[str, int]]:
    """Layer or tensor names grouped by their pattern, numeric components as ``*``.

    ``model.layers.3.self_attn.q_proj`` -> ``model.layers.*.self_attn.q_proj``; a
    pattern only one name has is that name.  Returns ``[(pattern, count)]`` in order
    of first appearance.
    """
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(_INDEX.sub("*", name), []).append(name)
    # a crafted multi-megabyte name is shown by its start, length and hash (errors.short_name)
    return [(short_name(pat if len(ns) > 1 else ns[0]), len(ns)) for pat, ns in groups.items()]


def _patterns_text(names: Iterable[str]) -> str:
    return ", ".join(p if n == 1 else f"{p} ({n})" for p, n in name_patterns(names))


def _group_cell(group_size: int, size_k: int, source_group_size: int | None, act_order: bool) -> str:
    """The ``group`` cell of both commands' tables: ``128``, ``chan``, ``64 (from 128)``, ``... act-order``."""
    group = "chan" if group_size == size_k else str(group_size)
    return (
        group
        + (f" (from {source_group_size})" if source_group_size is not None else "")
        + (" act-order" if act_order else "")
    )


def _layer_cells(lay: Any) -> tuple[str, ...]:
    """The K ... upstream cells of a converted layer's row (a ``LayerEntry``)."""
    return (
        str(lay.size_k),
        str(lay.size_n) + (f" (pad {lay.padded_n})" if lay.padded_n is not None else ""),
        _group_cell(lay.group_size, lay.size_k, lay.source_group_size, lay.act_order),
        str(lay.bits),
        "yes" if lay.symmetric else "no",
        lay.zero_convention.value,
        "yes" if lay.upstream_marlin_compatible else "no",
    )


def _files_text(files: list[dict[str, Any]], verbose: bool) -> str:
    """``name (size)`` of every file, or (not ``verbose``, when more than one would be left
    out) the first few, the index file if there is one, and ``... N more`` at the end."""
    items = [f"{f['name']} ({human_size(f['bytes'])})" for f in files]
    index = [i for i, f in enumerate(files) if str(f["name"]).endswith(".index.json")][:1]
    if verbose or len(items) <= FILES_SHOWN + 1:  # hiding one file would save nothing
        return ", ".join(items)
    keep = [i for i in range(len(items)) if i not in index][: FILES_SHOWN - len(index)] + index
    return ", ".join([*(items[i] for i in keep), f"... {len(items) - len(keep)} more (--verbose lists all)"])


def _render_convert(report: Any, verbose: bool) -> None:
    """The summary of :func:`~converter.convert.convert`: the result on stdout, warnings on stderr.

    By default: the converted layers as one table row per name pattern and shape (a
    200-layer model fits on a screen), the regrouped and padded layers, the layers not
    converted grouped by reason with their name patterns, the plain tensors counted by
    reason, the files (the first few), and a total; the warnings grouped, on stderr.
    ``verbose``: one row per layer, every passed-through tensor with its reason, every
    file, every warning.
    """
    print_ = out_console.print
    dry = report.dry_run
    title = f"would convert {report.source}, would write {report.output}" if dry else f"wrote {report.output}"
    print_(_show(title), soft_wrap=True)  # a line of its own: a table title would wrap at the table's width
    table = Table()
    for col in ("layer", "count", "K", "N", "group", "bits", "sym", "zeros", "upstream"):
        table.add_column(col, overflow="fold")
    rows: dict[tuple[str, ...], list[str]] = {}
    for lay in report.converted:
        rows.setdefault((lay.name if verbose else _INDEX.sub("*", lay.name), *_layer_cells(lay)), []).append(lay.name)
    for (pattern, *cells), names in rows.items():
        table.add_row(_show(names[0] if len(names) == 1 else pattern), str(len(names)), *cells)
    if rows:
        print_(table)
    if any(not lay.upstream_marlin_compatible for lay in report.converted):
        print_(f"[dim]{_show(UPSTREAM_LEGEND)}[/]", soft_wrap=True)
    lines: list[str] = []

    def group(head: str, names: list[str]) -> None:
        lines.append(f"{head}\n  {_show(', '.join(names) if verbose else _patterns_text(names))}")

    regrouped = [lay for lay in report.converted if lay.source_group_size is not None]
    if regrouped:
        sizes = ", ".join(f"{a} -> {b}" for a, b in sorted({(r.source_group_size, r.group_size) for r in regrouped}))
        group(
            f"{len(regrouped)} layer(s) regrouped, exactly (short last group; each source group's scale and zero "
            f"repeated per slice): group size {sizes}",
            [lay.name for lay in regrouped],
        )
    padded = [lay for lay in report.converted if lay.padded_n is not None]
    if padded:
        group(
            f"{len(padded)} layer(s) padded (N rounded up to a multiple of 64 with zero columns; outputs keep N)",
            [lay.name for lay in padded],
        )
    by_reason: dict[str, list[str]] = {}
    for nc in report.not_converted:
        by_reason.setdefault(nc.reason, []).append(nc.name)
    for reason, names in by_reason.items():
        group(f"{len(names)} layer(s) not converted: {_show(reason)}", names)
    of_layers = {t for nc in report.not_converted for t in nc.tensors}
    plain: dict[str, list[str]] = {}
    for p in report.passthrough:
        if verbose or p.name not in of_layers:
            plain.setdefault(p.reason, []).append(p.name)
    if verbose:  # every carried-over tensor, the not-converted layers' too
        lines += [f"pass-through: {_show(', '.join(names))}  [dim]({_show(why)})[/]" for why, names in plain.items()]
    elif plain:
        counts = "; ".join(f"{_show(why)} ({len(names)})" for why, names in plain.items())
        lines.append(f"{sum(map(len, plain.values()))} plain tensor(s) carried over unchanged: {counts}")
    _print_capped(print_, lines, verbose, "--verbose for all; --json for every tensor")
    warnings: dict[str, list[str]] = {}
    for lay in report.converted:
        for w in lay.warnings:
            warnings.setdefault(w, []).append(lay.name)
    notes = [
        f"[yellow]warning:[/] {_show(', '.join(names) if verbose else _patterns_text(names))}: {_show(w)}"
        for w, names in warnings.items()
    ] + [f"[yellow]warning:[/] {_show(w)}" for w in report.warnings]
    # One warning, one line (a log grep finds it whole).
    _print_capped(err_console.print, notes, verbose, "warnings; --verbose for all", soft_wrap=True)
    verb = "would write" if dry else "wrote"
    if dry or len(report.files) > 1:
        print_(f"files: {verb} {len(report.files)}: {_show(_files_text(report.files, verbose))}", soft_wrap=True)
    extra = ", ".join(f"{len(xs)} {what}" for xs, what in ((regrouped, "regrouped"), (padded, "padded")) if xs)
    counts = (
        f"would convert {len(report.converted)} layers{f' ({extra})' if extra else ''}, "
        f"pass {len(report.passthrough)} tensors through"
        if dry
        else f"{len(report.converted)} layers converted{f' ({extra})' if extra else ''}, "
        f"{len(report.passthrough)} tensors passed through"
    )
    print_(f"{counts}; {verb} {human_size(report.bytes_out)} of tensor data")


def _print_capped(
    print_: Callable[..., None], lines: list[str], verbose: bool, more: str, *, soft_wrap: bool = False
) -> None:
    """``lines``, or the first :data:`SUMMARY_LINES` and a count of the rest."""
    shown = lines if verbose else lines[:SUMMARY_LINES]
    for line in shown:
        print_(line, soft_wrap=soft_wrap)
    if len(shown) < len(lines):
        print_(f"... and {len(lines) - len(shown)} more ({more})")


verify_app = typer.Typer(add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False)


@verify_app.command(
    cls=_Command,
    help="Verify a Marlin artifact: structure and checksums (--shapes, no GPU), exact agreement with its source "
    "(--against), and numerics on CPU and GPU.\n\n"
    "The table, the problems and the status line go to stdout; progress, notes and errors to stderr.\n\n"
    "Exit codes: 0 all good; 1 problems found; 2 unreadable input or bad usage; 130 interrupted; 141 stdout's "
    "reader went away (| head).",
    epilog="Example: marlin-verify model.marlin.safetensors --shapes --against model.tinyloop",
)
@_guard_streams
def verify_cmd(
    artifact: ArtPath,
    shapes: Annotated[
        bool, typer.Option("--shapes", help="Structure, shapes and checksums only; needs no GPU.")
    ] = False,
    against: Annotated[
        Path | None, typer.Option("--against", help="Source checkpoint to compare with, exactly.", show_default=False)
    ] = None,
    gpu: Annotated[bool, typer.Option("--gpu", help="Require GPU numerics (fail if no GPU).")] = False,
    cpu: Annotated[bool, typer.Option("--cpu", help="Skip GPU numerics even if a GPU is present.")] = False,
    as_json: JsonOpt = False,
    quiet: VerifyQuietOpt = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="Every problem (not the first 30), and every note on stderr, among them which CPU loops ran "
            "(compiled or NumPy: the cpu rel err figures depend on it).",
        ),
    ] = False,
    model: Annotated[
        bool,
        typer.Option(
            "--model",
            help="Whole-model parity: ART is a converted model folder; run it, and fp32 and fp16 models "
            "dequantized from --against, on the same tokens (needs the [model] extra).",
        ),
    ] = False,
    text: Annotated[
        Path | None,
        typer.Option(
            "--text",
            help="With --model: a UTF-8 text file to tokenize as the input (default: fixed tokens); "
            "perplexities for causal LMs.",
            show_default=False,
        ),
    ] = None,
    allow_source_mismatch: Annotated[
        bool,
        typer.Option(
            "--allow-source-mismatch",
            help="With --model: run the models even when --against is not the checkpoint the folder was "
            "converted from (its sha256 differs); by default that fails before any model is built.",
        ),
    ] = False,
    debug: DebugOpt = False,
    version: Annotated[bool, _version_option("marlin-verify")] = False,
) -> None:
    if gpu and cpu:
        _fail("--gpu and --cpu contradict each other", as_json)
    use_gpu = True if gpu else (False if cpu else None)  # None: when CuPy and a GPU are there
    if model or text is not None or allow_source_mismatch:
        _verify_model_cmd(
            artifact,
            against,
            text,
            model=model,
            gpu=use_gpu,
            shapes=shapes,
            as_json=as_json,
            quiet=quiet,
            debug=debug,
            allow_source_mismatch=allow_source_mismatch,
        )
    if artifact.is_dir():
        with _errors_to_exit(debug, as_json):
            from .export import export_manifest

            exported = export_manifest(artifact) is not None
        if exported:
            _verify_export_cmd(artifact, against, as_json, quiet, debug, shapes=shapes)
    with _errors_to_exit(debug, as_json), _progress(_show_progress(quiet, as_json)) as prog:
        from .verify import verify

        report = verify(artifact, shapes_only=shapes, against=against, gpu=use_gpu, progress=prog)
    if as_json:
        _print_json(report.to_json())
    else:
        _render_verify(report, quiet, verbose)
    raise typer.Exit(0 if report.ok else 1)


def _verify_export_cmd(
    folder: Path, against: Path | None, as_json: bool, quiet: bool, debug: bool, *, shapes: bool = False
) -> None:
    """``marlin-verify EXPORT --against SRC`` on a ``--to compressed-tensors`` export:
    :func:`converter.export.check_export` (codes, scales, zero points and act-order exactly,
    the source's sha256, and unless ``shapes`` the CPU numerics). Exits 0 when it passes,
    1 when it does not."""
    if against is None:
        _fail("a compressed-tensors export is checked against its source: pass --against SRC", as_json)
    with _errors_to_exit(debug, as_json):
        from .export import check_export

        check = check_export(folder, against, numerics=not shapes)
    ok = not check.problems
    if as_json:
        _print_json({"ok": ok, "export": str(folder), "against": str(against), **dataclasses.asdict(check)})
    else:
        for problem in check.problems:
            err_console.print(_show(f"problem: {problem}"), soft_wrap=True)
        if not quiet or not ok:
            status = (
                f"OK: {len(check.checked)} exported layers equal the source exactly"
                if ok
                else f"FAILED: {len(check.problems)} problem(s)"
            )
            unchecked = f"; not read back: {len(check.unchecked)}" if check.unchecked else ""
            what = "; checked against source" + (", CPU numerics" if check.cpu_numerics else "")
            out_console.print(_show(status + unchecked + what), soft_wrap=True)
    raise typer.Exit(0 if ok else 1)


def _verify_model_cmd(
    folder: Path,
    against: Path | None,
    text: Path | None,
    *,
    model: bool,
    gpu: bool | None,
    shapes: bool,
    as_json: bool,
    quiet: bool,
    debug: bool,
    allow_source_mismatch: bool,
) -> None:
    """``marlin-verify OUTDIR --model --against SRC``: see :mod:`converter.model.verify`."""
    usage = (
        "--text needs --model"
        if not model and text is not None
        else "--allow-source-mismatch needs --model (without it, --against compares anyway and reports "
        "source_differs first)"
        if not model
        else "--model and --shapes contradict each other (--shapes checks structure only)"
        if shapes
        else "--model needs --against SRC: the reference model is built from the source checkpoint"
        if against is None
        else None
    )
    if usage:
        _fail(usage, as_json)

    def stage(line: str) -> None:
        err_console.print(f"marlin-verify --model: {_show(line)}", soft_wrap=True)

    with _errors_to_exit(debug, as_json):
        from .model.report import render
        from .model.verify import verify_model

        report = verify_model(
            folder,
            against,
            text=text,
            gpu=gpu,
            progress=None if (as_json or quiet) else stage,
            allow_source_mismatch=allow_source_mismatch,
        )
    if as_json:
        _print_json(report.to_json())
    else:
        render(report, _real(out_console), _real(err_console), quiet=quiet)
    raise typer.Exit(0 if report.ok else 1)


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(type(obj).__name__)


#: Problems printed by marlin-verify before the rest are counted (all of them with --json or --verbose).
PROBLEM_LINES = 30


def cpu_loops_line() -> str:
    """``marlin-verify -v``'s note on which CPU loops computed ``cpu rel err``: the
    compiled ones (:mod:`converter._native`) or the NumPy code; the figures differ
    between the two (fp32 sums in another order)."""
    from . import native

    loops = "compiled loops" if native.lib() is not None else "NumPy code"
    return f"CPU numerics: {loops} ({native.status()}); the cpu rel err figures depend on which ran"


def _render_verify(report: Report, quiet: bool, verbose: bool = False) -> None:
    """The result on stdout: the table, the problems, the status line; ``quiet``: only
    the errors and, when there are any, the status line.  A note on GPU numerics that
    did not run goes to stderr, and only where it can help: a machine with an NVIDIA GPU
    (where installing CuPy, say, would make them run); elsewhere only with ``verbose``."""
    errors = [p for p in report.problems if p.severity == "error"]
    bad_layers = {p.tensor.rsplit(".", 1)[0] for p in errors} | {p.tensor for p in errors}
    # A layer that does not match --against's source has no meaningful "cpu rel err": it
    # would measure the artifact against a reference that is not its source.
    unmatched = {p.tensor for p in report.problems if p.code == "source_mismatch"}
    unmatched |= {t.rsplit(".", 1)[0] for t in unmatched}
    if not quiet and report.layers:
        with_gpu = any(isinstance(row.get("gpu"), dict) for row in report.layers)
        out_console.print(_show(report.artifact), soft_wrap=True)  # not a table title, which would wrap
        marks = ("❌", "✅") if _can_encode(out_console, "❌✅") else ("X", "ok")
        table = Table()  # rich draws its box in ASCII where the stream needs it
        cols = ["", "layer", "K", "N", "group", "sym", "exact", "cpu rel err"] + (
            ["gpu mean / max rel err"] if with_gpu else []
        )
        for col in cols:
            table.add_column(col, overflow="fold")
        for row in report.layers:
            exact = [row[k] for k in ("codes_exact", "scales_exact", "delta_exact", "padding_exact") if k in row]
            gpu = row.get("gpu")
            cells = [
                marks[row["name"] not in bad_layers],
                _show(short_name(row["name"])),
                str(row["size_k"]),
                str(row["size_n"]) + (f" (pad {row['padded_n']})" if "padded_n" in row else ""),
                _group_cell(
                    row["group_size"], row["size_k"], row.get("source_group_size"), row.get("act_order", False)
                ),
                "yes" if row["symmetric"] else "no",
                ("yes" if all(exact) else "NO") if exact else "-",
                f"{row['cpu_rel_err']:.2e}"
                if "cpu_rel_err" in row and all(exact) and row["name"] not in unmatched
                else "-",
            ]
            if with_gpu:
                cells.append(
                    f"{gpu['mean_rel_err']:.2e} / {gpu['max_rel_err']:.2e}" if isinstance(gpu, dict) else "skipped"
                )
            table.add_row(*cells)
        out_console.print(table)
    # The first lines say what is wrong; a wrong --against source, say, makes one per
    # tensor. --json and --verbose keep every problem.
    problems = errors if quiet else report.problems
    shown = problems if verbose else problems[:PROBLEM_LINES]
    for p in shown:
        tag = "[red]problem[/]" if p.severity == "error" else "[yellow]warning[/]"
        out_console.print(f"{tag} {escape(f'[{p.code}]')} {_show(p.message)}", soft_wrap=True)
    if len(shown) < len(problems):
        rest = problems[len(shown) :]
        codes = sorted({p.code for p in rest})
        out_console.print(
            f"... and {len(rest)} more ({', '.join(codes)}); --verbose or --json lists every problem", soft_wrap=True
        )
    if verbose and not quiet and report.checked.get("cpu_numerics"):
        err_console.print(f"[dim]{_show(cpu_loops_line())}[/]", soft_wrap=True)
    gpu_note = report.checked.get("gpu_numerics")
    if isinstance(gpu_note, str) and not quiet:
        if nvidia_gpu_present():  # something can be done here: say what
            err_console.print(f"[dim]GPU numerics {_show(gpu_note)}[/]", soft_wrap=True)
        elif verbose:
            err_console.print("[dim]GPU numerics not run: no NVIDIA GPU on this machine[/]", soft_wrap=True)
    if quiet and report.ok:
        return
    checked = report.checked
    what = (
        ["shapes", "checksums"]
        + (["against source"] if "against" in checked else [])
        + (["CPU numerics"] if checked.get("cpu_numerics") else [])
        + (["GPU numerics"] if checked.get("gpu_numerics") is True else [])
    )
    status = "OK" if report.ok else f"FAILED: {len(errors)} problem(s)"
    out_console.print(
        f"{status}: {checked.get('layers', 0)} layers, {checked.get('tensors', 0)} tensors; checked {', '.join(what)}"
    )


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
    try:
        code = _run(app, prog, wants_json(sys.argv[1:]))
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
    except _StreamError as exc:
        _stream_failed(exc.error)
    except OSError as exc:
        _stream_failed(exc)
    sys.exit(code)


def _run(app: typer.Typer, prog: str, as_json: bool) -> int:
    try:
        code = app(prog_name=prog, standalone_mode=False)
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_convert())

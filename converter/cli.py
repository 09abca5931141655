"""The ``marlin-convert`` and ``marlin-verify`` commands (thin: parse, call, render).

Exit codes: 0 success; 1 verification found problems; 2 bad input, bad usage or an
unreadable file (one line on stderr naming the file, the tensor and the rule; the
traceback only with ``--debug`` or ``MARLIN_DEBUG=1``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from . import __version__
from .artifact.problems import Report
from .errors import ConverterError

# Piped output (logs, CI) gets wide tables instead of 80-column wrapping.
err_console = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 160)
out_console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)

InPath = Annotated[
    Path,
    typer.Argument(
        help="Input: a .tinyloop file, or a GPTQ / AWQ (gemm) / compressed-tensors (pack-quantized) "
        "checkpoint folder / .safetensors / index.json.",
        show_default=False,
    ),
]
# str, not Path: a trailing "/" (folder mode) must survive parsing.
OutPath = Annotated[
    str,
    typer.Argument(
        help="Output artifact (.safetensors), or a folder (existing, or ending in '/') for model.safetensors "
        "+ config.json + tokenizer files.",
        show_default=False,
    ),
]
ArtPath = Annotated[
    Path,
    typer.Argument(
        help="Artifact to verify: a .safetensors file, a sharded artifact's index.json, or its folder.",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout.")]
DebugOpt = Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")]


def _version(value: bool) -> None:
    if value:
        out_console.print(f"{Path(sys.argv[0]).name or 'marlin-convert'} (marlin-convert {__version__})")
        raise typer.Exit(0)


VersionOpt = Annotated[
    bool, typer.Option("--version", callback=_version, is_eager=True, help="Show the version and exit.")
]


def _one_line(text: str) -> str:
    """Escape control characters (a tensor name may hold a newline) so the error stays one line."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _exit_on_signal(signum: int, frame: object) -> None:
    # SIGTERM/SIGHUP unwind like Ctrl-C, so the writers delete their temporary files.
    raise KeyboardInterrupt


@contextmanager
def _errors_to_exit(debug: bool, as_json: bool) -> Iterator[None]:
    """Map our errors to one stderr line (and a JSON error document) and exit 2."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    try:
        yield
    except ConverterError as exc:
        if debug or os.environ.get("MARLIN_DEBUG"):
            traceback.print_exc()
            raise typer.Exit(exc.exit_code) from None
        err_console.print(f"[bold red]error:[/] {escape(_one_line(str(exc)))}", soft_wrap=True)
        if as_json:
            print(
                json.dumps(
                    {
                        "ok": False,
                        "error": {
                            "type": type(exc).__name__,
                            "message": str(exc),
                            "file": exc.path,
                            "tensor": exc.tensor,
                        },
                    }
                )
            )
        raise typer.Exit(exc.exit_code) from None
    except OSError as exc:
        # The environment, not the input's content (disk full, folder vanished): one
        # line and exit 2 as well; the temporary output was already removed.
        if debug or os.environ.get("MARLIN_DEBUG"):
            traceback.print_exc()
            raise typer.Exit(2) from None
        where = f"{exc.filename}: " if exc.filename else ""
        msg = _one_line(f"{where}{exc.strerror or exc}")
        err_console.print(f"[bold red]error:[/] {escape(msg)}", soft_wrap=True)
        if as_json:
            print(
                json.dumps(
                    {
                        "ok": False,
                        "error": {"type": type(exc).__name__, "message": msg, "file": exc.filename, "tensor": None},
                    }
                )
            )
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        err_console.print("[bold red]interrupted[/]; no output was written")
        raise typer.Exit(130) from None


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
        console=err_console,
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


# Plain tracebacks (with --debug) that paste cleanly into a bug report.
convert_app = typer.Typer(add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False)


@convert_app.command(
    help="Convert an asymmetric 4-bit checkpoint (.tinyloop, GPTQ, AWQ, compressed-tensors) into a Marlin "
    "safetensors artifact (one file, HF shards with --max-shard-size, or a model folder).\n\n"
    "Exit codes: 0 ok; 2 bad input or usage (nothing is written).",
    epilog="Example: marlin-convert model.tinyloop model.marlin.safetensors",
)
def convert_cmd(
    source: InPath,
    output: OutPath,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing output.")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; write nothing.")] = False,
    as_json: JsonOpt = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress or summary on stderr.")] = False,
    max_shard_size: Annotated[
        str | None,
        typer.Option(
            "--max-shard-size",
            help="Split the output into HF shards of at most this much tensor data (e.g. 5GB, 500MiB), plus an index.",
            show_default=False,
        ),
    ] = None,
    debug: DebugOpt = False,
    version: VersionOpt = False,
) -> None:
    from .convert import convert

    with _errors_to_exit(debug, as_json), _progress(_show_progress(quiet, as_json)) as prog:
        report = convert(source, output, force=force, dry_run=dry_run, progress=prog, max_shard_size=max_shard_size)
    if as_json:
        print(json.dumps(report.to_json()))
        return
    if quiet:
        return
    table = Table(title=("plan (dry run)" if dry_run else f"wrote {report.output}"), title_justify="left")
    for col in ("layer", "K", "N", "group", "bits", "sym", "zeros", "upstream"):
        table.add_column(col, overflow="fold")
    for lay in report.converted:
        table.add_row(
            escape(lay.name),
            str(lay.size_k),
            str(lay.size_n),
            "chan" if lay.group_size == lay.size_k else str(lay.group_size),
            str(lay.bits),
            "yes" if lay.symmetric else "no",
            lay.zero_convention.value,
            "yes" if lay.upstream_marlin_compatible else "no",
        )
    err_console.print(table)
    reasons: dict[str, list[str]] = {}
    for p in report.passthrough:
        reasons.setdefault(p.reason, []).append(p.name)
    for reason, names in reasons.items():
        shown = ", ".join(names[:4]) + (f", ... ({len(names)} tensors)" if len(names) > 4 else "")
        err_console.print(f"pass-through: {escape(shown)}  [dim]({escape(reason)})[/]", soft_wrap=True)
    for lay in report.converted:
        for w in lay.warnings:
            err_console.print(f"[yellow]warning:[/] {escape(lay.name)}: {escape(w)}", soft_wrap=True)
    verb = "would write" if dry_run else "wrote"
    err_console.print(
        f"{len(report.converted)} layers converted, {len(report.passthrough)} tensors passed through; "
        f"{verb} {report.bytes_out / 1e6:.2f} MB of tensor data"
    )


verify_app = typer.Typer(add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False)


@verify_app.command(
    help="Verify a Marlin artifact: structure and checksums (--shapes, no GPU), exact agreement with its source "
    "(--against), and numerics on CPU and GPU.\n\n"
    "Exit codes: 0 all good; 1 problems found; 2 unreadable input or bad usage.",
    epilog="Example: marlin-verify model.marlin.safetensors --shapes --against model.tinyloop",
)
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
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only problems and the summary line.")] = False,
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
    debug: DebugOpt = False,
    version: VersionOpt = False,
) -> None:
    from .verify import verify

    if gpu and cpu:
        err_console.print("[bold red]error:[/] --gpu and --cpu contradict each other")
        raise typer.Exit(2)
    if model or text is not None:
        _verify_model_cmd(
            artifact,
            against,
            text,
            model=model,
            gpu=True if gpu else (False if cpu else None),
            shapes=shapes,
            as_json=as_json,
            quiet=quiet,
            debug=debug,
        )
    with _errors_to_exit(debug, as_json), _progress(_show_progress(quiet, as_json)) as prog:
        report = verify(
            artifact, shapes_only=shapes, against=against, gpu=True if gpu else (False if cpu else None), progress=prog
        )
    if as_json:
        print(json.dumps(report.to_json(), default=_jsonable))
    else:
        _render_verify(report, quiet)
    raise typer.Exit(0 if report.ok else 1)


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
) -> None:
    """``marlin-verify OUTDIR --model --against SRC``: see :mod:`converter.model.verify`."""
    usage = (
        "--text needs --model"
        if not model
        else "--model and --shapes contradict each other (--shapes checks structure only)"
        if shapes
        else "--model needs --against SRC: the reference model is built from the source checkpoint"
        if against is None
        else None
    )
    if usage:
        err_console.print(f"[bold red]error:[/] {usage}")
        raise typer.Exit(2)
    from .model.report import render
    from .model.verify import verify_model

    def stage(line: str) -> None:
        err_console.print(f"marlin-verify --model: {escape(line)}", soft_wrap=True)

    with _errors_to_exit(debug, as_json):
        report = verify_model(folder, against, text=text, gpu=gpu, progress=None if (as_json or quiet) else stage)
    if as_json:
        print(json.dumps(report.to_json(), default=_jsonable))
    else:
        render(report, out_console, err_console, quiet=quiet)
    raise typer.Exit(0 if report.ok else 1)


def _jsonable(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(type(obj).__name__)


def _render_verify(report: Report, quiet: bool) -> None:
    errors = [p for p in report.problems if p.severity == "error"]
    bad_layers = {p.tensor.rsplit(".", 1)[0] for p in errors} | {p.tensor for p in errors}
    if not quiet and report.layers:
        with_gpu = any(isinstance(row.get("gpu"), dict) for row in report.layers)
        table = Table(title=f"{report.artifact}", title_justify="left")
        cols = ["", "layer", "K", "N", "group", "sym", "exact", "cpu rel err"] + (
            ["gpu mean / max rel err"] if with_gpu else []
        )
        for col in cols:
            table.add_column(col, overflow="fold")
        for row in report.layers:
            exact = [row[k] for k in ("codes_exact", "scales_exact", "delta_exact") if k in row]
            gpu = row.get("gpu")
            cells = [
                "❌" if row["name"] in bad_layers else "✅",
                escape(row["name"]),
                str(row["size_k"]),
                str(row["size_n"]),
                "chan" if row["group_size"] == row["size_k"] else str(row["group_size"]),
                "yes" if row["symmetric"] else "no",
                ("yes" if all(exact) else "NO") if exact else "-",
                f"{row['cpu_rel_err']:.2e}" if "cpu_rel_err" in row else "-",
            ]
            if with_gpu:
                cells.append(
                    f"{gpu['mean_rel_err']:.2e} / {gpu['max_rel_err']:.2e}" if isinstance(gpu, dict) else "skipped"
                )
            table.add_row(*cells)
        out_console.print(table)
    for p in report.problems:
        tag = "[red]problem[/]" if p.severity == "error" else "[yellow]warning[/]"
        out_console.print(f"{tag} {escape(f'[{p.code}]')} {escape(p.message)}", soft_wrap=True)
    gpu_note = report.checked.get("gpu_numerics")
    if isinstance(gpu_note, str) and not quiet:
        err_console.print(f"[dim]GPU numerics {escape(gpu_note)}[/]", soft_wrap=True)
    errors = sum(p.severity == "error" for p in report.problems)
    checked = report.checked
    what = (
        ["shapes", "checksums"]
        + (["against source"] if "against" in checked else [])
        + (["CPU numerics"] if checked.get("cpu_numerics") else [])
        + (["GPU numerics"] if checked.get("gpu_numerics") is True else [])
    )
    status = "OK" if report.ok else f"FAILED: {errors} problem(s)"
    out_console.print(
        f"{status}: {checked.get('layers', 0)} layers, {checked.get('tensors', 0)} tensors; checked {', '.join(what)}"
    )


def main_convert() -> None:
    convert_app(prog_name="marlin-convert")


def main_verify() -> None:
    verify_app(prog_name="marlin-verify")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main_convert())

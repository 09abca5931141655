"""``marlin-convert``: its options, the ``--to compressed-tensors`` export, and the summary it prints."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from ..artifact.shards import human_size
from ..errors import short_name
from ..faults import set_command
from .options import DebugOpt, InPath, JsonOpt, OutPath, QuietOpt, _Command, _version_option
from .output import _errors_to_exit, _fail, _group_cell, _print_json, _progress, _show, _show_progress
from .streams import _guard_streams, err_console, out_console

# Plain tracebacks (with --debug) that paste cleanly into a bug report.
convert_app = typer.Typer(add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False)


@convert_app.command(
    cls=_Command,
    help="Convert an asymmetric 4-bit checkpoint (.tinyloop, GPTQ, AWQ, compressed-tensors) into a Marlin "
    "safetensors artifact: one file (OUT ends in .safetensors), HF shards with --max-shard-size, or a model "
    "folder (any other OUT).\n\n"
    "The summary goes to stdout; progress, warnings and errors to stderr.\n\n"
    "Exit codes: 0 ok; 1 a bug (InternalError, traceback with --debug); 2 bad input or usage (nothing is "
    "written, unless the line says the output is complete); 130 interrupted (the same); 141 stdout's "
    "reader went away (| head).",
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
    set_command("marlin-convert")
    if overwrite:  # the name other tools use: point at ours
        _fail("no such option: --overwrite; to replace an existing output, pass --force", as_json)
    if to not in EXPORT_FORMATS:
        _fail(f"--to {to!r}: one of {', '.join(EXPORT_FORMATS)}", as_json)
    if to != "marlin":
        _export_cmd(source, output, to, force, dry_run, as_json, quiet, max_shard_size, pad, debug,
                    allow_passthrough=allow_passthrough, legacy_act_order=legacy_act_order)  # fmt: skip
        return
    if allow_passthrough or legacy_act_order:
        given = _given(("--allow-passthrough", allow_passthrough), ("--legacy-act-order", legacy_act_order))
        _fail(f"{' and '.join(given)} {'go' if len(given) > 1 else 'goes'} with --to compressed-tensors", as_json)
    with _errors_to_exit(debug, as_json), _progress(_show_progress(quiet, as_json)) as prog:
        from ..convert import convert

        report = convert(
            source, output, force=force, dry_run=dry_run, progress=prog, max_shard_size=max_shard_size, pad=pad
        )
    if as_json:
        _print_json(report.to_json())
    elif not quiet:
        _render_convert(report, verbose)


#: What ``--to`` accepts: the Marlin artifact, or an exact export (converter.export).
EXPORT_FORMATS = ("marlin", "compressed-tensors")


def _given(*flags: tuple[str, bool]) -> list[str]:
    """The misplaced options the user gave, by name, never one they did not."""
    return [name for name, given in flags if given]


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
        given = _given(("--dry-run", dry_run), ("--no-pad", not pad))
        verb = "are" if len(given) > 1 else "is"
        _fail(f"{' and '.join(given)} {verb} for the Marlin artifact, not --to {to}", as_json)
    with _errors_to_exit(debug, as_json):
        from ..artifact.shards import parse_size
        from ..export import export_compressed_tensors

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

"""``marlin-verify``: its options, the export and ``--model`` variants, and the table it prints."""

from __future__ import annotations

import dataclasses
import glob
import json
import re
import shutil
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from ..artifact.problems import Report
from ..errors import short_name
from ..faults import set_command
from .options import ArtPath, DebugOpt, JsonOpt, VerifyQuietOpt, _Command, _version_option
from .output import _errors_to_exit, _fail, _group_cell, _print_json, _progress, _show, _show_progress
from .streams import _can_encode, _guard_streams, _real, err_console, out_console

verify_app = typer.Typer(add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False)


@verify_app.command(
    cls=_Command,
    help="Verify a Marlin artifact: structure and checksums (--shapes, no GPU), exact agreement with its source "
    "(--against), and numerics on CPU and GPU. On a --to compressed-tensors export, --against SRC checks it "
    "exactly against its source (docs/export.md).\n\n"
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
    device_map: Annotated[
        str | None,
        typer.Option(
            "--device-map",
            help="With --model: spread the converted model as from_pretrained does: auto, balanced, "
            "balanced_low_0, sequential, or a JSON object of modules to devices; the references then run "
            "on the CPU, a layer at a time.",
            show_default=False,
        ),
    ] = None,
    max_memory: Annotated[
        str | None,
        typer.Option(
            "--max-memory",
            help="With --device-map: memory per device as a JSON object, e.g. "
            '\'{"0": "70GiB", "1": "70GiB", "cpu": "200GiB"}\'.',
            show_default=False,
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option(
            "--dtype",
            help="The activation type, float16 or bfloat16 (fp16, bf16). With --model: run the converted model in it "
            "(its embeddings and norms cast; default: each tensor's own type); the 16-bit reference follows. "
            "Without: the GPU layer check's activations (default float16).",
            show_default=False,
        ),
    ] = None,
    debug: DebugOpt = False,
    version: Annotated[bool, _version_option("marlin-verify")] = False,
) -> None:
    set_command("marlin-verify")  # its interrupt line (a CliRunner call has no argv[0] to tell)
    if gpu and cpu:
        _fail("--gpu and --cpu contradict each other", as_json)
    if gpu and shapes:
        _fail("--gpu and --shapes contradict each other (--shapes runs no numerics)", as_json)
    use_gpu = True if gpu else (False if cpu else None)  # None: when CuPy and a GPU are there
    spread = _spread_options(device_map, max_memory, model=model, cpu=cpu, as_json=as_json)
    if dtype is not None:
        from ..dtypes import DTYPE_ALIASES

        dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype is not None and dtype not in ("float16", "bfloat16"):
        _fail(f"--dtype {dtype}: the converted layers run float16 or bfloat16 activations (or bf16, fp16)", as_json)
    if dtype is not None and not (model or text is not None or allow_source_mismatch):
        # Without --model, --dtype is the GPU layer check's type: a run that skips that check
        # would ignore it, and on a model folder the user most likely forgot --model.
        if shapes or cpu:
            left_out_by = "--shapes" if shapes else "--cpu"
            _fail(f"--dtype sets the GPU check's activations, which {left_out_by} leaves out", as_json)
        if artifact.is_dir():
            with _errors_to_exit(debug, as_json):
                from ..export import export_manifest

                if export_manifest(artifact) is not None:
                    _fail(f"--dtype: {artifact} is a compressed-tensors export, whose check runs no GPU", as_json)
        if not gpu and artifact.is_dir() and _runs_as_model(artifact):
            _fail(
                f"--dtype on the model folder {artifact}: add --model to run the model in it, or --gpu for the "
                "GPU layer check in it",
                as_json,
            )
        if not gpu:
            # Said before the long CPU pass: nothing the user can add makes --dtype work here.
            from ..errors import GpuUnavailableError
            from ..gpu.runtime import require_gpu

            try:
                require_gpu()
            except GpuUnavailableError as exc:
                reason = str(exc).split("; ")[0]
                _fail(
                    f"--dtype {dtype} sets the GPU layer check's activations, and no GPU can run it here ({reason}); "
                    "leave --dtype out (the CPU numerics run without it)",
                    as_json,
                )
        use_gpu = True
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
            spread=dict(spread or {}, **({"dtype": dtype} if dtype else {})),
        )
    if artifact.is_dir():
        with _errors_to_exit(debug, as_json):
            from ..export import export_manifest

            exported = export_manifest(artifact) is not None
        if exported and gpu:
            _fail(f"--gpu: {artifact} is a compressed-tensors export, whose check runs no GPU", as_json)
        if exported:
            _verify_export_cmd(artifact, against, as_json, quiet, debug, shapes=shapes, verbose=verbose)
    with _errors_to_exit(debug, as_json), _progress(_show_progress(quiet, as_json)) as prog:
        from ..verify import verify

        report = verify(
            artifact, shapes_only=shapes, against=against, gpu=use_gpu, progress=prog, act=dtype or "float16"
        )
    if as_json:
        _print_json(report.to_json())
    else:
        _render_verify(report, quiet, verbose)
    raise typer.Exit(0 if report.ok else 1)


def _verify_export_cmd(
    folder: Path,
    against: Path | None,
    as_json: bool,
    quiet: bool,
    debug: bool,
    *,
    shapes: bool = False,
    verbose: bool = False,
) -> None:
    """``marlin-verify EXPORT --against SRC`` on a ``--to compressed-tensors`` export:
    :func:`converter.export.check_export` (codes, scales, zero points and act-order exactly,
    the source's sha256, and unless ``shapes`` the CPU numerics). Exits 0 when it passes,
    1 when it does not."""
    if against is None:
        _fail("a compressed-tensors export is checked against its source: pass --against SRC", as_json)
    with _errors_to_exit(debug, as_json):
        from ..export import check_export

        check = check_export(folder, against, numerics=not shapes)
    ok = not check.problems
    if as_json:
        _print_json({"ok": ok, "export": str(folder), "against": str(against), **dataclasses.asdict(check)})
    else:
        shown = check.problems if verbose else check.problems[:PROBLEM_LINES]
        for problem in shown:
            out_console.print(_show(f"problem: {problem}"), soft_wrap=True)
        if len(shown) < len(check.problems):
            more = len(check.problems) - len(shown)
            out_console.print(f"... and {more} more; --verbose or --json lists every problem", soft_wrap=True)
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
    spread: dict | None = None,
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
    if against is not None and against.is_dir() and _runs_as_model(against) and not _runs_as_model(folder):
        _fail(
            f"{folder} is not a converted model folder, but --against {against} is one: the arguments are swapped; "
            f"run marlin-verify {against} --model --against {folder}",
            as_json,
        )

    def stage(line: str) -> None:
        err_console.print(f"marlin-verify --model: {_show(line)}", soft_wrap=True)

    with _errors_to_exit(debug, as_json):
        from ..model.report import render
        from ..model.verify import verify_model

        report = verify_model(
            folder,
            against,
            text=text,
            gpu=gpu,
            progress=None if (as_json or quiet) else stage,
            allow_source_mismatch=allow_source_mismatch,
            **(spread or {}),
        )
    if as_json:
        _print_json(report.to_json())
    else:
        render(report, _real(out_console), _real(err_console), quiet=quiet)
    raise typer.Exit(0 if report.ok else 1)


#: device_map names accelerate infers a map for.
SPREAD_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def _spread_options(
    device_map: str | None, max_memory: str | None, *, model: bool, cpu: bool, as_json: bool
) -> dict | None:
    """``--device-map`` / ``--max-memory`` as verify_model's keywords, or None; a usage
    error (exit 2, one line) for a bad value or a missing --model."""
    if device_map is None:
        if max_memory is not None:
            _fail("--max-memory needs --device-map", as_json)
        return None
    if not model:
        _fail("--device-map needs --model (it spreads the converted model)", as_json)
    if cpu:
        _fail(
            "--device-map and --cpu contradict each other (to keep it on the CPU: --max-memory '{\"cpu\": ...}')",
            as_json,
        )
    out: dict = {"device_map": device_map}
    if re.fullmatch(r"cpu|cuda(:\d+)?|\d+", device_map):  # from_pretrained's one-device form
        one = json.dumps({"": int(device_map) if device_map.isdigit() else device_map})
        _fail(
            f"--device-map {device_map}: one device is the JSON object '{one}' (or leave --device-map out: "
            "--gpu / --cpu pick the device)",
            as_json,
        )
    if device_map not in SPREAD_MAPS:
        not_json = f"neither {', '.join(SPREAD_MAPS)} nor a JSON object"
        shape = 'a JSON object maps module names to a device (0, "cuda:1", "cpu")'
        out["device_map"] = _json_object("--device-map", device_map, not_json, shape, as_json)
    if max_memory is not None:
        shape = 'a JSON object of devices to sizes, e.g. {"0": "70GiB", "cpu": "200GiB"}'
        parsed = _json_object("--max-memory", max_memory, "not a JSON object", shape, as_json)
        out["max_memory"] = {int(k) if str(k).isdigit() else k: v for k, v in parsed.items()}
    return out


def _json_object(option: str, text: str, not_json: str, shape: str, as_json: bool) -> dict:
    """``text`` as a JSON object of int or str values, else a usage error naming ``option``."""
    try:
        parsed = json.loads(text)
    except ValueError as exc:
        _fail(f"{option}: {not_json} ({exc})", as_json)
    if not isinstance(parsed, dict) or not all(isinstance(v, (int, str)) for v in parsed.values()):
        _fail(f"{option}: {shape}", as_json)
    return parsed


#: Problems printed by marlin-verify before the rest are counted (all of them with --json or --verbose).
PROBLEM_LINES = 30


def cpu_loops_line() -> str:
    """``marlin-verify -v``'s note on which CPU loops computed ``cpu rel err``: the
    compiled ones (:mod:`converter._native`) or the NumPy code; the figures differ
    between the two (fp32 sums in another order)."""
    from .. import native

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
        + (["GPU numerics" + _act_note(checked)] if checked.get("gpu_numerics") is True else [])
    )
    status = "OK" if report.ok else f"FAILED: {len(errors)} problem(s)"
    out_console.print(
        f"{status}: {checked.get('layers', 0)} layers, {checked.get('tensors', 0)} tensors; checked {', '.join(what)}"
    )


def _runs_as_model(folder: Path) -> bool:
    """Whether ``folder`` is a converted model folder that ``--model`` can run (the loader's
    own test: our quant_method, no ``.tinyloop`` source). Anything else is left to the
    checks to report."""
    from ..errors import ConverterError
    from ..model.loader import read_converted_config

    try:
        read_converted_config(folder)
    except ConverterError:
        return False
    return True


def _act_note(checked: dict) -> str:
    """The GPU check's activation type, named when it is not fp16 (the default)."""
    act = checked.get("gpu_act", "float16")
    return "" if act == "float16" else f" ({act})"


def nvidia_gpu_present() -> bool:
    """Whether this machine has an NVIDIA GPU (its device nodes, driver or ``nvidia-smi``),
    CuPy or not: only there can installing the GPU extra help."""
    return bool(
        glob.glob("/dev/nvidia[0-9]*")
        or glob.glob("/proc/driver/nvidia/gpus/*")
        or shutil.which("nvidia-smi") is not None
    )

"""The arguments and options the two commands share, and their usage line."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from .. import __version__
from ..faults import wants_json
from .streams import out_console

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


class _Command(typer.core.TyperCommand):
    """Usage as man pages and the README write it: ``marlin-convert [OPTIONS] IN OUT``
    (typer writes a required argument as ``{IN}``)."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [re.sub(r"^\{(.*)\}$", r"\1", piece) for piece in super().collect_usage_pieces(ctx)]

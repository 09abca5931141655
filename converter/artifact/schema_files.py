"""The JSON Schema files of the artifact manifest (``schemas/``, shipped in the package as
``converter/_schemas``): their names, loading one, and validating a manifest against it.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from .. import jsonio
from ..constants import ARTIFACT_SCHEMA_VERSION


def schema_file(version: int = ARTIFACT_SCHEMA_VERSION) -> str:
    return f"marlin-artifact.v{version}.schema.json"


@cache
def load_schema(version: int = ARTIFACT_SCHEMA_VERSION) -> dict[str, Any]:
    """The JSON Schema of artifact schema ``version`` (shipped in the package)."""
    name = schema_file(version)
    try:
        text = resources.files("converter").joinpath("_schemas", name).read_text("utf-8")
    except (FileNotFoundError, ModuleNotFoundError, NotADirectoryError):
        text = (Path(__file__).resolve().parents[2] / "schemas" / name).read_text("utf-8")
    return jsonio.loads(text, object_required=True)


def schema_errors(data: dict[str, Any], version: int = ARTIFACT_SCHEMA_VERSION) -> list[str] | None:
    """Every JSON Schema violation as ``"<json path>: <message>"``; None if jsonschema is absent."""
    try:
        import jsonschema
    except ImportError:
        return None
    validator = jsonschema.Draft202012Validator(load_schema(version))
    out = []
    for err in sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path))):
        where = "/".join(str(p) for p in err.absolute_path) or "(root)"
        out.append(f"{where}: {err.message}")
    return out

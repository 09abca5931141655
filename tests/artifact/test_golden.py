"""The golden artifact: converting the committed tiny source gives exactly the committed
header bytes (length prefix, tensor table, ``__metadata__``, manifest, padding).

A change to the artifact format, the manifest or the layout of the header shows up here
as a diff.  If the change is meant, rebuild both files with
``python scripts/make_golden.py`` and commit them with it."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

from converter.artifact.schema import load_schema, schema_errors
from converter.convert import convert
from converter.verify import verify
from tests.helpers.golden import HEADER, SOURCE, build_source, header_bytes


def _readable(header: bytes) -> list[str]:
    doc = json.loads(header[8:])
    doc["__metadata__"]["marlin.manifest"] = json.loads(doc["__metadata__"]["marlin.manifest"])
    return json.dumps(doc, indent=1, sort_keys=True).splitlines()


def test_header_is_byte_identical(tmp_path: Path) -> None:
    out = tmp_path / "tiny.marlin.safetensors"
    convert(SOURCE, out)
    got, want = header_bytes(out), HEADER.read_bytes()
    diff = "\n".join(difflib.unified_diff(_readable(want), _readable(got), "golden", "now", lineterm=""))
    assert got == want, f"artifact header changed (rebuild with scripts/make_golden.py if meant):\n{diff}"


def test_golden_is_a_valid_artifact(tmp_path: Path) -> None:
    doc = json.loads(HEADER.read_bytes()[8:])
    manifest = json.loads(doc["__metadata__"]["marlin.manifest"])
    assert (
        schema_errors(manifest) == []
        and manifest["schema_version"] == load_schema()["properties"]["schema_version"]["const"]
    )
    assert [(lay["name"], lay["bits"], lay["code_offset"], lay.get("padded_n")) for lay in manifest["layers"]] == [
        ("a", 4, 0, None),
        ("b", 2, 6, None),
        ("c", 4, 0, 64),
    ]
    assert manifest["layers"][2]["size_n"] == 48 and doc["c.marlin_B"]["shape"] == [2, 128]
    assert doc["c.marlin_scales"]["shape"] == [1, 64]
    out = tmp_path / "tiny.marlin.safetensors"
    convert(SOURCE, out)
    assert verify(out, against=SOURCE, gpu=False).ok


def test_golden_source_is_up_to_date(tmp_path: Path) -> None:
    assert build_source(tmp_path / "tiny.tinyloop").read_bytes() == SOURCE.read_bytes()

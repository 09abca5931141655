"""The typed manifest (converter/artifact/schema.py) against the schema file it mirrors,
its versioned reader, and the problem codes against docs/verify.md."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import xxhash

from converter.artifact.problems import ProblemCode
from converter.artifact.reader import open_artifact
from converter.artifact.schema import (
    ADDED_IN,
    PARSERS,
    SCHEMA_OBJECTS,
    LayerEntry,
    Manifest,
    from_json,
    load_schema,
    read_document,
    schema_errors,
)
from converter.artifact.validate import validate_artifact
from converter.constants import (
    ARTIFACT_SCHEMA_VERSION,
    META_MANIFEST,
    META_SCHEMA_VERSION,
    SUPPORTED_SCHEMA_VERSIONS,
    SourceFormat,
    ZeroConvention,
)
from converter.convert import convert
from converter.errors import ArtifactError, SchemaVersionError
from converter.verify import verify
from tests.helpers.artifact_edit import read_st, rewrite_artifact, write_st
from tests.helpers.paths import REPO, SAMPLE


def _schema_object(path: str, version: int = ARTIFACT_SCHEMA_VERSION) -> dict:
    """The schema of the object at ``path`` in SCHEMA_OBJECTS' notation."""
    node = load_schema(version)
    for part in filter(None, path.split(".")):
        node = node["properties"][part.removesuffix("[]")]
        if part.endswith("[]"):
            node = node["items"]
    return node


def _objects_of(version: int) -> set[str]:
    """SCHEMA_OBJECTS' paths schema ``version`` has: objects under a field a later version added are not."""
    later = {
        f"{path}.{n}" for v, objects in ADDED_IN.items() if v > version for path, ns in objects.items() for n in ns
    }
    return {
        p for p in SCHEMA_OBJECTS if not any(p == f or p.startswith(f + "[") or p.startswith(f + ".") for f in later)
    }


def _fields_of(cls: type, path: str, version: int) -> list[dataclasses.Field]:
    """The dataclass fields schema ``version`` has: those a later version added are not."""
    later = {name for v, objects in ADDED_IN.items() if v > version for name in objects.get(path, ())}
    return [f for f in dataclasses.fields(cls) if f.name not in later]


@pytest.mark.parametrize("version", SUPPORTED_SCHEMA_VERSIONS)
@pytest.mark.parametrize("path", sorted(SCHEMA_OBJECTS))
def test_dataclass_fields_are_the_schema_properties(path: str, version: int) -> None:
    """A field added to one side only fails here: each version's schema properties are
    the dataclass's fields (less those a later version added, :data:`ADDED_IN`), its
    required list the fields without a default."""
    if path not in _objects_of(version):
        assert version < ARTIFACT_SCHEMA_VERSION  # an object of a field a later version added
        return
    node, cls = _schema_object(path, version), SCHEMA_OBJECTS[path]
    fields = _fields_of(cls, path, version)
    assert node["additionalProperties"] is False
    assert sorted(f.name for f in fields) == sorted(node["properties"])
    required = [f.name for f in fields if f.default is dataclasses.MISSING]
    assert sorted(required) == sorted(node["required"])


def test_v2_adds_exactly_the_regrouping_and_padding_fields() -> None:
    assert ADDED_IN == {2: {"layers[]": ("source_group_size", "padded_n"), "checksums": ("files",)}}
    v1, v2 = (_schema_object("layers[]", v)["properties"] for v in (1, 2))
    assert sorted(set(v2) - set(v1)) == ["padded_n", "source_group_size"]
    # v2's size_n is the true N; a v1 layer's N was always a multiple of 64.
    assert v1["size_n"]["multipleOf"] == 64 and "multipleOf" not in v2["size_n"]
    assert v2["padded_n"]["multipleOf"] == 64
    # Every other property is v1's (only descriptions may say more).
    for key in set(v1) - {"size_n"}:
        assert {k: v for k, v in v1[key].items() if k != "description"} == {
            k: v for k, v in v2[key].items() if k != "description"
        }, key
    c1, c2 = (_schema_object("checksums", v)["properties"] for v in (1, 2))
    assert sorted(set(c2) - set(c1)) == ["files"] and all(c1[k] == c2[k] for k in c1)
    assert _schema_object("checksums.files[]", 2)["required"] == ["name", "bytes", "xxh3_128"]


@pytest.mark.parametrize("version", SUPPORTED_SCHEMA_VERSIONS)
def test_every_schema_object_has_a_dataclass(version: int) -> None:
    found = set()

    def walk(node: dict, path: str) -> None:
        if node.get("type") == "object" and "properties" in node:
            found.add(path)
            for key, child in node["properties"].items():
                walk(child, f"{path}.{key}" if path else key)
        if node.get("type") == "array" and "items" in node:
            walk(node["items"], path + "[]")

    walk(load_schema(version), "")
    assert found == _objects_of(version)


@pytest.mark.parametrize("version", SUPPORTED_SCHEMA_VERSIONS)
def test_enums_are_the_schema_enums(version: int) -> None:
    assert [f.value for f in SourceFormat] == _schema_object("source", version)["properties"]["format"]["enum"]
    layer = _schema_object("layers[]", version)["properties"]
    assert [z.value for z in ZeroConvention] == layer["zero_convention"]["enum"]
    assert load_schema(version)["properties"]["schema_version"]["const"] == version
    assert load_schema()["properties"]["schema_version"]["const"] == ARTIFACT_SCHEMA_VERSION == 2


def test_every_supported_version_has_a_parser_and_a_schema_file() -> None:
    assert sorted(PARSERS) == sorted(SUPPORTED_SCHEMA_VERSIONS)
    for version in PARSERS:
        schema = json.loads((REPO / "schemas" / f"marlin-artifact.v{version}.schema.json").read_text())
        assert schema["properties"]["schema_version"]["const"] == version


def test_every_problem_code_is_in_the_docs_table() -> None:
    page = (REPO / "docs" / "verify.md").read_text() + "\n"  # moved from the README (issue 39)
    start = page.index("Problem codes (`problems[].code`")
    table = page[start : page.index("\n\n", page.index("| code |", start))]
    documented = re.findall(r"^\| `([a-z0-9_]+)` \|", table, flags=re.M)
    assert documented == [c.value for c in ProblemCode]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("schema") / "s.safetensors"
    convert(SAMPLE, out)
    return out


def test_parse_then_write_gives_the_stored_object(artifact: Path) -> None:
    meta, _ = read_st(artifact)
    doc = read_document(meta, path=artifact)
    manifest = Manifest.parse(meta, path=artifact)
    assert manifest.to_json() == doc.data
    assert schema_errors(doc.data) == []
    assert isinstance(manifest.layers[0], LayerEntry) and manifest.source.format is SourceFormat.TINYLOOP
    # act_order is written only when true: no sample layer is act-order; padded_n only
    # for the padded head, source_group_size for no layer (none is regrouped).
    assert all("act_order" not in entry and "source_group_size" not in entry for entry in doc.data["layers"])
    assert {e["name"]: e["padded_n"] for e in doc.data["layers"] if "padded_n" in e} == {"head": 1024}
    head = next(rec for rec in manifest.layers if rec.name == "head")
    assert (head.size_n, head.padded_n, head.layout_n, head.shape.b_shape) == (1000, 1024, 1024, (8, 2048))


def test_a_v1_artifact_is_still_read_and_verified(tmp_path: Path) -> None:
    """What the tool wrote before v2 (no padded or regrouped layer: the sample with
    --no-pad) reads and verifies as it did; absent v2 fields mean what they meant in v1."""
    v2 = tmp_path / "v2.safetensors"
    convert(SAMPLE, v2, pad=False)
    v1 = rewrite_artifact(v2, tmp_path / "v1.safetensors", lambda m, t: None, schema_version=1)
    meta, _ = read_st(v1)
    assert meta[META_SCHEMA_VERSION] == "1" and json.loads(meta["marlin.manifest"])["schema_version"] == 1
    manifest = Manifest.parse(meta, path=v1)
    assert manifest.schema_version == 1
    assert all(rec.padded_n is None and rec.source_group_size is None for rec in manifest.layers)
    assert schema_errors(read_document(meta, path=v1).data, 1) == []
    report = verify(v1, against=SAMPLE, gpu=False)
    assert report.ok, [p.message for p in report.problems]
    assert report.schema_version == 1 and report.checked["layers"] == 14


def test_a_v1_manifest_with_a_v2_field_is_refused(artifact: Path, tmp_path: Path) -> None:
    """A v1 reader never saw padded_n: a manifest that says v1 and has it does not fit v1."""
    bad = rewrite_artifact(artifact, tmp_path / "bad.safetensors", lambda m, t: None, schema_version=1)
    meta, _ = read_st(bad)
    with pytest.raises(
        ArtifactError,
        match=r"layers\[14\]: unknown field 'padded_n' \(schema v2 added it; this manifest is v1\)",
    ):
        Manifest.parse(meta, path=bad)
    report = verify(bad, gpu=False)
    assert not report.ok and {p.code for p in report.problems} == {ProblemCode.SCHEMA_VIOLATION}
    assert any(
        "schema v1: layers/14: Additional properties are not allowed ('padded_n'" in p.message for p in report.problems
    )


def test_integral_floats_read_as_ints() -> None:
    """JSON Schema's "integer" includes 128.0; the typed reader must agree with it."""
    entry = {
        "name": "x",
        "size_k": 128.0,
        "size_n": 64,
        "group_size": 64,
        "num_groups": 2,
        "bits": 4,
        "code_offset": 0,
        "symmetric": False,
        "zero_convention": "gptq_v1",
        "has_bias": False,
        "upstream_marlin_compatible": False,
        "kernel_compatible": True,
        "warnings": [],
    }
    rec = from_json(LayerEntry, entry)
    assert rec.size_k == 128 and type(rec.size_k) is int and rec.act_order is False
    with pytest.raises(
        ArtifactError, match=r"manifest does not fit its schema: size_k: expected an integer, found number"
    ):
        from_json(LayerEntry, {**entry, "size_k": 128.5})
    with pytest.raises(ArtifactError, match=r"unknown field 'not_a_field'"):
        from_json(LayerEntry, {**entry, "not_a_field": 64})
    with pytest.raises(ArtifactError, match=r"zero_convention: 'gptq_v3' is not one of"):
        from_json(LayerEntry, {**entry, "zero_convention": "gptq_v3"})
    with pytest.raises(ArtifactError, match=r"has_bias: required field is missing"):
        from_json(LayerEntry, {k: v for k, v in entry.items() if k != "has_bias"})


@pytest.mark.parametrize(
    ("version", "match"),
    [
        ("3", r"artifact schema version '3' is not supported \(this tool reads 1, 2\); upgrade marlin-convert"),
        ("0", r"artifact schema version '0' is not supported \(this tool reads 1, 2\)$"),
        ("one", r"artifact schema version 'one' is not supported \(this tool reads 1, 2\)$"),
        # str.isdigit() is true for these; int() refuses the first and reads the others as 2.
        ("\u00b2", r"artifact schema version '\u00b2' is not supported \(this tool reads 1, 2\)$"),
        ("\u0662", r"artifact schema version '\u0662' is not supported \(this tool reads 1, 2\)$"),
        ("\uff12", r"artifact schema version '\uff12' is not supported \(this tool reads 1, 2\)$"),
        ("02", r"artifact schema version '02' is not supported \(this tool reads 1, 2\)$"),
        (" 2", r"artifact schema version ' 2' is not supported \(this tool reads 1, 2\)$"),
    ],
)
def test_version_is_read_first(artifact: Path, tmp_path: Path, version: str, match: str) -> None:
    meta, tensors = read_st(artifact)
    meta[META_SCHEMA_VERSION] = version
    with pytest.raises(SchemaVersionError, match=match):
        Manifest.parse(meta, path=artifact)


def test_manifest_that_does_not_fit_lists_no_layers(artifact: Path, tmp_path: Path) -> None:
    """Documented change: a manifest that fails its schema is reported (schema_violation)
    and its layers are no longer listed from a best-effort reading of it."""

    def edit(m: dict, t: dict) -> None:
        m["layers"][0]["size_k"] = "128"

    bad = rewrite_artifact(artifact, tmp_path / "bad.safetensors", edit)
    with open_artifact(bad) as art:
        assert art.manifest is None and art.layers == {}
        assert art.manifest_error.startswith("manifest does not fit its schema: layers[0].size_k: expected an integer")
    report = verify(bad, gpu=False)
    assert report.layers == [] and not report.ok
    assert {p.code for p in report.problems} == {ProblemCode.SCHEMA_VIOLATION}


def test_duplicate_key_in_manifest_is_refused(artifact: Path, tmp_path: Path) -> None:
    """Documented change: the manifest goes through the one JSON policy (converter.jsonio)."""
    meta, tensors = read_st(artifact)
    meta["marlin.manifest"] = meta["marlin.manifest"][:-1] + ',"passthrough":[]}'
    p = tmp_path / "dup.safetensors"
    write_st(p, tensors, meta)
    with pytest.raises(
        ArtifactError, match=r"marlin.manifest: manifest is not valid JSON: duplicate key 'passthrough'"
    ):
        validate_artifact(p)


# --------------------------------------------------------------------------- checksums.files (v2)


@pytest.fixture(scope="module")
def folder_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("schema-folder") / "model"
    convert(SAMPLE, str(out) + "/", pad=False)  # no v2 layer field: only checksums.files is v2
    return out


def test_v2_folder_artifact_records_its_files(folder_artifact: Path) -> None:
    meta, _ = read_st(folder_artifact / "model.safetensors")
    assert meta[META_SCHEMA_VERSION] == "2"
    data = json.loads(meta[META_MANIFEST])
    assert data["schema_version"] == 2 and schema_errors(data, 2) == []
    files = {f["name"]: f for f in data["checksums"]["files"]}
    assert sorted(files) == ["config.json"]  # the sample's folder has no tokenizer files
    cfg = (folder_artifact / "config.json").read_bytes()
    assert files["config.json"] == {
        "name": "config.json",
        "bytes": len(cfg),
        "xxh3_128": xxhash.xxh3_128_hexdigest(cfg),
    }


def test_a_single_file_artifact_writes_no_files_field(artifact: Path) -> None:
    meta, _ = read_st(artifact)
    assert "files" not in json.loads(meta[META_MANIFEST])["checksums"]
    assert Manifest.parse(meta, path=artifact).checksums.files == ()


def test_a_v1_manifest_with_checksummed_files_is_refused(folder_artifact: Path, tmp_path: Path) -> None:
    """A v1 reader never saw checksums.files: a manifest that says v1 and has it does not fit v1."""
    bad = rewrite_artifact(
        folder_artifact / "model.safetensors", tmp_path / "bad.safetensors", lambda m, t: None, schema_version=1
    )
    meta, _ = read_st(bad)
    with pytest.raises(
        ArtifactError, match=r"checksums: unknown field 'files' \(schema v2 added it; this manifest is v1\)"
    ):
        Manifest.parse(meta, path=bad)
    errors = schema_errors(json.loads(meta[META_MANIFEST]), 1)
    assert errors == ["checksums: Additional properties are not allowed ('files' was unexpected)"]

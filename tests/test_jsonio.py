"""The one JSON policy (converter/jsonio.py) and the HF index reader (converter/hf_index.py)
that every JSON file we read goes through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from converter.errors import ArtifactError, ConfigError, ConverterError, SourceFormatError
from converter.hf_index import HFIndex, index_bytes, read_index
from converter.jsonio import JsonError, JsonRule, loads, parse_object, read_object


@pytest.mark.parametrize(
    ("raw", "rule", "message"),
    [
        (b'{"a": 1, "b": {"c": 1, "c": 2}}', JsonRule.DUPLICATE_KEY, "doc is not valid JSON: duplicate key 'c'"),
        (b'{"a": "\\ud800"}', JsonRule.LONE_SURROGATE, r"doc JSON escapes a lone UTF-16 surrogate: '\ud800'"),
        (b'{"a": "\xff"}', JsonRule.NOT_UTF8, "doc is not valid UTF-8 (invalid start byte at byte 7)"),
        (b"[1, 2]", JsonRule.NOT_OBJECT, "doc must be a JSON object, found list"),
        (
            b"{",
            JsonRule.NOT_JSON,
            "doc is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        ),
        (b"[" * 100_000, JsonRule.NOT_JSON, "doc is not valid JSON: nested too deeply"),
    ],
)
def test_each_rule_is_named(raw: bytes, rule: JsonRule, message: str) -> None:
    with pytest.raises(JsonError) as info:
        loads(raw, object_required=True)
    assert info.value.rule is rule and info.value.message("doc") == message


def test_duplicate_key_says_where() -> None:
    with pytest.raises(JsonError) as info:
        loads(b'{"tensors": {"x": 1, "y": [{"k": 1, "k": 2}]}}')
    assert (info.value.key, info.value.where) == ("k", ("tensors", "y", 0))


def test_a_valid_surrogate_pair_is_text() -> None:
    assert loads(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}


def test_non_finite_numbers_only_where_the_format_forbids_them() -> None:
    # transformers writes NaN/Infinity into HF configs (json.dumps allows them): accepted.
    assert loads(b'{"a": NaN, "b": -Infinity}', object_required=True)["b"] == float("-inf")
    with pytest.raises(JsonError, match="non-standard JSON constant NaN"):
        loads(b'{"a": NaN}', finite_numbers=True)
    with pytest.raises(JsonError, match="number 1e999 overflows a float"):
        loads(b'{"a": 1e999}', finite_numbers=True)


def test_size_bound(tmp_path: Path) -> None:
    with pytest.raises(JsonError) as info:
        loads(b"{}" + b" " * 100, max_bytes=64)
    assert info.value.message("JSON file") == "102 bytes is too large for a JSON file (limit 64)"
    p = tmp_path / "big.json"
    p.write_bytes(b"{}" + b" " * 100)
    with pytest.raises(ConfigError, match=r"big.json: 102 bytes is too large for a JSON file \(limit 64\)"):
        read_object(p, what="JSON file", error=ConfigError, max_bytes=64)


def test_parse_object_raises_the_callers_error() -> None:
    with pytest.raises(ArtifactError, match=r"^x.json: header must be a JSON object, found int$"):
        parse_object(b"3", path="x.json", what="header", error=ArtifactError)


def _index(tmp_path: Path, wmap: object, **extra: object) -> Path:
    p = tmp_path / "model.safetensors.index.json"
    p.write_text(json.dumps({"metadata": {"total_size": 12}, "weight_map": wmap, **extra}))
    return p


def test_index_reader(tmp_path: Path) -> None:
    index = read_index(_index(tmp_path, {"a": "s2", "b": "s1", "c": "s2"}), error=SourceFormatError)
    assert index == HFIndex(tmp_path / "model.safetensors.index.json", {"a": "s2", "b": "s1", "c": "s2"}, 12)
    assert index.shard_names == ["s2", "s1"] and index.shard_path("s1") == tmp_path / "s1"
    with pytest.raises(
        SourceFormatError,
        match=r"weight_map: weight_map must be a non-empty map of tensor name to "
        r"shard file",
    ):
        read_index(_index(tmp_path, {}), error=SourceFormatError)
    assert read_index(_index(tmp_path, {}), error=ArtifactError, allow_empty=True).weight_map == {}
    with pytest.raises(ArtifactError, match=r"weight_map: shard '../x' must be a plain file name in the same folder"):
        read_index(_index(tmp_path, {"a": "../x"}), error=ArtifactError)
    with pytest.raises(ConfigError, match=r"JSON file is not valid JSON: duplicate key 'a'"):
        (tmp_path / "d.index.json").write_text('{"weight_map": {"a": "s", "a": "t"}}')
        read_index(tmp_path / "d.index.json", error=SourceFormatError, json_error=ConfigError)


def test_index_bytes_round_trip(tmp_path: Path) -> None:
    raw = index_bytes({"b": "s1", "a": "s2"}, 40)
    assert (
        raw
        == b'{\n  "metadata": {\n    "total_size": 40\n  },\n  "weight_map": {\n    "a": "s2",\n    "b": "s1"\n  }\n}\n'
    )
    (tmp_path / "i.index.json").write_bytes(raw)
    assert read_index(tmp_path / "i.index.json", error=ConverterError).weight_map == {"a": "s2", "b": "s1"}

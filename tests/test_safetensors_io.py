"""The safetensors container (converter/safetensors_io.py): every rule of the strict
reader, refused in a GPTQ shard and in an artifact the same way, and the page release
that keeps streaming in bounded memory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from converter.artifact.validate import validate_artifact
from converter.errors import ArtifactError, ConverterError, SourceFormatError
from converter.formats import open_source
from converter.safetensors_io import SafetensorsFile
from tests.helpers.checkpoints import T, only_shard, small_gptq, st_bytes
from tests.helpers.clirun import assert_one_line_error, run_cli

MIB = 2**20


@pytest.fixture()
def gptq(tmp_path: Path) -> Path:
    return small_gptq(tmp_path / "ckpt")


# -- the container: every rule of the safetensors reader ------------------------------
CONTAINER_CASES = [
    # (id, file bytes, message regex)
    ("empty", b"", r"0 bytes, need at least 8"),
    ("short", b"\x01\x02\x03", r"3 bytes, need at least 8"),
    (
        "text_not_safetensors",
        b"this is a text file, not a model\n" * 4,
        r"header length \d+ exceeds the 100000000-byte limit",
    ),
    ("zip_magic", b"PK\x03\x04" + b"\x00" * 60, r"header length \d+ runs past the end of the file \(64 bytes\)"),
    (
        "header_past_eof",
        st_bytes({"a": T}, b"\x00" * 16, header_len=10_000),
        r"header length 10000 runs past the end of the file",
    ),
    (
        "header_absurd",
        st_bytes(b"{}", header_len=2**63),
        r"header length 9223372036854775808 exceeds the 100000000-byte limit",
    ),
    ("header_not_json", st_bytes(b"{not json}   "), r"safetensors header is not valid JSON"),
    ("header_not_utf8", st_bytes(b'{"\xff\xfe": 1}'), r"safetensors header is not valid UTF-8"),
    ("header_list", st_bytes(b"[1, 2, 3]"), r"safetensors header must be a JSON object, found list"),
    ("header_number", st_bytes(b"42"), r"must be a JSON object, found int"),
    (
        "duplicate_names",
        st_bytes(
            b'{"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, '
            b'"a": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}',
            b"\x00" * 32,
        ),
        r"duplicate key 'a'",
    ),
    ("entry_not_object", st_bytes({"a": [1, 2]}), r"a: header entry must be an object"),
    (
        "metadata_not_strings",
        st_bytes({"__metadata__": {"x": 1}}),
        r"__metadata__: __metadata__ must be a map of strings to strings",
    ),
    ("unknown_dtype", st_bytes({"a": {**T, "dtype": "F7"}}, b"\x00" * 16), r"a: unknown dtype 'F7' \(known: BOOL, U8"),
    ("dtype_not_string", st_bytes({"a": {**T, "dtype": 4}}, b"\x00" * 16), r"a: unknown dtype 4"),
    (
        "negative_shape",
        st_bytes({"a": {**T, "shape": [-1, 4]}}, b"\x00" * 16),
        r"a: shape must be a list of non-negative integers, found \[-1, 4\]",
    ),
    (
        "float_shape",
        st_bytes({"a": {**T, "shape": [4.0]}}, b"\x00" * 16),
        r"a: shape must be a list of non-negative integers, found \[4.0\]",
    ),
    (
        "bool_shape",
        st_bytes({"a": {**T, "shape": [True]}}, b"\x00" * 16),
        r"a: shape must be a list of non-negative integers, found \[True\]",
    ),
    (
        "overflowing_shape",
        st_bytes({"a": {**T, "shape": [2**62, 2**62]}}, b"\x00" * 16),
        r"a: shape \[4611686018427387904, 4611686018427387904\] of F32 needs \d+ bytes, data_offsets span 16",
    ),
    (
        "zero_size_absurd_dim",
        st_bytes({"a": {**T, "shape": [0, 2**70], "data_offsets": [0, 0]}}),
        r"a: shape \[0, 1180591620717411303424\] exceeds 64 dimensions or 9223372036854775807 elements per dimension",
    ),
    (
        "too_many_dims",
        st_bytes({"a": {**T, "shape": [0] * 65, "data_offsets": [0, 0]}}),
        r"a: shape \[0, 0, .* exceeds 64 dimensions",
    ),
    (
        "negative_offset",
        st_bytes({"a": {**T, "data_offsets": [-16, 0]}}, b"\x00" * 16),
        r"a: data_offsets must be \[begin, end\] with 0 <= begin <= end, found \[-16, 0\]",
    ),
    ("reversed_offsets", st_bytes({"a": {**T, "data_offsets": [16, 0]}}, b"\x00" * 16), r"found \[16, 0\]"),
    ("offsets_not_pair", st_bytes({"a": {**T, "data_offsets": [0]}}, b"\x00" * 16), r"found \[0\]"),
    (
        "overflowing_offset",
        st_bytes({"a": {**T, "data_offsets": [2**64, 2**64 + 16]}}, b"\x00" * 16),
        r"a: data_offsets end 18446744073709551632 is past the end of the data buffer \(16 bytes; file truncated\?\)",
    ),
    (
        "overlap",
        st_bytes({"a": T, "b": {**T, "data_offsets": [8, 24]}}, b"\x00" * 24),
        r"b: data_offsets \[8, 24\) overlaps the previous tensor \(expected begin 16\)",
    ),
    (
        "gap",
        st_bytes({"a": T, "b": {**T, "data_offsets": [24, 40]}}, b"\x00" * 40),
        r"b: data_offsets \[24, 40\) leaves a gap after the previous tensor \(expected begin 16\)",
    ),
    (
        "nbytes_vs_shape",
        st_bytes({"a": {**T, "data_offsets": [0, 12]}}, b"\x00" * 12),
        r"a: shape \[4\] of F32 needs 16 bytes, data_offsets span 12",
    ),
    (
        "truncated",
        st_bytes({"a": T, "b": {**T, "data_offsets": [16, 32]}}, b"\x00" * 20),
        r"b: data_offsets end 32 is past the end of the data buffer \(20 bytes; file truncated\?\)",
    ),
    (
        "trailing_bytes",
        st_bytes({"a": T}, b"\x00" * 20),
        r"4 trailing bytes after the last tensor \(data ends at 16, buffer is 20\)",
    ),
]


@pytest.mark.parametrize("data,match", [c[1:] for c in CONTAINER_CASES], ids=[c[0] for c in CONTAINER_CASES])
def test_safetensors_container_rules(tmp_path: Path, data: bytes, match: str) -> None:
    p = tmp_path / "bad.safetensors"
    p.write_bytes(data)
    with pytest.raises(SourceFormatError, match=match) as info:
        SafetensorsFile(p)
    assert str(p) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("data,match", [c[1:] for c in CONTAINER_CASES], ids=[c[0] for c in CONTAINER_CASES])
def test_gptq_shard_container_rules(gptq: Path, data: bytes, match: str) -> None:
    """The same breakage inside a GPTQ folder's shard: refused before anything is read."""
    shard = only_shard(gptq)
    shard.write_bytes(data)
    with pytest.raises(SourceFormatError, match=match) as info:
        open_source(gptq).close()
    assert info.value.path == str(shard)


@pytest.mark.parametrize("data,match", [c[1:] for c in CONTAINER_CASES], ids=[c[0] for c in CONTAINER_CASES])
def test_artifact_container_rules(tmp_path: Path, data: bytes, match: str) -> None:
    """The same breakage in a file given to marlin-verify: ArtifactError (exit 2)."""
    p = tmp_path / "bad.marlin.safetensors"
    p.write_bytes(data)
    with pytest.raises(ArtifactError, match=match):
        validate_artifact(p)


def test_real_truncation_of_a_shard(gptq: Path) -> None:
    shard = only_shard(gptq)
    size = shard.stat().st_size
    os.truncate(shard, size - 100)
    with pytest.raises(SourceFormatError, match=r"is past the end of the data buffer \(\d+ bytes; file truncated\?\)"):
        open_source(gptq)


def test_real_trailing_bytes(gptq: Path) -> None:
    shard = only_shard(gptq)
    with open(shard, "ab") as fh:
        fh.write(b"\x00" * 3)
    with pytest.raises(SourceFormatError, match=r"3 trailing bytes after the last tensor"):
        open_source(gptq)


@pytest.mark.parametrize("tool", ["marlin-convert", "marlin-verify"])
def test_fifo_is_refused_not_waited_on(tmp_path: Path, tool: str) -> None:
    """A FIFO named like a weight file must not block the reader (nothing may hang)."""
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(ConverterError, match=r"model.safetensors: not a regular file"):
        SafetensorsFile(fifo)
    args = (fifo, tmp_path / "out.safetensors") if tool == "marlin-convert" else (fifo, "--shapes")
    r = run_cli(tool, *args, timeout=60)
    assert_one_line_error(r, "not a regular file" if tool == "marlin-convert" else "not a file")


def test_release_pages_drops_touched_mmap_pages(tmp_path: Path) -> None:
    """The mechanism: touched file-backed pages leave RSS after release_pages()."""
    p = tmp_path / "big.safetensors"
    n = 64 * MIB
    header = json.dumps({"x": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(p, "wb") as fh:
        fh.write(len(header).to_bytes(8, "little") + header)
        fh.write(np.ones(n, np.uint8).tobytes())

    def rss() -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    with SafetensorsFile(p) as sf:
        before = rss()
        assert int(sf.array("x")[::4096].sum()) == n // 4096  # touch every page
        touched = rss()
        sf.release_pages()
        after = rss()
        assert touched - before > 48 * MIB
        assert touched - after > 48 * MIB
        assert int(sf.array("x")[-1]) == 1  # still readable

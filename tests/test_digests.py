"""sha256 of the inputs on a thread of its own (converter.digests), and the readers'
``describe`` fed with digests computed elsewhere."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from converter.artifact.reader import open_artifact
from converter.convert import convert
from converter.digests import PLACEHOLDER, FileDigests
from converter.errors import ConverterError
from converter.formats import open_source
from tests.helpers.paths import SAMPLE
from tests.helpers.synthetic_gptq import small_gptq


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_digests_are_sha256_in_order(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(b"x" * (9 << 20))  # more than one read
    b.write_bytes(b"")
    with FileDigests([a, b, a]) as d:
        assert d.paths == [a, b]
        assert PLACEHOLDER == "0" * 64
        assert d.result() == {a: _sha(a), b: hashlib.sha256(b"").hexdigest()}


def test_unreadable_file_is_a_converter_error(tmp_path: Path) -> None:
    missing = tmp_path / "gone.safetensors"
    with (
        FileDigests([missing]) as d,
        pytest.raises(ConverterError, match=r"gone\.safetensors: cannot read for sha256: No such file or directory$"),
    ):
        d.result()


def test_a_file_that_changes_size_while_hashed_is_a_converter_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short read (another program truncated the file) is reported by name, not hashed."""
    import os

    from converter import digests as digests_mod

    f = tmp_path / "w.safetensors"
    f.write_bytes(b"y" * (3 << 20))
    real = os.fstat

    def bigger(fd: int) -> os.stat_result:
        st = real(fd)
        return os.stat_result((*st[:6], st.st_size + 5, *st[7:]))

    monkeypatch.setattr(digests_mod.os, "fstat", bigger)
    with (
        FileDigests([f]) as d,
        pytest.raises(
            ConverterError,
            match=rf"w\.safetensors: cannot read for sha256: its size changed while it was read "
            rf"\({(3 << 20) + 5} bytes, then {3 << 20}\)",
        ),
    ):
        d.result()


@pytest.mark.parametrize("kind", ["gptq", "tinyloop"])
def test_describe_with_digests_equals_describe(tmp_path: Path, kind: str) -> None:
    path = small_gptq(tmp_path / "src", shards=2) if kind == "gptq" else SAMPLE
    with open_source(path) as src:
        files = src.digest_files()
        with FileDigests(files) as d:
            assert src.describe(digests=d.result()) == src.describe()
        fake = src.describe(digests=dict.fromkeys(files, PLACEHOLDER))
        assert src.describe(digests=False) == fake  # the placeholders that size the manifest
    assert [f["sha256"] for f in fake["files"]] == [PLACEHOLDER] * len(files)
    assert [f["name"] for f in fake["files"]] == [p.name for p in files]


def test_converted_manifest_records_the_real_sha256(tmp_path: Path) -> None:
    src = small_gptq(tmp_path / "src", shards=2)
    out = convert(src, tmp_path / "a.safetensors").output
    with open_artifact(out) as art:
        recorded = {f.name: f.sha256 for f in art.manifest.source.files}
    want = {p.name: _sha(p) for p in sorted(src.iterdir()) if p.suffix in (".safetensors", ".json")}
    want.pop("tokenizer.json", None)
    assert recorded == want

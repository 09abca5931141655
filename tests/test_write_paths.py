"""How the converter's bytes reach the file: pass-through tensors copied file to file
(``copy_file_range``, convert._copy_tensor), computed chunks spliced (atomic.splice_write),
and ``pwrite`` wherever the kernel cannot do either; every way gives the same artifact,
and a source that ends early during a copy is an error naming it."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from converter.convert import convert
from converter.errors import SourceFormatError
from converter.safetensors_io import SafetensorsFile
from converter.verify import verify
from tests.helpers.producers import gptq_config, gptq_tensors, make_layer, plain_tensors, write_checkpoint


def _checkpoint(folder: Path, shards: int = 1) -> Path:
    rng = np.random.default_rng(3)
    tensors = plain_tensors(rng) | gptq_tensors("model.layers.0.mlp.up_proj", make_layer(rng, 256, 128), v1=True)
    tensors["lm_head.weight"] = rng.standard_normal((96, 64)).astype(np.float32)
    return write_checkpoint(folder, tensors, gptq_config(4, 128), where="quantize_config.json", shards=shards)


def _copy_every_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small pass-through tensors are written in batches (issue 42): these tests are of
    the file-to-file copy of the others, so every tensor takes that path here."""
    import sys

    import converter.convert.stream  # noqa: F401 - the module that reads it (the package attribute is the function)

    monkeypatch.setattr(sys.modules["converter.convert.stream"], "SMALL_TENSOR_BYTES", 0)


@pytest.mark.parametrize("shards", [1, 2])
def test_copied_passthrough_is_byte_identical_to_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shards: int
) -> None:
    src = _checkpoint(tmp_path / "src", shards)
    _copy_every_tensor(monkeypatch)
    real = os.copy_file_range
    copied: list[int] = []

    def counting(*args: int) -> int:
        copied.append(args[2])
        return real(*args)

    monkeypatch.setattr(os, "copy_file_range", counting)
    rep = convert(src, tmp_path / "copied.safetensors")
    passthrough = {p.name for p in rep.passthrough}
    assert passthrough == {"model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"}
    assert sorted(copied) == sorted([64 * 2, 32 * 64 * 2, 96 * 64 * 4])  # each tensor in one call
    assert verify(tmp_path / "copied.safetensors", against=src, gpu=False).ok

    def refused(*args: int) -> int:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", refused)
    convert(src, tmp_path / "refused.safetensors")
    monkeypatch.delattr(os, "copy_file_range")
    convert(src, tmp_path / "absent.safetensors")
    data = (tmp_path / "copied.safetensors").read_bytes()
    assert (tmp_path / "refused.safetensors").read_bytes() == data
    assert (tmp_path / "absent.safetensors").read_bytes() == data


def test_source_truncated_during_the_copy_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last tensor of the file loses its last 10 bytes just before it is copied (its
    bytes were hashed already): the copy comes up short and the error names the file
    and both sizes."""
    src = _checkpoint(tmp_path / "src")
    _copy_every_tensor(monkeypatch)
    weights = src / "model.safetensors"
    sf = SafetensorsFile(weights)
    last = max(sf.infos, key=lambda n: sf.byte_range(n)[1])
    end = sf.byte_range(last)[1]
    size = sf.file_size
    assert end == size
    real = os.copy_file_range

    def truncating(fd_in: int, fd_out: int, count: int, off_in: int, off_out: int) -> int:
        if off_in + count == end:
            os.truncate(weights, end - 10)
        return real(fd_in, fd_out, count, off_in, off_out)

    monkeypatch.setattr(os, "copy_file_range", truncating)
    with pytest.raises(SourceFormatError) as err:
        convert(src, tmp_path / "a.safetensors")
    assert err.value.path == str(weights)
    assert f"shrank from {size} to {size - 10} bytes while being read" in str(err.value)
    assert not (tmp_path / "a.safetensors").exists()
    assert not list(tmp_path.glob(".a.safetensors*"))


def test_splice_write_puts_the_bytes_at_the_offset(tmp_path: Path) -> None:
    """atomic.splice_write: several pipefuls (1 MiB each) land exactly at the offset,
    the bytes around them untouched; with vmsplice unavailable it writes nothing and
    says so (0), for the caller's pwrite."""
    from converter import atomic

    data = np.random.default_rng(1).integers(0, 256, (3 << 20) + 12345, dtype=np.uint8)
    path = tmp_path / "out"
    path.write_bytes(b"\xee" * (data.nbytes + 100))
    fd = os.open(path, os.O_RDWR)
    try:
        assert atomic.splice_write(fd, data.ctypes.data, data.nbytes, 40) == data.nbytes
    finally:
        os.close(fd)
    got = path.read_bytes()
    assert got[:40] == b"\xee" * 40 and got[40 + data.nbytes :] == b"\xee" * 60
    assert got[40 : 40 + data.nbytes] == data.tobytes()
    saved = atomic.splice._VMSPLICE
    try:
        atomic.splice._VMSPLICE = None
        assert atomic.splice_write(0, data.ctypes.data, data.nbytes, 0) == 0
    finally:
        atomic.splice._VMSPLICE = saved


def test_spliced_artifact_is_byte_identical_to_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The computed chunks (B, scales, delta) spliced, or written with pwrite where the
    kernel refuses to splice (EINVAL from vmsplice) or cannot (no vmsplice): the same
    artifact."""
    import ctypes

    from converter import atomic

    src = _checkpoint(tmp_path / "src")
    calls: list[int] = []
    real = atomic.splice._VMSPLICE

    def counting(*args: object) -> int:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(atomic.splice, "_VMSPLICE", counting)
    convert(src, tmp_path / "spliced.safetensors")
    assert calls

    def refusing(*args: object) -> int:
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(atomic.splice, "_VMSPLICE", refusing)
    convert(src, tmp_path / "refused.safetensors")
    monkeypatch.setattr(atomic.splice, "_VMSPLICE", None)
    convert(src, tmp_path / "written.safetensors")
    data = (tmp_path / "spliced.safetensors").read_bytes()
    assert (tmp_path / "refused.safetensors").read_bytes() == data
    assert (tmp_path / "written.safetensors").read_bytes() == data


# --------------------------------------------------------------------------- amplification (issue 42)


def _one_layer(rng: np.random.Generator, prefix: str = "model.layers.0.mlp.up_proj") -> dict[str, np.ndarray]:
    return gptq_tensors(prefix, make_layer(rng, 128, 64, group_size=64), v1=True)


def test_a_quant_config_that_would_make_a_header_above_the_limit_is_refused_up_front(tmp_path: Path) -> None:
    """30 M backslashes in the quant config: the manifest's JSON doubles each (120 MB of
    header, which our own reader refuses). Refused before anything is written or hashed."""
    from tests.helpers.clirun import run_cli_rss

    src = write_checkpoint(
        tmp_path / "src", _one_layer(np.random.default_rng(0)), gptq_config(4, 64, note="\\" * 30_000_000)
    )
    out = tmp_path / "o.safetensors"
    r, rss = run_cli_rss("marlin-convert", src, out)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr
    assert "safetensors header would be" in lines[0] and "100000000-byte limit" in lines[0]
    assert lines[0].startswith(f"error: {out}:") and len(lines[0]) < 1000
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["src"]


def test_many_passthrough_names_that_would_overflow_the_header_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same rule for many long pass-through names (150 k such names made 117 MB);
    the limit is lowered here so that the checkpoint stays small."""
    from converter.artifact import writer as writer_mod

    monkeypatch.setattr(writer_mod, "SAFETENSORS_MAX_HEADER_BYTES", 1_000_000)
    t = _one_layer(np.random.default_rng(0))
    for i in range(3000):
        t[f"{'p' * 200}.{i}"] = np.zeros(1, np.uint8)
    src = write_checkpoint(tmp_path / "src", t, gptq_config(4, 64))
    with pytest.raises(SourceFormatError, match=r"header would be \d+ bytes, above the 1000000-byte limit"):
        convert(src, tmp_path / "o.safetensors")
    assert [p.name for p in tmp_path.iterdir()] == ["src"]


def test_many_tiny_passthrough_tensors_are_linear_and_bounded(tmp_path: Path) -> None:
    """100 k one-byte pass-through tensors (400 k took 106 s and 1.3 GB): hashed at once,
    written in batches; the result verifies against its source."""
    import time

    from tests.helpers.clirun import run_cli, run_cli_rss

    t = _one_layer(np.random.default_rng(0))
    one = np.ones(1, np.uint8)
    for i in range(100_000):
        t[f"t.{i}"] = one
    src = write_checkpoint(tmp_path / "src", t, gptq_config(4, 64))
    out = tmp_path / "o.safetensors"
    start = time.monotonic()
    r, rss = run_cli_rss("marlin-convert", src, out, "-q")
    took = time.monotonic() - start
    assert r.returncode == 0, r.stderr
    assert took < 60, took
    assert rss < 450 << 20, rss  # measured 308 MiB (53 MiB with no tiny tensors): ~2.6 KB a tensor
    v = run_cli("marlin-verify", out, "--against", src, "--shapes", "-q")
    assert v.returncode == 0, v.stdout + v.stderr


def test_a_huge_tensor_name_gives_a_short_error_line(tmp_path: Path) -> None:
    """A 5 M-character tensor name is shortened in the message: its start, its length and
    a hash, never the whole name (a 5 MB error line)."""
    from tests.helpers.clirun import run_cli

    prefix = "L" * 5_000_000
    t = _one_layer(np.random.default_rng(0), prefix)
    t[f"{prefix}.marlin_B"] = np.zeros(4, np.float16)  # collides with the converted layer's B
    src = write_checkpoint(tmp_path / "src", t, gptq_config(4, 64))
    r = run_cli("marlin-convert", src, tmp_path / "o.safetensors")
    assert r.returncode == 2, r.stderr[:500]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and len(lines[0]) < 1000, len(r.stderr)
    assert "(5000009 chars, xxh3 " in lines[0] and "collides" in lines[0]


def test_a_tinyloops_neighbour_files_are_not_copied(tmp_path: Path) -> None:
    """``marlin-convert dir/m.tinyloop OUT/``: only the model's own files go into OUT/ (for
    .tinyloop, none of its neighbours), and the manifest seals only what was written."""
    import json
    import shutil

    from tests.helpers.clirun import run_cli
    from tests.helpers.paths import SAMPLE

    d = tmp_path / "dir"
    d.mkdir()
    shutil.copy(SAMPLE, d / "m.tinyloop")
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "vocab.json",
        "generation_config.json",
        "special_tokens_map.json",
    ):
        (d / name).write_text('{"auto_map": {"AutoTokenizer": ["evil.Tok", null]}}')
    out = tmp_path / "OUT"
    r = run_cli("marlin-convert", d / "m.tinyloop", f"{out}/", "-q")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    meta = SafetensorsFile(out / "model.safetensors").metadata
    files = json.loads(next(v for k, v in meta.items() if "manifest" in k))["checksums"]["files"]
    assert [f["name"] for f in files] == ["config.json"]
    assert run_cli("marlin-verify", out, "--shapes", "-q").returncode == 0


# --------------------------------------------------------------------------- the old four (issue 42)


def test_force_over_an_old_output_whose_config_json_is_a_folder_is_all_or_nothing(tmp_path: Path) -> None:
    from tests.helpers.clirun import assert_one_line_error, run_cli, snapshot
    from tests.helpers.paths import SAMPLE

    out = tmp_path / "OUT"
    assert run_cli("marlin-convert", SAMPLE, f"{out}/", "-q").returncode == 0
    (out / "config.json").unlink()
    (out / "config.json").mkdir()
    (out / "config.json" / "keep").write_text("x")
    before = snapshot(out)
    r = run_cli("marlin-convert", _checkpoint(tmp_path / "src"), f"{out}/", "--force")
    assert_one_line_error(
        r, f"{out / 'config.json'}: is a folder where the output writes a file", "nothing was written"
    )
    assert snapshot(out) == before  # nothing committed, no .backup left


def test_commit_all_refuses_a_folder_under_a_final_name_before_any_rename(tmp_path: Path) -> None:
    from converter.atomic import commit_all
    from converter.errors import ConverterError

    (tmp_path / "a.new").write_text("a")
    (tmp_path / "b.new").write_text("b")
    (tmp_path / "a").write_text("old a")
    (tmp_path / "b").mkdir()
    with pytest.raises(ConverterError, match="is a folder where the output writes a file"):
        commit_all([(tmp_path / "a.new", tmp_path / "a"), (tmp_path / "b.new", tmp_path / "b")], tmp_path)
    assert (tmp_path / "a").read_text() == "old a"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "a.new", "b", "b.new"]


def test_a_nul_byte_in_a_shard_name_of_the_index_is_one_line(tmp_path: Path) -> None:
    import json

    from tests.helpers.clirun import assert_one_line_error, run_cli

    src = _checkpoint(tmp_path / "src", shards=2)
    index = src / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safe\x00tensors"
    index.write_text(json.dumps(doc))
    r = run_cli("marlin-convert", src, tmp_path / "o.safetensors")
    assert_one_line_error(r, str(index), "weight_map", "\\x00", "not a valid file name")
    assert not (tmp_path / "o.safetensors").exists()

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


@pytest.mark.parametrize("shards", [1, 2])
def test_copied_passthrough_is_byte_identical_to_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shards: int
) -> None:
    src = _checkpoint(tmp_path / "src", shards)
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
    saved = atomic._VMSPLICE
    try:
        atomic._VMSPLICE = None
        assert atomic.splice_write(0, data.ctypes.data, data.nbytes, 0) == 0
    finally:
        atomic._VMSPLICE = saved


def test_spliced_artifact_is_byte_identical_to_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The computed chunks (B, scales, delta) spliced, or written with pwrite where the
    kernel refuses to splice (EINVAL from vmsplice) or cannot (no vmsplice): the same
    artifact."""
    import ctypes

    from converter import atomic

    src = _checkpoint(tmp_path / "src")
    calls: list[int] = []
    real = atomic._VMSPLICE

    def counting(*args: object) -> int:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(atomic, "_VMSPLICE", counting)
    convert(src, tmp_path / "spliced.safetensors")
    assert calls

    def refusing(*args: object) -> int:
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(atomic, "_VMSPLICE", refusing)
    convert(src, tmp_path / "refused.safetensors")
    monkeypatch.setattr(atomic, "_VMSPLICE", None)
    convert(src, tmp_path / "written.safetensors")
    data = (tmp_path / "spliced.safetensors").read_bytes()
    assert (tmp_path / "refused.safetensors").read_bytes() == data
    assert (tmp_path / "written.safetensors").read_bytes() == data

"""The GPU loader's checks that run before any GPU work, tested without a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from converter.convert import convert
from converter.errors import ArtifactError
from tests.helpers.paths import SAMPLE


def test_corrupted_artifact_never_reaches_the_gpu(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import converter.gpu.runtime as runtime
    from converter.gpu.api import load_artifact_gpu

    # Pretend CuPy is there: validation must refuse the file before anything uses it.
    monkeypatch.setattr(runtime, "cupy_module", lambda: object())
    good = tmp_path / "s.safetensors"
    convert(SAMPLE, good)
    bad = tmp_path / "bad.safetensors"
    data = bytearray(good.read_bytes())
    data[-3] ^= 0x40
    bad.write_bytes(bytes(data))
    with pytest.raises(
        ArtifactError,
        match=r"bad.safetensors: fails validation \(.*does not match the manifest's .* \(corrupted bytes\)\); "
        r"run marlin-verify",
    ):
        load_artifact_gpu(bad)

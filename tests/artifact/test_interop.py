"""The reference reader reads what we write: ``safetensors.safe_open`` on our artifacts
gives the same tensor names, metadata, dtypes, shapes and bytes as our own reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from converter.convert import convert
from converter.safetensors_io import SafetensorsFile
from tests.helpers.paths import SAMPLE
from tests.helpers.synthetic_gptq import small_gptq


def _same_as_ours(path: Path, framework: str = "numpy") -> set[str]:
    """Compare every tensor NumPy can hold; return the names of the BF16 ones it cannot."""
    bf16 = set()
    with SafetensorsFile(path) as ours, safe_open(str(path), framework=framework) as ref:
        assert ref.metadata() == ours.metadata
        assert sorted(ref.keys()) == sorted(ours.infos)
        for name, info in ours.infos.items():
            if info.dtype == "BF16":
                bf16.add(name)
                continue
            t = ref.get_tensor(name)
            assert tuple(t.shape) == info.shape, name
            assert np.ascontiguousarray(t).tobytes() == bytes(ours.raw(name)), name
    return bf16


def test_gptq_artifact_reads_with_safe_open(tmp_path: Path) -> None:
    src = small_gptq(tmp_path / "src", bias=True)
    for out in (tmp_path / "a.safetensors", tmp_path / "shards" / "m.safetensors"):
        out.parent.mkdir(exist_ok=True)
        convert(src, out, max_shard_size="40KB" if out.parent.name == "shards" else None)
    assert _same_as_ours(tmp_path / "a.safetensors") == set()
    shards = sorted((tmp_path / "shards").glob("m-*.safetensors"))
    assert len(shards) > 1 and all(_same_as_ours(s) == set() for s in shards)


def test_sample_artifact_reads_with_safe_open(tmp_path: Path) -> None:
    """The sample carries a bf16 embedding: NumPy cannot hold it, torch can."""
    out = tmp_path / "s.safetensors"
    convert(SAMPLE, out)
    assert _same_as_ours(out) == {"embed"}
    torch = pytest.importorskip("torch")
    with SafetensorsFile(out) as ours, safe_open(str(out), framework="pt") as ref:
        embed = ref.get_tensor("embed")
        assert embed.dtype == torch.bfloat16
        assert embed.view(torch.int16).numpy().tobytes() == bytes(ours.raw("embed"))

"""The user-facing GPU API end to end: artifact on disk -> layers on the GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from converter.artifact.reader import open_artifact
from converter.convert import convert
from converter.verify import artifact_weight, unpack_layer
from tests.helpers.paths import SAMPLE

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("api") / "s.safetensors"
    convert(SAMPLE, out)
    return out


def test_every_layer_matches_the_artifact_weight(cp, artifact: Path) -> None:
    from converter.gpu.api import load_artifact_gpu

    layers = load_artifact_gpu(artifact)
    rng = np.random.default_rng(11)
    with open_artifact(artifact) as art:
        assert set(layers) == set(art.layers)
        for name, rec in art.layers.items():
            w = artifact_weight(unpack_layer(art, rec), rec)  # fp32, source channel order
            bias = np.asarray(art.tensor(f"{name}.bias"), dtype=np.float32) if rec.has_bias else 0.0
            for m in (1, 17):
                a = rng.standard_normal((m, rec.size_k)).astype(np.float16)
                y = cp.asnumpy(layers[name](cp.asarray(a))).astype(np.float32)
                ref = a.astype(np.float32) @ w + bias
                rel = float(np.abs(y - ref).mean() / np.abs(ref).mean())
                assert rel < 1e-3, (name, m, rel)


def test_module_wrapper_runs_through_dlpack(cp, artifact: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from converter.gpu.api import MarlinLinearModule, load_artifact_gpu

    layer = load_artifact_gpu(artifact)["pre.0.mlp_down"]
    mod = MarlinLinearModule(layer)
    x = torch.randn(4, mod.in_features, dtype=torch.float16, device="cuda")
    y = mod(x)
    assert y.shape == (4, mod.out_features) and y.dtype == torch.float16 and y.is_cuda
    assert np.array_equal(
        y.cpu().numpy().view(np.uint16), cp.asnumpy(layer(cp.asarray(x.cpu().numpy()))).view(np.uint16)
    )

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


def _twin_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """converter.gpu.api on the CPU: NumPy as the array module and the kernels' NumPy
    twins as the launchers, so the loader's wiring (sizes, padded_n, n_out) runs for real."""
    import types

    import numpy as np

    import converter.gpu.api as api
    import converter.gpu.reference as ref
    import converter.gpu.runtime as runtime

    monkeypatch.setattr(runtime, "cupy_module", lambda: np)

    def gemm(*a, b_units=None, **k):  # the CPU has no persistent kernel: B itself always
        return ref.marlin_gemm(*a, **k)

    fake = types.SimpleNamespace(
        gemm_plan=lambda *a, **k: None,
        prepare_delta=lambda d: d,
        marlin_gemm=gemm,
        keeps_b_units=lambda *a, **k: False,
        keeps_b_stages=lambda *a, **k: False,
    )
    monkeypatch.setattr(api, "kernels", fake)


@pytest.mark.parametrize("case", ["vocab-head", "n32-gptq", "regrouped"])
def test_loaded_layers_return_exactly_size_n_columns(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, case) -> None:
    import numpy as np

    from converter.artifact.reader import open_artifact
    from converter.gpu.api import load_artifact_gpu
    from converter.verify import artifact_weight, unpack_layer
    from tests.helpers.producers import RAGGED_SIZES, ragged_gptq
    from tests.helpers.sample import build_vocab_head

    _twin_gpu(monkeypatch)
    if case == "vocab-head":
        src, name, want = build_vocab_head(tmp_path / "v.tinyloop"), "head", (50257, 50304)
    else:
        q, _, k = RAGGED_SIZES
        src, _ = ragged_gptq(tmp_path / "src", np.random.default_rng(4), act_order=True)
        name, want = (k, (32, 64)) if case == "n32-gptq" else (q, (128, 128))
    out = tmp_path / "a.safetensors"
    convert(src, out)
    layers = load_artifact_gpu(out)
    layer = layers[name]
    assert (layer.size_n, layer.padded_n) == want
    with open_artifact(out) as art:
        rec = art.layers[name]
        w = artifact_weight(unpack_layer(art, rec), rec)
        bias = np.asarray(art.tensor(f"{name}.bias"), np.float32) if rec.has_bias else 0.0
    a = np.random.default_rng(0).standard_normal((2, 3, rec.size_k)).astype(np.float16)
    y = layer(a)
    assert y.shape == (2, 3, want[0]) and y.dtype == np.float16
    ref = a.astype(np.float32) @ w + bias
    assert float(np.abs(y.astype(np.float32) - ref).mean() / np.abs(ref).mean()) < 1e-3


def test_a_layer_served_persistent_at_every_m_keeps_only_the_unit_major_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """On sm_90 (faked: NumPy and the twins), a layer that kernels.keeps_b_units names
    keeps B unit-major only (reference.b_units's layout) and calls the GEMM with B None
    and that copy; undoing the layout gives back B, and the result is the twin's."""
    import types

    import numpy as np

    import converter.gpu.api as api
    import converter.gpu.kernels as kernels
    import converter.gpu.reference as ref
    import converter.gpu.runtime as runtime
    from converter.marlin.layout import pack_b, permute_scales

    monkeypatch.setattr(runtime, "cupy_module", lambda: np)
    monkeypatch.setattr(kernels, "hopper_device", lambda: True)
    seen = {}

    def gemm(A, B, S, *, b_units=None, size_k, size_n, **k):
        assert B is None and b_units is not None
        seen["units"] = b_units
        rows = b_units.transpose(1, 0, 2).reshape(size_k // 16, -1)[:, : 2 * size_n]  # back to Marlin's order
        return ref.marlin_gemm(A, rows, S, size_k=size_k, size_n=size_n, **k)

    fake = types.SimpleNamespace(
        gemm_plan=lambda *a, **k: None,
        prepare_delta=lambda d: d,
        prepare_b_units=lambda B, size_k, size_n: ref.b_units(B, size_n),
        marlin_gemm=gemm,
        keeps_b_units=kernels.keeps_b_units,  # the real rules, on a faked sm_90
        keeps_b_stages=kernels.keeps_b_stages,
    )
    monkeypatch.setattr(api, "kernels", fake)
    rng = np.random.default_rng(7)
    k, n = 4608, 4096
    B = pack_b(rng.integers(0, 16, (k, n), dtype=np.uint8))
    S = permute_scales((rng.uniform(0.5, 2, (k // 128, n)) / 64).astype(np.float16))
    layer = api.MarlinLinear("l", k, n, 128, B, S, None, None, None)
    assert layer._B is None and layer._B_units.shape == (n // 256, k // 16, 512)
    a = rng.standard_normal((2, k)).astype(np.float16)
    got = layer(a)
    assert np.array_equal(seen["units"], ref.b_units(B, n))
    want = ref.marlin_gemm(a, B, S, size_k=k, size_n=n, group_size=128)
    got16, want16 = np.asarray(got, np.float16), np.asarray(want, np.float16)
    assert np.array_equal(got16.view(np.uint16), want16.view(np.uint16))


def test_which_layers_keep_b_unit_major(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels.keeps_b_units: on sm_90 the layers the persistent kernel serves at every M
    (groups of 128 or per-channel on layers of N >= 4096 above 4096² weights), on no other
    device; sizes the kernels do not take are a KernelError naming the rule."""
    import converter.gpu.kernels as kernels
    from converter.errors import KernelError

    monkeypatch.setattr(kernels, "hopper_device", lambda: True)
    assert kernels.keeps_b_units(4608, 4096, 128) and kernels.keeps_b_units(8192, 57344, -1)
    assert kernels.keeps_b_units(14336, 4096, 14336)  # per-channel spelled as K
    assert not kernels.keeps_b_units(4608, 4096, 64)  # the decode kernel below 9 rows
    assert not kernels.keeps_b_units(4096, 4096, 128) and not kernels.keeps_b_units(8192, 1024, 128)
    with pytest.raises(KernelError, match="group_size"):
        kernels.keeps_b_units(4096, 4096, 40)
    monkeypatch.setattr(kernels, "hopper_device", lambda: False)
    assert not kernels.keeps_b_units(4608, 4096, 128)


def test_an_asymmetric_group_128_layer_keeps_the_scales_and_deltas_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    """On sm_90 (faked), an asymmetric group-128 layer that kernels.keeps_b_units names
    keeps B with each stage's scales and deltas inline (reference.b_stages's layout) and
    calls the GEMM with B None and that copy; its pieces give back B, the scales and the
    fp16 deltas, and the result is the twin's. The same layer without a delta stays
    unit-major (no zero rows streamed), and so does one of groups of 64."""
    import types

    import numpy as np

    import converter.gpu.api as api
    import converter.gpu.kernels as kernels
    import converter.gpu.reference as ref
    import converter.gpu.runtime as runtime
    from converter.marlin.layout import pack_b, permute_scales

    monkeypatch.setattr(runtime, "cupy_module", lambda: np)
    monkeypatch.setattr(kernels, "hopper_device", lambda: True)
    seen = {}

    def gemm(A, B, S, *, b_units=None, size_k, size_n, delta=None, **k):
        assert B is None and b_units is not None
        seen["units"] = b_units
        g = size_k // 128
        assert b_units.shape == (-(-size_n // 256), g, kernels.STAGE_RUN_INT32)
        rows = b_units[:, :, : 8 * 512].reshape(b_units.shape[0], size_k // 16, 512)
        rows = rows.transpose(1, 0, 2).reshape(size_k // 16, -1)[:, : 2 * size_n]
        s_in = b_units[:, :, 4096:4224].transpose(1, 0, 2).reshape(g, -1).view(np.float16)[:, :size_n]
        d_in = b_units[:, :, 4224:].transpose(1, 0, 2).reshape(g, -1).view(np.float16)[:, :size_n]
        assert np.array_equal(s_in.view(np.uint16), S.view(np.uint16))
        assert np.array_equal(d_in.view(np.uint16), delta.view(np.uint16))
        return ref.marlin_gemm(A, rows, S, size_k=size_k, size_n=size_n, delta=delta, **k)

    def d16(d):  # kernels.prepare_delta on the host: fp16, then Marlin's scale order
        return permute_scales(np.asarray(d, np.float32).astype(np.float16))

    fake = types.SimpleNamespace(
        gemm_plan=lambda *a, **k: None,
        prepare_delta=d16,
        prepare_b_units=lambda B, size_k, size_n: ref.b_units(B, size_n),
        prepare_b_stages=lambda B, S, D, size_k, size_n: ref.b_stages(B, S, D, size_n),
        marlin_gemm=gemm,
        keeps_b_units=kernels.keeps_b_units,
        keeps_b_stages=kernels.keeps_b_stages,
    )
    monkeypatch.setattr(api, "kernels", fake)
    rng = np.random.default_rng(8)
    k, n = 4608, 4352  # N / 64 = 68: a ragged last unit, zero-padded
    B = pack_b(rng.integers(0, 16, (k, n), dtype=np.uint8))
    S = permute_scales((rng.uniform(0.5, 2, (k // 128, n)) / 64).astype(np.float16))
    D = rng.normal(0, 0.01, (k // 128, n)).astype(np.float32)
    layer = api.MarlinLinear("l", k, n, 128, B, S, D, None, None)
    assert layer._B is None and layer._B_units.shape == (-(-n // 256), k // 128, 4352)
    assert np.array_equal(layer._B_units, ref.b_stages(B, S, d16(D), n))
    a = rng.standard_normal((3, k)).astype(np.float16)
    got = np.asarray(layer(a), np.float16)
    want = np.asarray(ref.marlin_gemm(a, B, S, size_k=k, size_n=n, group_size=128, delta=d16(D)), np.float16)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    assert api.MarlinLinear("l", k, n, 128, B, S, None, None, None)._B_units.shape == (-(-n // 256), k // 16, 512)
    assert not kernels.keeps_b_stages(k, n, 64, True) and not kernels.keeps_b_stages(k, n, 128, False)
    assert kernels.keeps_b_stages(k, n, 128, True) and not kernels.keeps_b_stages(4096, 4096, 128, True)


@pytest.mark.parametrize(
    "shape,dtype", [((2, 128), "float32"), ((2, 128), "int32"), ((1, 2, 128), "bfloat16"), ((2, 129), "float16")]
)
def test_the_ops_tracing_form_refuses_what_the_op_refuses(shape, dtype) -> None:
    """While tracing (torch.compile, fake tensors), the op refuses what run_gemm refuses,
    in its words: not float16 / bfloat16, not 2-D, not (M, size_k)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from converter.errors import KernelError
    from converter.gpu import torch_op  # noqa: F401  (registers torch.ops.marlin_convert.gemm)

    k, n = 128, 64
    op = torch.ops.marlin_convert.gemm
    with FakeTensorMode():
        b, s = torch.zeros(k // 16, 2 * n, dtype=torch.int32), torch.ones(1, n, dtype=torch.float16)
        locks, x = torch.zeros(8, dtype=torch.int32), torch.zeros(shape, dtype=getattr(torch, dtype))
        refused = r"A: expected a float16 or bfloat16 CUDA tensor \(M, 128\)"
        with pytest.raises((KernelError, RuntimeError), match=refused):
            op(x, b, s, None, None, None, locks, k, n, 128, n)
        y = op(torch.zeros(3, k, dtype=torch.bfloat16), b, s, None, None, None, locks, k, n, 128, n)
        assert (y.dtype, tuple(y.shape)) == (torch.bfloat16, (3, n))

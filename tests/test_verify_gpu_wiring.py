"""marlin-verify's GPU mode, wired to stand-in kernels so it runs without a GPU.

The stand-in computes C with the NumPy reference of the kernel path, so the wiring
(arguments, per-layer rows, the 1e-3 bar, skip and force behaviour) is exercised
for real; the kernels themselves are tested in tests/gpu on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from converter.convert import convert
from converter.errors import GpuUnavailableError
from converter.marlin.layout import unpack_b, unpermute_scales
from converter.verify import verify
from tests.helpers.paths import SAMPLE


def _standin(scale_error: float, unit_major_same: bool | None = None):
    def verify_layer_gpu(B, scales, delta, perm, size_k, size_n, group_size, w_ref_f32, *, n_out):
        assert w_ref_f32.shape == (size_k, n_out) and n_out <= size_n
        q = unpack_b(B, size_n).astype(np.float32)
        s = unpermute_scales(scales, single=scales.shape[0] == 1).astype(np.float32)
        g = np.arange(size_k) // (size_k if group_size == -1 else group_size)
        a = np.random.default_rng(0).standard_normal((17, size_k)).astype(np.float32)
        ap = a[:, perm] if perm is not None else a
        c = (ap @ ((q - 8) * s[g]) + ap.reshape(17, -1, size_k // s.shape[0]).sum(2) @ delta)[:, :n_out]
        ref = a @ w_ref_f32
        err = float(np.abs(c * (1 + scale_error) - ref).mean() / np.abs(ref).mean())
        entry = {"mean_rel_err": err, "max_rel_err": err, "deterministic": True}
        if unit_major_same is not None:
            entry["unit_major_same"] = unit_major_same
        return {17: entry, "ok": err <= 1e-3 and unit_major_same is not False}

    return verify_layer_gpu


@pytest.fixture()
def artifact(tmp_path: Path) -> Path:
    out = tmp_path / "s.safetensors"
    convert(SAMPLE, out)
    return out


def _patch(monkeypatch: pytest.MonkeyPatch, scale_error: float, unit_major_same: bool | None = None) -> None:
    import converter.gpu.runtime as runtime
    import converter.gpu.verify as gverify

    monkeypatch.setattr(runtime, "require_gpu", lambda: None)
    monkeypatch.setattr(gverify, "verify_layer_gpu", _standin(scale_error, unit_major_same))


def test_gpu_mode_reports_per_layer_errors(monkeypatch: pytest.MonkeyPatch, artifact: Path) -> None:
    _patch(monkeypatch, 0.0)
    report = verify(artifact, against=SAMPLE, gpu=True)
    assert report.ok, [p.message for p in report.problems if p.severity == "error"]
    assert report.checked["gpu_numerics"] is True
    rows = {r["name"]: r for r in report.layers}
    assert rows["pre.0.mlp_down"]["gpu"]["mean_rel_err"] < 1e-5
    assert rows["pre.0.mlp_down"]["gpu"]["per_m"]["17"]["deterministic"] is True
    # K = 128 with group 128 fits the kernel; every sample layer does.
    assert all(isinstance(r["gpu"], dict) for r in rows.values())


def test_gpu_mode_fails_above_1e3(monkeypatch: pytest.MonkeyPatch, artifact: Path) -> None:
    _patch(monkeypatch, 0.01)
    report = verify(artifact, gpu=True)
    assert not report.ok
    problems = [p for p in report.problems if p.code == "gpu_numerics"]
    assert len(problems) == 15
    assert "GPU mean relative error 0.01 (limit 0.001)" in problems[0].message


def test_gpu_mode_fails_when_the_unit_major_copy_differs(monkeypatch: pytest.MonkeyPatch, artifact: Path) -> None:
    _patch(monkeypatch, 0.0, unit_major_same=False)
    report = verify(artifact, gpu=True)
    assert not report.ok
    problems = [p for p in report.problems if p.code == "gpu_numerics"]
    assert len(problems) == 15
    assert problems[0].message.endswith("; B unit-major (as MarlinLinear serves it) gives other bits")
    rows = {r["name"]: r for r in report.layers}
    assert rows["pre.0.mlp_down"]["gpu"]["unit_major_same"] is False
    _patch(monkeypatch, 0.0, unit_major_same=True)
    assert verify(artifact, gpu=True).ok


def test_forced_gpu_without_gpu_is_a_problem(monkeypatch: pytest.MonkeyPatch, artifact: Path) -> None:
    import converter.gpu.runtime as runtime

    def no_gpu():
        raise GpuUnavailableError("no CUDA device found")

    monkeypatch.setattr(runtime, "require_gpu", no_gpu)
    report = verify(artifact, gpu=True)
    assert [p.message for p in report.problems if p.code == "gpu"] == ["--gpu given but no CUDA device found"]
    auto = verify(artifact, gpu=None)
    assert auto.ok and auto.checked["gpu_numerics"] == "skipped: no CUDA device found"


def test_gpu_check_on_the_kernels_numpy_twins_covers_regrouped_and_padded_layers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The real converter.gpu.verify check, with NumPy for CuPy and the kernels' twins for
    the launchers: the regrouped (K = 576 and 960) and padded (N = 32) layers of a short-
    last-group checkpoint pass the 1e-3 bar on exactly their size_n columns."""
    import functools
    import types

    import converter.gpu.reference as ref
    import converter.gpu.runtime as runtime
    import converter.gpu.verify as gverify
    from tests.helpers.producers import RAGGED_SIZES, ragged_gptq

    monkeypatch.setattr(runtime, "require_gpu", lambda: None)
    monkeypatch.setattr(gverify.runtime, "cupy_module", lambda: np)
    fake = types.SimpleNamespace(
        marlin_gemm=ref.marlin_gemm,
        marlin_gemm_two_kernel=ref.marlin_gemm_two_kernel,
        synchronize=lambda: None,
        keeps_b_units=lambda *a, **k: False,  # small layers: MarlinLinear keeps B in Marlin's order on any device
        keeps_b_stages=lambda *a, **k: False,
    )
    monkeypatch.setattr(gverify, "kernels", fake)
    monkeypatch.setattr(gverify, "verify_layer_gpu", functools.partial(gverify.verify_layer_gpu, repeats=2))
    src, _ = ragged_gptq(tmp_path / "src", np.random.default_rng(21), bits=2, act_order=True)
    out = tmp_path / "a.safetensors"
    convert(src, out)
    report = verify(out, against=src, gpu=True)
    assert report.ok, [p.message for p in report.problems]
    rows = {r["name"]: r for r in report.layers}
    assert set(rows) == set(RAGGED_SIZES)
    for row in rows.values():
        gpu = row["gpu"]
        assert gpu["ok"] and gpu["deterministic"] and set(gpu["per_m"]) == {"1", "16", "17", "64", "128"}
        assert 0 < gpu["mean_rel_err"] < 1e-3 and "two_kernel_mean_rel_err" in gpu["per_m"]["17"]

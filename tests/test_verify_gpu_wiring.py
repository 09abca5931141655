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


def _standin(scale_error: float, unit_major_same: bool | None = None, bar: float = 1e-3):
    def verify_layer_gpu(B, scales, delta, perm, size_k, size_n, group_size, w_ref_f32, *, n_out, act):
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
        return {17: entry, "ok": err <= bar and unit_major_same is not False}

    return verify_layer_gpu


@pytest.fixture()
def artifact(tmp_path: Path) -> Path:
    out = tmp_path / "s.safetensors"
    convert(SAMPLE, out)
    return out


def _patch(
    monkeypatch: pytest.MonkeyPatch, scale_error: float, unit_major_same: bool | None = None, bar: float = 1e-3
) -> None:
    import converter.gpu.runtime as runtime
    import converter.gpu.verify as gverify

    monkeypatch.setattr(runtime, "require_gpu", lambda: None)
    monkeypatch.setattr(gverify, "verify_layer_gpu", _standin(scale_error, unit_major_same, bar))


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
    assert "GPU mean relative error 0.01 in float16 (limit 0.001)" in problems[0].message


def test_gpu_mode_in_bf16_names_its_type_and_bar(monkeypatch: pytest.MonkeyPatch, artifact: Path) -> None:
    _patch(monkeypatch, 0.01, bar=8e-3)
    report = verify(artifact, gpu=True, act="bfloat16")
    problems = [p for p in report.problems if p.code == "gpu_numerics"]
    assert len(problems) == 15
    assert "GPU mean relative error 0.01 in bfloat16 (limit 0.008)" in problems[0].message
    assert report.checked["gpu_act"] == "bfloat16"
    assert {r["gpu"]["act"] for r in report.layers} == {"bfloat16"}
    assert verify(artifact, gpu=True, act="bf16").checked["gpu_act"] == "bfloat16"  # the CLI's alias


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
    assert [p.message for p in report.problems if p.code == "gpu"] == ["GPU numerics required but no CUDA device found"]
    auto = verify(artifact, gpu=None)
    assert auto.ok and auto.checked["gpu_numerics"] == "skipped: no CUDA device found"


def _twin_gemm(a, B, S, *, act, **kw):
    """The launcher's stand-in: the kernels' NumPy twin of the activation type asked."""
    import converter.gpu.reference as ref
    import converter.gpu.reference_bf16 as ref16

    if act == "bfloat16":
        assert a.dtype == np.uint16, a.dtype  # bf16 travels as its bits
        return ref16.marlin_gemm(a, B, S, **kw)
    assert act == "float16" and a.dtype == np.float16
    return ref.marlin_gemm(a, B, S, **kw)


@pytest.mark.parametrize("act", ["float16", "bfloat16"])
def test_gpu_check_on_the_kernels_numpy_twins_covers_regrouped_and_padded_layers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, act: str
) -> None:
    """The real converter.gpu.verify check, with NumPy for CuPy and the kernels' twins for
    the launchers: the regrouped (K = 576 and 960) and padded (N = 32) layers of a short-
    last-group checkpoint pass the bar (1e-3 in fp16, 8e-3 in bf16) on exactly their size_n
    columns; bf16 runs the fused path only (the two-kernel path has no bf16 form)."""
    import functools
    import types

    import converter.gpu.reference as ref
    import converter.gpu.runtime as runtime
    import converter.gpu.verify as gverify
    from tests.helpers.producers import RAGGED_SIZES, ragged_gptq

    monkeypatch.setattr(runtime, "require_gpu", lambda: None)
    monkeypatch.setattr(gverify.runtime, "cupy_module", lambda: np)
    fake = types.SimpleNamespace(
        marlin_gemm=_twin_gemm,
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
    report = verify(out, against=src, gpu=True, act=act)
    assert report.ok, [p.message for p in report.problems]
    rows = {r["name"]: r for r in report.layers}
    assert set(rows) == set(RAGGED_SIZES)
    # bf16 rounds the weight and the output to 8 bits: more than fp16's error, under its bar
    low, high = (0, 1e-3) if act == "float16" else (1e-3, 8e-3)
    for row in rows.values():
        gpu = row["gpu"]
        assert gpu["ok"] and gpu["deterministic"] and set(gpu["per_m"]) == {"1", "16", "17", "64", "128"}
        assert low < gpu["mean_rel_err"] < high and gpu["act"] == act, gpu["mean_rel_err"]
        assert ("two_kernel_mean_rel_err" in gpu["per_m"]["17"]) == (act == "float16")


def test_cli_dtype_runs_the_gpu_check_in_bf16_and_says_so(monkeypatch: pytest.MonkeyPatch, artifact: Path) -> None:
    import json

    from tests.helpers.clirun import invoke

    asked = []
    standin = _standin(0.0)

    def recording(*args, act, **kw):
        asked.append(act)
        return standin(*args, act=act, **kw)

    import converter.gpu.runtime as runtime
    import converter.gpu.verify as gverify

    monkeypatch.setattr(runtime, "require_gpu", lambda: None)
    monkeypatch.setattr(gverify, "verify_layer_gpu", recording)
    res = invoke("marlin-verify", artifact, "--gpu", "--dtype", "bf16")
    assert res.exit_code == 0, res.stderr
    assert set(asked) == {"bfloat16"} and len(asked) == 15
    assert res.stdout.splitlines()[-1].endswith("checked shapes, checksums, CPU numerics, GPU numerics (bfloat16)")
    asked.clear()
    res = invoke("marlin-verify", artifact, "--gpu", "--json")
    assert res.exit_code == 0 and set(asked) == {"float16"}
    assert json.loads(res.stdout)["checked"]["gpu_act"] == "float16"
    assert invoke("marlin-verify", artifact, "--gpu").stdout.splitlines()[-1].endswith("CPU numerics, GPU numerics")


def test_cli_dtype_where_no_gpu_can_run_it_is_refused_up_front(monkeypatch: pytest.MonkeyPatch, artifact: Path) -> None:
    """--dtype asks for the GPU check in that type: where none can run it the command stops
    before any work, saying what to do, instead of passing with the type ignored; with
    --gpu as well, that is --gpu's problem (exit 1)."""
    import converter.gpu.runtime as runtime
    from tests.helpers.clirun import assert_refused, invoke

    def no_gpu():
        raise GpuUnavailableError("CuPy is not available (no module); on a machine without an NVIDIA GPU, ...")

    monkeypatch.setattr(runtime, "require_gpu", no_gpu)
    line = assert_refused(invoke("marlin-verify", artifact, "--dtype", "bf16"))
    assert line == (
        "error: --dtype bfloat16 sets the GPU layer check's activations, and no GPU can run it here (CuPy is not "
        "available (no module)); leave --dtype out (the CPU numerics run without it)"
    )
    res = invoke("marlin-verify", artifact, "--gpu", "--dtype", "bf16")
    assert res.exit_code == 1 and "GPU numerics required but CuPy is not available" in res.stdout
    assert invoke("marlin-verify", artifact).exit_code == 0  # without it: skipped


def test_verify_checks_act_before_any_work(artifact: Path) -> None:
    with pytest.raises(ValueError, match=r"act='float32': the kernels take float16 or bfloat16 activations"):
        verify(artifact, shapes_only=True, act="float32")


def _numpy_gpu_check(monkeypatch: pytest.MonkeyPatch, *, units: bool, seen: list[tuple[str, bool]]):
    """converter.gpu.verify on NumPy, with the kernels' twins for the launchers; with
    ``units`` the layer is one MarlinLinear keeps unit-major (the copy is B itself here).
    ``seen`` gets (act, called on the copy) per launch."""
    import types

    import converter.gpu.reference as ref
    import converter.gpu.verify as gverify

    def gemm(a, B, S, *, act, b_units=None, **kw):
        seen.append((act, b_units is not None))
        return _twin_gemm(a, B if b_units is None else b_units, S, act=act, **kw)

    fake = types.SimpleNamespace(
        marlin_gemm=gemm,
        marlin_gemm_two_kernel=ref.marlin_gemm_two_kernel,
        synchronize=lambda: None,
        keeps_b_units=lambda *a, **k: units,
        keeps_b_stages=lambda *a, **k: False,
        prepare_b_units=lambda B, *a: B,
    )
    monkeypatch.setattr(gverify.runtime, "cupy_module", lambda: np)
    monkeypatch.setattr(gverify, "kernels", fake)
    return gverify.verify_layer_gpu


def _random_layer(k: int = 512, n: int = 128, gs: int = 128):
    import converter.gpu.reference as ref
    from converter.marlin.layout import pack_b, permute_scales

    rng = np.random.default_rng(9)
    g = k // gs
    q = rng.integers(0, 16, (k, n), dtype=np.uint8)
    s = (rng.uniform(0.5, 2.0, (g, n)) / 64).astype(np.float16)
    delta = (s.astype(np.float32) * (8 - rng.integers(0, 16, (g, n)))).astype(np.float32)
    B, S = pack_b(q), permute_scales(s)
    return B, S, delta, ref.reference_weight(B, S, delta, None, size_k=k, size_n=n, group_size=gs)


def test_each_type_has_its_own_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight 0.4 % off: above fp16's bar (1e-3), within bf16's (8e-3)."""
    check = _numpy_gpu_check(monkeypatch, units=False, seen=[])
    B, S, delta, w = _random_layer()
    off = (w * np.float32(1.004)).astype(np.float32)
    args = (B, S, delta, None, 512, 128, 128, off)
    fp16 = check(*args, repeats=1, ms=(17,))
    bf16 = check(*args, repeats=1, ms=(17,), act="bfloat16")
    assert 3e-3 < fp16[17]["mean_rel_err"] < 5e-3 and not fp16["ok"]
    assert 3e-3 < bf16[17]["mean_rel_err"] < 8e-3 and bf16["ok"]


def test_verify_layer_gpu_refuses_another_type(monkeypatch: pytest.MonkeyPatch) -> None:
    from converter.errors import KernelError

    check = _numpy_gpu_check(monkeypatch, units=False, seen=[])
    B, S, delta, w = _random_layer()
    with pytest.raises(KernelError, match=r"act='bf16': the kernels take float16 or bfloat16 activations"):
        check(B, S, delta, None, 512, 128, 128, w, act="bf16")


def test_the_kept_copy_runs_in_the_type_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, bool]] = []
    check = _numpy_gpu_check(monkeypatch, units=True, seen=seen)
    B, S, delta, w = _random_layer()
    res = check(B, S, delta, None, 512, 128, 128, w, repeats=2, ms=(1, 17), act="bfloat16")
    assert res["ok"] and res[17]["unit_major_same"] is True
    assert seen == [("bfloat16", False), ("bfloat16", False), ("bfloat16", True)] * 2


def test_a_result_that_moves_between_calls_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A race shows as a moving result: one call in ten a unit off in one output fails
    the layer, whatever its error."""
    import converter.gpu.verify as gverify

    check = _numpy_gpu_check(monkeypatch, units=False, seen=[])
    twin = gverify.kernels.marlin_gemm
    calls = []

    def flaky(*args, **kw):
        c = np.array(twin(*args, **kw))
        calls.append(1)
        if len(calls) == 5:
            c.view(np.uint16)[0, 0] ^= 1
        return c

    monkeypatch.setattr(gverify.kernels, "marlin_gemm", flaky)
    B, S, delta, w = _random_layer()
    res = check(B, S, delta, None, 512, 128, 128, w, repeats=10, ms=(17,), act="bfloat16")
    assert res[17]["deterministic"] is False and not res["ok"]
    assert res[17]["mean_rel_err"] < 8e-3  # the error alone would pass

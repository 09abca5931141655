"""CPU tests of the NumPy twins in converter.gpu.reference and of the GPU loader's
behaviour without CuPy (no GPU needed; no marker)."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

from converter.errors import GpuUnavailableError
from converter.gpu import reference as ref
from converter.marlin.layout import pack_b, permute_scales
from tests.helpers.kernel_layers import make_twin_layer as make_layer
from tests.helpers.paths import REPO


@pytest.mark.parametrize(
    "k,n,group_size", [(128, 64, 32), (256, 128, 64), (256, 192, 128), (128, 64, -1), (256, 64, 256)]
)
def test_dequant_symmetric_equals_fp16_product(k, n, group_size):
    rng = np.random.default_rng(k + n)
    L = make_layer(rng, k, n, group_size, asym=False)
    w = ref.dequant(L["B"], L["S"], size_k=k, size_n=n, group_size=group_size)
    rows = np.arange(k) // L["gs"]
    # numpy multiplies float16 in float32 (exact for a 4-bit x 11-bit product), then rounds once
    expect = (L["q"].astype(np.float16) - np.float16(8)) * L["s"][rows]
    assert w.dtype == np.float16 and w.shape == (k, n)
    assert np.array_equal(w.view(np.uint16), expect.astype(np.float16).view(np.uint16))


@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_dequant_asymmetric_within_one_rounding(group_size):
    k, n = 256, 128
    rng = np.random.default_rng(7)
    L = make_layer(rng, k, n, group_size)
    w = ref.dequant(L["B"], L["S"], size_k=k, size_n=n, group_size=group_size, delta=L["delta"])
    rows = np.arange(k) // L["gs"]
    exact = (L["q"].astype(np.float64) - 8) * L["s"].astype(np.float64)[rows] + L["delta"].astype(np.float64)[rows]
    # fp16(delta) then one fp16 rounding: at most half an ulp of each
    d16_err = np.abs(L["delta"].astype(np.float16).astype(np.float64) - L["delta"].astype(np.float64))[rows]
    tol = d16_err + 2.0**-11 * np.abs(exact) * 1.001 + 2.0**-25
    assert np.all(np.abs(w.astype(np.float64) - exact) <= tol)


def test_dequant_closed_form_spot():
    # checkpoint-formats.md 4.3 worked example: q = 1 only at (8, 0) -> nibble 1 of B[0, 0]
    q = np.zeros((16, 64), np.uint8)
    q[8, 0] = 9
    s = np.ones((1, 64), np.float16)
    w = ref.dequant(pack_b(q), permute_scales(s), size_k=16, size_n=64, group_size=-1)
    expect = np.full((16, 64), -8, np.float16)
    expect[8, 0] = 1
    assert np.array_equal(w, expect)


@pytest.mark.parametrize("act_order", [False, True])
def test_gemm_twin_matches_float64(act_order):
    k, n, m = 512, 192, 5
    rng = np.random.default_rng(3)
    L = make_layer(rng, k, n, 64, act_order=act_order)
    a = rng.standard_normal((m, k)).astype(np.float16)
    bias = rng.standard_normal(n).astype(np.float16)
    c = ref.marlin_gemm(
        a, L["B"], L["S"], size_k=k, size_n=n, group_size=64, delta=L["delta"], perm=L["perm"], bias=bias
    )
    w_src = ref.reference_weight(L["B"], L["S"], L["delta"], L["perm"], size_k=k, size_n=n, group_size=64)
    exact = a.astype(np.float64) @ w_src.astype(np.float64) + bias.astype(np.float64)
    rel = np.abs(c.astype(np.float64) - exact).mean() / np.abs(exact).mean()
    assert c.dtype == np.float16 and c.shape == (m, n)
    assert rel < 1e-3
    # the twin's own bound covers a float32 evaluation of the same product
    w16 = ref.dequant(L["B"], L["S"], size_k=k, size_n=n, group_size=64, delta=L["delta"])
    a_m = a[:, L["perm"]] if act_order else a
    c32 = (a_m.astype(np.float32) @ w16.astype(np.float32) + bias.astype(np.float32)).astype(np.float16)
    bound = ref.gemm_error_bound(
        a, L["B"], L["S"], size_k=k, size_n=n, group_size=64, delta=L["delta"], perm=L["perm"], bias=bias
    )
    assert np.all(np.abs(c32.astype(np.float64) - c.astype(np.float64)) <= bound)


@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_decode_twin_is_the_per_group_formula(group_size):
    """The decode twin equals sum_g s_g (A_g (q_g - 8)) + X_g fp16(d_g), written out per group."""
    k, n, m = 256, 128, 3
    rng = np.random.default_rng([17, group_size % 97])
    L = make_layer(rng, k, n, group_size)
    a = rng.standard_normal((m, k)).astype(np.float16)
    kw = dict(size_k=k, size_n=n, group_size=group_size, delta=L["delta"])
    got = ref.marlin_gemm(a, L["B"], L["S"], arith="group", **kw).astype(np.float64)
    gs, a64 = L["gs"], a.astype(np.float64)
    acc = np.zeros((m, n))
    for g in range(k // gs):
        rows = slice(g * gs, (g + 1) * gs)
        p = a64[:, rows] @ (L["q"][rows].astype(np.float64) - 8)
        x = a64[:, rows].sum(1, keepdims=True)
        d16 = L["delta"][g].astype(np.float16).astype(np.float64)
        acc += p * L["s"][g].astype(np.float64) + x * d16
    # got is acc rounded once to fp16: within half an fp16 ulp (2**-11 relative)
    assert np.all(np.abs(got - acc) <= 2.0**-11 * np.abs(acc) * (1 + 1e-9) + 2.0**-25)
    # the two kernels' twins differ by the fp16 rounding of the tile kernel's weight only
    tile = ref.marlin_gemm(a, L["B"], L["S"], arith="weight", **kw).astype(np.float64)
    w16 = ref.dequant(L["B"], L["S"], size_k=k, size_n=n, group_size=group_size, delta=L["delta"])
    slack = np.abs(a64) @ (2.0**-11 * np.abs(w16.astype(np.float64))) + 2.0**-10 * (np.abs(tile) + np.abs(got))
    assert np.all(np.abs(tile - got) <= slack + 2.0**-24)
    assert not np.array_equal(tile, got)  # really two different formulas
    # a float32 evaluation of the per-group formula stays inside the decode bound
    c32 = sum(
        (a[:, g * gs : (g + 1) * gs].astype(np.float32) @ (L["q"][g * gs : (g + 1) * gs].astype(np.float32) - 8))
        * L["s"][g].astype(np.float32)
        + a[:, g * gs : (g + 1) * gs].astype(np.float32).sum(1, keepdims=True)
        * L["delta"][g].astype(np.float16).astype(np.float32)
        for g in range(k // gs)
    ).astype(np.float16)
    bound = ref.gemm_error_bound(a, L["B"], L["S"], arith="group", **kw)
    assert np.all(np.abs(c32.astype(np.float64) - got) <= bound)


@pytest.mark.parametrize("g", [1, 3])
def test_prepared_delta_order_matches_the_scales(g):
    """kernels.prepare_delta's column order is the scales' (so the kernels read both at one offset)."""
    from converter.gpu import kernels

    n = 128
    d = np.arange(g * n, dtype=np.float32).reshape(g, n)
    order = kernels._scale_order(n, g == 1)
    assert np.array_equal(d[:, order], permute_scales(d))
    # the twins accept both operand forms and agree
    rng = np.random.default_rng(g)
    L = make_layer(rng, 64 * g, n, 64)
    a = rng.standard_normal((2, 64 * g)).astype(np.float16)
    d16 = permute_scales(L["delta"].astype(np.float16))
    kw = dict(size_k=64 * g, size_n=n, group_size=64)
    for arith in ("weight", "group"):
        assert np.array_equal(
            ref.marlin_gemm(a, L["B"], L["S"], delta=L["delta"], arith=arith, **kw),
            ref.marlin_gemm(a, L["B"], L["S"], delta=d16, arith=arith, **kw),
        )


@pytest.mark.parametrize("n", [256, 320, 1024])
def test_b_units_puts_each_units_k_tiles_together(n):
    """reference.b_units: unit u's k-tile t is B's 512 int32 at row t, column 512 u;
    a ragged last unit (N / 64 not a multiple of 4) is zero-padded; the round trip
    gives B back."""
    rng = np.random.default_rng(n)
    k = 96
    B = rng.integers(-(2**31), 2**31, size=(k // 16, 2 * n), dtype=np.int64).astype(np.int32)
    U = ref.b_units(B, n)
    units = -(-n // 256)
    assert U.shape == (units, k // 16, 512) and U.dtype == np.int32 and U.flags.c_contiguous
    for u in range(units):
        for t in range(k // 16):
            piece = B[t, 512 * u : 512 * (u + 1)]
            assert np.array_equal(U[u, t, : piece.size], piece)
            assert not U[u, t, piece.size :].any()
    assert np.array_equal(U.transpose(1, 0, 2).reshape(k // 16, -1)[:, : 2 * n], B)
    with pytest.raises(ValueError, match="must be"):
        ref.b_units(B[:, :-2], n)


@pytest.mark.parametrize("n", [256, 320, 1024])
def test_b_stages_puts_each_groups_weights_scales_and_deltas_together(n):
    """reference.b_stages: unit u's group g is b_units' k-tiles 8 g .. 8 g + 7, then the
    scale row and the delta row of the unit's 256 features (fp16 bits, zero past N and for
    delta None); bad shapes are refused."""
    rng = np.random.default_rng(n + 1)
    k = 384
    g = k // 128
    B = rng.integers(-(2**31), 2**31, size=(k // 16, 2 * n), dtype=np.int64).astype(np.int32)
    S = rng.uniform(0.01, 1, (g, n)).astype(np.float16)
    D = rng.normal(0, 0.01, (g, n)).astype(np.float16)
    V = ref.b_stages(B, S, D, n)
    U = ref.b_units(B, n)
    units = -(-n // 256)
    assert V.shape == (units, g, 4352) and V.dtype == np.int32 and V.flags.c_contiguous
    for u in range(units):
        live = min(256, n - 256 * u)
        for gi in range(g):
            assert np.array_equal(V[u, gi, :4096], U[u, 8 * gi : 8 * gi + 8].reshape(-1))
            s_row, d_row = V[u, gi, 4096:4224].view(np.float16), V[u, gi, 4224:].view(np.float16)
            assert np.array_equal(s_row[:live].view(np.uint16), S[gi, 256 * u : 256 * u + live].view(np.uint16))
            assert np.array_equal(d_row[:live].view(np.uint16), D[gi, 256 * u : 256 * u + live].view(np.uint16))
            assert not s_row[live:].view(np.uint16).any() and not d_row[live:].view(np.uint16).any()
    assert not ref.b_stages(B, S, None, n)[:, :, 4224:].any()
    with pytest.raises(ValueError, match="multiple of 8"):
        ref.b_stages(B[:-1], S, D, n)
    with pytest.raises(ValueError, match="must be"):
        ref.b_stages(B, S[:, :-64], D, n)


def test_gemm_path_rule_and_pipes():
    from converter.gpu import plan

    tuning = plan.Tuning()
    wide, narrow = tuning.wide_n * 2, tuning.wide_n // 2
    assert plan.gemm_path(1, narrow) == plan.gemm_path(8, narrow) == "decode"
    assert plan.gemm_path(16, tuning.wide_n) == "decode" and plan.gemm_path(9, narrow) == "tile"
    assert plan.gemm_path(17, wide) == plan.gemm_path(tuning.decode_max_m, wide) == "decode_w"
    assert plan.gemm_path(32, tuning.wide_n) == "tile" and plan.gemm_path(33, wide) == "tile"
    assert plan.gemm_arith(1, narrow) == "group" and plan.gemm_arith(32, wide) == "weight"
    for m in (1, 8, 9, 16, 17, 32, 33, 64, 128):
        for n in (narrow, wide):
            pipe = plan.default_pipe(m, 4096, n, 8)
            assert pipe in plan.GEMM_PIPES and pipe[0] == plan.gemm_path(m, n)
            rows = 16 * pipe[1] if pipe[0] == "tile" else 8 * pipe[1]
            assert rows >= min(m, 32)
    # shared memory: 4 rings of NS stages (B, A, scales, deltas), or the parked sums
    assert plan.Pipe.of(("decode", 1, 4, 3)).smem(1) == 4 * 3 * (4 * 512 + 4 * 256 + 256)
    # ... except that the decode kernel's wk = 1 blocks share one A ring (SplitRing)
    dec = plan.Pipe.of(("decode", 2, 8, 3))
    assert dec.smem(1, wk=1) == 3 * (8 * 16 * 32) + 4 * 3 * (8 * 512 + 256) == 64512
    assert dec.smem(1, wk=4) == dec.smem(1) == 4 * 3 * (8 * 512 + 8 * 16 * 32 + 256) == 101376
    assert plan.resident_blocks(168, dec.smem(1, wk=1), 228 * 1024) == 3
    assert plan.resident_blocks(168, dec.smem(1, wk=4), 228 * 1024) == 2
    assert plan.Pipe.of(("tile", 4, 2, 3)).smem(1) == 4 * max(3 * (2 * 512 + 2 * 2048 + 256), 16384)


def test_reference_weight_orders_rows_by_perm():
    k, n = 128, 64
    rng = np.random.default_rng(11)
    L = make_layer(rng, k, n, 32, act_order=True)
    w_src = ref.reference_weight(L["B"], L["S"], L["delta"], L["perm"], size_k=k, size_n=n, group_size=32)
    w_marlin = ref.reference_weight(L["B"], L["S"], L["delta"], None, size_k=k, size_n=n, group_size=32)
    assert np.array_equal(w_src[L["perm"]], w_marlin)


def test_group_sums_and_add_correction_twins():
    rng = np.random.default_rng(5)
    m, k, n, gs = 3, 256, 128, 64
    a = rng.standard_normal((m, k)).astype(np.float16)
    xs = ref.group_sums(a, group_size=gs)
    loops = np.array(
        [[sum(float(a[i, j]) for j in range(g * gs, (g + 1) * gs)) for g in range(k // gs)] for i in range(m)]
    )
    assert xs.dtype == np.float32 and np.allclose(xs, loops, rtol=1e-6, atol=1e-6)
    c = rng.standard_normal((m, n)).astype(np.float16)
    d = rng.standard_normal((k // gs, n)).astype(np.float32)
    out = ref.add_correction(c, xs, d)
    expect = c.astype(np.float64) + loops @ d.astype(np.float64)
    assert np.all(np.abs(out.astype(np.float64) - expect) <= 2.0**-10 * np.abs(expect) + 1e-4)
    assert np.array_equal(ref.group_sums(a, group_size=-1)[:, 0], a.astype(np.float64).sum(1).astype(np.float32))


def test_two_kernel_twin_close_to_fused_twin():
    k, n, m = 256, 128, 4
    rng = np.random.default_rng(9)
    L = make_layer(rng, k, n, 128)
    a = rng.standard_normal((m, k)).astype(np.float16)
    kw = dict(size_k=k, size_n=n, group_size=128, delta=L["delta"])
    f = ref.marlin_gemm(a, L["B"], L["S"], **kw).astype(np.float64)
    t = ref.marlin_gemm_two_kernel(a, L["B"], L["S"], **kw).astype(np.float64)
    assert np.abs(f - t).mean() / np.abs(t).mean() < 2e-3


@pytest.mark.parametrize("arith", ["weight", "group"])
def test_twins_store_n_out_columns_of_a_padded_layer(arith):
    """A padded layer (N = 50 in a 64-wide layout): the twins, as the launchers, give the
    first n_out columns of the full product, with an n_out-long bias and a wider delta."""
    rng = np.random.default_rng(50)
    k, n, n_out = 128, 64, 50
    L = make_layer(rng, k, n, 32, act_order=True)
    a = rng.standard_normal((5, k)).astype(np.float16)
    bias = rng.standard_normal(n).astype(np.float16)
    kw = dict(size_k=k, size_n=n, group_size=32, delta=L["delta"], perm=L["perm"], arith=arith)
    full = ref.marlin_gemm(a, L["B"], L["S"], bias=bias, **kw)
    part = ref.marlin_gemm(a, L["B"], L["S"], bias=bias[:n_out], n_out=n_out, **kw)
    assert part.shape == (5, n_out) and np.array_equal(part.view(np.uint16), full[:, :n_out].view(np.uint16))
    two = ref.marlin_gemm_two_kernel(a, L["B"], L["S"], bias=bias[:n_out], n_out=n_out, **kw)
    two_full = ref.marlin_gemm_two_kernel(a, L["B"], L["S"], bias=bias, **kw)
    assert two.shape == (5, n_out) and np.array_equal(two.view(np.uint16), two_full[:, :n_out].view(np.uint16))


def _without_cupy(monkeypatch):
    from converter.gpu import runtime

    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    runtime._import_cupy.cache_clear()
    runtime._device_info.cache_clear()
    return runtime


def test_no_cupy_gives_one_line_error(monkeypatch):
    runtime = _without_cupy(monkeypatch)
    from converter.gpu import api, kernels

    with pytest.raises(GpuUnavailableError) as exc:
        kernels.marlin_gemm(
            np.zeros((1, 128), np.float16),
            np.zeros((8, 128), np.int32),
            np.zeros((1, 64), np.float16),
            size_k=128,
            size_n=64,
            group_size=-1,
        )
    assert "\n" not in str(exc.value) and "CuPy" in str(exc.value)
    with pytest.raises(GpuUnavailableError):
        api.load_artifact_gpu("does-not-matter.safetensors")
    runtime._import_cupy.cache_clear()


def test_package_imports_without_cupy(monkeypatch):
    _without_cupy(monkeypatch)
    code = (
        "import converter.gpu, converter.gpu.api, converter.gpu.verify, converter.gpu.kernels, "
        "converter.gpu.build, converter.gpu.plan; "
        "import sys; assert 'cupy' not in sys.modules and 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_kernel_sources_found_and_headers_name_their_twins():
    from converter.gpu import build

    folder = build.kernel_dir()
    for cu in ("marlin_gemm.cu", "marlin_decode.cu", "dequant.cu", "asym_correction.cu"):
        head = (folder / cu).read_text().split("#include")[0]
        names = re.findall(r"converter\.gpu\.reference\.(\w+)", head)
        names += re.findall(r"\.(\w+)\)?\.?$", head, flags=re.M)
        assert any(hasattr(ref, n) for n in names), cu
        assert "Launch geometry" in head and "Constraints" in head


def test_kernels_ship_in_wheel(tmp_path):
    """Build a wheel offline, install it elsewhere, and find the .cu files from there."""
    if not (REPO / "pyproject.toml").is_file():
        pytest.skip("no pyproject.toml yet")
    pytest.importorskip("hatchling")
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(REPO),
        ],
        capture_output=True,
        text=True,
    )
    if build.returncode:
        pytest.skip("cannot build a wheel offline here: " + build.stderr.strip().splitlines()[-1][:200])
    wheel = next((tmp_path / "dist").glob("*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    from converter.gpu.build import SOURCES

    assert len(SOURCES) == 10
    for cu in SOURCES:
        assert f"converter/_kernels/{cu}" in names, sorted(n for n in names if "kernel" in n)
    assert "converter/py.typed" in names
    from converter import native

    if native.lib() is not None:  # this machine compiles the C extension: the wheel ships it
        assert [n for n in names if n.startswith("converter/_native.") and n.endswith((".so", ".pyd"))], sorted(names)
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    out = subprocess.run(
        [sys.executable, "-c", "from converter.gpu.build import kernel_dir; print(kernel_dir())"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(out.stdout.strip()) == target / "converter" / "_kernels"

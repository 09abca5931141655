"""GPU kernels against their NumPy twins (converter.gpu.reference).

Bounds: dequant must match bit for bit. GEMMs must satisfy
``|gpu - twin| <= reference.gemm_error_bound(...)`` elementwise: fp32 summation error
``(K + splits + 1) * 2**-24 * (|A| @ |W| + |bias|)`` plus one fp16 rounding of each side
(``2**-10 * |x| + 2**-24``). The two-kernel path adds the correction's own bound
(``(G + 2) * 2**-24 * |xsum| @ |delta|`` + group-sum error + one more fp16 rounding).
Outputs are poisoned with NaN before every run; fresh random data per case.
"""

from __future__ import annotations

import numpy as np
import pytest

from converter.errors import KernelError
from converter.gpu import kernels
from converter.gpu import reference as ref
from converter.gpu.plan import ARITH, GEMM_GPIS, GEMM_PIPES, Pipe, Tuning, hopper_split, kernel_variant
from tests.helpers.kernel_layers import make_layer

pytestmark = pytest.mark.gpu

Ms = (1, 15, 16, 17, 33, 64, 65, 128)
# (K, N, group_size, act_order, asym): every group size, per-channel, act-order, K 128..8192, N 64..8192
SHAPES = [
    (128, 64, 32, False, True),
    (128, 64, -1, False, False),
    (256, 128, 64, True, True),
    (512, 192, 128, False, True),
    (1024, 256, 32, True, False),
    (1024, 512, -1, True, True),
    (2048, 1024, 128, True, True),
    (4096, 320, 64, False, True),
    (8192, 128, 128, False, False),
    (640, 8192, 128, False, True),
    (8192, 8192, 128, True, True),
    (3072, 4096, -1, False, True),
    (192, 64, 64, False, True),  # K % 128 != 0 (K % 64 bonus)
    (768, 128, 16, True, True),
    (768, 192, 48, False, True),  # odd group tile counts
]
CASES = [(m,) + s for i, s in enumerate(SHAPES) for m in (Ms if i < 4 else (Ms[i % 8], Ms[(i + 3) % 8]))]


def poisoned(cp, shape):
    return cp.full(shape, cp.nan, dtype=cp.float16)


def _dev(cp, x):
    return None if x is None else cp.asarray(x)


@pytest.mark.parametrize("m,k,n,group_size,act_order,asym", CASES)
def test_gemm_matches_twin(cp, m, k, n, group_size, act_order, asym):
    _routed_call_matches_twin(cp, m, k, n, group_size, act_order, asym)


@pytest.mark.parametrize(
    "m,k,n,group_size,act_order,asym,kind",
    [
        # the small layers' persistent route (plan.Tuning.hopper_small_*, plan.small_chunk):
        # 4-tile stages in even chunks of 8-32 tokens, the per-group form at 17+ rows in
        # chunks of <= 16 (three chunks, the last ragged; two)
        (8, 8192, 1024, 128, True, True, "hopper_sk"),
        (32, 2048, 4096, 64, False, True, "hopper_sk"),
        (40, 8192, 1024, 128, False, True, "hopper_skg"),
        (24, 4096, 2048, 256, True, True, "hopper_skg"),
        (100, 8192, 1024, 256, True, True, "hopper_sk"),
        (256, 8192, 1024, -1, False, True, "hopper_sk"),
        (128, 4096, 4096, 128, True, False, "hopper_sk"),
        (129, 4096, 4096, 128, False, True, "hopper_sk"),
        # a mid-sized layer at 97-128 rows: two 64-token chunks (the second ragged)
        (100, 4608, 4096, 128, True, True, "hopper_sk"),
        # wide layers of a short K (plan.Tuning.hopper_thin_k_*): 4-tile stages, and two
        # 64-token chunks of 8-tile stages at 65-128 rows (the second ragged)
        (17, 1024, 8192, 128, False, True, "hopper_sk"),
        (100, 512, 14336, 128, True, True, "hopper_sk"),
        (300, 1024, 8192, -1, False, True, "hopper_sk"),
    ],
)
def test_small_layer_routes_match_twin(cp, m, k, n, group_size, act_order, asym, kind):
    """The planner's own route on a small layer (asserted on sm_90, where it exists) gives
    the twin's product within the bound, deterministically."""
    if kernels.hopper_device():
        assert kernels.gemm_plan(m, k, n, group_size, delta=asym).kind == kind
    _routed_call_matches_twin(cp, m, k, n, group_size, act_order, asym)


def _routed_call_matches_twin(cp, m, k, n, group_size, act_order, asym):
    rng = np.random.default_rng([m, k, n, group_size % 997, act_order, asym])
    L = make_layer(rng, k, n, group_size, act_order, asym)
    a = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)
    kw = dict(size_k=k, size_n=n, group_size=group_size)
    args = dict(delta=_dev(cp, L["delta"]), perm=_dev(cp, L["perm"]), bias=_dev(cp, L["bias"]))
    out = poisoned(cp, (m, n))
    c = kernels.marlin_gemm(cp.asarray(a), cp.asarray(L["B"]), cp.asarray(L["S"]), out=out, **kw, **args)
    again = kernels.marlin_gemm(
        cp.asarray(a), cp.asarray(L["B"]), cp.asarray(L["S"]), out=poisoned(cp, (m, n)), **kw, **args
    )
    kernels.synchronize()
    got = cp.asnumpy(c).astype(np.float64)
    assert np.isfinite(got).all(), "unwritten (NaN) outputs"
    assert np.array_equal(cp.asnumpy(c).view(np.uint16), cp.asnumpy(again).view(np.uint16)), "not deterministic"
    plan = kernels.gemm_plan(m, k, n, group_size, delta=asym)
    splits = plan.splits
    host = dict(delta=L["delta"], perm=L["perm"], bias=L["bias"], arith=plan.arith)
    twin = ref.marlin_gemm(a, L["B"], L["S"], **kw, **host).astype(np.float64)
    bound = ref.gemm_error_bound(a, L["B"], L["S"], **kw, **host, splits=splits)
    bad = np.abs(got - twin) > bound
    assert not bad.any(), f"{bad.sum()} outputs out of bound; worst {np.abs(got - twin).max():.3g}"

    if asym:  # two-kernel path
        c2 = kernels.marlin_gemm_two_kernel(
            cp.asarray(a), cp.asarray(L["B"]), cp.asarray(L["S"]), out=poisoned(cp, (m, n)), **kw, **args
        )
        got2 = cp.asnumpy(c2).astype(np.float64)
        assert np.isfinite(got2).all()
        sym_plan = kernels.gemm_plan(m, k, n, group_size, delta=False)
        host2 = dict(host, arith=sym_plan.arith)
        twin2 = ref.marlin_gemm_two_kernel(a, L["B"], L["S"], **kw, **host2).astype(np.float64)
        a_m = a[:, L["perm"]] if act_order else a
        gs = k if group_size == -1 else group_size
        xs_mag = np.abs(a_m.astype(np.float64)).reshape(m, -1, gs).sum(-1)
        corr = (gs + k // gs + 4) * 2.0**-24 * (xs_mag @ np.abs(L["delta"].astype(np.float64)))
        sym_bound = ref.gemm_error_bound(
            a, L["B"], L["S"], **kw, perm=L["perm"], bias=L["bias"], splits=sym_plan.splits, arith=sym_plan.arith
        )
        bound2 = sym_bound + corr + 2.0**-10 * (np.abs(twin2) + corr) + 2.0**-24
        bad2 = np.abs(got2 - twin2) > bound2
        assert not bad2.any(), f"two-kernel: {bad2.sum()} out of bound"


@pytest.mark.parametrize("wk", [1, 4])
@pytest.mark.parametrize(
    "m,k,n,group_size",
    [(1, 1024, 320, 128), (17, 512, 192, 32), (65, 768, 448, -1), (128, 256, 64, 64), (9, 2048, 320, 128)],
)
def test_gemm_block_shapes(cp, wk, m, k, n, group_size):
    """Both block shapes (4 column blocks per block, or 4 K quarters), ragged N / 256."""
    tuning = Tuning(force_wk=wk)
    rng = np.random.default_rng([m, k, n, wk])
    L = make_layer(rng, k, n, group_size, True, True)
    a = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)
    kw = dict(size_k=k, size_n=n, group_size=group_size)
    plan = kernels.gemm_plan(m, k, n, group_size, delta=True, tuning=tuning)
    assert plan.wk == wk
    c = kernels.marlin_gemm(
        cp.asarray(a),
        cp.asarray(L["B"]),
        cp.asarray(L["S"]),
        delta=cp.asarray(L["delta"]),
        perm=cp.asarray(L["perm"]),
        out=poisoned(cp, (m, n)),
        tuning=tuning,
        **kw,
    )
    got = cp.asnumpy(c).astype(np.float64)
    assert np.isfinite(got).all()
    host = dict(delta=L["delta"], perm=L["perm"], arith=plan.arith)
    twin = ref.marlin_gemm(a, L["B"], L["S"], **kw, **host).astype(np.float64)
    bound = ref.gemm_error_bound(a, L["B"], L["S"], **kw, **host, splits=plan.splits)
    assert (np.abs(got - twin) <= bound).all()


DECODE_CASES = [
    (p, m, k, n, gs)
    for p in GEMM_PIPES
    if p[0] in ("decode", "decode_w")
    for (m, k, n, gs) in (
        (1, 1024, 192, 128),
        (8 * p[1], 512, 320, 32),
        (8 * p[1] + 3, 2048, 128, -1),
        (5, 768, 256, 48),
        (2, 4096, 4096, 128),
    )
    if k % (16 * p[2]) == 0
]


@pytest.mark.parametrize("wk", [1, 4])
@pytest.mark.parametrize("pipe,m,k,n,group_size", DECODE_CASES)
def test_every_gemm_variant(cp, wk, pipe, m, k, n, group_size):
    """Every built variant (both kernels, forced), several row chunks, both block shapes
    (wk = 1 shares A across the block), against the twin of its own kernel; the prepared
    fp16 delta gives the same bits as the artifact's fp32."""
    tuning = Tuning(force_wk=wk)
    rng = np.random.default_rng([pipe[1], pipe[2], pipe[3], m, k, n])
    L = make_layer(rng, k, n, group_size, False, True)
    a = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)
    kw = dict(size_k=k, size_n=n, group_size=group_size)
    for variant in (pipe, ("tile", 1, 4, 3)):
        try:
            plan = kernels.gemm_plan(m, k, n, group_size, delta=True, pipe=variant, tuning=tuning)
        except KernelError as exc:  # group size not served by this U
            assert "not supported" in str(exc)
            continue
        c = kernels.marlin_gemm(
            cp.asarray(a),
            cp.asarray(L["B"]),
            cp.asarray(L["S"]),
            delta=cp.asarray(L["delta"]),
            bias=cp.asarray(L["bias"]) if L["bias"] is not None else None,
            out=poisoned(cp, (m, n)),
            pipe=variant,
            tuning=tuning,
            **kw,
        )
        c16 = kernels.marlin_gemm(
            cp.asarray(a),
            cp.asarray(L["B"]),
            cp.asarray(L["S"]),
            delta=kernels.prepare_delta(cp.asarray(L["delta"])),
            bias=cp.asarray(L["bias"]) if L["bias"] is not None else None,
            out=poisoned(cp, (m, n)),
            pipe=variant,
            tuning=tuning,
            **kw,
        )
        got = cp.asnumpy(c)
        assert np.array_equal(got.view(np.uint16), cp.asnumpy(c16).view(np.uint16))
        arith = ARITH[Pipe.of(variant).kind]
        host = dict(delta=L["delta"], bias=L["bias"], arith=arith)
        twin = ref.marlin_gemm(a, L["B"], L["S"], **kw, **host).astype(np.float64)
        bound = ref.gemm_error_bound(a, L["B"], L["S"], **kw, **host, splits=plan.splits * plan.wk)
        bad = np.abs(got.astype(np.float64) - twin) > bound
        assert np.isfinite(got).all() and not bad.any(), (variant, plan, int(bad.sum()))
        # The bound is first-order worst case (and loose for the offset codes' cancelling
        # sums); kernel and twin both round to fp16 and should differ in few outputs.
        rel = np.abs(got.astype(np.float64) - twin).mean() / np.abs(twin).mean()
        assert rel < 5e-5, (variant, rel)
        sym = kernels.marlin_gemm(
            cp.asarray(a),
            cp.asarray(L["B"]),
            cp.asarray(L["S"]),
            out=poisoned(cp, (m, n)),
            pipe=variant,
            tuning=tuning,
            **kw,
        )
        twin_s = ref.marlin_gemm(a, L["B"], L["S"], **kw, arith=arith).astype(np.float64)
        bound_s = ref.gemm_error_bound(a, L["B"], L["S"], **kw, arith=arith, splits=plan.splits * plan.wk)
        assert (np.abs(cp.asnumpy(sym).astype(np.float64) - twin_s) <= bound_s).all(), (variant, "sym")


@pytest.mark.parametrize("pipe", [("decode", 1, 4, 3), ("decode", 2, 8, 3), ("decode", 4, 4, 3)])
@pytest.mark.parametrize(
    "k,group_size,mean,limit", [(14336, -1, 0.5, 2.5e-5), (8192, 8192, 0.1, 2.5e-5), (4096, 128, 0.5, 5e-5)]
)
def test_decode_delta_precision_with_long_groups_and_biased_activations(cp, pipe, k, group_size, mean, limit):
    """The fused decode path's offset sums cancel at ~1000x the result's size. Over one
    group of all of K (per-channel) with activations of mean 0.1-0.5, left unclosed, a
    NumPy model of the fp32 sums (rounded once per k-tile) puts the fp16 result 5e-5 of
    its mean size away from the exact twin's; closed every step (what the kernel does)
    1e-6 to 2e-6, and 8e-6 over 128-row groups; the limits leave a 10x margin for the
    tensor cores' own accumulation."""
    n = 256
    rng = np.random.default_rng([k, group_size % 997, pipe[1]])
    L = make_layer(rng, k, n, group_size, False, True)
    m = 8 * pipe[1]
    a = (rng.standard_normal((m, k), dtype=np.float32) + mean).astype(np.float16)
    kw = dict(size_k=k, size_n=n, group_size=group_size)
    plan = kernels.gemm_plan(m, k, n, group_size, delta=True, pipe=pipe)
    c = kernels.marlin_gemm(
        cp.asarray(a), cp.asarray(L["B"]), cp.asarray(L["S"]), delta=cp.asarray(L["delta"]), pipe=pipe, **kw
    )
    got = cp.asnumpy(c).astype(np.float64)
    twin = ref.marlin_gemm(a, L["B"], L["S"], **kw, delta=L["delta"], arith="group").astype(np.float64)
    bound = ref.gemm_error_bound(a, L["B"], L["S"], **kw, delta=L["delta"], arith="group", splits=plan.splits * plan.wk)
    assert (np.abs(got - twin) <= bound).all()
    rel = np.abs(got - twin).mean() / np.abs(twin).mean()
    assert rel < limit, (plan, rel)


@pytest.mark.parametrize(
    "k,n,group_size,asym",
    [
        (128, 64, 32, True),
        (256, 128, -1, False),
        (1024, 512, 64, True),
        (8192, 8192, 128, True),
        (4096, 256, -1, True),
        (512, 1024, 128, False),
        (2048, 64, 32, False),
    ],
)
def test_dequant_exact(cp, k, n, group_size, asym):
    rng = np.random.default_rng([k, n, group_size % 997, asym])
    L = make_layer(rng, k, n, group_size, False, asym)
    kw = dict(size_k=k, size_n=n, group_size=group_size)
    out = poisoned(cp, (k, n))
    w = kernels.dequant(cp.asarray(L["B"]), cp.asarray(L["S"]), delta=_dev(cp, L["delta"]), out=out, **kw)
    twin = ref.dequant(L["B"], L["S"], delta=L["delta"], **kw)
    got = cp.asnumpy(w)
    assert np.array_equal(got.view(np.uint16), twin.view(np.uint16)), (
        f"{(got.view(np.uint16) != twin.view(np.uint16)).sum()} codes differ"
    )


@pytest.mark.parametrize("m,k,group_size", [(1, 128, 32), (17, 1024, 128), (65, 4096, -1), (128, 8192, 64)])
def test_group_sums_and_add_correction(cp, m, k, group_size):
    rng = np.random.default_rng([m, k])
    a = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)
    xs = cp.asnumpy(kernels.group_sums(cp.asarray(a), group_size=group_size)).astype(np.float64)
    twin = ref.group_sums(a, group_size=group_size).astype(np.float64)
    gs = k if group_size == -1 else group_size
    mag = np.abs(a.astype(np.float64)).reshape(m, -1, gs).sum(-1)
    assert np.all(np.abs(xs - twin) <= (gs + 2) * 2.0**-24 * mag + 2.0**-24 * np.abs(twin))
    n = 192
    g = k // gs
    c = rng.standard_normal((m, n)).astype(np.float16)
    d = rng.standard_normal((g, n)).astype(np.float32)
    xs32 = ref.group_sums(a, group_size=group_size)
    out = kernels.add_correction(cp.asarray(c), cp.asarray(xs32), cp.asarray(d))
    twin_c = ref.add_correction(c, xs32, d).astype(np.float64)
    corr = (g + 2) * 2.0**-24 * (np.abs(xs32.astype(np.float64)) @ np.abs(d.astype(np.float64)))
    err = np.abs(cp.asnumpy(out).astype(np.float64) - twin_c)
    assert np.all(err <= corr + 2.0**-10 * (np.abs(twin_c) + corr) + 2.0**-24)


def test_gather_columns_exact(cp):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((17, 384)).astype(np.float16)
    perm = rng.permutation(384).astype(np.int32)
    got = cp.asnumpy(kernels.gather_columns(cp.asarray(a), cp.asarray(perm)))
    assert np.array_equal(got, ref.gather_columns(a, perm))


def test_launcher_checks_before_launch(cp):
    a = cp.zeros((4, 128), cp.float16)
    b = cp.zeros((8, 128), cp.int32)
    s = cp.zeros((1, 64), cp.float16)
    kw = dict(size_k=128, size_n=64, group_size=-1)
    with pytest.raises(KernelError, match="float16"):
        kernels.marlin_gemm(a.astype(cp.float32), b, s, **kw)
    with pytest.raises(KernelError, match="shape"):
        kernels.marlin_gemm(a, b[:4], s, **kw)
    with pytest.raises(KernelError, match="contiguous"):
        kernels.marlin_gemm(cp.zeros((128, 4), cp.float16).T, b, s, **kw)
    with pytest.raises(KernelError, match="group_size"):
        kernels.marlin_gemm(a, b, s, size_k=128, size_n=64, group_size=40)


def test_verify_layer_gpu(cp):
    from converter.gpu.verify import verify_layer_gpu

    rng = np.random.default_rng(2)
    k, n = 1024, 256
    L = make_layer(rng, k, n, 128, True, True)
    w = ref.reference_weight(L["B"], L["S"], L["delta"], L["perm"], size_k=k, size_n=n, group_size=128)
    res = verify_layer_gpu(L["B"], L["S"], L["delta"], L["perm"], k, n, 128, w, repeats=3)
    assert res["ok"], res
    assert set(res) == {1, 16, 17, 64, 128, "ok"}
    assert res[17]["deterministic"] and res[17]["two_kernel_deterministic"]


def test_verify_layer_gpu_proves_the_unit_major_copy(cp):
    """On sm_90, a layer MarlinLinear keeps unit-major: verify_layer_gpu also runs the
    fused call on that copy and requires the bits of the call on B, at every M."""
    from converter.gpu.verify import verify_layer_gpu

    _hopper_or_skip()
    rng = np.random.default_rng(5)
    k, n = 4608, 4096
    L = make_layer(rng, k, n, 128, True, True)
    w = ref.reference_weight(L["B"], L["S"], L["delta"], L["perm"], size_k=k, size_n=n, group_size=128)
    res = verify_layer_gpu(L["B"], L["S"], L["delta"], L["perm"], k, n, 128, w, repeats=2, ms=(1, 17, 64))
    assert res["ok"], res
    assert [res[m]["unit_major_same"] for m in (1, 17, 64)] == [True, True, True]
    thin = make_layer(rng, 1024, 256, 128, False, True)
    w = ref.reference_weight(thin["B"], thin["S"], thin["delta"], None, size_k=1024, size_n=256, group_size=128)
    res = verify_layer_gpu(thin["B"], thin["S"], thin["delta"], None, 1024, 256, 128, w, repeats=2, ms=(1,))
    assert "unit_major_same" not in res[1]  # MarlinLinear keeps B in Marlin's order there


def test_api_module_roundtrip(cp):
    from converter.gpu.api import MarlinLinear

    rng = np.random.default_rng(4)
    k, n = 512, 128
    L = make_layer(rng, k, n, 64, True, True)
    layer = MarlinLinear("x", k, n, 64, L["B"], L["S"], L["delta"], L["perm"], L["bias"])
    a = rng.standard_normal((2, 3, k)).astype(np.float16)
    y = cp.asnumpy(layer(cp.asarray(a)))
    twin = ref.marlin_gemm(
        a.reshape(6, k),
        L["B"],
        L["S"],
        size_k=k,
        size_n=n,
        group_size=64,
        delta=L["delta"],
        perm=L["perm"],
        bias=L["bias"],
    )
    assert y.shape == (2, 3, n)
    assert np.abs(y.reshape(6, n).astype(np.float64) - twin).max() <= 0.05 * np.abs(twin).max()
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from converter.gpu.api import MarlinLinearModule

    mod = MarlinLinearModule(layer)
    yt = mod(torch.from_numpy(a).cuda())
    assert yt.dtype == torch.float16 and tuple(yt.shape) == (2, 3, n)
    assert np.array_equal(yt.cpu().numpy().view(np.uint16), y.view(np.uint16))


def _hopper_or_skip():
    if not kernels.hopper_device():
        pytest.skip("the Hopper kernel needs sm_90")


def _group_for(pipe: Pipe, group_size: int) -> int:
    """``group_size``, or where a variant with 8-tile stages does not serve it (its stage
    holds one group slot: group sizes that are multiples of 128) 128, 256 for 32."""
    if pipe.u == 8 and group_size != -1 and group_size % 128:
        return 256 if group_size == 32 else 128
    return group_size


HOPPER_CASES = [
    (p, m, k, n, _group_for(p, gs), act, asym)
    for p in GEMM_PIPES
    if p.spec.wgmma
    for (m, k, n, gs, act, asym) in (
        (8 * p[1], 1024, 512, 128, False, True),  # a full chunk
        (8 * p[1] - 3, 2048, 320, 32, True, True),  # ragged N (one live block of 4), GPI 2, act-order
        (8 * p[1] * 2 + 5, 768, 256, 48, False, False),  # three chunks, GPI 4, symmetric
        (1, 4096, 4096, -1, True, True),  # per-channel, deep K split
        (8 * p[1] + 1, 256, 8192, 16, False, True),  # two chunks, group 16, one split
    )
]


@pytest.mark.parametrize("pipe,m,k,n,group_size,act_order,asym", HOPPER_CASES)
def test_every_hopper_variant(cp, pipe, m, k, n, group_size, act_order, asym):
    """Every Hopper variant (forced): full and ragged token chunks, several chunks, ragged
    N, every group-slot count, per-channel, act-order (gathered by hopper_activations, or
    by gather_columns before a tensor-map read), K splits of 1 and many; against the
    twin of its own arithmetic (per-weight, or per-group for ``hopper_skg``), bitwise
    stable over 3 calls, and the prepared fp16 delta giving the artifact fp32 delta's
    bits."""
    _hopper_or_skip()
    rng = np.random.default_rng([pipe[1], pipe[3], m, k, n, group_size % 97])
    L = make_layer(rng, k, n, group_size, act_order, asym)
    a = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)
    kw = dict(size_k=k, size_n=n, group_size=group_size)
    plan = kernels.gemm_plan(m, k, n, group_size, delta=asym, pipe=pipe)
    assert plan.kind == pipe.kind and plan.pipe.spec.wgmma and plan.arith == pipe.spec.arith
    args = dict(delta=_dev(cp, L["delta"]), perm=_dev(cp, L["perm"]), bias=_dev(cp, L["bias"]), pipe=pipe)
    outs = [
        cp.asnumpy(
            kernels.marlin_gemm(
                cp.asarray(a), cp.asarray(L["B"]), cp.asarray(L["S"]), out=poisoned(cp, (m, n)), **kw, **args
            )
        )
        for _ in range(3)
    ]
    assert all(np.array_equal(o.view(np.uint16), outs[0].view(np.uint16)) for o in outs), "not deterministic"
    got = outs[0].astype(np.float64)
    assert np.isfinite(got).all(), "unwritten (NaN) outputs"
    host = dict(delta=L["delta"], perm=L["perm"], bias=L["bias"], arith=plan.arith)
    twin = ref.marlin_gemm(a, L["B"], L["S"], **kw, **host).astype(np.float64)
    bound = ref.gemm_error_bound(a, L["B"], L["S"], **kw, **host, splits=plan.splits)
    bad = np.abs(got - twin) > bound
    assert not bad.any(), (plan, int(bad.sum()), float(np.abs(got - twin).max()))
    if asym:
        c16 = kernels.marlin_gemm(
            cp.asarray(a),
            cp.asarray(L["B"]),
            cp.asarray(L["S"]),
            out=poisoned(cp, (m, n)),
            **kw,
            **dict(args, delta=kernels.prepare_delta(cp.asarray(L["delta"]))),
        )
        assert np.array_equal(cp.asnumpy(c16).view(np.uint16), outs[0].view(np.uint16))


UNITS_CASES = [
    (p, m, k, n, _group_for(p, gs), act, iters)
    for p in GEMM_PIPES
    if p.spec.persistent
    for (m, k, n, gs, act, iters) in (
        (8 * p[1], 1024, 512, 128, False, None),  # a full chunk, runs across units
        (8 * p[1] - 3, 2048, 320, 32, True, 3),  # ragged N (a padded last unit), act-order, cut units
        (8 * p[1] * 2 + 5, 768, 768, 64, False, 2),  # three chunks
        (1, 4096, 1024, -1, True, None),  # per-channel, deep K
    )
]


@pytest.mark.parametrize("pipe,m,k,n,group_size,act_order,iters", UNITS_CASES)
def test_unit_major_b_gives_the_same_bits(cp, pipe, m, k, n, group_size, act_order, iters):
    """Every persistent variant (forced) streaming B unit-major (kernels.prepare_b_units)
    gives exactly the bits of the same call on B in Marlin's order, with and without a
    delta; B may be left out then."""
    _hopper_or_skip()
    rng = np.random.default_rng([pipe[1], pipe[2], m, k, n, group_size % 97])
    L = make_layer(rng, k, n, group_size, act_order, True)
    a = cp.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(np.float16))
    B = cp.asarray(L["B"])
    units = kernels.prepare_b_units(B, k, n)
    assert np.array_equal(cp.asnumpy(units), ref.b_units(L["B"], n))
    kw = dict(size_k=k, size_n=n, group_size=group_size, perm=_dev(cp, L["perm"]), pipe=pipe)
    kw["tuning"] = Tuning(streamk_iters=iters)
    for delta in (None, _dev(cp, L["delta"])):
        want = kernels.marlin_gemm(a, B, cp.asarray(L["S"]), out=poisoned(cp, (m, n)), delta=delta, **kw)
        got = kernels.marlin_gemm(
            a, None, cp.asarray(L["S"]), out=poisoned(cp, (m, n)), delta=delta, b_units=units, **kw
        )
        assert np.isfinite(cp.asnumpy(got)).all(), "unwritten (NaN) outputs"
        w, g = cp.asnumpy(want).view(np.uint16), cp.asnumpy(got).view(np.uint16)
        assert np.array_equal(w, g), int((w != g).sum())


STAGES_CASES = [
    (p, m, k, n, act, iters)
    for p in GEMM_PIPES
    if p.spec.persistent
    for (m, k, n, act, iters) in (
        (8 * p[1], 1024, 512, False, None),  # a full chunk, runs across units
        (8 * p[1] - 3, 2048, 320, True, 3),  # ragged N (a padded last unit), act-order, cut units
        (8 * p[1] * 2 + 5, 768, 768, False, 2),  # three chunks
    )
]


@pytest.mark.parametrize("pipe,m,k,n,act_order,iters", STAGES_CASES)
def test_b_with_inline_scales_gives_the_same_bits(cp, pipe, m, k, n, act_order, iters):
    """Every persistent variant (forced; 4- and 8-tile stages) streaming B with each
    stage's scales and deltas inline (kernels.prepare_b_stages, the twin's bits) gives
    exactly the bits of the same call on B in Marlin's order, with and without a delta;
    B may be left out. Group size 128, the only one that copy serves."""
    _hopper_or_skip()
    rng = np.random.default_rng([pipe[1], pipe[2], m, k, n, 7])
    L = make_layer(rng, k, n, 128, act_order, True)
    a = cp.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(np.float16))
    B, S = cp.asarray(L["B"]), cp.asarray(L["S"])
    d16 = kernels.prepare_delta(cp.asarray(L["delta"]))
    stages = kernels.prepare_b_stages(B, S, d16, k, n)
    assert np.array_equal(cp.asnumpy(stages), ref.b_stages(L["B"], L["S"], cp.asnumpy(d16), n))
    kw = dict(size_k=k, size_n=n, group_size=128, perm=_dev(cp, L["perm"]), pipe=pipe)
    kw["tuning"] = Tuning(streamk_iters=iters)
    for delta in (None, d16):
        want = kernels.marlin_gemm(a, B, S, out=poisoned(cp, (m, n)), delta=delta, **kw)
        got = kernels.marlin_gemm(a, None, S, out=poisoned(cp, (m, n)), delta=delta, b_units=stages, **kw)
        assert np.isfinite(cp.asnumpy(got)).all(), "unwritten (NaN) outputs"
        w, g = cp.asnumpy(want).view(np.uint16), cp.asnumpy(got).view(np.uint16)
        assert np.array_equal(w, g), int((w != g).sum())


def test_b_with_inline_scales_is_refused_for_other_group_sizes(cp):
    """A copy with the scales inline is for groups of 128: another group size is a
    KernelError naming the rule, before any launch."""
    _hopper_or_skip()
    rng = np.random.default_rng(3)
    L = make_layer(rng, 1024, 512, 128, False, True)
    stages = kernels.prepare_b_stages(cp.asarray(L["B"]), cp.asarray(L["S"]), None, 1024, 512)
    a = cp.asarray(rng.standard_normal((4, 1024), dtype=np.float32).astype(np.float16))
    S64 = cp.zeros((16, 512), cp.float16)
    with pytest.raises(KernelError, match="group_size 128, not 64"):
        kernels.marlin_gemm(a, None, S64, size_k=1024, size_n=512, group_size=64, b_units=stages)


def test_linear_layers_keep_b_unit_major_where_every_call_is_persistent(cp):
    """MarlinLinear keeps only the unit-major B on a layer that the persistent kernel
    serves at every M (sm_90), and gives the bits of the call on B itself."""
    from converter.gpu.api import MarlinLinear

    _hopper_or_skip()
    rng = np.random.default_rng(9)
    k, n = 4608, 4096
    L = make_layer(rng, k, n, 128, True, True)
    lin = MarlinLinear("l", k, n, 128, L["B"], L["S"], L["delta"], L["perm"], L["bias"])
    assert lin._B is None and lin._B_units.shape == (n // 256, k // 128, kernels.STAGE_RUN_INT32)  # scales inline
    for m in (1, 8, 16, 17, 64, 100):
        x = cp.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(np.float16))
        want = kernels.marlin_gemm(
            x,
            cp.asarray(L["B"]),
            cp.asarray(L["S"]),
            size_k=k,
            size_n=n,
            group_size=128,
            delta=_dev(cp, L["delta"]),
            perm=_dev(cp, L["perm"]),
            bias=_dev(cp, L["bias"]),
        )
        assert np.array_equal(cp.asnumpy(lin(x)).view(np.uint16), cp.asnumpy(want).view(np.uint16)), m
    sym = MarlinLinear("y", k, n, 128, L["B"], L["S"], None, L["perm"], None)
    assert sym._B is None and sym._B_units.shape == (n // 256, k // 16, 512)  # unit-major: no zero rows streamed
    small = MarlinLinear("s", 4096, 4096, 128, L["B"][: 4096 // 16, : 2 * 4096], L["S"][:32], None, None, None)
    assert small._B is not None and small._B_units is None  # the decode kernel serves 1-7 rows


def test_unit_major_b_needs_b_where_another_kernel_serves(cp):
    """Without B, a call that the decode kernel serves is refused before any launch."""
    rng = np.random.default_rng(3)
    L = make_layer(rng, 4096, 4096, 128, False, False)
    units = kernels.prepare_b_units(cp.asarray(L["B"]), 4096, 4096)
    a = cp.asarray(rng.standard_normal((1, 4096), dtype=np.float32).astype(np.float16))
    with pytest.raises(KernelError, match="reads B in Marlin's order"):
        kernels.marlin_gemm(
            a,
            None,
            cp.asarray(L["S"]),
            size_k=4096,
            size_n=4096,
            group_size=128,
            b_units=units,
            pipe=("decode", 1, 4, 3),
        )


@pytest.mark.parametrize(
    "m,k,perm,tok,swizzle",
    [
        (1, 64, False, None, False),
        (37, 512, True, None, False),
        (128, 8192, False, None, False),
        (300, 1024, True, None, False),
        (1, 64, False, 8, False),
        (37, 512, True, 16, False),
        (300, 1024, True, 128, False),
        (130, 256, False, 64, False),
        (1, 64, False, 8, True),
        (37, 512, True, 16, True),
        (300, 1024, True, 128, True),
        (130, 256, False, 64, True),
    ],
)
def test_hopper_activations_exact(cp, m, k, perm, tok, swizzle):
    """Chunk-major A in one block of all rows (marlin_wgmma) or in blocks of ``tok``
    token rows, or those blocks as marlin_streamk's swizzled slots; act-order gathered,
    padding rows zero."""
    _hopper_or_skip()
    from converter.gpu import build

    rng = np.random.default_rng([m, k])
    a = rng.standard_normal((m, k)).astype(np.float16)
    p = rng.permutation(k).astype(np.int32) if perm else None
    m_pad = -(-m // (tok or 64)) * (tok or 64)
    at = cp.full(m_pad * k, cp.nan, dtype=cp.float16)
    pieces = k // 8 * m_pad
    build.function("marlin_wgmma.cu", "hopper_activations")(
        (-(-pieces // 256),),
        (256,),
        (
            cp.asarray(a),
            cp.asarray(p) if perm else np.uint64(0),
            at,
            np.int32(m),
            np.int32(k),
            np.int32(m_pad),
            np.int32(tok or m_pad),
            np.int32(swizzle),
        ),
    )
    want = ref.hopper_activations(a, p, m_pad, tok, swizzle=swizzle)
    got = cp.asnumpy(at).reshape(want.shape)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


STREAMK_CASES = [
    # (pipe r, m, k, n, group, act, asym, forced stages per block). Planned on an H200
    # (132 SMs) the first six cut units into 32, 22, 8, 8, 10 and 4 pieces (the last
    # arriver adding up to 32 parked pieces); the last two store whole units only: a block's run of four
    # units, and one block with the whole layer. Ragged N and chunks, two token chunks,
    # per-channel, GPI 1/2/4, act-order.
    (1, 1, 8192, 1024, 128, False, True, 1),
    (1, 3, 4096, 512, 32, True, True, 3),
    (2, 16, 2048, 2304, 16, False, True, 5),
    (4, 29, 1024, 320, -1, True, True, 2),
    (8, 64, 4096, 1280, 128, False, False, 7),
    (16, 200, 1536, 768, 48, True, True, 11),
    (12, 96, 768, 4096, 64, False, True, 48),
    (6, 47, 8192, 256, 128, True, True, 128),
]


# The per-group form (8-tile stages, group sizes that are multiples of 128): cut units,
# two and four chunks, per-channel, act-order, symmetric, whole units.
STREAMK_G_CASES = [
    (1, 1, 8192, 1024, 128, False, True, 1),
    (4, 128, 2048, 1024, 128, False, True, 2),  # four 32-token chunks
    (4, 100, 4096, 768, 256, True, True, 3),  # four, the last ragged (4 of 32 tokens)
    (2, 13, 4096, 512, 256, True, True, 3),
    (4, 29, 1024, 320, -1, True, True, 2),
    (3, 40, 2048, 1280, 128, False, False, 5),
    (4, 32, 2048, 256, 128, True, True, 64),
]


@pytest.mark.parametrize(
    "pipe,r,m,k,n,group_size,act_order,asym,iters",
    [(("hopper_sk", c[0], 4, 8), *c) for c in STREAMK_CASES]
    + [(("hopper_skg", c[0], 8, 6), *c) for c in STREAMK_G_CASES],
)
def test_streamk_pieces_are_summed_exactly_once(cp, pipe, r, m, k, n, group_size, act_order, asym, iters):
    """The persistent kernel with forced run lengths: every unit's pieces, parked by the
    blocks that hold them and added in block order by the last to arrive, give the
    twin's product within the bound (NaN-poisoned output fully written) and the same bits
    over 3 calls (the counters reset themselves between launches)."""
    _hopper_or_skip()
    rng = np.random.default_rng([r, m, k, n, iters])
    L = make_layer(rng, k, n, group_size, act_order, asym)
    a = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)
    kw = dict(size_k=k, size_n=n, group_size=group_size, pipe=pipe)
    args = dict(delta=_dev(cp, L["delta"]), perm=_dev(cp, L["perm"]), bias=_dev(cp, L["bias"]))
    tuning = Tuning(streamk_iters=iters)
    plan = kernels.gemm_plan(m, k, n, group_size, delta=asym, pipe=kw["pipe"], tuning=tuning)
    from converter.gpu import runtime

    u = pipe[2]
    units, stages = plan.m_chunks * -(-(n // 64) // 4), k // (16 * u)
    least = -(-units * stages // runtime.device_info().sm_count)
    assert plan.tiles_per_split == u * min(max(iters, least), units * stages)
    assert (plan.splits > 1) == (iters < stages), plan  # the first six cases exercise the parked sums
    outs = [
        cp.asnumpy(
            kernels.marlin_gemm(
                cp.asarray(a),
                cp.asarray(L["B"]),
                cp.asarray(L["S"]),
                out=poisoned(cp, (m, n)),
                tuning=tuning,
                **kw,
                **args,
            )
        )
        for _ in range(3)
    ]
    assert all(np.array_equal(o.view(np.uint16), outs[0].view(np.uint16)) for o in outs), "not deterministic"
    got = outs[0].astype(np.float64)
    assert np.isfinite(got).all(), "unwritten (NaN) outputs"
    host = dict(delta=L["delta"], perm=L["perm"], bias=L["bias"], arith=plan.arith)
    twin = ref.marlin_gemm(a, L["B"], L["S"], size_k=k, size_n=n, group_size=group_size, **host).astype(np.float64)
    bound = ref.gemm_error_bound(
        a, L["B"], L["S"], size_k=k, size_n=n, group_size=group_size, **host, splits=plan.splits
    )
    bad = np.abs(got - twin) > bound
    assert not bad.any(), (plan, int(bad.sum()), float(np.abs(got - twin).max()))
    rel = np.abs(got - twin).mean() / np.abs(twin).mean()
    assert rel < 5e-4, rel


@pytest.mark.parametrize(
    "pipe,m,k,n,group_size,act_order",
    [
        (("hopper_skg", 1, 8, 6), 3, 4096, 512, 128, True),
        (("hopper_skg", 4, 8, 6), 29, 2048, 1280, -1, False),
        (("hopper_sk", 3, 8, 6), 20, 1024, 320, 128, True),
        (("hopper_sk", 8, 8, 6), 64, 2048, 512, 256, False),
        (("hopper_sk", 16, 4, 8), 130, 1536, 768, 48, True),
    ],
)
def test_streamk_reads_a_in_place_or_relaid_out_to_the_same_bits(cp, pipe, m, k, n, group_size, act_order):
    """The persistent kernel's two activation paths (swizzled tensor-map boxes of A
    itself, or a 1-D copy of A laid out the same way by hopper_activations;
    Tuning.hopper_xmap_max_tok picks) fill the same shared memory: the same bits, tokens
    past M (zero-filled by the one, zero-padded by the other) and act-order included."""
    _hopper_or_skip()
    from converter.gpu import tensormap

    if not tensormap.available():
        pytest.skip("no cuda-bindings: both calls would take the re-layout path")
    rng = np.random.default_rng([m, k, n])
    L = make_layer(rng, k, n, group_size, act_order, True)
    a = cp.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(np.float16))
    kw = dict(
        size_k=k, size_n=n, group_size=group_size, pipe=pipe, delta=_dev(cp, L["delta"]), perm=_dev(cp, L["perm"])
    )
    outs = [
        cp.asnumpy(
            kernels.marlin_gemm(a, cp.asarray(L["B"]), cp.asarray(L["S"]), tuning=Tuning(hopper_xmap_max_tok=tok), **kw)
        ).view(np.uint16)
        for tok in (0, 128)
    ]
    assert np.array_equal(outs[0], outs[1]), int((outs[0] != outs[1]).sum())


# Test-only kernels that take multiprocessors away from a GEMM: `hold` keeps one block
# per multiprocessor (the launch gives it all the shared memory a block may have, so no
# GEMM block fits beside it) until `release` is set or `limit_ns` has passed, and says
# which happened; `wait_for` spins until n blocks of `hold` run.
_HOLD_SRC = r"""
extern "C" __global__ void hold(int* started, const volatile int* release, int* timed_out,
                                unsigned long long limit_ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    if (threadIdx.x == 0) atomicAdd(started, 1);
    while (*release == 0) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (t - t0 > limit_ns) { atomicExch(timed_out, 1); return; }
    }
}
extern "C" __global__ void wait_for(const volatile int* started, int n) { while (*started < n) {} }
extern "C" __global__ void set_flag(int* flag) { *flag = 1; }
"""


def test_streamk_finishes_on_a_few_multiprocessors(cp):
    """The persistent kernel's blocks never wait for each other: with all but one
    multiprocessor held by another stream's kernel (which lets go only when a kernel
    queued after the GEMM on the GEMM's stream says so, or after 10 s), the GEMM's 128
    blocks run one after another, finish, and give the same bits as on the whole
    device. A block that waited for a later block's piece (the kernel's first design,
    whose owners did) would wait for a block that cannot start: the holder would time
    out. (With 4 free multiprocessors that design also timed out on an H200.)"""
    _hopper_or_skip()
    from converter.gpu import runtime

    m, k, n, group_size = 64, 4096, 4096, 128
    rng = np.random.default_rng(7)
    L = make_layer(rng, k, n, group_size, False, True)
    a = cp.asarray(rng.standard_normal((m, k), dtype=np.float32).astype(np.float16))
    kw = dict(size_k=k, size_n=n, group_size=group_size, pipe=("hopper_sk", 8, 4, 8))
    args = (a, cp.asarray(L["B"]), cp.asarray(L["S"]))
    delta = _dev(cp, L["delta"])
    plan = kernels.gemm_plan(m, k, n, group_size, delta=True, pipe=kw["pipe"])
    assert plan.splits > 1 and plan.blocks > 64, plan  # units cut across many blocks
    whole = cp.asnumpy(kernels.marlin_gemm(*args, delta=delta, **kw))  # also compiles

    mod = cp.RawModule(code=_HOLD_SRC)
    hold, wait_for, set_flag = (mod.get_function(f) for f in ("hold", "wait_for", "set_flag"))
    smem = cp.cuda.Device().attributes["MaxSharedMemoryPerBlockOptin"]
    hold.max_dynamic_shared_size_bytes = smem
    flags = cp.zeros(3, dtype=cp.int32)  # started, release, timed_out
    held = runtime.device_info().sm_count - 1
    gemm_stream, hold_stream = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    cp.cuda.Device().synchronize()
    with hold_stream:
        hold((held,), (32,), (flags[0:], flags[1:], flags[2:], np.uint64(10**10)), shared_mem=smem)
    with gemm_stream:
        wait_for((1,), (32,), (flags[0:], np.int32(held)))
        out = kernels.marlin_gemm(*args, delta=delta, out=poisoned(cp, (m, n)), **kw)
        set_flag((1,), (1,), (flags[1:],))
    gemm_stream.synchronize()
    hold_stream.synchronize()
    started, released, timed_out = (int(v) for v in cp.asnumpy(flags))
    assert started == held and released == 1
    assert timed_out == 0, "the GEMM needed the held multiprocessors: its blocks waited for blocks that could not start"
    assert np.array_equal(cp.asnumpy(out).view(np.uint16), whole.view(np.uint16))


PADDED_PIPES = [
    ("decode", 1, 4, 3),
    ("decode_w", 4, 4, 3),
    ("tile", 2, 4, 3),
    ("tile", 4, 2, 3),
    ("hopper", 2, 4, 4),
    ("hopper", 16, 4, 6),
    ("hopper_fs", 8, 4, 6),
    ("hopper_fs", 16, 4, 4),
    ("hopper_sk", 1, 4, 8),
    ("hopper_sk", 16, 4, 8),
    ("hopper_skg", 1, 8, 6),
    ("hopper_skg", 4, 8, 6),
]


@pytest.mark.parametrize("pipe", PADDED_PIPES)
@pytest.mark.parametrize("n_out,m", [(333, 5), (320, 17), (257, 70), (1, 3)])
def test_padded_layer_stores_exactly_n_out_columns(cp, pipe, n_out, m):
    """A layer padded from n_out to 384 columns (zero codes, scale 1, delta 0 in the
    padding) gives exactly n_out columns, the real ones equal to the unpadded product's
    first n_out; nothing past them is written (poisoned guard columns)."""
    if Pipe.of(pipe).spec.wgmma:
        _hopper_or_skip()
    rng = np.random.default_rng([n_out, m, pipe[1]])
    k, n = 512, 384
    L = make_layer(rng, k, n, 128, True, True)
    bias = rng.standard_normal(n_out).astype(np.float16)
    a = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)
    kw = dict(size_k=k, size_n=n, group_size=128)
    try:  # decided on the CPU: a variant that does not take groups of 128 on this K is no test
        kernel_variant(k, n, 128, pipe, smem_limit=1 << 30)
    except KernelError as exc:
        pytest.skip(f"{pipe} does not serve this layer: {exc}")
    plan = kernels.gemm_plan(m, k, n, 128, delta=True, pipe=pipe)
    flat = cp.full(m * n_out + 64, cp.nan, dtype=cp.float16)  # 64 guard values after the result
    out = flat[: m * n_out].reshape(m, n_out)
    c = kernels.marlin_gemm(
        cp.asarray(a),
        cp.asarray(L["B"]),
        cp.asarray(L["S"]),
        delta=cp.asarray(L["delta"]),
        perm=cp.asarray(L["perm"]),
        bias=cp.asarray(bias),
        out=out,
        n_out=n_out,
        pipe=pipe,
        **kw,
    )
    assert c.shape == (m, n_out)
    got = cp.asnumpy(c).astype(np.float64)
    assert np.isfinite(got).all() and np.isnan(cp.asnumpy(flat[m * n_out :])).all()
    full_bias = np.concatenate([bias, np.zeros(n - n_out, np.float16)])
    host = dict(delta=L["delta"], perm=L["perm"], bias=full_bias, arith=plan.arith)
    twin = ref.marlin_gemm(a, L["B"], L["S"], **kw, **host).astype(np.float64)[:, :n_out]
    bound = ref.gemm_error_bound(a, L["B"], L["S"], **kw, **host, splits=plan.splits * plan.wk)[:, :n_out]
    assert (np.abs(got - twin) <= bound).all()
    # the two-kernel path stores the same columns
    c2 = kernels.marlin_gemm_two_kernel(
        cp.asarray(a),
        cp.asarray(L["B"]),
        cp.asarray(L["S"]),
        delta=cp.asarray(L["delta"]),
        perm=cp.asarray(L["perm"]),
        bias=cp.asarray(bias),
        n_out=n_out,
        **kw,
    )
    assert c2.shape == (m, n_out) and np.isfinite(cp.asnumpy(c2)).all()
    with pytest.raises(KernelError, match=r"n_out=385 must be in 1..size_n=384"):
        kernels.marlin_gemm(cp.asarray(a), cp.asarray(L["B"]), cp.asarray(L["S"]), n_out=385, **kw)


# One probe kernel per layout struct, so that the test reads the sizes the kernels use.
_SMEM_PROBES = r"""
template <int NT, int U, int GPI, int NS> __global__ void decode_smem_probe(int* out) {
    out[0] = DecodeSmem<NT, U, GPI, NS>::bytes(1);
    out[1] = DecodeSmem<NT, U, GPI, NS>::bytes(4);
}
template <int MT, int U, int GPI, int NS> __global__ void gemm_smem_probe(int* out) {
    out[0] = out[1] = GemmSmem<MT, U, GPI, NS>::BYTES;
}
"""


def test_shared_memory_of_every_variant_is_what_the_planner_reserves(cp):
    """The launcher reserves ``plan.Pipe.smem(gpi, wk)`` bytes; the kernels lay their
    rings out by the structs of kernels/marlin_gemm.cu and marlin_decode.cu. A planner
    size below the kernel's would let a ring overrun the allocation."""
    from converter.gpu import build, runtime

    rings = [(p, gpi) for p in GEMM_PIPES if not p.spec.wgmma for gpi in GEMM_GPIS[p.u]]
    probe = {"decode": "decode_smem_probe", "decode_w": "decode_smem_probe", "tile": "gemm_smem_probe"}
    names = [f"{probe[p.kind.value]}<{p.r}, {p.u}, {gpi}, {p.ns}>" for p, gpi in rings]
    folder = build.kernel_dir()
    code = '#include "marlin_gemm.cu"\n#include "marlin_decode.cu"\n' + _SMEM_PROBES
    arch = runtime.device_info().arch
    mod = cp.RawModule(
        code=code, options=("-std=c++17", f"--gpu-architecture={arch}", f"-I{folder}"), name_expressions=names
    )
    out = cp.zeros(2, dtype=cp.int32)
    for (pipe, gpi), name in zip(rings, names, strict=True):
        mod.get_function(name)((1,), (1,), (out,))
        one, four = (int(v) for v in out.get())
        assert (pipe.smem(gpi, wk=1), pipe.smem(gpi, wk=4)) == (one, four), (pipe, gpi)


def test_shared_memory_of_every_hopper_variant_is_what_the_planner_reserves(cp):
    """As above for kernels/marlin_wgmma.cu (WgLayout::RING; the planner counts the delta
    rows always, so the symmetric variant needs no more than it reserves)."""
    from converter.gpu import build, runtime

    if not kernels.hopper_device():
        pytest.skip("the Hopper kernel needs sm_90")
    pipes = [(p, gpi) for p in GEMM_PIPES if p.spec.wgmma for gpi in GEMM_GPIS[p.u]]
    names = []
    for p, gpi in pipes:
        t, wgs = hopper_split(p.r, p.kind)
        for d in ("true", "false"):
            if p.spec.persistent:
                names.append(f"sk_smem_probe<{t}, {p.u}, {gpi}, {p.ns}, {d}>")
            else:
                names.append(f"wg_smem_probe<{t}, {wgs}, {p.u}, {gpi}, {p.ns}, {d}, {p.spec.wg_tiles}>")
    code = (
        '#include "marlin_wgmma.cu"\n#include "marlin_streamk.cu"\n'
        "template <int T, int WGS, int U, int GPI, int NS, bool D, int J> __global__ void wg_smem_probe(int* out) {\n"
        "    out[0] = WgLayout<T, WGS, U, GPI, NS, D, J>::RING;\n}\n"
        "template <int T, int U, int GPI, int NS, bool D> __global__ void sk_smem_probe(int* out) {\n"
        "    out[0] = StreamkLayout<T, U, GPI, NS, D>::RING;\n}\n"
    )
    arch = runtime.device_info().arch + "a"
    opts = ("-std=c++17", f"--gpu-architecture={arch}", f"-I{build.kernel_dir()}")
    mod = cp.RawModule(code=code, options=opts, name_expressions=names)
    out = cp.zeros(1, dtype=cp.int32)
    for i, (pipe, gpi) in enumerate(pipes):
        sizes = []
        for name in names[2 * i : 2 * i + 2]:
            mod.get_function(name)((1,), (1,), (out,))
            sizes.append(int(out.get()[0]))
        assert sizes[0] == pipe.smem(gpi) >= sizes[1], (pipe, gpi, sizes)

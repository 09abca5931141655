#!/usr/bin/env python3
"""Benchmark our Marlin GEMM against cuBLAS fp16 and PyTorch's int4 kernel (needs a GPU).

Measures, in one run, for each shape (K, N) and batch M:
  ours_sym     our GEMM, symmetric (marlin_B + marlin_scales)
  ours_fused   our GEMM with the asymmetric delta folded in (no extra launch)
  ours_2k      two-kernel correction path (symmetric GEMM + group_sums + add_correction)
               (all three with B as MarlinLinear keeps it: unit-major, kernels.prepare_b_units,
               on layers that a persistent kind serves at every M, and for ours_fused with
               group 128 the scales and deltas inline, kernels.prepare_b_stages; row "b_order")
  fp16         torch.matmul fp16 (cuBLAS), W [K, N]
  int4pack     torch.ops.aten._weight_int4pack_mm, bf16 activations, the same group size
  upstream     upstream IST-DASLab Marlin (the prebuilt peer binary of ../shared/peers,
               copied to .peers/upstream-marlin; symmetric only), when present
  upstream_corr  the same plus the two-launch asymmetric correction (group sums of A,
               then addmm with delta): what an asymmetric checkpoint costs on it
The peer is a measuring instrument only: it is loaded here, never by the package.
Timing: each method's launches are captured into a CUDA graph of R back-to-back calls
that rotate over enough weight copies to exceed 2x the L2 cache (60 MB on an H200), so
no weight is served from L2; the graph is replayed `--reps` times between CUDA events
and the median time per call is reported (microseconds); ours_sym and ours_fused are
each the mean of two such medians timed in ABBA order (sym, fused, fused, sym), because
the card power-caps under sustained load and the first timed would gain. Also measured once: copy
bandwidth (device-to-device, read + write bytes) and the fp16 matmul rate, which give the
roofline floor of each row: max(bytes / BW, flops / rate).

Usage: PYTHONPATH=$PWD python3 benchmarks/bench_gemm.py --json-out benchmarks/results/h200/bench_gemm_h200.json
The run ends with the targets of the kernel-performance issue, each PASS or MISS with
the rows that miss.

With ``--dtype bf16`` (issue 40) ours_sym and ours_fused run bf16 activations and
outputs, ``fp16_fused`` is the fp16 fused path timed beside them (ABBA), ``bf16`` is
cuBLAS bf16 (torch.matmul) on the same weight shape, ``fp16`` stays cuBLAS fp16 and
upstream Marlin (fp16 only) stays a reference column; the two-kernel path is not timed.
The targets printed are then issue 40's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from functools import partial

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192), (8192, 57344), (28672, 8192), (8192, 1024)]
MS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256]
SHAPES_70B = ((8192, 57344), (28672, 8192))
SHAPES_7B = ((4096, 14336), (14336, 4096), (8192, 8192))
PEER_DIR = ".peers/upstream-marlin"
GROUP = 128
L2_BYTES = 60 * 2**20


def timed_graph(cp, calls, reps):
    """Median microseconds per call of `calls` (list of thunks) captured in one graph."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for f in calls[: min(len(calls), 3)]:  # warm-up: module load, workspaces, pool blocks
            f()
        stream.synchronize()
        stream.begin_capture()
        for f in calls:
            f()
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(reps):
            start.record(stream)
            graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3 / len(calls))
    return statistics.median(times)


def timed_torch_graph(torch, calls, reps):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in calls[:3]:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    g.replay()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / len(calls))
    return statistics.median(times)


def safe(row, fn, *a):
    """``fn(*a)``, or NaN with the error recorded in ``row`` (keep benchmarking the rest)."""
    try:
        return fn(*a)
    except Exception as exc:
        row.setdefault("errors", []).append(f"{type(exc).__name__}: {str(exc)[:160]}")
        return float("nan")


def time_ours(cp, row, weights, kw, fn, deltas, **extra):
    """Median us per call of our ``fn`` (``kernels.marlin_gemm`` or the two-kernel path)
    over the rotated weight copies; ``deltas`` per copy (None: symmetric); ``extra``
    overrides ``kw`` (a pipe, a tuning; ``b_units``: a list, one per copy, or None for B in
    Marlin's order). A failure is NaN with the error in ``row``."""
    a, Bs, Ss, out, calls, reps = weights
    ckw = {**kw, **extra}
    units = ckw.pop("b_units", None)
    # partial, not lambda: each call binds its own copy of the weights now.
    thunks = [
        partial(
            fn,
            a,
            Bs[i % len(Bs)],
            Ss[i % len(Bs)],
            out=out,
            **ckw,
            **({} if deltas is None else {"delta": deltas[i % len(Bs)]}),
            **({} if units is None else {"b_units": units[i % len(Bs)]}),
        )
        for i in range(calls)
    ]
    return safe(row, timed_graph, cp, thunks, reps)


def ceilings(cp, torch):
    """Measured copy bandwidth (bytes/s, read + write) and fp16 matmul rate (FLOP/s)."""
    w = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    for _ in range(50):  # bring the clocks up before measuring
        torch.matmul(w, w)
    torch.cuda.synchronize()
    n = 2 * 2**30
    a = torch.ones(n // 4, device="cuda", dtype=torch.float32)
    b = torch.empty_like(a)
    t = timed_torch_graph(torch, [partial(b.copy_, a)] * 5, 5)
    bw = 2 * n / (t * 1e-6)
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    t = timed_torch_graph(torch, [partial(torch.matmul, x, y)] * 5, 5)
    rate = 2 * 8192**3 / (t * 1e-6)
    del a, b, x, y
    return bw, rate


def load_peer(folder: str):
    """The upstream Marlin peer module (``marlin_cuda``) from ``folder``, or None."""
    import os

    if not os.path.isdir(folder):
        return None
    sys.path.insert(0, folder)
    try:
        import marlin_cuda

        return marlin_cuda
    except Exception as exc:  # built for another Python or torch: say so, benchmark the rest
        print(f"# upstream peer not loaded from {folder}: {type(exc).__name__}: {exc}", flush=True)
        return None
    finally:
        sys.path.remove(folder)


def peer_runs(k: int, n: int, m: int) -> bool:
    """The peer's limits (its README): K % 128, N % 256 (N % 128 when M <= 16), group 128."""
    return k % 128 == 0 and (n % 256 == 0 or (m <= 16 and n % 128 == 0))


def upstream_corrected(torch, peer, a, b, c, s, ws, delta16, groups):
    """Upstream Marlin (symmetric) plus the original two-launch correction."""
    peer.mul(a, b, c, s, ws, -1, -1, -1, 16)
    xsum = a.view(a.shape[0], groups, -1).float().sum(-1).half()
    c.addmm_(xsum, delta16)


def targets(rows):
    """The kernel-performance issue's targets: ``[(target, ok, [missing rows])]``."""
    out = []

    def check(name, pred, sel):
        misses, seen = [], 0
        for r in rows:
            if sel(r):
                seen += 1
                ok, why = pred(r)
                if not ok:
                    misses.append(f"{r['K']}x{r['N']} M={r['M']}: {why}")
        if not seen:  # a target this run did not measure is not met
            misses.append("no row of this run measures it")
        out.append((name, not misses, misses))

    def vs_fp16(limit):
        return lambda r: (r["fp16"] / r["ours_fused"] >= limit, f"{r['fp16'] / r['ours_fused']:.2f}x")

    bands_70b = [((1, 4), 3.3), ((8, 16), 3.0), ((24, 32), 2.5), ((48, 64), 2.0), ((96, 128), 1.3)]
    for (lo, hi), lim in bands_70b:
        check(
            f"70B shapes, M {lo}..{hi}: >= {lim}x cuBLAS fp16",
            vs_fp16(lim),
            lambda r, lo=lo, hi=hi: (r["K"], r["N"]) in SHAPES_70B and lo <= r["M"] <= hi,
        )
    for (lo, hi), lim in [((1, 4), 2.6), ((8, 16), 2.2), ((32, 32), 1.8), ((64, 64), 1.4)]:
        check(
            f"7B shapes and 8192x8192, M {lo}..{hi}: >= {lim}x cuBLAS fp16",
            vs_fp16(lim),
            lambda r, lo=lo, hi=hi: (r["K"], r["N"]) in SHAPES_7B and lo <= r["M"] <= hi,
        )
    check("never slower than cuBLAS fp16 (any shape, M <= 256)", vs_fp16(1.0), lambda r: r["M"] <= 256)
    check(
        ">= 1.25x upstream Marlin + correction (every shape it runs, M <= 128)",
        lambda r: (r["upstream_corr"] / r["ours_fused"] >= 1.25, f"{r['upstream_corr'] / r['ours_fused']:.2f}x"),
        lambda r: r["M"] <= 128 and bool(r.get("upstream_corr")),
    )
    check(
        "fused correction <= 3 % over our symmetric GEMM (70B shapes, M <= 64)",
        lambda r: (r["ours_fused"] <= 1.03 * r["ours_sym"], f"+{100 * (r['ours_fused'] / r['ours_sym'] - 1):.1f}%"),
        lambda r: (r["K"], r["N"]) in SHAPES_70B and r["M"] <= 64,
    )
    check(
        "4096 x 4096 at M = 1: <= 7 us",
        lambda r: (r["ours_fused"] <= 7.0, f"{r['ours_fused']:.1f} us"),
        lambda r: (r["K"], r["N"]) == (4096, 4096) and r["M"] == 1,
    )
    check(
        "never slower than torch int4pack",
        lambda r: (r["ours_fused"] <= r["int4pack"], f"{r['ours_fused']:.1f} vs {r['int4pack']:.1f} us"),
        lambda r: bool(r.get("int4pack")),
    )
    return out


def targets_bf16(rows):
    """Issue 40's speed targets: ``[(target, ok, [missing rows])]``."""
    out = []

    def check(name, pred):
        misses = [f"{r['K']}x{r['N']} M={r['M']}: {why}" for r in rows for ok, why in [pred(r)] if not ok]
        out.append((name, bool(rows) and not misses, misses or ([] if rows else ["no rows"])))

    check(
        "bf16 fused / fp16 fused <= 1.05 (every row)",
        lambda r: (r["ours_fused"] <= 1.05 * r["fp16_fused"], f"{r['ours_fused'] / r['fp16_fused']:.3f}"),
    )

    def same_ratio(r):
        bf, hf = r["bf16"] / r["ours_fused"], r["fp16"] / r["fp16_fused"]
        return abs(bf / hf - 1) <= 0.05, f"vs cuBLAS bf16 {bf:.2f}x, fp16 path vs cuBLAS fp16 {hf:.2f}x"

    check("bf16 fused vs cuBLAS bf16 within 5 % of the fp16 path's ratio over cuBLAS fp16 (every row)", same_ratio)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-out", default=None)
    ap.add_argument(
        "--dtype",
        default="fp16",
        choices=("fp16", "bf16"),
        help="activations of ours_sym / ours_fused (bf16: cuBLAS bf16 baseline and the fp16 fused path beside)",
    )
    ap.add_argument("--shapes", default=None, help="e.g. 4096x4096,8192x57344")
    ap.add_argument("--ms", default=None, help="e.g. 1,16,64")
    ap.add_argument("--group", type=int, default=GROUP, help="group size of every layer (default 128, the targets')")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--calls", type=int, default=24, help="launches per graph (at least the copy count)")
    ap.add_argument(
        "--force-wk",
        type=int,
        default=None,
        choices=(1, 4),
        help="force the GEMM block shape (experiments; see converter.gpu.plan.Tuning.force_wk)",
    )
    ap.add_argument(
        "--b-order-ab",
        action="store_true",
        help="on layers served with B unit-major (as MarlinLinear keeps it where the persistent kinds serve "
        "every M: kernels.keeps_b_units), also time B in Marlin's order: marlin_order_sym, "
        "marlin_order_fused, in ABBA order with ours_sym / ours_fused; and where the fused call is served with "
        "the scales inline (kernels.keeps_b_stages), that call on the unit-major copy: unit_major_fused",
    )
    ap.add_argument("--peer", default=PEER_DIR, help="folder of the upstream Marlin peer binary (marlin_cuda)")
    ap.add_argument(
        "--sweep",
        default=None,
        help="extra our-kernel variants to time (in --dtype), e.g. d1x4x3w1,t1x4x3w1 (d = decode kernel with NT "
        "8-row tiles, w = the same with per-weight scaling, t = tile kernel with MT "
        "16-row tiles, h = Hopper kernel with R 8-token tiles, f = the same with its warpgroups "
        "splitting the features, p = the persistent Hopper kernel, g = the same with per-group scaling, "
        "R 0 = the tiles that hold M; "
        "x U x NS; w = waves target; optional i = the persistent kernel's stages per block, "
        "o = blocks per SM cap, m = its tensor-map token cap, m0 re-lays A out first; in that order)",
    )
    ap.add_argument(
        "--sweep-splits",
        type=int,
        default=0,
        metavar="MAX",
        help="on rows the planner sends to a kernel of --sweep-kinds, also time the fused path at "
        "every feasible K split count up to MAX (row['fused_by_splits']: us and plan per count), "
        "for refitting the planner's split cost (converter.gpu.plan.Tuning.force_splits)",
    )
    ap.add_argument(
        "--sweep-kinds",
        default="hopper",
        help="the kernel kinds --sweep-splits sweeps, e.g. hopper,decode (default hopper)",
    )
    args = ap.parse_args()
    group = args.group
    bf16 = args.dtype == "bf16"
    if group <= 0 or group % 16:
        ap.error(f"--group {group}: a positive multiple of 16 that divides every K (per-channel is not timed)")

    try:
        import cupy as cp
        import torch
    except ImportError as exc:
        print(f"bench_gemm.py needs a GPU machine with CuPy and torch: {exc}", file=sys.stderr)
        return 2

    from converter.gpu import kernels, runtime
    from converter.gpu.plan import HOPPER_SK_RS, HOPPER_SKG_RS, KernelKind, Tuning

    info = runtime.require_gpu()
    base = Tuning(force_wk=args.force_wk)
    sweep_kinds = {KernelKind(v).value for v in args.sweep_kinds.split(",")}
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if any(k % group for k, _ in shapes):
        ap.error(f"--group {group} does not divide K of every shape: {shapes}")
    ms = MS if not args.ms else [int(v) for v in args.ms.split(",")]
    bw, rate = ceilings(cp, torch)
    print(
        f"# {info.name} sm_{info.compute_capability} {info.sm_count} SMs; copy {bw / 1e12:.2f} TB/s, "
        f"fp16 matmul {rate / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    peer = load_peer(args.peer)
    int4_note = None
    results = []
    cp.random.seed(0)
    for k, n in shapes:
        g = k // group
        int4_bytes = k * n // 2 + g * n * 2
        delta_bytes = g * n * 2  # the fused GEMM reads fp16(delta) (kernels.prepare_delta)
        copies = max(2, math.ceil(2 * L2_BYTES / int4_bytes))
        Bs = [(cp.random.random((k // 16, 2 * n)) * 2**32).astype(cp.uint32).view(cp.int32) for _ in range(copies)]
        Ss = [(cp.random.random((g, n), dtype=cp.float32) * 0.02 + 0.001).astype(cp.float16) for _ in range(copies)]
        Ds = [(cp.random.random((g, n), dtype=cp.float32) - 0.5) * 0.05 for _ in range(copies)]
        Ds16 = [kernels.prepare_delta(d) for d in Ds]  # done once at load time by MarlinLinear
        # B as MarlinLinear keeps it: unit-major where a persistent kind serves every M
        Us = [kernels.prepare_b_units(b, k, n) for b in Bs] if kernels.keeps_b_units(k, n, group, base) else None
        # ... and for the asymmetric (fused) calls with the scales and deltas inline where it keeps that
        Vs = Us
        if kernels.keeps_b_stages(k, n, group, True, base):
            Vs = [kernels.prepare_b_stages(b, s, d, k, n) for b, s, d in zip(Bs, Ss, Ds16, strict=True)]
        f16_copies = max(2, math.ceil(2 * L2_BYTES / (k * n * 2)))
        Ws = [torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.02 for _ in range(f16_copies)]
        # PyTorch int4: its own packed layout, built from random codes
        packed, sz = None, None
        try:
            codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
            packed = [torch.ops.aten._convert_weight_to_int4pack(codes, 8) for _ in range(copies)]
            sz = [torch.rand(g, n, 2, device="cuda", dtype=torch.bfloat16) * 0.01 for _ in range(copies)]
            del codes
        except Exception as exc:  # op missing or layout changed in this torch build
            int4_note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            packed = None
        for m in ms:
            a = (cp.random.standard_normal((m, k), dtype=cp.float32)).astype(cp.float16)
            out = cp.empty((m, n), dtype=cp.float16)
            kw = dict(size_k=k, size_n=n, group_size=group, tuning=base, b_units=Us)
            calls = max(args.calls, copies)
            act = "bfloat16" if bf16 else "float16"  # the plan of ours_*: bf16 routes by its own knobs
            row = {
                "K": k,
                "N": n,
                "M": m,
                "plan": dataclasses.asdict(kernels.gemm_plan(m, k, n, group, tuning=base, act=act)),
            }
            if bf16:
                row["plan_fp16"] = dataclasses.asdict(kernels.gemm_plan(m, k, n, group, tuning=base))
            row["b_order"] = "marlin" if Us is None else "unit-major" if Vs is Us else "unit-major, fused inline"
            weights = (a, Bs, Ss, out, calls, args.reps)
            ours = partial(time_ours, cp, row, weights, kw)
            if bf16:  # bf16 A and C as bits (CuPy has no bf16); the fp16 fused path beside, ABBA
                a_bf = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                bits = cp.from_dlpack(a_bf.view(torch.int16)).view(cp.uint16)
                out_b = cp.empty((m, n), dtype=cp.uint16)
                ours_b = partial(time_ours, cp, row, (bits, Bs, Ss, out_b, calls, args.reps), {**kw, "act": "bfloat16"})
                s1, f1 = ours_b(kernels.marlin_gemm, None), ours_b(kernels.marlin_gemm, Ds16, b_units=Vs)
                h1, h2 = ours(kernels.marlin_gemm, Ds16, b_units=Vs), ours(kernels.marlin_gemm, Ds16, b_units=Vs)
                f2, s2 = ours_b(kernels.marlin_gemm, Ds16, b_units=Vs), ours_b(kernels.marlin_gemm, None)
                row["ours_sym"], row["ours_fused"], row["fp16_fused"] = (s1 + s2) / 2, (f1 + f2) / 2, (h1 + h2) / 2
                row["ours_2k"] = float("nan")
                ws_b = [w.to(torch.bfloat16) for w in Ws]
                mm = [partial(torch.matmul, a_bf, ws_b[i % f16_copies]) for i in range(max(args.calls, f16_copies))]
                row["bf16"] = timed_torch_graph(torch, mm, args.reps)
                del ws_b
            # ABBA: under sustained load the H200 caps its power (clocks 1980 -> ~1550 MHz
            # at M >= 96 on the 70B layers), so whichever is timed first gains; a
            # linear drift cancels in the mean of the two orders.
            if not bf16:
                s1, f1 = ours(kernels.marlin_gemm, None), ours(kernels.marlin_gemm, Ds16, b_units=Vs)
            if args.b_order_ab and Us is not None and not bf16:  # A B B A: as served, Marlin's order twice, as served
                on = partial(ours, kernels.marlin_gemm, b_units=None)
                fo1, so1, so2, fo2 = on(Ds16), on(None), on(None), on(Ds16)
                row["marlin_order_sym"], row["marlin_order_fused"] = (so1 + so2) / 2, (fo1 + fo2) / 2
            if args.b_order_ab and Vs is not Us and not bf16:  # ... and the fused call on the unit-major copy, twice
                fu1, fu2 = ours(kernels.marlin_gemm, Ds16, b_units=Us), ours(kernels.marlin_gemm, Ds16, b_units=Us)
                row["unit_major_fused"] = (fu1 + fu2) / 2
            if not bf16:
                f2, s2 = ours(kernels.marlin_gemm, Ds16, b_units=Vs), ours(kernels.marlin_gemm, None)
                row["ours_sym"], row["ours_fused"] = (s1 + s2) / 2, (f1 + f2) / 2
                row["ours_2k"] = ours(kernels.marlin_gemm_two_kernel, Ds)
            for spec in args.sweep.split(",") if args.sweep else []:
                # d|w|t R x U x NS w waves [i stages per persistent block] [o blocks per SM]
                # [m map cap], e.g. d1x4x3w1,
                # t1x4x3w1, d1x4x3w1o3, p0x8x6w1m0 (the persistent kernel on re-laid-out A),
                # w1m0 (whatever the planner picks, A re-laid out where that is persistent)
                pipe_s, w = spec.rsplit("w", 1)
                w, _, xcap = w.partition("m")
                w, _, occ = w.partition("o")
                w, _, its = w.partition("i")
                pipe, kind = None, None  # "w1m0": the planner's own variant, only the knobs changed
                if pipe_s:
                    kind = KernelKind(
                        {
                            "d": "decode",
                            "w": "decode_w",
                            "t": "tile",
                            "h": "hopper",
                            "f": "hopper_fs",
                            "p": "hopper_sk",
                            "g": "hopper_skg",
                        }[pipe_s[0]]
                    )
                    pipe = (kind,) + tuple(int(v) for v in pipe_s[1:].split("x"))
                    if pipe[1] == 0:  # R 0: the fewest 8-token tiles that hold M (the kind's largest chunk beyond)
                        rs = HOPPER_SKG_RS if kind is KernelKind.HOPPER_SKG else HOPPER_SK_RS
                        pipe = (kind, next((r for r in rs if 8 * r >= m), rs[-1]), *pipe[2:])
                cap = ((kind, int(occ)),) if occ and kind else base.occupancy_cap
                swept = dataclasses.replace(base, waves=int(w), occupancy_cap=cap)
                if xcap:
                    swept = dataclasses.replace(swept, hopper_xmap_max_tok=int(xcap))
                if its:
                    swept = dataclasses.replace(swept, streamk_iters=int(its))
                mine = ours_b if bf16 else ours  # --dtype bf16: the variants in bf16 too
                row[f"sym_{spec}"] = mine(kernels.marlin_gemm, None, pipe=pipe, tuning=swept)
                row[f"fused_{spec}"] = mine(kernels.marlin_gemm, Ds16, pipe=pipe, tuning=swept, b_units=Vs)
            if args.sweep_splits and row["plan"]["kind"] in sweep_kinds:
                row["fused_by_splits"] = {}
                for sp in range(1, args.sweep_splits + 1):
                    forced = dataclasses.replace(base, force_splits=sp)
                    plan = kernels.gemm_plan(m, k, n, group, tuning=forced)
                    if plan.splits != sp:  # not a feasible count for this K
                        continue
                    us = ours(kernels.marlin_gemm, Ds16, tuning=forced, b_units=Vs)
                    row["fused_by_splits"][sp] = {"us": us, "plan": dataclasses.asdict(plan)}
                print(
                    f"   splits sweep {k}x{n} M={m} (planner {row['plan']['splits']}): "
                    + " ".join(f"{sp}:{v['us']:.1f}" for sp, v in row["fused_by_splits"].items() if v["us"]),
                    flush=True,
                )
            at = torch.randn(m, k, device="cuda", dtype=torch.float16)
            fc = max(args.calls, f16_copies)
            row["fp16"] = timed_torch_graph(
                torch, [partial(torch.matmul, at, Ws[i % f16_copies]) for i in range(fc)], args.reps
            )
            if packed is not None:
                ab = at.to(torch.bfloat16)
                try:
                    row["int4pack"] = timed_torch_graph(
                        torch,
                        [
                            partial(torch.ops.aten._weight_int4pack_mm, ab, packed[i % copies], group, sz[i % copies])
                            for i in range(calls)
                        ],
                        args.reps,
                    )
                except Exception as exc:
                    int4_note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    row["int4pack"] = None
            else:
                row["int4pack"] = None
            if peer is not None and group == GROUP and peer_runs(k, n, m):
                bt = [torch.from_dlpack(b) for b in Bs]
                st = [torch.from_dlpack(x) for x in Ss]
                dt = [torch.from_dlpack(d).half() for d in Ds]
                ct = torch.empty(m, n, dtype=torch.float16, device="cuda")
                wsp = torch.zeros(n // 128 * 16, dtype=torch.int32, device="cuda")
                row["upstream"] = safe(
                    row,
                    timed_torch_graph,
                    torch,
                    [
                        partial(peer.mul, at, bt[i % copies], ct, st[i % copies], wsp, -1, -1, -1, 16)
                        for i in range(calls)
                    ],
                    args.reps,
                )
                row["upstream_corr"] = safe(
                    row,
                    timed_torch_graph,
                    torch,
                    [
                        partial(
                            upstream_corrected,
                            torch,
                            peer,
                            at,
                            bt[i % copies],
                            ct,
                            st[i % copies],
                            wsp,
                            dt[i % copies],
                            g,
                        )
                        for i in range(calls)
                    ],
                    args.reps,
                )
                del bt, st, dt
            io = m * k * 2 + m * n * 2
            row["floor_sym_us"] = max((int4_bytes + io) / bw, 2 * m * k * n / rate) * 1e6
            row["floor_fused_us"] = max((int4_bytes + delta_bytes + io) / bw, 2 * m * k * n / rate) * 1e6
            row["floor_fp16_us"] = max((k * n * 2 + io) / bw, 2 * m * k * n / rate) * 1e6
            # the same floors at the datasheet's 4.8 TB/s (cuBLAS streams at ~4.4 here)
            row["floor_fused_us_4p8"] = max((int4_bytes + delta_bytes + io) / 4.8e12, 2 * m * k * n / rate) * 1e6
            row["fp16_stream_TBps"] = (k * n * 2) / (row["fp16"] * 1e-6) / 1e12
            row["eff_bw_fused_TBps"] = (int4_bytes + delta_bytes) / (row["ours_fused"] * 1e-6) / 1e12
            results.append(row)
            i4 = f"{row['int4pack']:9.1f}" if row["int4pack"] else "      n/a"
            up = f"{row['upstream_corr']:8.1f}" if row.get("upstream_corr") else "     n/a"
            print(
                f"{k:6d} {n:6d} {m:4d} {row['plan']['kind']:>8s} | "
                f"sym {row['ours_sym']:8.1f} fused {row['ours_fused']:8.1f} "
                f"2k {row['ours_2k']:8.1f} fp16 {row['fp16']:8.1f} int4 {i4} up+c {up} | "
                f"x{row['fp16'] / row['ours_sym']:5.2f} x{row['fp16'] / row['ours_fused']:5.2f} "
                f"fused+{100 * (row['ours_fused'] / row['ours_sym'] - 1):5.1f}% "
                f"floor {row['floor_sym_us']:7.1f} splits {row['plan']['splits']}"
                + "".join(f" {key[4:]}:{v:.1f}" for key, v in row.items() if key.startswith("sym_"))
                + (
                    f" | Marlin order sym {row['marlin_order_sym']:.1f} fused {row['marlin_order_fused']:.1f}"
                    if "marlin_order_fused" in row
                    else ""
                )
                + (
                    f" | bf16: cuBLAS bf16 {row['bf16']:.1f} fp16 fused {row['fp16_fused']:.1f} "
                    f"bf16/fp16 {row['ours_fused'] / row['fp16_fused']:.3f} x{row['bf16'] / row['ours_fused']:.2f} "
                    f"(fp16 x{row['fp16'] / row['fp16_fused']:.2f})"
                    if bf16
                    else ""
                ),
                flush=True,
            )
        del Bs, Ss, Ds, Ds16, Us, Ws, packed, sz
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()

    print(
        "\n| K x N | M | kernel | ours sym | ours fused | two-kernel | cuBLAS fp16 | torch int4 | upstream "
        "| upstream+corr | fused vs fp16 | fused vs upstream+corr | floor (fused) |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        i4 = f"{r['int4pack']:.1f}" if r["int4pack"] else "n/a"
        up = f"{r['upstream']:.1f}" if r.get("upstream") else "n/a"
        upc = f"{r['upstream_corr']:.1f}" if r.get("upstream_corr") else "n/a"
        xup = f"{r['upstream_corr'] / r['ours_fused']:.2f}x" if r.get("upstream_corr") else "n/a"
        print(
            f"| {r['K']} x {r['N']} | {r['M']} | {r['plan']['kind']} | {r['ours_sym']:.1f} | {r['ours_fused']:.1f} | "
            f"{r['ours_2k']:.1f} | {r['fp16']:.1f} | {i4} | {up} | {upc} | "
            f"{r['fp16'] / r['ours_fused']:.2f}x | {xup} | "
            f"{r['floor_fused_us']:.1f} |"
        )
    verdicts = targets_bf16(results) if bf16 else targets(results)
    print("\n# targets (fused asymmetric path)")
    for name, ok, misses in verdicts:
        print(f"{'PASS' if ok else 'MISS'}  {name}" + ("" if ok else "  misses: " + "; ".join(misses)))
    if args.json_out:
        doc = {
            "device": info.name,
            "sm": info.compute_capability,
            "sm_count": info.sm_count,
            "copy_bw_TBps": bw / 1e12,
            "fp16_matmul_TFLOPs": rate / 1e12,
            "group_size": group,
            "dtype": args.dtype,
            "torch": torch.__version__,
            "cupy": cp.__version__,
            "int4pack_note": int4_note,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": "PYTHONPATH=$PWD python3 benchmarks/bench_gemm.py " + " ".join(sys.argv[1:]),
            "results": results,
            "targets": [{"target": t, "pass": ok, "misses": mi} for t, ok, mi in verdicts],
            "peer": str(getattr(peer, "__file__", None)) if peer is not None else None,
        }
        with open(args.json_out, "w") as f:
            json.dump(doc, f, indent=1)
    if int4_note:
        print(f"# int4pack: {int4_note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

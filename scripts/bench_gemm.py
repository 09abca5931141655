#!/usr/bin/env python3
"""Benchmark our Marlin GEMM against cuBLAS fp16 and PyTorch's int4 kernel (needs a GPU).

Measures, in one run, for each shape (K, N) and batch M:
  ours_sym     our GEMM, symmetric (marlin_B + marlin_scales)
  ours_fused   our GEMM with the asymmetric delta folded in (no extra launch)
  ours_2k      two-kernel correction path (symmetric GEMM + group_sums + add_correction)
  fp16         torch.matmul fp16 (cuBLAS), W [K, N]
  int4pack     torch.ops.aten._weight_int4pack_mm, bf16 activations, group 128
Timing: each method's launches are captured into a CUDA graph of R back-to-back calls
that rotate over enough weight copies to exceed 2x the L2 cache (60 MB on an H200), so
no weight is served from L2; the graph is replayed `--reps` times between CUDA events
and the median time per call is reported (microseconds). Also measured once: copy
bandwidth (device-to-device, read + write bytes) and the fp16 matmul rate, which give the
roofline floor of each row: max(bytes / BW, flops / rate).

Usage: PYTHONPATH=$PWD python3 scripts/bench_gemm.py --json-out scripts/bench_gemm_h200.json
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

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 8192), (8192, 57344), (28672, 8192)]
MS = [1, 2, 4, 8, 16, 32, 64, 128]
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--shapes", default=None, help="e.g. 4096x4096,8192x57344")
    ap.add_argument("--ms", default=None, help="e.g. 1,16,64")
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
        "--sweep",
        default=None,
        help="extra our-kernel variants to time, e.g. d1x4x3w1,t1x4x3w1 (d = decode kernel with NT "
        "8-row tiles, w = the same with per-weight scaling, t = tile kernel with MT "
        "16-row tiles; x U x NS; w = waves target)",
    )
    args = ap.parse_args()

    import cupy as cp
    import torch

    from converter.gpu import kernels, runtime
    from converter.gpu.plan import KernelKind, Tuning

    info = runtime.require_gpu()
    base = Tuning(force_wk=args.force_wk)
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = MS if not args.ms else [int(v) for v in args.ms.split(",")]
    bw, rate = ceilings(cp, torch)
    print(
        f"# {info.name} sm_{info.compute_capability} {info.sm_count} SMs; copy {bw / 1e12:.2f} TB/s, "
        f"fp16 matmul {rate / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    int4_note = None
    results = []
    cp.random.seed(0)
    for k, n in shapes:
        g = k // GROUP
        int4_bytes = k * n // 2 + g * n * 2
        delta_bytes = g * n * 2  # the fused GEMM reads fp16(delta) (kernels.prepare_delta)
        copies = max(2, math.ceil(2 * L2_BYTES / int4_bytes))
        Bs = [(cp.random.random((k // 16, 2 * n)) * 2**32).astype(cp.uint32).view(cp.int32) for _ in range(copies)]
        Ss = [(cp.random.random((g, n), dtype=cp.float32) * 0.02 + 0.001).astype(cp.float16) for _ in range(copies)]
        Ds = [(cp.random.random((g, n), dtype=cp.float32) - 0.5) * 0.05 for _ in range(copies)]
        Ds16 = [kernels.prepare_delta(d) for d in Ds]  # done once at load time by MarlinLinear
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
            kw = dict(size_k=k, size_n=n, group_size=GROUP, tuning=base)
            calls = max(args.calls, copies)
            row = {"K": k, "N": n, "M": m, "plan": dataclasses.asdict(kernels.gemm_plan(m, k, n, GROUP, tuning=base))}
            # partial, not lambda: each call binds its own copy of the weights now.
            row["ours_sym"] = safe(
                row,
                timed_graph,
                cp,
                [partial(kernels.marlin_gemm, a, Bs[i % copies], Ss[i % copies], out=out, **kw) for i in range(calls)],
                args.reps,
            )
            row["ours_fused"] = safe(
                row,
                timed_graph,
                cp,
                [
                    partial(
                        kernels.marlin_gemm, a, Bs[i % copies], Ss[i % copies], delta=Ds16[i % copies], out=out, **kw
                    )
                    for i in range(calls)
                ],
                args.reps,
            )
            row["ours_2k"] = safe(
                row,
                timed_graph,
                cp,
                [
                    partial(
                        kernels.marlin_gemm_two_kernel,
                        a,
                        Bs[i % copies],
                        Ss[i % copies],
                        delta=Ds[i % copies],
                        out=out,
                        **kw,
                    )
                    for i in range(calls)
                ],
                args.reps,
            )
            for spec in args.sweep.split(",") if args.sweep else []:
                # d|w|t R x U x NS w waves [o blocks per SM], e.g. d1x4x3w1, t1x4x3w1, d1x4x3w1o3
                pipe_s, w = spec.rsplit("w", 1)
                w, _, occ = w.partition("o")
                kind = KernelKind({"d": "decode", "w": "decode_w", "t": "tile"}[pipe_s[0]])
                pipe = (kind,) + tuple(int(v) for v in pipe_s[1:].split("x"))
                cap = ((kind, int(occ)),) if occ else base.occupancy_cap
                skw = {**kw, "tuning": dataclasses.replace(base, waves=int(w), occupancy_cap=cap)}
                row[f"sym_{spec}"] = safe(
                    row,
                    timed_graph,
                    cp,
                    [
                        partial(kernels.marlin_gemm, a, Bs[i % copies], Ss[i % copies], out=out, pipe=pipe, **skw)
                        for i in range(calls)
                    ],
                    args.reps,
                )
                row[f"fused_{spec}"] = safe(
                    row,
                    timed_graph,
                    cp,
                    [
                        partial(
                            kernels.marlin_gemm,
                            a,
                            Bs[i % copies],
                            Ss[i % copies],
                            delta=Ds16[i % copies],
                            out=out,
                            pipe=pipe,
                            **skw,
                        )
                        for i in range(calls)
                    ],
                    args.reps,
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
                            partial(torch.ops.aten._weight_int4pack_mm, ab, packed[i % copies], GROUP, sz[i % copies])
                            for i in range(calls)
                        ],
                        args.reps,
                    )
                except Exception as exc:
                    int4_note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                    row["int4pack"] = None
            else:
                row["int4pack"] = None
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
            print(
                f"{k:6d} {n:6d} {m:4d} | sym {row['ours_sym']:8.1f} fused {row['ours_fused']:8.1f} "
                f"2k {row['ours_2k']:8.1f} fp16 {row['fp16']:8.1f} int4 {i4} | "
                f"x{row['fp16'] / row['ours_sym']:5.2f} x{row['fp16'] / row['ours_fused']:5.2f} "
                f"fused+{100 * (row['ours_fused'] / row['ours_sym'] - 1):5.1f}% "
                f"floor {row['floor_sym_us']:7.1f} splits {row['plan']['splits']}"
                + "".join(f" {key[4:]}:{v:.1f}" for key, v in row.items() if key.startswith("sym_")),
                flush=True,
            )
        del Bs, Ss, Ds, Ds16, Ws, packed, sz
        cp.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()

    print(
        "\n|   K   |   N   |  M  | ours sym us | fused us | 2-kernel us | fp16 us | int4pack us "
        "| x fp16 (sym) | x fp16 (fused) | x int4pack | fused overhead | floor us (fused) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        i4 = f"{r['int4pack']:.1f}" if r["int4pack"] else "n/a"
        xi4 = f"{r['int4pack'] / r['ours_fused']:.2f}" if r["int4pack"] else "n/a"
        print(
            f"| {r['K']} | {r['N']} | {r['M']} | {r['ours_sym']:.1f} | {r['ours_fused']:.1f} | "
            f"{r['ours_2k']:.1f} | {r['fp16']:.1f} | {i4} | {r['fp16'] / r['ours_sym']:.2f} | "
            f"{r['fp16'] / r['ours_fused']:.2f} | {xi4} | {100 * (r['ours_fused'] / r['ours_sym'] - 1):.1f}% | "
            f"{r['floor_fused_us']:.1f} |"
        )
    if args.json_out:
        doc = {
            "device": info.name,
            "sm": info.compute_capability,
            "sm_count": info.sm_count,
            "copy_bw_TBps": bw / 1e12,
            "fp16_matmul_TFLOPs": rate / 1e12,
            "group_size": GROUP,
            "torch": torch.__version__,
            "cupy": cp.__version__,
            "int4pack_note": int4_note,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": "PYTHONPATH=$PWD python3 scripts/bench_gemm.py " + " ".join(sys.argv[1:]),
            "results": results,
        }
        with open(args.json_out, "w") as f:
            json.dump(doc, f, indent=1)
    if int4_note:
        print(f"# int4pack: {int4_note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

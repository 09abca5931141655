#!/usr/bin/env python3
"""Read-only stream of Marlin-sized B buffers in several access patterns (needs a GPU).

What bounds the GEMMs at small M is the weight stream; this times how fast the device
streams the same bytes in the orders a kernel can choose, with nothing else in the way:
plain 16-byte ``ld.global.nc`` loads, 8 in flight a thread, XOR-folded (the result kept
only to keep the loads). Patterns, over B viewed as rows of 16-byte words (one row per
k-tile, 2 N words of 4 bytes):
  seq_gGxT       each of G blocks of T threads a contiguous 1/G of B;
  rr_cwC_ksS_gG  rectangles of C bytes of a row x rows/S rows, numbered column group
                 fastest and dealt round-robin to G blocks (the device's blocks on
                 neighbouring columns of the same rows at once);
  runs_cwC_ksS   the same rectangles numbered K slice fastest and dealt in contiguous
                 runs, one block per multiprocessor (each block its own column strip at
                 its own rows: the persistent GEMM's stream-K order).
Timing as benchmarks/bench_gemm.py: a CUDA graph of 16 calls rotating over copies of B past
2 x the L2, median us per call. The table in docs/notes/perf_notes.md (2026-12-03T13:52Z)
came from this script.

Usage: PYTHONPATH=$PWD python3 benchmarks/bench_stream_patterns.py [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

KERNEL = r"""
extern "C" __global__ void __launch_bounds__(512) probe(const int4* __restrict__ B, long long total, int rows,
                                                       int row_i4, int cw, int kslices, int mode, int run,
                                                       unsigned* out) {
    unsigned acc = 0;
    const int tid = threadIdx.x, nt = blockDim.x;
    if (mode == 0) {  // contiguous 1/G of the buffer per block
        long long per = (total + gridDim.x - 1) / gridDim.x;
        long long lo = per * blockIdx.x, hi = min(lo + per, total);
        long long i = lo + tid;
        for (; i + 7LL * nt < hi; i += 8LL * nt) {
            int4 v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u)
                asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                             : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                             : "l"(B + i + (long long)u * nt));
#pragma unroll
            for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
        for (; i < hi; i += nt) {
            int4 v = B[i];
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
    } else {  // rectangles of (rows / kslices) x cw int4; item = (kslice, colgroup)
        const int groups = row_i4 / cw, rps = rows / kslices;
        const int items = groups * kslices;
        const int per_item = rps * cw, sh = __ffs(cw) - 1;
        for (int j = 0;; ++j) {
            int item;
            if (mode == 1) {  // round-robin, colgroup fastest
                item = blockIdx.x + j * gridDim.x;
            } else {  // contiguous runs, kslice fastest
                if (j >= run) break;
                item = blockIdx.x * run + j;
            }
            if (item >= items) break;
            int ks, cg;
            if (mode == 1) {
                ks = item / groups;
                cg = item % groups;
            } else {
                cg = item / kslices;
                ks = item % kslices;
            }
            const int4* base = B + (long long)ks * rps * row_i4 + (long long)cg * cw;
            int e = tid;
            for (; e + 7 * nt < per_item; e += 8 * nt) {
                int4 v[8];
#pragma unroll
                for (int u = 0; u < 8; ++u) {
                    int f = e + u * nt;
                    int r = f >> sh, c = f & (cw - 1);
                    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                                 : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                                 : "l"(base + (long long)r * row_i4 + c));
                }
#pragma unroll
                for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
            }
            for (; e < per_item; e += nt) {
                int r = e >> sh, c = e & (cw - 1);
                int4 v = base[(long long)r * row_i4 + c];
                acc ^= v.x ^ v.y ^ v.z ^ v.w;
            }
        }
    }
    if (acc == 0x9e3779b9u) atomicXor(out, acc);  // keeps the loads; (almost) never taken
}
"""

SHAPES = [(8192, 57344), (28672, 8192), (4096, 4096)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    try:
        import cupy as cp
        import numpy as np
    except ImportError as exc:
        print(f"bench_stream_patterns.py needs a GPU machine with CuPy: {exc}", file=sys.stderr)
        return 2
    from benchmarks.bench_gemm import timed_graph

    fn = cp.RawModule(code=KERNEL, options=("-std=c++17",)).get_function("probe")
    out = cp.zeros(1, cp.uint32)
    sm = cp.cuda.Device().attributes["MultiProcessorCount"]

    def run(bs, k, n, mode, cw=0, kslices=1, grid=None, run_=0, threads=512):
        rows, row_i4 = k // 16, (2 * n) // 4
        total = rows * row_i4
        kargs = lambda b: (  # noqa: E731
            b,
            np.int64(total),
            np.int32(rows),
            np.int32(row_i4),
            np.int32(cw),
            np.int32(kslices),
            np.int32(mode),
            np.int32(run_),
            out,
        )
        calls = [partial(fn, (grid,), (threads,), kargs(b)) for b in bs]
        calls = (calls * ((16 + len(calls) - 1) // len(calls)))[: max(16, len(calls))]
        return timed_graph(cp, calls, 7)

    res = {}
    for k, n in SHAPES:
        nbytes = k * n // 2
        copies = max(2, -(-2 * 60 * 2**20 // nbytes))
        bs = [cp.random.randint(0, 2**31, size=(k // 16, 2 * n), dtype=cp.int32) for _ in range(copies)]
        rows, row_i4 = k // 16, (2 * n) // 4
        pats = {
            "seq_g132x512": dict(mode=0, grid=sm),
            "seq_g264x512": dict(mode=0, grid=2 * sm),
            "seq_g528x256": dict(mode=0, grid=4 * sm, threads=256),
        }
        for cw_b in (512, 2048, 16384):
            cw = cw_b // 16
            if row_i4 % cw:
                continue
            groups = row_i4 // cw
            for ks in (1, 2, 4, 8, 16, 32):
                if rows % ks or groups * ks < sm:
                    continue
                items = groups * ks
                pats[f"rr_cw{cw_b}_ks{ks}_g{min(items, 4 * sm)}"] = dict(
                    mode=1, cw=cw, kslices=ks, grid=min(items, 4 * sm), threads=256
                )
                if items >= sm:
                    run_ = -(-items // sm)
                    pats[f"runs_cw{cw_b}_ks{ks}"] = dict(mode=2, cw=cw, kslices=ks, grid=-(-items // run_), run_=run_)
        for name, p in pats.items():
            p = dict(p)
            us = run(bs, k, n, p.pop("mode"), **p)
            res.setdefault(f"{k}x{n}", {})[name] = us
            print(f"{k}x{n} {name:32s} {us:8.2f} us  {nbytes / us / 1e6:5.2f} TB/s", flush=True)
        del bs
        cp.get_default_memory_pool().free_all_blocks()
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Does an L2 prefetch of a GEMM's weights, issued before a window of other work, shorten
that GEMM at decode? (needs an sm_90 GPU)

For four Llama-3-8B serving layers at M = 1 and 8: a CUDA graph of 16 calls, each a
``torch.cuda._sleep`` window (4 or 15 us) then the GEMM on one of several weight copies
(past 150 MB, so nothing stays in L2 from the call before); then the same with a small
kernel that issues ``cp.async.bulk.prefetch.L2`` over the first ``frac`` of each of 132
slices of the layer's ``B`` before the window. Each row gives the GEMM's time without
(``gemm``) and with each fraction prefetched (``gemm_pf<frac>``), and the prefetch
kernel's own time in the stream (``pf<frac>_overhead``), us a call.

Usage: PYTHONPATH=$PWD python3 scripts/probe_l2_prefetch.py [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHAPES = ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096))
FRACS = (0.1, 0.25, 0.5, 1.0)
SRC = r"""
extern "C" __global__ void l2_prefetch(const char* base, unsigned long long slice,
                                       unsigned long long take, int slices) {
  for (int s = blockIdx.x * blockDim.x + threadIdx.x; s < slices; s += gridDim.x * blockDim.x) {
    const char* p = base + (unsigned long long)s * slice;
    for (unsigned long long off = 0; off < take; off += 32768) {
      unsigned long long n = take - off; if (n > 32768) n = 32768;
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p + off), "r"((unsigned)n) : "memory");
    }
  }
}"""


def _timed(torch, np, fn, calls: int = 16, reps: int = 9) -> float:
    """Median us a call of ``fn(i)`` over ``calls`` calls captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(0)
        fn(1)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return float(np.median(times))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()

    import cupy as cp
    import numpy as np
    import torch

    from benchmarks.bench_op_host import _layer
    from converter.gpu.api import MarlinLinearModule

    kernel = cp.RawKernel(SRC, "l2_prefetch", options=("-arch=sm_90",))

    def prefetch(t, frac: float, slices: int = 132) -> None:
        slice_ = (t.numel() * t.element_size() // slices) // 16 * 16
        take = int(slice_ * frac) // 16 * 16
        with cp.cuda.Stream.from_external(torch.cuda.current_stream()):
            kernel((2,), (128,), (np.uint64(t.data_ptr()), np.uint64(slice_), np.uint64(take), np.int32(slices)))

    cycles_per_us = torch.cuda.get_device_properties(0).clock_rate / 1e3
    rows = []
    for k, n in SHAPES:
        base = _layer(k, n)
        copies = max(3, int(np.ceil(150e6 / (k * n // 2))) + 1)
        mods = [MarlinLinearModule(base) for _ in range(copies)]
        for m in (1, 8):
            xs = [torch.randn(m, k, dtype=torch.float16, device="cuda") for _ in range(copies)]
            for window_us in (4, 15):
                cyc = int(window_us * cycles_per_us)

                def step(i: int, frac: float | None, gemm: bool, cyc=cyc, mods=mods, xs=xs, copies=copies) -> None:
                    if frac is not None:
                        prefetch(mods[i % copies].b, frac)
                    torch.cuda._sleep(cyc)
                    if gemm:
                        mods[i % copies](xs[i % copies])

                sleep = _timed(torch, np, lambda i: step(i, None, False))
                plain = _timed(torch, np, lambda i: step(i, None, True))
                row = {"K": k, "N": n, "M": m, "window_us": window_us, "gemm": round(plain - sleep, 2)}
                for frac in FRACS:
                    alone = _timed(torch, np, lambda i, f=frac: step(i, f, False))
                    both = _timed(torch, np, lambda i, f=frac: step(i, f, True))
                    row[f"pf{frac}_overhead"] = round(alone - sleep, 2)
                    row[f"gemm_pf{frac}"] = round(both - alone, 2)
                print(json.dumps(row), flush=True)
                rows.append(row)
        del mods
        torch.cuda.empty_cache()
    if args.json_out:
        args.json_out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

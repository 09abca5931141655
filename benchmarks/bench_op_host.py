#!/usr/bin/env python3
"""Host time of one eager call of a swapped linear, against torch's fp16 ``F.linear``.

Usage::

    PYTHONPATH=$PWD python3 benchmarks/bench_op_host.py [--json PATH]

For each layer shape it times, on the host clock, a burst of eager calls at M = 1 whose
GPU work is shorter than their issue, so the burst's wall time over its calls is the
host time of a call: the module's ``forward`` (the direct path eager mode takes, with
the packed launch off and on: ``MARLIN_FAST_LAUNCH`` 0 and 1), the
registered op through torch's dispatcher (``torch.ops.marlin_convert.gemm``, what a
compiled graph calls), the ``KernelMarlinLinear`` wrapper a loaded model holds, and
``F.linear`` on the fp16 weight as the baseline, all in the same run. It also times the
GPU side of each (one CUDA graph of 100 calls, replayed) so the reader sees which side
bounds an eager decode step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SHAPES = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096)]


def _layer(k: int, n: int):
    from converter.gpu.api import MarlinLinear

    rng = np.random.default_rng(k + n)
    g = k // 128
    B = rng.integers(-(2**31), 2**31, (k // 16, 2 * n), dtype=np.int64).astype(np.int32)
    s = rng.uniform(1e-3, 2e-2, (g, n)).astype(np.float16)
    d = rng.uniform(-0.05, 0.05, (g, n)).astype(np.float32)
    return MarlinLinear(f"{k}x{n}", k, n, 128, B, s, d, None, None)


def _host_us(fn, x, calls: int = 2000) -> float:
    import torch

    for _ in range(50):
        fn(x)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x)
        t1 = time.perf_counter()  # before the sync: the issue time alone
        torch.cuda.synchronize()
        best = min(best, (t1 - t0) / calls * 1e6)
    return best


def _gpu_us(fn, x, calls: int = 100) -> float:
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn(x)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return float(np.median(times))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from converter.gpu.api import MarlinLinearModule
    from converter.gpu.torch_op import FAST_LAUNCH_ENV
    from converter.model.modules import KernelMarlinLinear

    rows = []
    for k, n in SHAPES:
        mod = MarlinLinearModule(_layer(k, n))
        wrapped = KernelMarlinLinear("layer", mod, k, n)
        w = torch.randn(n, k, dtype=torch.float16, device="cuda") * 0.02
        x = torch.randn(1, k, dtype=torch.float16, device="cuda")

        def op(x, mod=mod):
            return torch.ops.marlin_convert.gemm(
                x, mod.b, mod.scales, mod.delta, mod.perm, mod.bias, mod.locks,
                mod.in_features, mod.size_n, mod.group_size, mod.out_features,
            )  # fmt: skip

        def fp16(x, w=w):
            return F.linear(x, w)

        # name -> (callable, MARLIN_FAST_LAUNCH): "wrapper" is what a loaded model holds,
        # with the packed launch (the default); "*_unpacked" the same through run_gemm.
        fns = {
            "wrapper": (wrapped, "1"),
            "wrapper_unpacked": (wrapped, "0"),
            "module": (mod, "1"),
            "module_unpacked": (mod, "0"),
            "op": (op, "0"),
            "fp16_linear": (fp16, "0"),
        }
        row = {"K": k, "N": n, "M": 1}
        for name, (fn, fast) in fns.items():
            os.environ[FAST_LAUNCH_ENV] = fast
            row[f"host_us_{name}"] = round(_host_us(fn, x), 2)
            row[f"gpu_us_{name}"] = round(_gpu_us(fn, x), 2)
        os.environ.pop(FAST_LAUNCH_ENV)
        rows.append(row)
    card = torch.cuda.get_device_name()
    print(f"card: {card}")
    cols = list(fns)
    print(f"{'K x N':>13} | host us: " + " ".join(f"{c:>16}" for c in cols) + " | gpu us: wrapper fp16")
    for r in rows:
        host = " ".join(f"{r[f'host_us_{c}']:>16.1f}" for c in cols)
        print(f"{r['K']:>6} x {r['N']:<5} | {host} | {r['gpu_us_wrapper']:>7.1f} {r['gpu_us_fp16_linear']:>4.1f}")
    if a.json:
        a.json.write_text(json.dumps({"card": card, "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

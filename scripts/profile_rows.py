#!/usr/bin/env python3
"""One routed GEMM call per row inside cudaProfilerStart/Stop, for Nsight Compute (needs a GPU).

Each row (K:N:M, group 128, fused path, B as ``MarlinLinear`` keeps it) is warmed up with
three calls, then called once between ``cudaProfilerStart`` and ``cudaProfilerStop``, so
that ``ncu --profile-from-start off`` profiles exactly that call. The command behind
benchmarks/results/h200/ncu_streamk_h200.json:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats \\
        --section Occupancy --csv --page details \\
        python3 scripts/profile_rows.py 8192:57344:1,28672:8192:1,4096:14336:1,...

(``--clock-control none``: the clocks as the benchmark finds them.)
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.splitlines()[0] + "\nUsage: python3 scripts/profile_rows.py K:N:M,...", file=sys.stderr)
        return 2
    import cupy as cp
    import numpy as np

    from converter.gpu import kernels

    rng = np.random.default_rng(0)
    for k, n, m in (tuple(int(v) for v in c.split(":")) for c in sys.argv[1].split(",")):
        g = k // 128
        B = cp.asarray(rng.integers(-(2**31), 2**31, (k // 16, 2 * n), dtype=np.int64).astype(np.int32))
        units = kernels.prepare_b_units(B, k, n) if kernels.keeps_b_units(k, n, 128) else None
        S = cp.asarray((rng.uniform(0.5, 2, (g, n)) / 64).astype(np.float16))
        D = kernels.prepare_delta(cp.asarray(rng.normal(0, 0.01, (g, n)).astype(np.float32)))
        a = cp.asarray(rng.normal(0, 1, (m, k)).astype(np.float16))
        for i in range(4):
            if i == 3:
                cp.cuda.runtime.deviceSynchronize()
                cp.cuda.profiler.start()
            kernels.marlin_gemm(a, B, S, size_k=k, size_n=n, group_size=128, delta=D, b_units=units)
        cp.cuda.runtime.deviceSynchronize()
        cp.cuda.profiler.stop()
        print("row", k, n, m, kernels.gemm_plan(m, k, n, 128, delta=True).kind.value, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

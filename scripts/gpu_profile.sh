#!/usr/bin/env bash
# Nsight Compute profile of one marlin_gemm launch per case (clocks left alone).
# Run on the GPU machine from the repo root: bash scripts/gpu_profile.sh [OUTDIR]
set -u
out=${1:-${OUT:-/tmp}}
export PYTHONPATH=$PWD
cat > /tmp/prof_cases.py <<'PY'
import sys, cupy as cp
from converter.gpu import kernels
cases = [(1, 28672, 8192), (16, 28672, 8192), (64, 28672, 8192), (1, 4096, 4096)]
for m, k, n in cases:
    B = (cp.random.random((k // 16, 2 * n)) * 2**32).astype(cp.uint32).view(cp.int32)
    S = (cp.random.random((k // 128, n), dtype=cp.float32) * 0.01).astype(cp.float16)
    D = cp.random.random((k // 128, n), dtype=cp.float32) * 0.01
    a = cp.random.random((m, k), dtype=cp.float32).astype(cp.float16)
    for _ in range(2):
        kernels.marlin_gemm(a, B, S, delta=D, size_k=k, size_n=n, group_size=128)
    cp.cuda.get_current_stream().synchronize()
    print(m, k, n, kernels.gemm_plan(m, k, n, 128, delta=True), flush=True)
PY
ncu --clock-control none -k regex:marlin_gemm --launch-skip-before-match 0 \
    --launch-count 8 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section WarpStateStats --section LaunchStats --section SchedulerStats --section InstructionStats \
    python3 /tmp/prof_cases.py > "$out/ncu.log" 2>&1
echo "ncu rc=$?"
grep -E "marlin_gemm|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Theoretical Occupancy|Registers Per|Stall|Issue Slots|Eligible|Warp Cycles Per Issued|L2 Hit|Executed Ipc|No Eligible|Block Limit" "$out/ncu.log" | head -150

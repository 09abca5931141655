#!/usr/bin/env bash
# Nsight Compute profile of one marlin_gemm launch per case (clocks left alone).
# Run on the GPU machine from the repo root: bash scripts/gpu_profile.sh [OUTDIR]
set -u
out=${1:-${OUT:-/tmp}}
export PYTHONPATH=$PWD
cat > /tmp/prof_cases.py <<'PY'
import sys, cupy as cp
from converter.gpu import kernels
cases = [(1, 28672, 8192), (64, 28672, 8192), (1, 4096, 4096)]
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
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats
  --section LaunchStats --section SchedulerStats --section InstructionStats"
# every second launch of each case: the fused (delta) GEMM after one warm-up call
ncu --clock-control none -k regex:marlin_gemm --launch-count 6 $sections --print-details all \
    python3 /tmp/prof_cases.py > "$out/ncu.log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  ncu --clock-control none -k regex:marlin_gemm --launch-count 6 $sections \
      python3 /tmp/prof_cases.py > "$out/ncu.log" 2>&1
  rc=$?
fi
echo "ncu rc=$rc"
grep -E "Duration|DRAM Throughput|Issued Warp|No Eligible|Executed Instructions  |Achieved Active|Stall" "$out/ncu.log" | head -60

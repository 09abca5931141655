#!/usr/bin/env bash
# Nsight Compute profile of one GEMM launch per case (clocks left alone).
# Run on the GPU machine from the repo root: bash scripts/gpu_profile.sh [OUTDIR] [CASES]
# CASES: m:k:n:delta,... (default 1:28672:8192:1,16:28672:8192:1,16:28672:8192:0,1:4096:4096:1)
#   a case may name the variant to force: m:k:n:delta:kind/R/U/NS (e.g. 128:8192:57344:1:hopper_fs/16/4/4)
# PROF_EXTRA_SECTIONS adds ncu sections (e.g. "--section SourceCounters": where warps stall).
# PROF_OPCODES=1 also writes OUTDIR/ncu_opcodes.log: the executed SASS instruction mix of
# each launch (sass__inst_executed_per_opcode, one line per opcode).
set -u
out=${1:-${OUT:-/tmp}}
export PYTHONPATH=$PWD
[ -n "${2:-}" ] && export PROF_CASES=$2
ncases=$(python3 -c "import os; print(len(os.environ.get('PROF_CASES', 'a,b,c,d').split(',')))")
cat > /tmp/prof_cases.py <<'PY'
import os, sys, cupy as cp
from converter.gpu import kernels
spec = os.environ.get("PROF_CASES", "1:28672:8192:1,16:28672:8192:1,16:28672:8192:0,1:4096:4096:1")
cases = [c.split(":") for c in spec.split(",")]
for case in cases:
    m, k, n, use_delta = (int(v) for v in case[:4])
    pipe = tuple(int(v) if v.isdigit() else v for v in case[4].split("/")) if len(case) > 4 else None
    B = (cp.random.random((k // 16, 2 * n)) * 2**32).astype(cp.uint32).view(cp.int32)
    S = (cp.random.random((k // 128, n), dtype=cp.float32) * 0.01).astype(cp.float16)
    D = kernels.prepare_delta(cp.random.random((k // 128, n), dtype=cp.float32) * 0.01) if use_delta else None
    a = cp.random.random((m, k), dtype=cp.float32).astype(cp.float16)
    for _ in range(2):
        kernels.marlin_gemm(a, B, S, delta=D, size_k=k, size_n=n, group_size=128, pipe=pipe)
    cp.cuda.get_current_stream().synchronize()
    print(m, k, n, kernels.gemm_plan(m, k, n, 128, delta=bool(use_delta), pipe=pipe), flush=True)
PY
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats
  --section LaunchStats --section SchedulerStats --section InstructionStats ${PROF_EXTRA_SECTIONS:-}"
# both launches of each case (a warm-up call, then the measured one)
ncu --clock-control none -k regex:marlin_ --launch-count $((2 * ncases)) $sections --print-details all \
    python3 /tmp/prof_cases.py > "$out/ncu.log" 2>&1
rc=$?
if [ $rc -ne 0 ]; then
  ncu --clock-control none -k regex:marlin_ --launch-count $((2 * ncases)) $sections \
      python3 /tmp/prof_cases.py > "$out/ncu.log" 2>&1
  rc=$?
fi
echo "ncu rc=$rc"
if [ "${PROF_OPCODES:-0}" = 1 ]; then
  # both launches of each case again, one pass: the counts are per launch
  ncu --clock-control none -k regex:marlin_ --launch-count $((2 * ncases)) \
      --metrics sass__inst_executed_per_opcode,smsp__inst_executed.sum,gpu__time_duration.sum \
      --print-metric-instances details python3 /tmp/prof_cases.py > "$out/ncu_opcodes.log" 2>&1
  echo "ncu opcodes rc=$?"
fi
grep -E "marlin_|Duration|DRAM Throughput|Issued Warp|No Eligible|Executed Instructions  |Achieved Active|Registers Per|Stall|L2 Cache Throughput|L1/TEX Cache Throughput" "$out/ncu.log" | head -150

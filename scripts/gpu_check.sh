#!/usr/bin/env bash
# One device call: GPU tests, sanitizer, benchmark. Run from the repo root on the GPU
# machine: bash scripts/gpu_check.sh [tests|sanitize|bench|all] (logs under $OUT).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
if [[ $what == tests || $what == all ]]; then
  timeout 300 python3 -m pytest --maxfail=8 -q --tb=line -p no:cacheprovider tests/gpu 2>&1 | tee "$out/gpu_tests.log" | tail -25
fi
if [[ $what == sanitize || $what == all ]]; then
  timeout 240 bash scripts/gpu_sanitize.sh "$out"
fi
if [[ $what == bench || $what == all ]]; then
  timeout 500 python3 benchmarks/bench_gemm.py --json-out "$out/bench_gemm_h200.json" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" | tail -60
fi

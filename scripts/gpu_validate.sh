#!/usr/bin/env bash
# The H200 validation of a kernel change, in two device calls (run from the repo root on
# the GPU machine; logs and JSON under $OUT):
#   bash scripts/gpu_validate.sh correctness REALINPUT
#       every GPU test (tests/gpu), compute-sanitizer memcheck/racecheck/synccheck over
#       every kernel variant (scripts/gpu_sanitize.sh), the error table over M in
#       {1, 8, 16, 17, 32, 33, 64, 65, 128, 129, 256} (scripts/gpu_error_table.sh),
#       marlin-verify --gpu on every real checkpoint (scripts/gpu_verify_all.sh) and
#       whole-model parity (scripts/gpu_model_parity.sh)
#   bash scripts/gpu_validate.sh bench
#       benchmarks/bench_gemm.py (JSON with the upstream peer's columns and the target
#       verdicts) and an ncu profile of the Hopper kernel (scripts/gpu_profile.sh)
# REALINPUT: a copy of shared/realinput inside the checkout (e.g. .realinput).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
what=${1:?usage: scripts/gpu_validate.sh correctness REALINPUT | bench}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
if [[ $what == correctness ]]; then
  real=${2:?REALINPUT}
  echo "== GPU tests"
  timeout 240 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu 2>&1 | tee "$out/gpu_tests.log" | tail -15
  echo "== compute-sanitizer"
  timeout 150 bash scripts/gpu_sanitize.sh "$out" 2>&1 | tail -6
  echo "== error table"
  timeout 60 bash scripts/gpu_error_table.sh > "$out/error_table.md" 2>&1; tail -3 "$out/error_table.md"
  echo "== real checkpoints"
  timeout 90 bash scripts/gpu_verify_all.sh "$real" /tmp/verify_all > "$out/verify_all.log" 2>&1
  echo "exit $?"; grep "^==" "$out/verify_all.log"
  echo "== model parity"
  timeout 120 bash scripts/gpu_model_parity.sh "$real" "$out/model-parity" > "$out/model_parity.log" 2>&1
  echo "exit $?"; tail -14 "$out/model_parity.log"
elif [[ $what == bench ]]; then
  timeout 420 python3 benchmarks/bench_gemm.py --json-out "$out/bench_gemm_h200.json" --reps 9 --calls 16 \
    > "$out/bench.log" 2>&1
  echo "bench exit $?"; grep -A40 "^# targets" "$out/bench.log" | head -30
  PROF_CASES=${PROF_CASES:-16:8192:57344:1,64:8192:57344:1,128:28672:8192:1} \
    timeout 100 bash scripts/gpu_profile.sh "$out" > /dev/null 2>&1
  echo "profile exit $?"
fi

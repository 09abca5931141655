#!/usr/bin/env bash
# One device call each: the serving checks of issue 38. Run from the repo root on the GPU
# machine, with the real checkpoints copied to .shared/realinput (ignored, carried):
#   bash scripts/gpu_serving.sh tests     # op, packed launch, capture, compile, generate, from_pretrained on
#                                         # CUDA, parity, host time (~6 min on a fresh machine: NVRTC builds first)
#   bash scripts/gpu_serving.sh graph     # bench_generate, CUDA graph, batches 1-64, fused and unfused (~2 min)
#   bash scripts/gpu_serving.sh compile   # compile + graph, batches 1 and 8 (~2.5 min; compile32 for 32 and 64)
# Logs and JSON under $OUT; merge the compile halves with benchmarks/bench_generate.py --merge A B.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MARLIN_SHARED=$PWD/.shared
out=${OUT:-/tmp}
what=${1:-tests}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
compile() {
  timeout 400 python3 benchmarks/bench_generate.py --mode compile --compile-mode default --skip-prefill \
    --profile-steps 2 --batches "$1" --json "$out/bench_compile_${1/,/_}.json" 2>&1 | grep -A12 "^compile:"
}
case $what in
  tests)
    timeout 300 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_serving.py tests/gpu/test_fast_launch.py \
      tests/gpu/test_model_gpu.py tests/model/test_hf_quantizer.py -k "serving or gpu or cuda or fast or generate" 2>&1 \
      | tee "$out/serving.log" | tail -15
    timeout 120 python3 scripts/gpu_generate_parity.py --shared .shared --json "$out/parity.json" 2>&1 | tail -10
    timeout 90 python3 benchmarks/bench_op_host.py --json "$out/op_host.json" 2>&1 | tail -7 ;;
  graph)
    timeout 400 python3 benchmarks/bench_generate.py --mode graph --with ours-unfused --profile-steps 2 \
      --json "$out/bench_graph.json" 2>&1 | grep -A40 "^card:" ;;
  compile) compile 1,8 ;;
  compile32) compile 32,64 ;;
  *) echo "usage: $0 tests|graph|compile|compile32" >&2; exit 2 ;;
esac

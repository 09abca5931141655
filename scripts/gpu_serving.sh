#!/usr/bin/env bash
# One device call each: the serving checks of issue 38. Run from the repo root on the GPU
# machine, with the real checkpoints copied to .shared/realinput (ignored, carried):
#   bash scripts/gpu_serving.sh tests   # op, capture, compile, from_pretrained on CUDA, parity (~4 min)
#   bash scripts/gpu_serving.sh graph   # bench_generate, CUDA graph, batches 1-64, profile (~4 min)
#   bash scripts/gpu_serving.sh compile # bench_generate, compile + graph, batches 1-64 (~8 min)
# Logs and JSON under $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MARLIN_SHARED=$PWD/.shared
out=${OUT:-/tmp}
what=${1:-tests}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
case $what in
  tests)
    timeout 200 python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_serving.py \
      tests/gpu/test_model_gpu.py tests/model/test_hf_quantizer.py -k "serving or gpu or cuda" 2>&1 | tee "$out/serving.log" | tail -15
    timeout 120 python3 scripts/gpu_generate_parity.py --shared .shared --json "$out/parity.json" 2>&1 | tail -10
    timeout 60 python3 benchmarks/bench_op_host.py --json "$out/op_host.json" 2>&1 | tail -7 ;;
  graph)
    timeout 500 python3 benchmarks/bench_generate.py --mode graph --json "$out/bench_graph.json" 2>&1 | tail -25 ;;
  compile)
    timeout 560 python3 benchmarks/bench_generate.py --mode compile --compile-mode default --skip-prefill \
      --json "$out/bench_compile.json" 2>&1 | tail -20 ;;
  *) echo "usage: $0 tests|graph|compile" >&2; exit 2 ;;
esac

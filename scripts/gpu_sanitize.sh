#!/usr/bin/env bash
# compute-sanitizer (memcheck, racecheck, synccheck) over a small set of kernel cases.
# Run on the GPU machine from the repo root: bash scripts/gpu_sanitize.sh [OUTDIR]
# Each tool's full log goes to OUTDIR/sanitizer_<tool>.log; the summary lines are printed.
set -u
out=${1:-${OUT:-/tmp}}
export PYTHONPATH=$PWD
cat > /tmp/sanitize_cases.py <<'PY'
import numpy as np, cupy as cp
from converter.gpu import kernels, reference as ref
from converter.marlin.layout import pack_b, permute_scales
rng = np.random.default_rng(0)
def layer(k, n, gs):
    g = k // gs
    q = rng.integers(0, 16, (k, n), dtype=np.uint8)
    s = (rng.uniform(0.5, 2, (g, n)) / 32).astype(np.float16)
    d = rng.normal(0, 0.05, (g, n)).astype(np.float32)
    return cp.asarray(pack_b(q)), cp.asarray(permute_scales(s)), cp.asarray(d)
# (m, k, n, group, act-order, wk, pipe): pipe None = the launcher's choice
for (m, k, n, gs, act, wk, pipe) in [
        (1, 1024, 256, 128, False, None, None), (17, 1024, 256, 32, True, 4, None),
        (65, 512, 128, 64, False, 1, None), (16, 256, 64, 256, False, None, None),
        (128, 384, 192, 128, True, 1, None), (5, 192, 320, 64, False, 1, None),
        (33, 1536, 320, 48, True, 4, None), (24, 512, 256, 128, False, 1, None),
        (12, 1024, 320, 1024, True, 1, None),
        (14, 1024, 320, 128, False, 1, ("decode", 2, 8, 3)), (27, 512, 320, 64, True, 1, ("decode", 4, 4, 3)),
        (27, 512, 320, 512, False, 1, ("decode_w", 4, 4, 3)), (9, 512, 192, 32, False, 4, ("decode", 2, 4, 3))]:
    kernels.FORCE_WK = wk
    B, S, D = layer(k, n, gs)
    a = cp.asarray(rng.standard_normal((m, k)).astype(np.float16))
    perm = cp.asarray(rng.permutation(k).astype(np.int32)) if act else None
    bias = cp.asarray(rng.standard_normal(n).astype(np.float16))
    kw = dict(size_k=k, size_n=n, group_size=gs, perm=perm)
    for _ in range(2):
        kernels.marlin_gemm(a, B, S, delta=D, bias=bias, pipe=pipe, **kw)
        kernels.marlin_gemm(a, B, S, pipe=pipe, **kw)
        kernels.marlin_gemm_two_kernel(a, B, S, delta=D, **kw)
    kernels.dequant(B, S, delta=D, size_k=k, size_n=n, group_size=gs)
    kernels.dequant(B, S, size_k=k, size_n=n, group_size=gs)
    kernels.synchronize()
    print("case", m, k, n, gs, act, "plan", kernels.gemm_plan(m, k, n, gs, pipe=pipe), flush=True)
print("sanitize cases done")
PY
python3 /tmp/sanitize_cases.py >/dev/null || { echo "cases fail outside the sanitizer"; exit 1; }
for tool in memcheck racecheck synccheck; do
  compute-sanitizer --tool "$tool" --print-limit 50 --error-exitcode 9 python3 /tmp/sanitize_cases.py \
     > "$out/sanitizer_$tool.log" 2>&1
  rc=$?
  echo "== $tool rc=$rc: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|hazard' "$out/sanitizer_$tool.log" | tail -2 | tr '\n' ' ')"
done

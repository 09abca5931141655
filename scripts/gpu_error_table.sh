#!/usr/bin/env bash
# Error table of converter.gpu.verify.verify_layer_gpu on random layers (GPU machine,
# repo root): bash scripts/gpu_error_table.sh. Prints one markdown row per layer and M.
# fp16 activations; the bf16 table, beside cuBLAS bf16: scripts/gpu_error_table_bf16.py.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 - <<'PY'
import numpy as np
from converter.gpu import reference as ref
from converter.gpu.verify import verify_layer_gpu
from converter.marlin.layout import pack_b, permute_scales
rng = np.random.default_rng(0)
print("| K | N | group | act-order | asym | M | fused mean | fused max | 2-kernel mean | 2-kernel max | bitwise-stable x10 |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for k, n, gs, act, asym in [(4096, 4096, 128, False, True), (4096, 14336, 128, True, True), (8192, 8192, 128, True, True),
                            (14336, 4096, -1, False, True), (8192, 1024, 32, True, True),
                            (2048, 8192, 64, False, False), (1024, 320, 16, True, True),
                            (4096, 4096, 128, True, "float"), (8192, 1024, 32, False, "float")]:
    g = 1 if gs == -1 else k // gs
    q = rng.integers(0, 16, (k, n), dtype=np.uint8)
    s = (rng.uniform(0.5, 2.0, (g, n)) / 64).astype(np.float16)
    z = rng.integers(0, 16, (g, n))
    # asym True: integer zero points (GPTQ / AWQ); "float": a float additive zero (.tinyloop)
    delta = (s.astype(np.float32) * (8 - z)).astype(np.float32) if asym else None
    if asym == "float":
        delta = (rng.normal(0, 0.02, (g, n)) + 8 * s.astype(np.float32)).astype(np.float32)
    perm = rng.permutation(k).astype(np.int32) if act else None
    B, S = pack_b(q), permute_scales(s)
    w = ref.reference_weight(B, S, delta, perm, size_k=k, size_n=n, group_size=gs)
    res = verify_layer_gpu(B, S, delta, perm, k, n, gs, w, repeats=10, ms=(1, 8, 16, 17, 32, 33, 64, 65, 128, 129, 256))
    for m, e in res.items():
        if m == "ok":
            continue
        tk = (f"{e['two_kernel_mean_rel_err']:.2e} | {e['two_kernel_max_rel_err']:.2e}" if asym else "- | -")
        det = e["deterministic"] and e.get("two_kernel_deterministic", True)
        print(f"| {k} | {n} | {gs} | {act} | {asym} | {m} | {e['mean_rel_err']:.2e} | {e['max_rel_err']:.2e} | {tk} | {det} |")
    print(f"<!-- layer {k}x{n} g{gs}: ok={res['ok']} -->")
PY

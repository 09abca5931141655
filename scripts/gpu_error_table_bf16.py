"""The error table in bf16 (issue 40): our fused GEMM with bf16 activations against the
fp32 product, beside cuBLAS bf16 given the same activations and the weight rounded to
bf16, on random layers, over the table's M.

GPU machine, repo root (needs CuPy and torch with CUDA):
    PYTHONPATH=$PWD python3 scripts/gpu_error_table_bf16.py [--json OUT.json]

Prints one markdown row per layer and M. Relative errors are mean|C - ref| / mean|ref|
(max: max|C - ref| / mean|ref|) over all M x N outputs, ref = A @ W in float64 with W the
artifact's exact weight (converter.gpu.reference.reference_weight). "ratio" is ours over
cuBLAS bf16's mean error; the issue's bar is 1.2. "x10" says whether ten calls gave the
same bits. Exit 1 when a row misses the bar or is not bitwise stable.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

Ms = (1, 8, 16, 17, 32, 33, 64, 65, 128, 129, 256)
# (K, N, group_size, act_order, asym): as scripts/gpu_error_table.sh's fp16 table
LAYERS = [
    (4096, 4096, 128, False, True),
    (4096, 14336, 128, True, True),
    (8192, 8192, 128, True, True),
    (14336, 4096, -1, False, True),
    (8192, 1024, 32, True, True),
    (2048, 8192, 64, False, False),
    (1024, 320, 16, True, True),
]
BAR = 1.2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write every row here")
    opts = ap.parse_args(argv)
    import cupy as cp
    import torch

    from converter.dtypes import f32_to_bf16
    from converter.gpu import kernels
    from converter.gpu import reference as ref
    from converter.marlin.layout import pack_b, permute_scales

    rng = np.random.default_rng(0)
    rows, bad = [], 0
    print(f"device: {torch.cuda.get_device_name(0)}")
    print("| K | N | group | act-order | asym | M | ours mean | ours max | cuBLAS bf16 mean | ratio | x10 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k, n, gs, act, asym in LAYERS:
        g = 1 if gs == -1 else k // gs
        q = rng.integers(0, 16, (k, n), dtype=np.uint8)
        s = (rng.uniform(0.5, 2.0, (g, n)) / 64).astype(np.float16)
        z = rng.integers(0, 16, (g, n))
        delta = (s.astype(np.float32) * (8 - z)).astype(np.float32) if asym else None
        perm = rng.permutation(k).astype(np.int32) if act else None
        B, S = pack_b(q), permute_scales(s)
        w = ref.reference_weight(B, S, delta, perm, size_k=k, size_n=n, group_size=gs)
        w64 = cp.asarray(w, dtype=cp.float64)
        w_bf16 = torch.from_numpy(w).cuda().to(torch.bfloat16)
        dev = dict(delta=None if delta is None else cp.asarray(delta), perm=None if perm is None else cp.asarray(perm))
        Bd, Sd = cp.asarray(B), cp.asarray(S)
        for m in Ms:
            a_bits = f32_to_bf16(rng.standard_normal((m, k), dtype=np.float32))
            a = cp.asarray(a_bits)
            calls = [
                kernels.marlin_gemm(a, Bd, Sd, size_k=k, size_n=n, group_size=gs, act="bfloat16", **dev)
                for _ in range(10)
            ]
            same = all(bool((c == calls[0]).all()) for c in calls[1:])
            ours = (calls[0].astype(cp.uint32) << 16).view(cp.float32).astype(cp.float64)
            a64 = (a.astype(cp.uint32) << 16).view(cp.float32).astype(cp.float64)
            exact = a64 @ w64
            a_t = torch.from_numpy(a_bits.view(np.int16)).cuda().view(torch.bfloat16)
            cublas = cp.asarray((a_t @ w_bf16).float()).astype(cp.float64)
            scale = float(cp.abs(exact).mean())
            ours_mean = float(cp.abs(ours - exact).mean()) / scale
            ours_max = float(cp.abs(ours - exact).max()) / scale
            cublas_mean = float(cp.abs(cublas - exact).mean()) / scale
            ratio = ours_mean / cublas_mean
            ok = same and ratio <= BAR and bool(cp.isfinite(ours).all())
            bad += not ok
            rows.append(
                dict(k=k, n=n, group_size=gs, act_order=act, asym=asym, m=m, ours_mean=ours_mean, ours_max=ours_max,
                     cublas_mean=cublas_mean, ratio=ratio, deterministic=same, ok=ok)
            )  # fmt: skip
            print(
                f"| {k} | {n} | {gs} | {act} | {asym} | {m} | {ours_mean:.2e} | {ours_max:.2e} | {cublas_mean:.2e} "
                f"| {ratio:.3f}{'' if ok else ' MISS'} | {same} |"
            )
    print(f"{len(rows) - bad} of {len(rows)} rows within {BAR}x cuBLAS bf16 and bitwise stable")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "bar": BAR, "rows": rows}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

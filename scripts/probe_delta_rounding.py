"""What the kernels' fp16 delta costs, on the CPU (the kernels' NumPy twins, no GPU).

The kernels read ``delta`` rounded to fp16. That rounding error is the same for every
row of a group, so each output gains ``e_delta * sum(A over the group)``: it grows with
the activations' mean instead of averaging out as independent per-weight roundings do.
This prints the mean relative error against the exact float64 product, on a random
asymmetric layer (K 1536, N 384, groups of 128: the MiniLM-L6's FFN down projection)
and activations of mean 0, 1 and 3, for:

- the twin of each fp16 arithmetic (per-weight: ``fma(q - 8, s, fp16(delta))`` rounded
  to fp16 per weight; per-group: ``s * sum(A (q - 8)) + fp16(delta) * sum(A)`` in fp32),
- the per-group form with delta exact (what a kernel reading fp32 delta would give),
- the fp16-dequantized weight ``fp16((q - z) s)`` (marlin-verify --model's 16-bit reference).

    PYTHONPATH=$PWD python3 scripts/probe_delta_rounding.py
"""

from __future__ import annotations

import numpy as np

from converter.gpu import reference as ref
from converter.marlin.layout import pack_b, permute_scales

K, N, GS, M = 1536, 384, 128, 64


def rel_err(c: np.ndarray, exact: np.ndarray) -> float:
    return float(np.abs(np.asarray(c, dtype=np.float64) - exact).mean() / np.abs(exact).mean())


def main() -> None:
    rng = np.random.default_rng(0)
    g = K // GS
    q = rng.integers(0, 16, (K, N), dtype=np.uint8)
    s = (rng.uniform(0.5, 2.0, (g, N)) / 64).astype(np.float16)
    z = rng.integers(0, 16, (g, N))
    delta = (s.astype(np.float32) * (8 - z)).astype(np.float32)
    B, S = pack_b(q), permute_scales(s)
    rows = np.arange(K) // GS
    s64 = s.astype(np.float64)[rows]
    w_exact = (q.astype(np.float64) - z[rows]) * s64
    w_fp16 = w_exact.astype(np.float16).astype(np.float64)
    print("| A | per-weight, fp16 delta | per-group, fp16 delta | per-group, exact delta | fp16-dequantized |")
    print("|---|---|---|---|---|")
    for mean in (0.0, 1.0, 3.0):
        a16 = (mean + rng.standard_normal((M, K))).astype(np.float16)
        a = a16.astype(np.float64)
        exact = a @ w_exact
        kw = dict(size_k=K, size_n=N, group_size=GS, delta=delta)
        weight = rel_err(ref.marlin_gemm(a16, B, S, arith="weight", **kw), exact)
        group = rel_err(ref.marlin_gemm(a16, B, S, arith="group", **kw), exact)
        xsum = a.reshape(M, g, GS).sum(2)
        sym = a @ ((q.astype(np.float64) - 8) * s64)
        exact_delta = rel_err((sym + xsum @ delta.astype(np.float64)).astype(np.float16), exact)
        dequant = rel_err((a @ w_fp16).astype(np.float16), exact)
        print(f"| N({mean:g}, 1) | {weight:.2e} | {group:.2e} | {exact_delta:.2e} | {dequant:.2e} |")


if __name__ == "__main__":
    main()

"""Which bf16 weight forms the numerics bar allows, on the CPU (no GPU, no kernel).

Issue 40's bar: our bf16 GEMM's mean relative error against the exact product at most
1.2x that of cuBLAS bf16 given the weight rounded once to bf16. The per-weight kernels
meet it by forming ``RN_bf16((q - 8) s + d)`` in fp32, which costs fp32 ops and a
half-rate ``cvt.rn.bf16x2.f32`` a pair (docs/notes/bf16.md). Cheaper forms round
something else first; this prints what each costs in error, as the error table measures
it (scripts/gpu_error_table_bf16.py: its layer and scale distributions, mean|C - ref| /
mean|ref|, ref = A @ W in float64), with every product evaluated in float64 and rounded
to bf16 once (the kernels and cuBLAS accumulate in fp32; the difference is far below
the weight's rounding). Forms:

- ``exact``: ``RN((q - 8) s + d)``, the shipped per-weight form (the cuBLAS baseline's weight);
- ``s,d bf16``: ``RN((q - 8) RN(s) + RN(d))``, one ``fma.rn.bf16x2`` from scales and
  deltas rounded at load (what engines with bf16 scales multiply);
- ``zero, s bf16``: ``RN((q - z) RN(s))``, one ``mul.rn.bf16x2`` from integer zeros;
- ``via fp16``: ``RN_bf16(RN_fp16((q - 8) s + d))``, the fp16 kernels' weight converted.

    PYTHONPATH=$PWD python3 scripts/probe_bf16_weight_forms.py
"""

from __future__ import annotations

import numpy as np

from converter.dtypes import bf16_to_f32
from converter.gpu.reference_bf16 import round_bf16

K, N, GS = 4096, 1024, 128
Ms = (1, 16, 64, 256)


def rb(x: np.ndarray) -> np.ndarray:
    """float64 ``x`` rounded once to bf16, as float64."""
    return bf16_to_f32(round_bf16(x)).astype(np.float64)


def rel_err(a: np.ndarray, weight: np.ndarray, exact_weight: np.ndarray) -> float:
    """mean|RN_bf16(a @ weight) - a @ exact_weight| / mean|a @ exact_weight|."""
    exact = a @ exact_weight
    return float(np.abs(rb(a @ weight) - exact).mean() / np.abs(exact).mean())


def main() -> None:
    rng = np.random.default_rng(0)
    g = K // GS
    q = rng.integers(0, 16, (K, N))
    s = np.repeat((rng.uniform(0.5, 2.0, (g, N)) / 64).astype(np.float16).astype(np.float64), GS, 0)
    z = np.repeat(rng.integers(0, 16, (g, N)), GS, 0)
    d = (s * (8 - z)).astype(np.float16).astype(np.float64)  # the kernels read fp16(delta)
    w = (q - 8) * s + d
    forms = {
        "s,d bf16": rb((q - 8) * rb(s) + rb(d)),
        "zero, s bf16": rb((q - z) * rb(s)),
        "via fp16": rb(((q - 8) * s + d).astype(np.float16).astype(np.float64)),
    }
    base = rb(w)
    print(f"K {K}, N {N}, group {GS}: mean relative error over cuBLAS bf16's (bar 1.2)")
    print("| M | cuBLAS bf16 | " + " | ".join(forms) + " |")
    print("|---|---|" + "---|" * len(forms))
    for m in Ms:
        a = rb(rng.standard_normal((m, K)))
        e0 = rel_err(a, base, w)
        print(f"| {m} | {e0:.3e} | " + " | ".join(f"{rel_err(a, wf, w) / e0:.3f}" for wf in forms.values()) + " |")


if __name__ == "__main__":
    main()

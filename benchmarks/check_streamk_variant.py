#!/usr/bin/env python3
"""A variant of the persistent Hopper kernel against the NumPy twins, before it is timed
(needs an sm_90 GPU): ``ab_streamk_variants.py`` compares bits with the shipped kernel,
which a variant that sums in another order (``skg_producer_sums.patch``) changes by
design; this checks its outputs within ``gemm_error_bound``, in both activation types,
B unit-major as ``MarlinLinear`` keeps it and in Marlin's order, forced pipes of one kind,
ragged N, act-order, per-channel, symmetric and units cut into pieces (forced run lengths). Usage::

    PYTHONPATH=$PWD python3 benchmarks/check_streamk_variant.py \\
        docs/notes/streamk_variants/skg_producer_sums.patch SKG_XSUM=1 [hopper_skg|hopper_sk|hopper_skg64]

Prints one line a case and exits 1 when any output is outside the bound or NaN.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# m, k, n, group size, act-order, asymmetric, forced run length (None: the planner's),
# B unit-major (else Marlin's order)
CASES = (
    (1, 4096, 4096, 128, False, True, None, True),
    (8, 4096, 4096, 128, False, True, 3, True),
    (13, 2048, 1024, 128, True, True, 5, True),
    (16, 4096, 512, -1, False, True, 2, True),
    (17, 1024, 4096, 128, False, False, None, True),
    (24, 4096, 4096, 128, False, True, 7, True),
    (32, 8192, 1024, 256, False, True, 3, True),
    (29, 2048, 1280, 128, True, True, None, True),
    (32, 4096, 4096, 128, False, True, None, True),
    (64, 4096, 2048, 128, False, True, 5, True),
    (100, 2048, 1024, 128, True, True, None, True),
    (9, 2048, 1280, 128, False, True, 3, False),
    (31, 4096, 512, -1, True, True, None, False),
)
PIPES = {
    "hopper_skg": [("hopper_skg", r, 8, 6) for r in (1, 2, 3, 4)],
    "hopper_sk": [("hopper_sk", r, 8, 6) for r in (3, 4, 6, 8)],
    # the per-group kind up to 64 tokens a chunk (not in the catalog: ab_streamk_variants' ^ pipes)
    "hopper_skg64": [("hopper_skg", r, 8, 6) for r in (1, 2, 3, 4, 6, 8)],
}


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    import cupy as cp
    import numpy as np

    from benchmarks.ab_streamk_variants import allow_pipes, apply_patch, build
    from converter.dtypes import bf16_to_f32, f32_to_bf16
    from converter.gpu import build as gbuild
    from converter.gpu import kernels, launches
    from converter.gpu import reference as ref
    from converter.gpu import reference_bf16 as ref16
    from converter.gpu.plan import Pipe, Tuning
    from tests.helpers.kernel_layers import make_layer
    from tests.helpers.streamk_probe import route_streamk

    code = apply_patch((REPO / "kernels" / "marlin_streamk.cu").read_text(), Path(sys.argv[1]).read_text())
    defs = tuple("-D" + d for d in sys.argv[2].split(",") if d)
    pipes = PIPES[sys.argv[3] if len(sys.argv) > 3 else "hopper_skg"]
    names = sorted({Pipe.of(p).name(1, d) for p in pipes for d in (True, False)})
    allow_pipes(pipes)
    acts = ("float16", "bfloat16")
    mods = {a: build(code, defs + (("-DMARLIN_BF16",) if a == "bfloat16" else ()), names) for a in acts}
    current = {"act": acts[0]}
    route_streamk(gbuild, lambda name: mods[current["act"]].get_function(name))
    bad_total = 0
    for act in acts:
        current["act"] = act
        launches._gemm_launch.cache_clear()
        launches._plan.cache_clear()
        twin = ref16 if act == "bfloat16" else ref
        for m, k, n, gs, act_order, asym, iters, unit_major in CASES:
            pipe = next((p for p in pipes if 8 * p[1] >= m), pipes[-1])
            rng = np.random.default_rng([m, k, n, 7])
            L = make_layer(rng, k, n, gs, act_order, asym)
            a32 = rng.standard_normal((m, k)).astype(np.float32)
            a = f32_to_bf16(a32) if act == "bfloat16" else a32.astype(np.float16)
            B = cp.asarray(L["B"])
            dev = {key: None if L[key] is None else cp.asarray(L[key]) for key in ("delta", "perm", "bias")}
            kw = dict(size_k=k, size_n=n, group_size=gs)
            tuning = Tuning(streamk_iters=iters) if iters else Tuning()
            units = kernels.prepare_b_units(B, k, n) if unit_major else None
            got = kernels.marlin_gemm(
                cp.asarray(a), B, cp.asarray(L["S"]), **kw, **dev, pipe=pipe, b_units=units, tuning=tuning, act=act
            )
            got = cp.asnumpy(got)
            plan = kernels.gemm_plan(m, k, n, gs, delta=asym, pipe=pipe, tuning=tuning, act=act)
            host = dict(delta=L["delta"], perm=L["perm"], bias=L["bias"], arith=plan.arith)
            want = twin.marlin_gemm(a, L["B"], L["S"], **kw, **host)
            as64 = (
                (lambda x: bf16_to_f32(x).astype(np.float64)) if act == "bfloat16" else (lambda x: x.astype(np.float64))
            )
            diff = np.abs(as64(got) - as64(want))
            bound = twin.gemm_error_bound(a, L["B"], L["S"], **kw, **host, splits=plan.splits * plan.wk)
            bad = int((diff > bound).sum()) + int(np.isnan(diff).sum())
            bad_total += bad
            worst = float(np.nanmax(diff / bound))
            print(
                f"{act} M={m} K={k} N={n} group={gs} act_order={act_order} asym={asym} iters={iters} "
                f"unit_major={unit_major} "
                f"{plan.kind.value} T={8 * pipe[1]}: {bad} out of bound, worst {worst:.3f} of it",
                flush=True,
            )
    print(f"{bad_total} outputs out of bound")
    return 1 if bad_total else 0


if __name__ == "__main__":
    sys.exit(main())

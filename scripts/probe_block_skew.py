#!/usr/bin/env python3
"""How unevenly the persistent Hopper GEMM's blocks finish (needs an H200 or another sm_90 GPU).

Builds the timeline copy of ``kernels/marlin_streamk.cu`` (tests/helpers/streamk_probe.py,
``%globaltimer`` stamps per block) with one more stamp, the multiprocessor a block ran on
(``%smid``), and runs the planner's own call of each row, B as ``MarlinLinear`` keeps it,
``--reps`` times (each time a burst of back-to-back calls; the last call's stamps stay).
Prints, per row, the median time a block's consumers finish their last stage, how far the
slowest block is behind it in each call, how well the blocks' lateness in the even calls
predicts the odd calls' (1: the same blocks are late every time), and the run's blocks
by the number of unit pieces they hold (a stream-K run that crosses two unit boundaries
has three) with their mean lateness.

Usage: PYTHONPATH=$PWD python3 scripts/probe_block_skew.py K:N:M,... [--reps 12] [--json-out FILE]
The numbers in docs/notes/perf_notes.md (2026-12-03T17:58Z) and
benchmarks/results/h200/streamk_block_skew_h200.json (a summary of its output) came from a development copy
of this script, with the same patch.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (HERE, REPO):  # run as a plain script from a fresh checkout
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

SMID_ANCHOR = "    if (tid == 0) STAMP(0);\n"
SMID_STAMP = (
    "    if (tid == 0) {\n        STAMP(0);\n        unsigned sm_;\n"
    '        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm_));\n        probe_ts[blockIdx.x][7] = sm_;\n    }\n'
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", help="K:N:M,... (group 128, fused path)")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    import cupy as cp
    import numpy as np

    from converter.gpu import build, kernels
    from converter.gpu.plan import Pipe
    from tests.helpers.streamk_probe import instrumented_source, persistent_cases, random_layers, route_streamk

    try:
        pipes = persistent_cases(args.shapes)
    except ValueError as exc:
        ap.error(str(exc))
    folder = build.kernel_dir()
    code = instrumented_source(folder)
    assert code.count(SMID_ANCHOR) == 1, "the timeline's entry stamp moved"
    code = code.replace(SMID_ANCHOR, SMID_STAMP)
    names = sorted({Pipe.of(p).name(1, True) for p in pipes.values()})
    mod = cp.RawModule(
        code=code,
        options=("-std=c++17", "--gpu-architecture=sm_90a", f"-I{folder}", "-DPROBE_TS"),
        name_expressions=names,
    )
    restore = route_streamk(build, mod.get_function)
    rng = np.random.default_rng(0)
    results: dict = {"rows": {}}
    for k, n, m in pipes:
        layers = random_layers(cp, rng, k, n, unit_major=kernels.keeps_b_units(k, n, 128))
        a = cp.asarray(rng.normal(0, 1, (m, k)).astype(np.float16))
        out = cp.empty((m, n), cp.float16)
        kw = dict(size_k=k, size_n=n, group_size=128, out=out)
        calls = [partial(kernels.marlin_gemm, a, **layers[i % len(layers)], **kw) for i in range(2 * len(layers))]
        plan = kernels.gemm_plan(m, k, n, 128, delta=True)
        stamps = cp.ndarray((1024, 8), cp.uint64, memptr=mod.get_global("probe_ts"))
        done = []
        for _ in range(args.reps):
            stamps.fill(0)
            for f in calls:
                f()
            cp.cuda.runtime.deviceSynchronize()
            h = stamps.get().astype(np.int64)[: plan.blocks]
            done.append((h[:, 3] - h[:, 0].min()) / 1e3)  # consumers' last stage done, us from the first entry
        L = np.array(done)
        late = (L - np.median(L, axis=1, keepdims=True)).mean(0)
        stages, iters = k // 16 // plan.u, plan.tiles_per_split // plan.u
        total = plan.m_chunks * -(-(n // 64) // 4) * stages
        whole = [(b + 1) * iters <= total for b in range(plan.blocks)]  # the last run may be shorter
        pieces = [len({s // stages for s in range(b * iters, min((b + 1) * iters, total))}) for b in range(plan.blocks)]
        by_pieces = {
            str(p): float(np.mean([late[b] for b in range(plan.blocks) if pieces[b] == p and whole[b]]))
            for p in sorted(set(pieces))
            if any(pieces[b] == p and whole[b] for b in range(plan.blocks))
        }
        corr = float(np.corrcoef(L[0::2].mean(0), L[1::2].mean(0))[0, 1]) if args.reps > 2 else float("nan")
        row = {
            "blocks": plan.blocks,
            "loop_done_median_us": float(np.median(L)),
            "max_minus_median_us": [float(v) for v in (L.max(1) - np.median(L, axis=1))],
            "block_split_half_corr": corr,
            "mean_lateness_us_by_pieces": by_pieces,
        }
        results["rows"][f"{k}x{n}:{m}"] = row
        print(
            f"{k}x{n} M={m}: {plan.blocks} blocks, last stage done at {row['loop_done_median_us']:.2f} us (median); "
            f"slowest - median {np.median(row['max_minus_median_us']):.2f} us; split-half corr {corr:.2f}; "
            f"lateness by pieces { ({p: round(v, 2) for p, v in by_pieces.items()}) }",
            flush=True,
        )
        del layers, calls
        cp.get_default_memory_pool().free_all_blocks()
    restore()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

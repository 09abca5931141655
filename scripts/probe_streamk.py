#!/usr/bin/env python3
"""Where a persistent Hopper GEMM call spends its time (needs an H200 or another sm_90 GPU).

Builds instrumented copies of ``kernels/marlin_streamk.cu`` (the shipped source, patched
in memory; each patch asserts that its anchor text is still there) and runs them through
``kernels.marlin_gemm`` on the planner's own plans:

* ``--variants``: the kernel with parts of its work removed, timed like
  ``benchmarks/bench_gemm.py`` (a CUDA graph of 16 back-to-back calls over weight copies
  past 2 x the L2, median us per call; each variant twice, in A B B A order):
  ``base`` (unchanged), ``noload`` (the producer copies nothing: the consumers' work and
  the skeleton), ``nodq_nomma`` (no dequantization, no ``wgmma``: the operand stream and
  the skeleton), ``none`` (neither: the skeleton alone). The removed ``wgmma`` leave an
  XOR and an add per k-tile behind so that the compiler keeps the rest.
* ``--timeline``: the unchanged kernel (and the ``none`` variant) with ``%globaltimer``
  stamps per block: entry, after setup, the first stage's operands landed, the producer's
  last issue, the consumers' last stage done, the split-sum fix-up done, exit. Printed as
  median / max over the blocks in us from the earliest entry, for the last of several
  back-to-back calls.

The numbers in docs/notes/perf_notes.md ("A call's timeline, the fix-up's fences, unit-major
B measured", 2026-12-03) came from this script's development copy, with the same patches;
the script itself was then run on the H200 in both modes.

Usage: PYTHONPATH=$PWD python3 scripts/probe_streamk.py (--variants | --timeline)
           [--shapes K:N:M,...] [--json-out FILE]
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--variants", action="store_true", help="time base / noload / nodq_nomma / none")
    mode.add_argument("--timeline", action="store_true", help="per-block %%globaltimer stamps of one call")
    ap.add_argument(
        "--shapes",
        default="8192:57344:1,28672:8192:1,4096:14336:1,8192:8192:1,8192:57344:16,8192:57344:64,4096:14336:64",
        help="K:N:M,... (group 128, fused path)",
    )
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()

    import cupy as cp
    import numpy as np

    from benchmarks.bench_gemm import timed_graph
    from converter.gpu import build, kernels
    from converter.gpu.plan import Pipe
    from tests.helpers.streamk_probe import (
        STAMP_NAMES,
        VARIANTS,
        instrumented_source,
        persistent_cases,
        random_layers,
        route_streamk,
    )

    try:
        pipes = persistent_cases(args.shapes)
    except ValueError as exc:
        ap.error(str(exc))
    names = sorted({Pipe.of(p).name(1, True) for p in pipes.values()})
    folder = build.kernel_dir()
    code = instrumented_source(folder)
    wanted = ["base", "noload", "nodq_nomma", "none"] if args.variants else ["base", "none"]
    mods = {}
    for v in wanted:
        extra = VARIANTS[v] + (("-DPROBE_TS",) if args.timeline else ())
        mods[v] = cp.RawModule(
            code=code,
            options=("-std=c++17", "--gpu-architecture=sm_90a", f"-I{folder}", *extra),
            name_expressions=names,
        )
        for n in names:
            mods[v].get_function(n)
    current = {"v": "base"}
    restore = route_streamk(build, lambda name: mods[current["v"]].get_function(name))
    rng = np.random.default_rng(0)
    results: dict = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "rows": {}}
    for k, n, m in pipes:
        layers = random_layers(cp, rng, k, n, unit_major=False)  # B in Marlin's order, as these runs always were
        copies = len(layers)
        a = cp.asarray(rng.normal(0, 1, (m, k)).astype(np.float16))
        out = cp.empty((m, n), cp.float16)
        kw = dict(size_k=k, size_n=n, group_size=128, out=out)
        calls = [partial(kernels.marlin_gemm, a, **layers[i % copies], **kw) for i in range(16)]
        row: dict = {"pipe": [str(x.value) if hasattr(x, "value") else x for x in pipes[(k, n, m)]]}
        if args.variants:
            times: dict = {}
            for order in (wanted, wanted[::-1]):
                for v in order:
                    current["v"] = v
                    times.setdefault(v, []).append(timed_graph(cp, calls, 7))
            row["us"] = {v: float(np.mean(t)) for v, t in times.items()}
            print(
                f"{k}x{n} M={m} {row['pipe']}: " + "  ".join(f"{v} {t:.1f}" for v, t in row["us"].items()), flush=True
            )
        else:
            for v in wanted:
                current["v"] = v
                graph_us = timed_graph(cp, calls, 7)
                stamps = cp.ndarray((1024, 8), cp.uint64, memptr=mods[v].get_global("probe_ts"))
                stamps.fill(0)
                stream = cp.cuda.Stream(non_blocking=True)
                with stream:
                    for f in calls[:copies]:  # back to back: the last call's stamps stay
                        f()
                stream.synchronize()
                h = stamps.get().astype(np.int64)
                h = h[h[:, 0] > 0]
                if not len(h):  # no block stamped its entry: say so rather than stop the other rows
                    row[v] = {"graph_us": graph_us, "blocks": 0}
                    print(f"{k}x{n} M={m} {row['pipe']} {v}: {graph_us:.1f} us a call, no stamps", flush=True)
                    continue
                rel = (h - h[:, 0].min()) / 1e3
                rel[h == 0] = np.nan  # a block that parked its last piece never reaches the fix-up stamp
                row[v] = {"graph_us": graph_us, "blocks": int(len(h))}
                for slot, name in STAMP_NAMES.items():
                    col = rel[:, slot][~np.isnan(rel[:, slot])]
                    row[v][name] = [float(np.median(col)), float(col.max())] if len(col) else None
                print(
                    f"{k}x{n} M={m} {row['pipe']} {v}: {graph_us:.1f} us a call, {len(h)} blocks; median / max us: "
                    + " ".join(
                        f"{nm} {row[v][nm][0]:.2f}/{row[v][nm][1]:.2f}" for nm in STAMP_NAMES.values() if row[v][nm]
                    ),
                    flush=True,
                )
        results["rows"][f"{k}x{n}:{m}"] = row
        del layers, calls
        cp.get_default_memory_pool().free_all_blocks()
    restore()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

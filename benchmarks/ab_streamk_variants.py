#!/usr/bin/env python3
"""A/B of variants of the persistent Hopper kernel, timed in one run (needs an sm_90 GPU).

Each variant is the shipped ``kernels/marlin_streamk.cu``, or that file with a unified diff
applied (``docs/notes/streamk_variants/*.patch``), with optional ``-D`` defines and an optional
forced run length (``Tuning.streamk_iters``). Every variant is built side by side from the
names the planner picks for the rows (in parallel processes, which also fills CuPy's disk
cache), then each row is timed as ``benchmarks/bench_gemm.py`` times ours: 16 calls in one
CUDA graph rotating over weight copies past 3 x 60 MB, B unit-major as ``MarlinLinear``
keeps it, fused path, group 128, 7 replays, the median per call; the variants in the order
A B .. B A, twice, and the mean of the four medians. ``same`` says whether a variant's
output has the first variant's bits (it should, unless the arithmetic or the split-K
order changed). Usage::

    PYTHONPATH=$PWD python3 benchmarks/ab_streamk_variants.py 8192:57344:1,28672:8192:64 out.json \\
        main=- deep=docs/notes/streamk_variants/deep_wgmma_queue.patch \\
        deep_gs=docs/notes/streamk_variants/deep_wgmma_queue.patch:GS_DEPTH=8 \\
        i55=-@55

``--bf16`` first: every variant built with ``-DMARLIN_BF16`` and timed on bf16 activations
(the routes bf16's knobs give; ``same`` then compares bf16 bits).

A variant is ``NAME=SOURCE[:DEF,DEF..][@ITERS][%THREADS][^KIND.R.U.NS]``, SOURCE ``-`` for the
shipped kernel or a diff of that one file (it is compiled against the shipped headers: a diff
that needs new helpers carries them); THREADS launches its blocks with that many threads
instead of the shipped 384 (``streamk_variants/four_consumer_warpgroups.patch:SK_WG4=1%640``);
``^KIND.R.U.NS`` forces that pipe on every row instead of the planner's (a form the route
table does not give, e.g. ``^hopper_skg.8.8.6``, the per-group kind at 64 tokens a chunk).
Limits: rows the planner gives the persistent kinds only (a decode or tile row has no
``marlin_streamk`` name to build), group 128, B unit-major always, one block per
multiprocessor (``streamk_variants/two_blocks_per_sm.patch`` needs two, so it is a ptxas
check, not a variant to time here).
Results: docs/notes/perf_notes.md (2026-12-03T18:30Z section).
"""

from __future__ import annotations

import json
import multiprocessing
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
KERNEL = REPO / "kernels" / "marlin_streamk.cu"
HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+\d+(?:,\d+)? @@")


def apply_patch(source: str, patch: str) -> str:
    """``source`` with every hunk of the unified diff ``patch`` applied; each hunk's old
    lines must occur exactly once (our variants are small diffs of one file)."""
    hunks: list[tuple[list[str], list[str]]] = []
    for line in patch.splitlines():
        if HUNK.match(line):
            hunks.append(([], []))
        elif hunks and line[:1] in (" ", "-", "+", ""):
            old, new = hunks[-1]
            body = line[1:]
            if line[:1] in (" ", ""):
                old.append(body)
                new.append(body)
            elif line[0] == "-":
                old.append(body)
            else:
                new.append(body)
    text = "\n" + source  # whole lines only: every hunk starts after a newline
    for old, new in hunks:
        a, b = "\n" + "\n".join(old) + "\n", "\n" + "\n".join(new) + "\n"
        if text.count(a) != 1:
            raise SystemExit(f"patch hunk does not match the kernel exactly once: {old[:2]!r}")
        text = text.replace(a, b)
    return text[1:]


def parse(spec: str) -> tuple[str, str, tuple[str, ...], int | None, int | None, tuple | None]:
    name, rest = spec.split("=", 1)
    rest, _, forced = rest.partition("^")
    pipe = None
    if forced:
        kind, *rest_nums = forced.split(".")
        pipe = (kind, *(int(v) for v in rest_nums))
        if len(pipe) != 4:
            raise SystemExit(f"{spec}: a forced pipe is KIND.R.U.NS, e.g. hopper_skg.8.8.6")
    rest, _, threads = rest.partition("%")
    rest, _, iters = rest.partition("@")
    src, _, defs = rest.partition(":")
    code = KERNEL.read_text() if src == "-" else apply_patch(KERNEL.read_text(), Path(src).read_text())
    defines = tuple("-D" + d for d in defs.split(",") if d)
    return name, code, defines, int(iters) if iters else None, int(threads) if threads else None, pipe


def build(code: str, defines: tuple[str, ...], names: list[str]):
    import cupy as cp

    from converter.gpu import build as gbuild

    options = ("-std=c++17", "--gpu-architecture=sm_90a", f"-I{gbuild.kernel_dir()}", *defines)
    mod = cp.RawModule(code=code, options=options, name_expressions=names)
    for n in names:
        mod.get_function(n)
    return mod


def allow_pipes(pipes: list[tuple]) -> None:
    """Let the launcher take forced pipes the catalog does not build (``hopper_skg`` at 48
    or 64 tokens): their kernels come from the variants' own modules, built from ``names``."""
    from converter.gpu.plan import Pipe, catalog

    extra = tuple(p for p in {Pipe.of(f) for f in pipes} if p not in catalog.GEMM_PIPES)
    if extra:
        print(f"forced pipes outside the catalog: {', '.join(map(str, extra))}", file=sys.stderr, flush=True)
        catalog.GEMM_PIPES = catalog.GEMM_PIPES + extra


def _warm(args) -> None:
    build(*args)


def main() -> int:
    argv = sys.argv[1:]
    act = "bfloat16" if argv[:1] == ["--bf16"] else "float16"
    argv = argv[1:] if act == "bfloat16" else argv
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    from converter.dtypes import f32_to_bf16
    from converter.gpu.plan import DEFAULT_TUNING, Pipe, Tuning
    from tests.helpers.streamk_probe import persistent_cases, random_layers, route_streamk

    try:
        pipes = persistent_cases(argv[0], DEFAULT_TUNING.for_act(act))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    out_json = argv[1]
    bf16_define = ("-DMARLIN_BF16",) if act == "bfloat16" else ()
    parsed = [parse(spec) for spec in argv[2:]]
    variants = {name: (code, defs + bf16_define, iters) for name, code, defs, iters, _, _ in parsed}
    threads = {name: t for name, _, _, _, t, _ in parsed}
    forced = {name: f for name, *_, f in parsed}
    names = sorted({Pipe.of(p).name(1, True) for p in [*pipes.values(), *(f for f in forced.values() if f)]})
    allow_pipes([f for f in forced.values() if f])
    sources = {(code, defs) for code, defs, _ in variants.values()}
    print(f"building {len(names)} kernel(s) in {len(sources)} form(s): {', '.join(names)}", file=sys.stderr, flush=True)
    # NVRTC in parallel (CuPy caches the cubins); spawned, so no child inherits a CUDA context
    with ProcessPoolExecutor(len(sources), mp_context=multiprocessing.get_context("spawn")) as ex:
        list(ex.map(_warm, [(code, defs, names) for code, defs in sources]))
    import cupy as cp
    import numpy as np

    from benchmarks.bench_gemm import timed_graph
    from converter.gpu import build as gbuild
    from converter.gpu import kernels as K
    from converter.gpu import launches
    from converter.gpu.plan import catalog

    shipped_threads = catalog.STREAMK_THREADS

    mods = {v: build(code, defs, names) for v, (code, defs, _) in variants.items()}
    current: dict = {"v": None}
    served: dict[str, set[str]] = {v: set() for v in variants}

    def lookup(name: str) -> object:
        served[current["v"]].add(name)
        return mods[current["v"]].get_function(name)

    def use(v: str) -> None:
        # A launch keeps its kernel (launches' caches, keyed by sizes and tuning, not by
        # variant): without this every variant after the first ran the first one's.
        current["v"] = v
        # the launch takes its block size from the catalog's constant at each plan
        catalog.STREAMK_THREADS = threads[v] or shipped_threads
        launches._gemm_launch.cache_clear()
        launches._plan.cache_clear()

    route_streamk(gbuild, lookup)
    tunings = {v: Tuning(streamk_iters=it) if it else Tuning() for v, (_, _, it) in variants.items()}
    rng = np.random.default_rng(0)
    order, results = list(variants), {}
    for k, n, m in pipes:
        layers = random_layers(cp, rng, k, n, unit_major=True)
        a32 = rng.normal(0, 1, (m, k)).astype(np.float32)
        a = cp.asarray(f32_to_bf16(a32) if act == "bfloat16" else a32.astype(np.float16))
        out = cp.empty((m, n), a.dtype)
        kw = dict(size_k=k, size_n=n, group_size=128, act=act)
        calls = max(16, len(layers))
        thunks = {
            v: [
                partial(K.marlin_gemm, a, **layers[i % len(layers)], out=out, tuning=tunings[v], pipe=forced[v], **kw)
                for i in range(calls)
            ]
            for v in order
        }
        ref, same = None, {}
        for v in order:
            print(f"{k} x {n} M={m}: first call of {v}", file=sys.stderr, flush=True)
            use(v)
            got = K.marlin_gemm(a, **layers[0], tuning=tunings[v], pipe=forced[v], **kw)
            bits = got.view(cp.uint16).copy()
            ref = bits if ref is None else ref
            same[v] = bool(cp.array_equal(bits, ref))
        runs: dict[str, list[float]] = {v: [] for v in order}
        for rep in range(4):
            for v in order if rep % 2 == 0 else order[::-1]:
                use(v)
                runs[v].append(timed_graph(cp, thunks[v], 7))
        mean = {v: float(np.mean(r)) for v, r in runs.items()}
        plans = {}
        for v in order:
            use(v)  # the plan counts the variant's own registers
            p = K.gemm_plan(m, k, n, 128, delta=True, tuning=tunings[v], act=act, pipe=forced[v])
            plans[v] = {
                "kind": p.kind.value,
                "rows": p.rows,
                "blocks": p.blocks,
                "iters": p.tiles_per_split // p.u,
                "pieces": p.splits,
            }
        results[f"{k}x{n}:{m}"] = {"us": mean, "runs": runs, "bitwise_same": same, "plans": plans}
        base = mean[order[0]]
        print(
            f"{k} x {n} M={m}: "
            + "  ".join(f"{v} {t:.2f} ({100 * (t / base - 1):+.1f}%)" for v, t in mean.items())
            + "  same "
            + "".join("Y" if s else "N" for s in same.values()),
            flush=True,
        )
        del layers, thunks
        cp.get_default_memory_pool().free_all_blocks()
    idle = [v for v, got in served.items() if not got]
    Path(out_json).write_text(
        json.dumps({"argv": sys.argv[1:], "act": act, "results": results, "never_ran": idle}, indent=1)
    )
    if idle:  # the guard against a cache that keeps serving one variant's kernel
        print(f"variants {', '.join(idle)} never ran their own kernel: their timings are the others'", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

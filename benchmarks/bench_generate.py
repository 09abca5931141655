#!/usr/bin/env python3
"""End-to-end decode and prefill of a Llama-3-8B-shaped model: our converted GPTQ
w4g128 model against the same config in fp16, both under one treatment (issue 38).

On the GPU machine (one command, well under 10 minutes in graph mode)::

    PYTHONPATH=$PWD python3 benchmarks/bench_generate.py --json $OUT/bench_generate.json
    PYTHONPATH=$PWD python3 benchmarks/bench_generate.py --mode compile --only fp16 --json $OUT/c16.json
    PYTHONPATH=$PWD python3 benchmarks/bench_generate.py --merge $OUT/c16.json $OUT/cours.json   # one table

On the CPU (a smoke test of every phase at tiny sizes)::

    python3 benchmarks/bench_generate.py --device cpu --blocks 2 --hidden 256 --intermediate 512 --kv 128 \\
        --head-dim 64 --vocab 512 --batches 1,2 --prompt 8 --new 8 --prefill 32 --mode both --repeats 1

What it does:

1. The model: ``tests.helpers.synthetic_gptq.write_gptq`` (hidden 4096, intermediate 14336,
   kv 1024, 32 blocks, vocab 32000, group 128, asymmetric, scales in ``FINITE_SCALE_RANGE``
   so that its activations stay finite in fp16; ``prefill_logits_finite`` records it) with a complete Llama attention
   config (``llama_attention_config``: 32/8 heads of 128, untied fp16 head, fp16), then
   ``converter.convert(src, out/)``. Kept in ``--work`` (``done.json`` marks a finished
   conversion of the same config; the source is deleted after converting).
2. The copy bandwidth: a large device-to-device copy, bytes read + written.
3. For each model (``fp16``: ``AutoModelForCausalLM.from_config`` with random fp16 weights
   on the device; ``ours``: ``converter.load_model(out, device)``), each mode and batch:
   prefill ``--prompt`` random tokens eagerly into a ``StaticCache`` of ``prompt + new``,
   then ``new - 1`` decode steps (``benchmarks/decode_loop.py``: ``graph`` = the step captured
   once with ``torch.cuda.graph`` and replayed; ``compile`` = the step under
   ``torch.compile(fullgraph=True, mode=--compile-mode)``, then captured the same way;
   ``eager`` = no graph), ``--repeats`` times from the same prefilled state; CUDA events
   around every step, median. Then the standalone fp16 ``lm_head`` at that batch, and
   ``torch.profiler`` over ``--profile-steps`` replayed steps (un-captured steps when the
   replay shows too few kernels) split into linears and the rest by kernel name.
4. Prefill of one ``--prefill``-token prompt (eager, static cache, median of 5), and the
   peak memory (torch's allocator, reset between models, and CuPy's pool).
5. The table: measured ratio fp16/ours beside the issue's target and beside the ratio the
   linears' bytes at the measured bandwidth plus the measured non-linear time allow.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a plain script from a fresh checkout
    sys.path.insert(0, str(REPO))

#: Issue 38's decode targets (fp16 ms / ours ms) by batch, and the prefill bound (ours / fp16).
TARGETS = {1: 2.5, 8: 2.4, 32: 2.0, 64: 1.5}
PREFILL_TARGET = 1.25
MODELS = ("fp16", "ours")
#: Extra models ``--with`` adds (timed, printed beside ``ours``; the rows stay fp16 vs ours).
EXTRA_MODELS = ("ours-unfused",)
#: Kernel classes, tried in this order: our CuPy kernels, attention, GEMMs (cuBLAS,
#: cuBLASLt, CUTLASS, inductor's mm templates), everything else.
ATTENTION_RE = re.compile(r"fmha|flash|attention|attn|sdpa", re.I)
GEMM_RE = re.compile(r"gemm|gemv|cutlass|cublas|xmma|nvjet|splitkreduce|triton_tem", re.I)
OUR_PREFIXES = ("marlin", "hopper")


# --------------------------------------------------------------------------- pure arithmetic


def our_kernel_names(folder: Path = REPO / "kernels") -> frozenset[str]:
    """Every ``__global__`` function name in ``kernels/*.cu`` (launched through CuPy)."""
    names = set()
    for path in sorted(folder.glob("*.cu*")):
        text = path.read_text()
        for m in re.finditer(r"__global__\s+void\s+", text):
            rest = text[m.end() :]
            if rest.startswith("__launch_bounds__"):
                depth, i = 0, len("__launch_bounds__")
                for i in range(len("__launch_bounds__"), len(rest)):
                    depth += {"(": 1, ")": -1}.get(rest[i], 0)
                    if depth == 0:
                        break
                rest = rest[i + 1 :]
            name = re.match(r"\s*(\w+)", rest)
            if name:
                names.add(name.group(1))
    return frozenset(names)


OUR_KERNELS = our_kernel_names()


def kernel_class(name: str) -> str:
    """``ours``, ``attention``, ``gemm`` or ``other`` for a device kernel's (demangled) name."""
    base = re.match(r"(?:void\s+)?([\w:]+)", name.strip())
    ident = base.group(1).split("::")[-1] if base else ""
    if ident in OUR_KERNELS or ident.startswith(OUR_PREFIXES):
        return "ours"
    if ATTENTION_RE.search(name):
        return "attention"
    if GEMM_RE.search(name):
        return "gemm"
    return "other"


def split_profile(kernels: list[tuple[str, float]], *, steps: int, lm_head_ms: float | None, model: str) -> dict:
    """Per-step GPU ms of a profile ``[(kernel name, us)]`` over ``steps`` decode steps.

    ``linear_ms``: our kernels (``ours``), or the fp16 GEMMs less the ``lm_head``'s
    standalone time (``fp16``); ``outside_ms``: everything else, the ``lm_head`` included.
    """
    per = {c: 0.0 for c in ("ours", "attention", "gemm", "other")}
    for name, us in kernels:
        per[kernel_class(name)] += us / 1e3 / steps
    total = sum(per.values())
    if model == "ours":
        linear = per["ours"]
    else:
        linear = max(0.0, per["gemm"] - (lm_head_ms or 0.0))
    return {
        "total_ms": total,
        "linear_ms": linear,
        "outside_ms": total - linear,
        "by_class_ms": per,
        "lm_head_ms": lm_head_ms,
    }


def linear_shapes(*, hidden: int, intermediate: int, kv: int, blocks: int) -> list[tuple[int, int]]:
    """``(K, N)`` of every quantized linear (q, k, v, o, gate, up, down per block); not the lm_head."""
    block = [(hidden, hidden), (hidden, kv), (hidden, kv), (hidden, hidden)]
    block += [(hidden, intermediate), (hidden, intermediate), (intermediate, hidden)]
    return block * blocks


def linear_bytes(shapes: list[tuple[int, int]], *, batch: int, kind: str, group_size: int) -> int:
    """Bytes the linears of one decode step must move: weights (fp16; or 4-bit codes plus an
    fp16 scale and an fp16 delta per group and column), plus fp16 activations in and out."""
    total = 0
    for k, n in shapes:
        if kind == "fp16":
            weights = 2 * k * n
        else:
            weights = k * n // 2 + 2 * 2 * (-(-k // group_size)) * n
        total += weights + 2 * batch * (k + n)
    return total


def limit_row(batch: int, fp16: dict, ours: dict, *, bandwidth_gbps: float | None, bytes_: dict) -> dict:
    """One decode row: the measured ratio, the target, and the byte-limit arithmetic."""
    f, o = fp16.get("ms_median"), ours.get("ms_median")
    row: dict[str, Any] = {"batch": batch, "fp16_ms": f, "ours_ms": o, "target": TARGETS.get(batch)}
    row["ratio"] = f / o if f and o else None
    fn = (fp16.get("profile") or {}).get("outside_ms")
    on = (ours.get("profile") or {}).get("outside_ms")
    row.update(fp16_nonlinear_ms=fn, ours_nonlinear_ms=on, lm_head_ms=ours.get("lm_head_ms") or fp16.get("lm_head_ms"))
    row.update(fp16_linear_bytes=bytes_["fp16"], ours_linear_bytes=bytes_["ours"])
    if bandwidth_gbps and on is not None:
        ours_min = bytes_["ours"] / (bandwidth_gbps * 1e9) * 1e3
        fp16_min = bytes_["fp16"] / (bandwidth_gbps * 1e9) * 1e3
        row.update(ours_linear_min_ms=ours_min, fp16_linear_min_ms=fp16_min, ours_best_ms=ours_min + on)
        if f:
            row["limit_ratio"] = f / (ours_min + on)
            row["limit_ratio_90"] = 0.9 * row["limit_ratio"]
        if fn is not None:
            row["limit_ratio_bytes"] = (fp16_min + fn) / (ours_min + on)
    goal = [x for x in (row["target"], row.get("limit_ratio_90")) if x is not None]
    row["goal"] = min(goal) if goal else None
    if row["ratio"] is not None and row["goal"] is not None:
        row["met"] = row["ratio"] >= row["goal"] and row["ratio"] >= 1.0
    return row


# --------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from benchmarks.decode_loop import DEFAULT_COMPILE_MODE

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", type=Path, help="write every measurement here (rewritten after each phase)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "marlin-bench-generate")
    ap.add_argument("--regenerate", action="store_true", help="rewrite and reconvert the checkpoint even if done")
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--kv", type=int, default=1024, help="k/v_proj width (kv heads x head dim)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128, help="new tokens: 1 from the prefill, new - 1 decode steps")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--mode", default="graph", help="graph | compile | both (graph,compile) | eager, or a comma list")
    ap.add_argument("--compile-mode", default=DEFAULT_COMPILE_MODE, help="torch.compile mode ('default' for none)")
    ap.add_argument("--only", choices=MODELS + EXTRA_MODELS)
    ap.add_argument(
        "--with",
        dest="extra",
        default="",
        help="also time these (comma list): ours-unfused = ours with MARLIN_FUSE off (every layer its own kernel)",
    )
    ap.add_argument(
        "--dtype",
        choices=("float16", "bfloat16"),
        default="float16",
        help="activations of both models (the dense row's weights too; ours keeps its operands)",
    )
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--skip-profile", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="passes over the decode steps from one prefill")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument(
        "--attn",
        default=None,
        help="attn_implementation for both models (transformers' default); sdpa_kv_heads:\n"
        "converter.model.attention, a decode step's query heads folded onto the kv heads",
    )
    ap.add_argument("--merge", nargs="+", type=Path, help="merge earlier --json files, print their table, exit")
    a = ap.parse_args(argv)
    a.batch_list = [int(b) for b in a.batches.split(",") if b]
    modes = {"both": "graph,compile"}.get(a.mode, a.mode)
    a.modes = [m for m in modes.split(",") if m]
    bad = [m for m in a.modes if m not in ("eager", "graph", "compile")]
    if bad:
        ap.error(f"unknown --mode {','.join(bad)}")
    extra = [m for m in a.extra.split(",") if m]
    bad = [m for m in extra if m not in EXTRA_MODELS]
    if bad:
        ap.error(f"unknown --with {','.join(bad)}")
    a.models = [a.only] if a.only else list(MODELS) + extra
    if a.compile_mode == "default":
        a.compile_mode = None
    return a


# --------------------------------------------------------------------------- the checkpoint


def config_extra(a: argparse.Namespace) -> dict[str, Any]:
    from tests.helpers.synthetic_gptq import llama_attention_config

    max_pos = max(8192, a.prompt + a.new, a.prefill)
    return llama_attention_config(a.hidden, a.kv, head_dim=a.head_dim, max_position_embeddings=max_pos)


def ensure_checkpoint(a: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    """The converted folder (made, or reused when ``done.json`` says it is this config's)."""
    from converter import convert
    from tests.helpers.synthetic_gptq import FINITE_SCALE_RANGE, write_gptq

    extra = config_extra(a)
    tag = f"llama-h{a.hidden}-i{a.intermediate}-kv{a.kv}-hd{a.head_dim}-b{a.blocks}-v{a.vocab}-g{a.group_size}"
    root = a.work / tag
    out, done = root / "out", root / "done.json"
    if not a.regenerate and done.is_file() and (out / "config.json").is_file():
        info = json.loads(done.read_text())
        if info.get("config_extra") == extra and info.get("scale_range") == list(FINITE_SCALE_RANGE):
            return out, {**info, "reused": True}
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    t0 = time.perf_counter()
    shape = dict(hidden=a.hidden, intermediate=a.intermediate, kv=a.kv, blocks=a.blocks, vocab=a.vocab)
    written = write_gptq(
        root / "src",
        **shape,
        shards=max(1, a.blocks // 4),
        group_size=a.group_size,
        config_extra=extra,
        scale_range=FINITE_SCALE_RANGE,  # the default's activations leave fp16 by the second block
    )
    t1 = time.perf_counter()
    convert(root / "src", str(out) + "/")
    t2 = time.perf_counter()
    shutil.rmtree(root / "src")
    info = {
        "folder": str(out),
        "config_extra": extra,
        "scale_range": list(FINITE_SCALE_RANGE),
        "source_bytes": written["bytes"],
        "artifact_bytes": sum(p.stat().st_size for p in out.iterdir() if p.is_file()),
        "generate_s": round(t1 - t0, 2),
        "convert_s": round(t2 - t1, 2),
        "native": os.environ.get("MARLIN_NATIVE", "(default)"),
    }
    done.write_text(json.dumps(info, indent=1))
    return out, {**info, "reused": False}


# --------------------------------------------------------------------------- device helpers


def sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def free_device(dev: Any) -> None:
    import torch

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        if "cupy" in sys.modules:
            sys.modules["cupy"].get_default_memory_pool().free_all_blocks()


def memory_state(dev: Any) -> dict[str, Any]:
    """torch's allocated and peak bytes, CuPy's pool (when loaded) and the device's used bytes."""
    import torch

    if dev.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(dev)
    out = {
        "torch_allocated": torch.cuda.memory_allocated(dev),
        "torch_peak": torch.cuda.max_memory_allocated(dev),
        "device_used": total - free,
    }
    if "cupy" in sys.modules:
        pool = sys.modules["cupy"].get_default_memory_pool()
        out["cupy_pool_used"], out["cupy_pool_total"] = pool.used_bytes(), pool.total_bytes()
    return out


@contextlib.contextmanager
def timed(dev: Any) -> Iterator[list[float]]:
    """Milliseconds of the block (CUDA events on a GPU), appended to the yielded list."""
    import torch

    box: list[float] = []
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield box
        end.record()
        end.synchronize()
        box.append(start.elapsed_time(end))
    else:
        t = time.perf_counter()
        yield box
        box.append((time.perf_counter() - t) * 1e3)


def measure_bandwidth(dev: Any) -> dict[str, Any]:
    """Device-to-device copy bandwidth: (bytes read + bytes written) / time, median of 10."""
    import torch

    nbytes = (1 << 31) if dev.type == "cuda" else (1 << 26)
    src = torch.ones(nbytes // 2, dtype=torch.float16, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        with timed(dev) as ms:
            dst.copy_(src)
        times.append(ms[0])
    del src, dst
    free_device(dev)
    t = statistics.median(times)
    return {"bytes_copied": nbytes, "ms_median": t, "GBps": 2 * nbytes / (t / 1e3) / 1e9}


# --------------------------------------------------------------------------- models


def build_fp16(folder: Path, dev: Any, attn: str | None, dtype: str = "float16") -> Any:
    """The converted folder's config (no quantization) in ``dtype`` (the "fp16" row: 16-bit
    dense) with random weights, made on ``dev``."""
    import torch
    from transformers import AutoModelForCausalLM

    from converter.model.build import hf_config

    config = hf_config(json.loads((folder / "config.json").read_text()), path=folder / "config.json")
    kw: dict[str, Any] = {"dtype": getattr(torch, dtype)}
    if attn:
        from converter.model import attention

        attention.register()  # so that --attn may name sdpa_kv_heads for this model too
        kw["attn_implementation"] = attn
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, **kw)
    return model.to(dev).eval().requires_grad_(False)


def build_ours(folder: Path, dev: Any, attn: str | None, *, fuse: bool = True, dtype: str = "float16") -> Any:
    import converter

    kw = {"attn_implementation": attn} if attn else {}
    return converter.load_model(folder, str(dev), fuse=fuse, dtype=dtype, **kw).eval()


def load_paths(model: Any) -> dict[str, int]:
    """How many layers took each path (``marlin-kernel``, ``exact`` ...), from the load report."""
    report = getattr(model, "marlin_report", None)
    counts: dict[str, int] = {}
    for path in getattr(report, "layers", {}).values():
        counts[path] = counts.get(path, 0) + 1
    return counts


# --------------------------------------------------------------------------- measurements


def step_times(run: Callable[[], Any], steps: int, dev: Any) -> list[float]:
    """Milliseconds of each of ``steps`` back-to-back decode steps."""
    import torch

    if dev.type == "cuda":
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        ev[0].record()
        for i in range(steps):
            run()
            ev[i + 1].record()
        ev[-1].synchronize()
        return [ev[i].elapsed_time(ev[i + 1]) for i in range(steps)]
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        run()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def lm_head_ms(model: Any, batch: int, dev: Any, calls: int = 20) -> float:
    """The fp16 ``lm_head`` alone on ``(batch, 1, hidden)``: ms per call, ``calls`` back to back
    between two events (no launch gaps), median of 3."""
    import torch

    head = model.get_output_embeddings()
    dtype = getattr(getattr(head, "weight", None), "dtype", torch.float16)
    x = torch.randn(batch, 1, model.config.hidden_size, dtype=dtype, device=dev)
    times = []
    with torch.no_grad():
        for _ in range(3):
            head(x)
        for _ in range(3):
            with timed(dev) as ms:
                for _ in range(calls):
                    head(x)
            times.append(ms[0] / calls)
    return statistics.median(times)


def device_kernels(prof: Any) -> list[tuple[str, float]]:
    """``[(name, us)]`` of every device-side event (kernels, memcpy, memset) of a profile."""
    from torch.autograd import DeviceType

    return [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]


def top_names(kernels: list[tuple[str, float]], steps: int, per_class: int = 12) -> dict[str, list]:
    """Per class, the most expensive distinct kernel names: ``[name, calls per step, ms per step]``."""
    acc: dict[str, list[float]] = {}
    for name, us in kernels:
        a = acc.setdefault(name, [0.0, 0.0])
        a[0] += 1 / steps
        a[1] += us / 1e3 / steps
    out: dict[str, list] = {}
    for name, (calls, ms) in sorted(acc.items(), key=lambda kv: -kv[1][1]):
        rows = out.setdefault(kernel_class(name), [])
        if len(rows) < per_class:
            rows.append([name[:160], round(calls, 2), round(ms, 5)])
    return out


def profile_steps(dec: Any, runner: Any, a: argparse.Namespace, kind: str, head_ms: float, dev: Any) -> dict:
    """torch.profiler over ``--profile-steps`` decode steps (replayed; un-captured if the
    replay shows fewer kernels than linears), split into linears and the rest."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    steps = a.profile_steps
    snap = dec.snapshot()

    def collect(fn: Callable[[], Any]) -> list[tuple[str, float]]:
        with profile(activities=acts) as prof:
            for _ in range(steps):
                fn()
            sync(dev)
        return device_kernels(prof)

    source = "graph-replay" if runner.graph is not None else f"{runner.mode}-steps"
    kernels = collect(runner)
    note = None
    wanted = 7 * a.blocks * steps
    if runner.graph is not None and len(kernels) < wanted:
        note = (
            f"replaying the graph gave {len(kernels)} device events for {steps} steps (fewer than the "
            f"{wanted} linears): profiled {steps} un-captured steps instead"
        )
        dec.restore(snap)
        kernels = collect(runner.fn)
        source = f"{runner.mode}-uncaptured-steps"
    dec.restore(snap)
    if not kernels:
        return {"source": source, "kernel_events": 0, "note": note or "no device events (no CUDA profiler?)"}
    split = split_profile(kernels, steps=steps, lm_head_ms=head_ms, model=kind)
    return {"source": source, "kernel_events": len(kernels), "note": note, **split, "names": top_names(kernels, steps)}


def decode_case(model: Any, kind: str, mode: str, batch: int, a: argparse.Namespace, dev: Any) -> dict:
    """Prefill, set up the step in ``mode``, time ``new - 1`` steps ``--repeats`` times, profile."""
    import torch

    from benchmarks.decode_loop import Decoder, make_runner

    gen = torch.Generator().manual_seed(1000 + batch)
    prompt = torch.randint(0, a.vocab, (batch, a.prompt), generator=gen).to(dev)
    dec = Decoder(model, batch, a.prompt, a.new, dev)
    with timed(dev) as pre:
        logits = dec.prefill(prompt)
    finite = bool(torch.isfinite(logits).all())
    if not finite:  # a NaN model times the same kernels but is no model to quote
        print(f"  WARNING: {kind} batch {batch}: the prefill's logits are not finite", flush=True)
    snap = dec.snapshot()
    runner = make_runner(dec, mode, warmup=a.warmup, compile_mode=a.compile_mode)
    steps = a.new - 1
    samples: list[float] = []
    for _ in range(a.repeats):
        dec.restore(snap)
        samples += step_times(runner, steps, dev)
    out: dict[str, Any] = {
        "steps": steps,
        "repeats": a.repeats,
        "ms_median": statistics.median(samples),
        "ms_mean": statistics.fmean(samples),
        "ms_min": min(samples),
        "ms_max": max(samples),
        "prompt_prefill_ms": pre[0],
        "setup_s": round(runner.setup_s, 2),
        "captured": runner.graph is not None,
        "first_tokens": dec.tokens[0, :8].tolist(),
        "prefill_logits_finite": finite,
        "lm_head_ms": lm_head_ms(model, batch, dev),
    }
    if not a.skip_profile:
        dec.restore(snap)
        out["profile"] = profile_steps(dec, runner, a, kind, out["lm_head_ms"], dev)
    del runner, dec
    free_device(dev)
    return out


def prefill_case(model: Any, a: argparse.Namespace, dev: Any, reps: int = 5) -> dict:
    """One ``--prefill``-token prompt, eager, into a static cache of that size: median of ``reps``."""
    import torch

    from benchmarks.decode_loop import cache_keyword, static_cache

    cache = static_cache(model, a.prefill)
    ids = torch.randint(0, a.vocab, (1, a.prefill), generator=torch.Generator().manual_seed(7)).to(dev)
    pos = torch.arange(a.prefill, device=dev)[None]
    kw = {cache_keyword(model): cache}
    times = []
    with torch.no_grad():
        for i in range(reps + 1):
            cache.reset()
            sync(dev)
            with timed(dev) as ms:
                model(input_ids=ids, position_ids=pos, use_cache=True, logits_to_keep=1, **kw)
            if i:
                times.append(ms[0])
    del cache
    free_device(dev)
    return {"tokens": a.prefill, "ms_median": statistics.median(times), "samples_ms": times}


def run_model(kind: str, folder: Path, a: argparse.Namespace, res: dict, save: Callable[[], None], dev: Any) -> None:
    """Every mode and batch, the prefill and the memory of one model; errors are recorded, not raised."""
    import torch

    entry = res["models"].setdefault(kind, {})
    free_device(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    entry["memory_before"] = memory_state(dev)
    t0 = time.perf_counter()
    try:
        if kind == "fp16":
            model = build_fp16(folder, dev, a.attn, a.dtype)
        else:
            model = build_ours(folder, dev, a.attn, fuse=kind != "ours-unfused", dtype=a.dtype)
    except Exception as exc:
        entry["error"] = record_error(f"{kind}: load", exc, res)
        save()
        return
    sync(dev)
    entry.update(load_s=round(time.perf_counter() - t0, 2), paths=load_paths(model))
    entry["memory_after_load"] = memory_state(dev)
    print(f"[{kind}] loaded in {entry['load_s']} s {entry['paths'] or ''}", flush=True)
    for mode in a.modes:
        for batch in a.batch_list:
            cell = entry.setdefault("decode", {}).setdefault(mode, {})
            try:
                cell[str(batch)] = decode_case(model, kind, mode, batch, a, dev)
                c = cell[str(batch)]
                print(
                    f"[{kind}] {mode} batch {batch}: {c['ms_median']:.3f} ms/step (setup {c['setup_s']} s)", flush=True
                )
            except Exception as exc:
                cell[str(batch)] = {"error": record_error(f"{kind}: {mode} batch {batch}", exc, res)}
                free_device(dev)
            save()
    if not a.skip_prefill:
        try:
            entry["prefill"] = prefill_case(model, a, dev)
            print(f"[{kind}] prefill {a.prefill}: {entry['prefill']['ms_median']:.2f} ms", flush=True)
        except Exception as exc:
            entry["prefill"] = {"error": record_error(f"{kind}: prefill", exc, res)}
    entry["memory_peak"] = memory_state(dev)
    del model
    if "compile" in a.modes:
        import torch._dynamo

        torch._dynamo.reset()  # the compiled steps hold the model's tensors
    free_device(dev)
    save()


def record_error(where: str, exc: BaseException, res: dict) -> str:
    msg = f"{type(exc).__name__}: {exc}".strip()
    print(f"ERROR {where}: {msg}", file=sys.stderr, flush=True)
    traceback.print_exc()
    res.setdefault("errors", []).append({"where": where, "error": msg[:2000]})
    return msg[:2000]


# --------------------------------------------------------------------------- summary


def summarize(res: dict) -> None:
    """Fill ``res["rows"]`` (per mode, per batch) and ``res["prefill"]`` from the measurements."""
    cfg = res["config"]
    shapes = linear_shapes(hidden=cfg["hidden"], intermediate=cfg["intermediate"], kv=cfg["kv"], blocks=cfg["blocks"])
    bw = (res.get("bandwidth") or {}).get("GBps")
    models = res.get("models", {})
    rows: dict[str, list] = {}
    modes = sorted({m for e in models.values() for m in e.get("decode", {})})
    for mode in modes:
        batches = sorted({int(b) for e in models.values() for b in e.get("decode", {}).get(mode, {})})
        for b in batches:
            f = models.get("fp16", {}).get("decode", {}).get(mode, {}).get(str(b), {})
            o = models.get("ours", {}).get("decode", {}).get(mode, {}).get(str(b), {})
            nbytes = {k: linear_bytes(shapes, batch=b, kind=k, group_size=cfg["group_size"]) for k in MODELS}
            row = limit_row(b, f, o, bandwidth_gbps=bw, bytes_=nbytes)
            u = models.get("ours-unfused", {}).get("decode", {}).get(mode, {}).get(str(b), {}).get("ms_median")
            if u:
                row.update(ours_unfused_ms=u, ratio_unfused=row["fp16_ms"] / u if row.get("fp16_ms") else None)
            rows.setdefault(mode, []).append(row)
    res["rows"] = rows
    pf = [models.get(k, {}).get("prefill", {}).get("ms_median") for k in MODELS]
    res["prefill"] = {
        "tokens": cfg.get("prefill"),
        "fp16_ms": pf[0],
        "ours_ms": pf[1],
        "ratio_ours_over_fp16": pf[1] / pf[0] if pf[0] and pf[1] else None,
        "target_at_most": PREFILL_TARGET,
    }


def _f(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def peak_bytes(entry: dict) -> int | None:
    """torch's peak plus CuPy's pool (our weights may live there) of one model's run."""
    m = entry.get("memory_peak") or {}
    if "torch_peak" not in m:
        return None
    return m["torch_peak"] + m.get("cupy_pool_total", 0)


def print_names(res: dict) -> None:
    """The distinct kernel names the profiles found, per model and class (to check the split)."""
    for kind, entry in res.get("models", {}).items():
        seen: dict[str, set[str]] = {}
        for cells in entry.get("decode", {}).values():
            for cell in cells.values():
                for cls, rows in ((cell.get("profile") or {}).get("names") or {}).items():
                    seen.setdefault(cls, set()).update(r[0] for r in rows)
        for cls in ("ours", "gemm", "attention", "other"):
            if seen.get(cls):
                print(f"[{kind}] {cls} kernels: " + " | ".join(sorted(n[:90] for n in seen[cls])))


def print_table(res: dict) -> None:
    print_names(res)
    bw = (res.get("bandwidth") or {}).get("GBps")
    print(f"\ncard: {res.get('card')} | torch {res.get('torch')} | transformers {res.get('transformers')}")
    print(f"copy bandwidth (read + write): {_f(bw, '.0f')} GB/s")
    head = (
        f"{'batch':>5} {'fp16 ms':>8} {'ours ms':>8} {'fp16/ours':>9} {'target':>6} {'limit':>6} {'90%lim':>6} "
        f"{'met':>4} {'nonlin16':>8} {'nonlinQ':>8} {'lm_head':>8} {'profile':>14}"
    )
    for mode, rows in res.get("rows", {}).items():
        print(f"\n{mode}: decode ms per step (median); nonlin = GPU ms/step outside the linears (lm_head included)")
        print(head)
        for r in rows:
            prof = res["models"].get("ours", {}).get("decode", {}).get(mode, {}).get(str(r["batch"]), {}).get("profile")
            met = {True: "yes", False: "NO", None: "-"}[r.get("met")]
            print(
                f"{r['batch']:>5} {_f(r['fp16_ms']):>8} {_f(r['ours_ms']):>8} {_f(r['ratio'], '.2f'):>9} "
                f"{_f(r['target'], '.1f'):>6} {_f(r.get('limit_ratio'), '.2f'):>6} "
                f"{_f(r.get('limit_ratio_90'), '.2f'):>6} {met:>4} {_f(r['fp16_nonlinear_ms']):>8} "
                f"{_f(r['ours_nonlinear_ms']):>8} {_f(r['lm_head_ms']):>8} {(prof or {}).get('source', '-')[:14]:>14}"
            )
            if r.get("ours_unfused_ms"):
                print(f"{'':>5} {'':>8} {r['ours_unfused_ms']:>8.3f} {_f(r['ratio_unfused'], '.2f'):>9} ours-unfused")
        for r in rows:
            if r.get("limit_ratio") is not None:
                print(
                    f"  byte limit, batch {r['batch']}: ours' linears {r['ours_linear_bytes'] / 1e9:.3f} GB / "
                    f"{bw:.0f} GB/s = {r['ours_linear_min_ms']:.3f} ms + non-linear {r['ours_nonlinear_ms']:.3f} ms"
                    f" = {r['ours_best_ms']:.3f} ms; fp16 {r['fp16_ms']:.3f} ms / that = {r['limit_ratio']:.2f}x "
                    f"(90 %: {r['limit_ratio_90']:.2f}x; both models at their byte limit: "
                    f"{_f(r.get('limit_ratio_bytes'), '.2f')}x)"
                )
    p = res.get("prefill") or {}
    print(
        f"\nprefill {p.get('tokens')} tokens: fp16 {_f(p.get('fp16_ms'), '.2f')} ms, ours {_f(p.get('ours_ms'), '.2f')}"
        f" ms, ours/fp16 {_f(p.get('ratio_ours_over_fp16'), '.2f')} (target <= {PREFILL_TARGET})"
    )
    gib = lambda x: _f(x / 2**30 if x is not None else None, ".2f")  # noqa: E731
    for kind, entry in res.get("models", {}).items():
        m = entry.get("memory_peak") or {}
        print(
            f"peak memory {kind}: {gib(peak_bytes(entry))} GiB (torch peak {gib(m.get('torch_peak'))} + cupy pool "
            f"{gib(m.get('cupy_pool_total', 0))}; device used {gib(m.get('device_used'))})"
        )
    for e in res.get("errors", []):
        print(f"ERROR {e['where']}: {e['error'][:300]}")


def merge(paths: list[Path]) -> dict:
    """Earlier runs' JSONs as one: later files win, model by model, mode by mode, batch by batch."""

    def deep(a: dict, b: dict) -> dict:
        for k, v in b.items():
            a[k] = deep(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
        return a

    res: dict = {}
    cards = []
    for p in paths:
        r = json.loads(p.read_text())
        cards.append(r.get("card"))
        errors = res.get("errors", []) + r.get("errors", [])
        res = deep(res, r)
        res["errors"] = errors
    if len(set(cards)) > 1:
        res["card_warning"] = f"the runs used different cards: {cards}"
        print(f"WARNING: {res['card_warning']}")
    res["merged_from"] = [str(p) for p in paths]
    return res


# --------------------------------------------------------------------------- main


def environment(dev: Any) -> dict[str, Any]:
    import torch
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(dev)}
    env["card"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    with contextlib.suppress(Exception):
        import cupy

        env["cupy"] = cupy.__version__
    return env


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    a = parse_args(argv)
    if a.merge:
        res = merge(a.merge)
        summarize(res)
        if a.json:
            a.json.write_text(json.dumps(res, indent=1))
        print_table(res)
        return 0
    import torch

    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        # the measured models run on our CUDA kernels: a CPU build of torch cannot time them
        print(
            f"bench_generate: --device {a.device} needs an NVIDIA GPU and a CUDA build of torch "
            f"(this torch {torch.__version__} sees none), the [model] extra and a GPU extra ([cuda12] or [cuda13])",
            file=sys.stderr,
        )
        return 2
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    res: dict[str, Any] = {"argv": sys.argv[1:], **environment(dev), "models": {}}
    res["config"] = {
        k: getattr(a, k)
        for k in ("blocks", "hidden", "intermediate", "kv", "head_dim", "vocab", "group_size", "prompt", "new")
    }
    res["config"].update(
        prefill=a.prefill, batches=a.batch_list, modes=a.modes, compile_mode=a.compile_mode, attn=a.attn, dtype=a.dtype
    )

    def save() -> None:
        summarize(res)
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(res, indent=1, default=str))

    print(f"card: {res['card']}", flush=True)
    t0 = time.perf_counter()
    folder, info = ensure_checkpoint(a)
    res["checkpoint"] = info
    what = "reused" if info["reused"] else f"generated in {info['generate_s']} s, converted in {info['convert_s']} s"
    print(f"checkpoint {folder}: {what} ({time.perf_counter() - t0:.1f} s)", flush=True)
    res["bandwidth"] = measure_bandwidth(dev)
    print(f"copy bandwidth: {res['bandwidth']['GBps']:.0f} GB/s", flush=True)
    save()
    with torch.no_grad():
        for kind in a.models:
            run_model(kind, folder, a, res, save, dev)
    save()
    print_table(res)
    return 1 if res.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())

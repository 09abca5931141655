#!/usr/bin/env python3
"""Greedy-decoding parity of every real causal-LM checkpoint: our converted model against
the fp16-dequantized source model, token for token, eager and with the decode step
captured in a CUDA graph (issue 38).

On the GPU machine (the checkpoints copied to an ignored folder, e.g. .shared/realinput)::

    PYTHONPATH=$PWD python3 scripts/gpu_generate_parity.py --shared .shared --json $OUT/generate_parity.json

On the CPU (a smoke test; ``graph`` then runs the same warm-up and restore, uncaptured)::

    python3 scripts/gpu_generate_parity.py --device cpu

For each ``realinput/*/*`` whose ``config.json`` names a ``*ForCausalLM`` (the llama-tiny
producers; MiniLM is skipped and listed): convert it into ``--work``, load it with
``converter.load_model``, build the fp16 reference (``converter.model.reference.build_reference``:
every quantized layer dequantized by the source format's own reader, rounded to fp16) and
the fp32 one, and greedy-decode ``--new`` tokens from a fixed prompt (the folder's
tokenizer on a fixed sentence for row 0, seeded random ids for the other rows) with
``benchmarks/decode_loop.py``: the reference eagerly, ours in every ``--modes``.

A divergence (ours picks another token than the reference, at the first step where the
two differ) is a *near tie* when the reference's logit gap between its token and ours is
at most ``tau = --tie-factor x E16``, where ``E16`` is the fp16 reference's own error: the
largest |fp16 reference - fp32 reference| logit over the reference's sequence (teacher
forced). Why: two tokens swap only if their gap is at most the sum of the two logits'
errors; if our logits are off the fp16 reference by no more than fp16 rounding allows
(ours and the fp16 reference each within E16 of fp32, so at most 2 E16 apart), a swap
needs a gap of at most 4 E16 (the default factor). A wider gap means our logits moved more
than fp16 rounding explains. Each row reports the reference's margin (top-1 minus top-2)
at that step, ours, and the gap. Ours in graph mode is also compared with ours eager
(same rule, against our eager logits).

Exit status: 0 all equal or near ties; 1 a divergence that is not a near tie, or a
checkpoint that failed to convert, load or decode; 2 no checkpoint found.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a plain script from a fresh checkout
    sys.path.insert(0, str(REPO))

#: Decoding rules: ``greedy`` is the parity the issue asks for; a random model's greedy
#: output soon repeats one token, so ``distinct`` (the best token not yet in the row,
#: ``generate``'s ``no_repeat_ngram_size=1``) makes all ``--new`` steps fresh decisions.
VARIANTS = {"greedy": False, "distinct": True}
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs back home to sleep."
PROMPT_TOKENS = 16


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    default_shared = Path(os.environ.get("MARLIN_SHARED", REPO.parent / "shared"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shared", type=Path, default=default_shared, help="the folder holding realinput/")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--work", type=Path, help="converted folders (default: a temporary folder, removed)")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2, help="rows: the text prompt, then seeded random ids")
    ap.add_argument("--modes", default="eager,graph", help="ours' decode modes (eager, graph, compile)")
    ap.add_argument(
        "--variants",
        default="greedy,distinct",
        help="greedy: plain argmax; distinct: argmax over tokens not yet in the row (no_repeat_ngram_size=1)",
    )
    ap.add_argument("--tie-factor", type=float, default=4.0, help="tau = factor x E16 (see above)")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation of all three models")
    ap.add_argument("--only", help="only checkpoints whose name contains this")
    a = ap.parse_args(argv)
    a.mode_list = [m for m in a.modes.split(",") if m]
    a.variant_list = [v for v in a.variants.split(",") if v]
    bad = [v for v in a.variant_list if v not in VARIANTS]
    if bad:
        ap.error(f"unknown --variants {','.join(bad)}")
    return a


def realinput_of(shared: Path) -> Path:
    return shared / "realinput" if (shared / "realinput").is_dir() else shared


def find_checkpoints(realinput: Path) -> tuple[list[Path], list[tuple[str, str]]]:
    """``(causal LM folders, [(name, why skipped)])`` under ``realinput/*/*``."""
    keep, skipped = [], []
    for cfg in sorted(realinput.glob("*/*/config.json")):
        folder = cfg.parent
        archs = json.loads(cfg.read_text()).get("architectures") or []
        if any(str(x).endswith("ForCausalLM") for x in archs):
            keep.append(folder)
        else:
            skipped.append((folder.name, f"not a causal LM (architectures {archs})"))
    return keep, skipped


def prompt_ids(folder: Path, vocab: int, batch: int) -> tuple[Any, dict[str, Any]]:
    """``(B, P)`` int64 ids: row 0 the folder's tokenizer on :data:`TEXT` (seeded ids when it has
    none, or it fails), the other rows seeded random ids of the same length."""
    import torch

    desc: dict[str, Any] = {"rows": batch}
    first = None
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False, local_files_only=True)
        ids = list(tok(TEXT)["input_ids"])[:PROMPT_TOKENS]
        if len(ids) >= 4 and max(ids) < vocab:
            first, desc["row0"] = ids, f"tokenizer: {TEXT[:40]}..."
    except Exception as exc:  # no tokenizer, or one transformers cannot read: the fixed ids
        desc["tokenizer_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    gen = torch.Generator().manual_seed(0)
    length = len(first) if first else PROMPT_TOKENS
    rows = torch.randint(0, vocab, (batch, length), generator=gen)
    if first:
        rows[0] = torch.tensor(first)
    else:
        desc["row0"] = "seeded random ids"
    desc["tokens"] = length
    return rows, desc


@contextlib.contextmanager
def true_fp32(dev: Any) -> Iterator[None]:
    """No TF32 while the fp32 reference runs."""
    import torch

    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    precision = torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        torch.set_float32_matmul_precision(precision)


def decode(model: Any, prompt: Any, new: int, mode: str, variant: str) -> tuple[Any, Any]:
    """Greedy tokens ``(B, new)`` and the float32 logits ``(new, B, V)`` that chose them (on the
    CPU; ``distinct``: tokens already in the row at -inf)."""
    import torch

    from benchmarks.decode_loop import greedy

    steps: list[Any] = []
    keep = lambda i, logits: steps.append(logits.float().cpu())  # noqa: E731
    tokens = greedy(model, prompt, new, mode, on_step=keep, ban_repeats=VARIANTS[variant])
    return tokens.cpu(), torch.stack(steps)


def forced_logits(model: Any, prompt: Any, tokens: Any) -> Any:
    """float32 logits ``(new, B, V)`` of the whole sequence in one forward (no cache): the
    logits each model gives at the reference's steps, teacher forced."""
    import torch

    seq = torch.cat([prompt, tokens[:, :-1].to(prompt.device)], dim=1)
    with torch.no_grad():
        y = model(input_ids=seq, use_cache=False).logits.float()
    p = prompt.shape[1]
    return y[:, p - 1 :, :].transpose(0, 1).cpu()


def margin(logits: Any) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def compare(ref_tok: Any, ref_log: Any, tok: Any, log: Any, tau: float) -> dict[str, Any]:
    """Token equality, and per diverging row the first differing step with its margins."""
    rows = []
    for r in range(ref_tok.shape[0]):
        diff = (ref_tok[r] != tok[r]).nonzero()
        if len(diff) == 0:
            continue
        t = int(diff[0])
        a, b = int(ref_tok[r, t]), int(tok[r, t])
        gap = float(ref_log[t, r, a] - ref_log[t, r, b])
        rows.append(
            {
                "row": r,
                "step": t,
                "ref_token": a,
                "our_token": b,
                "ref_margin": margin(ref_log[t, r]),
                "our_margin": margin(log[t, r]),
                "ref_gap": gap,
                "near_tie": gap <= tau,
            }
        )
    return {"equal": not rows, "divergences": rows, "explained": all(d["near_tie"] for d in rows)}


def free(dev: Any) -> None:
    import torch

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        if "cupy" in sys.modules:
            sys.modules["cupy"].get_default_memory_pool().free_all_blocks()


def run_checkpoint(src: Path, work: Path, a: argparse.Namespace, dev: Any) -> dict[str, Any]:
    """Convert, load, decode and compare one checkpoint."""
    import torch

    import converter
    from converter.formats import open_source
    from converter.model.reference import FP16, FP32, build_reference

    res: dict[str, Any] = {"name": src.name, "source": str(src)}
    out = work / src.name
    t0 = time.perf_counter()
    converter.convert(src, str(out) + "/", force=True)
    res["convert_s"] = round(time.perf_counter() - t0, 2)
    ours = converter.load_model(out, str(dev), attn_implementation=a.attn)
    report = getattr(ours, "marlin_report", None)
    res["paths"] = dict(getattr(report, "layers", {}))
    with open_source(src) as source:
        ref16, _ = build_reference(source, FP16, dev, attn_implementation=a.attn)
        with true_fp32(dev):
            ref32, _ = build_reference(source, FP32, dev, attn_implementation=a.attn)
    prompt, res["prompt"] = prompt_ids(src, int(ours.config.vocab_size), a.batch)
    prompt = prompt.to(dev)
    res["variants"] = {v: run_variant(v, ours, ref16, ref32, prompt, a) for v in a.variant_list}
    del ours, ref16, ref32
    with contextlib.suppress(Exception):
        torch._dynamo.reset()
    free(dev)
    return res


def run_variant(variant: str, ours: Any, ref16: Any, ref32: Any, prompt: Any, a: argparse.Namespace) -> dict:
    """The fp16 reference decoded eagerly, its error scale E16, and ours in every mode against it."""
    ref_tok, ref_log = decode(ref16, prompt, a.new, "eager", variant)
    with true_fp32(prompt.device):
        f32 = forced_logits(ref32, prompt, ref_tok)
    f16 = forced_logits(ref16, prompt, ref_tok)
    fours = forced_logits(ours, prompt, ref_tok)
    e16 = float((f16 - f32).abs().max())
    res: dict[str, Any] = {
        "E16": e16,
        "E_ours_vs_fp32": float((fours - f32).abs().max()),
        "E_ours_vs_fp16": float((fours - f16).abs().max()),
        "tau": a.tie_factor * e16,
        "distinct_ref_tokens": [len(set(row)) for row in ref_tok.tolist()],
        "ref_tokens": ref_tok.tolist(),
    }
    modes: dict[str, Any] = {}
    eager = None
    for mode in a.mode_list:
        try:
            tok, log = decode(ours, prompt, a.new, mode, variant)
        except Exception as exc:
            modes[mode] = {"error": f"{type(exc).__name__}: {str(exc)[:1000]}"}
            traceback.print_exc()
            continue
        cell = compare(ref_tok, ref_log, tok, log, res["tau"])
        cell["tokens"] = tok.tolist()
        if eager is not None:
            cell["vs_eager"] = compare(eager[0], eager[1], tok, log, res["tau"])
        if mode == "eager":
            eager = (tok, log)
        modes[mode] = cell
    res["modes"] = modes
    return res


def verdict(cell: dict[str, Any]) -> str:
    if "error" in cell:
        return "ERROR"
    if cell["equal"]:
        return "equal"
    return "near tie" if cell["explained"] else "DIVERGED"


def print_rows(results: list[dict[str, Any]]) -> None:
    print(
        f"\n{'checkpoint':<35} {'variant':<8} {'mode':<7} {'verdict':<9} {'row/step':>8} {'ref margin':>10} "
        f"{'our margin':>10} {'ref gap':>8} {'tau':>7} {'E16':>7} {'E ours':>7} {'=eager':>6} {'distinct':>8}"
    )
    fmt = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    for r in results:
        if "error" in r:
            print(f"{r['name']:<35} {'-':<8} {'-':<7} {'ERROR':<9} {r['error'][:100]}")
            continue
        for variant, v in r["variants"].items():
            for mode, cell in v["modes"].items():
                d = (cell.get("divergences") or [{}])[0]
                where = f"{d['row']}/{d['step']}" if d else "-"
                ve = cell.get("vs_eager")
                same = "-" if ve is None else ("yes" if ve["equal"] else ("tie" if ve["explained"] else "NO"))
                print(
                    f"{r['name']:<35} {variant:<8} {mode:<7} {verdict(cell):<9} {where:>8} "
                    f"{fmt(d.get('ref_margin')):>10} {fmt(d.get('our_margin')):>10} {fmt(d.get('ref_gap')):>8} "
                    f"{fmt(v['tau']):>7} {fmt(v['E16']):>7} {fmt(v['E_ours_vs_fp16']):>7} {same:>6} "
                    f"{'/'.join(map(str, v['distinct_ref_tokens'])):>8}"
                )
                if "error" in cell:
                    print(f"    {cell['error'][:300]}")
    print(
        "E16 = max |fp16 ref - fp32 ref| logit, E ours = max |ours - fp16 ref| (teacher forced on the reference's "
        "tokens); tau = tie factor x E16; distinct = distinct reference tokens per row; row/step = first divergence"
    )


def failed(results: list[dict[str, Any]]) -> bool:
    for r in results:
        if "error" in r:
            return True
        for v in r["variants"].values():
            for cell in v["modes"].values():
                if "error" in cell or not cell["explained"]:
                    return True
                if cell.get("vs_eager") and not cell["vs_eager"]["explained"]:
                    return True
    return False


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    a = parse_args(argv)
    import torch

    dev = torch.device(a.device)
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
    realinput = realinput_of(a.shared)
    srcs, skipped = find_checkpoints(realinput)
    if a.only:
        srcs = [s for s in srcs if a.only in s.name]
    for name, why in skipped:
        print(f"skip {name}: {why}")
    if not srcs:
        print(f"no causal-LM checkpoint under {realinput} (expected realinput/llama-tiny/*)", file=sys.stderr)
        return 2
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(f"card: {card}; {len(srcs)} checkpoint(s); modes {a.mode_list}; {a.new} new tokens", flush=True)
    results: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        work = a.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="generate-parity-")))
        work.mkdir(parents=True, exist_ok=True)
        for src in srcs:
            try:
                results.append(run_checkpoint(src, work, a, dev))
            except Exception as exc:
                traceback.print_exc()
                results.append({"name": src.name, "source": str(src), "error": f"{type(exc).__name__}: {exc}"})
                free(dev)
            r = results[-1]
            cells = [f"{v}/{m} {verdict(c)}" for v, x in r.get("variants", {}).items() for m, c in x["modes"].items()]
            print(f"{src.name}: " + ("ERROR " + r["error"][:200] if "error" in r else ", ".join(cells)), flush=True)
    bad = failed(results)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"card": card, "torch": torch.__version__, "argv": sys.argv[1:], "skipped": skipped}
        doc.update(tie_factor=a.tie_factor, new=a.new, variants=a.variant_list, modes=a.mode_list)
        doc.update(ok=not bad, results=results)
        a.json.write_text(json.dumps(doc, indent=1))
    print_rows(results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

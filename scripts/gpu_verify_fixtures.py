"""Synthetic GPTQ layers in every bit width and a few group sizes, proven on the GPU;
then short-last-group layers (regrouped: K = 576, 960 at g = 128, 256) and padded ones
(N = 32, and a .tinyloop head of 50257) through ``marlin-verify --gpu --against``.

Usage (GPU machine): PYTHONPATH=$PWD python3 scripts/gpu_verify_fixtures.py OUTDIR
Prints one line per case (bits, group, act-order, worst GPU mean/max relative error),
then one per regrouped or padded layer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from converter.convert import convert
from converter.verify import verify
from tests.helpers.producers import (
    gptq_config,
    gptq_tensors,
    make_layer,
    plain_tensors,
    ragged_gptq,
    write_checkpoint,
)
from tests.helpers.sample import build_vocab_head

P = "model.layers.0.mlp.down_proj"
out = Path(sys.argv[1])
ok = True
for bits, group, act in [(2, 128, False), (3, 64, False), (3, 128, True), (4, 32, True), (2, -1, False)]:
    rng = np.random.default_rng(bits * 100 + group)
    lay = make_layer(rng, 1024, 512, bits=bits, group_size=group, act_order=act, zeros="with_zero", bias=True)
    case = out / f"b{bits}-g{group}-act{int(act)}"
    src = write_checkpoint(
        case / "src",
        {**gptq_tensors(P, lay, v1=True), **plain_tensors(rng)},
        gptq_config(bits, group, desc_act=act),
        where="quantize_config.json",
    )
    convert(src, case / "a.safetensors")
    rep = verify(case / "a.safetensors", against=src, gpu=True)
    g = rep.layers[0]["gpu"]
    ok &= rep.ok
    print(
        f"bits={bits} group={group:4d} act_order={act!s:5s} gpu mean {g['mean_rel_err']:.2e} "
        f"max {g['max_rel_err']:.2e} deterministic={g['deterministic']} ok={rep.ok} "
        f"{[p.message for p in rep.problems if p.severity == 'error'][:2]}"
    )
cases = [(f"ragged-b{b}-g{g}-act{int(a)}", b, g, a) for b in (4, 2) for g in (128, 256) for a in (False, True)]
for name, bits, group, act in [*cases, ("vocab-head", 4, 32, False)]:
    case = out / name
    if name == "vocab-head":
        src = build_vocab_head(case / "v.tinyloop")
    else:
        src, _ = ragged_gptq(
            case / "src", np.random.default_rng(bits + group), bits=bits, group_size=group, v1=not act, act_order=act
        )
    convert(src, case / "a.safetensors")
    rep = verify(case / "a.safetensors", against=src, gpu=True)
    ok &= rep.ok
    for row in rep.layers:
        if "source_group_size" not in row and "padded_n" not in row:
            continue
        g = row["gpu"]
        print(
            f"{name:22s} {row['name']:32s} K={row['size_k']:4d} N={row['size_n']:5d} "
            f"pad={row.get('padded_n', '-')!s:5s} "
            f"group={row['group_size']} (from {row.get('source_group_size', '-')}) bits={row['bits']} "
            f"gpu mean {g['mean_rel_err']:.2e} max {g['max_rel_err']:.2e} deterministic={g['deterministic']} "
            f"ok={g['ok']}"
        )
    if not rep.ok:
        print(f"  FAILED: {[p.message for p in rep.problems if p.severity == 'error'][:3]}")
sys.exit(0 if ok else 1)

"""Synthetic GPTQ layers in every bit width and a few group sizes, proven on the GPU.

Usage (GPU machine): PYTHONPATH=$PWD python3 scripts/gpu_verify_fixtures.py OUTDIR
Prints one line per case: bits, group, act-order, worst GPU mean/max relative error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from converter.convert import convert
from converter.verify import verify
from tests.helpers.producers import gptq_config, gptq_tensors, make_layer, plain_tensors, write_checkpoint

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
sys.exit(0 if ok else 1)

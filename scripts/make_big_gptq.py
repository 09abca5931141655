#!/usr/bin/env python3
"""Write a deterministic synthetic GPTQ checkpoint (sharded safetensors) for scale tests.

Usage::

    python scripts/make_big_gptq.py /tmp/big-gptq                 # ~2.1 GB, 4 shards
    python scripts/make_big_gptq.py /tmp/g300 --blocks 2 --shards 3 --vocab 8192   # ~300 MB

The folder gets ``model-0000i-of-0000n.safetensors`` shards, ``model.safetensors.index.json``,
``quantize_config.json`` (4-bit, group 128, asymmetric, v1 zeros) and ``config.json``.
Llama-like block: q/k/v/o, gate/up/down (hidden -> 1024-wide k/v), plus fp16 embeddings,
lm_head and norms.  Random codes and zeros, scales in [1e-3, 2e-2]; every tensor is seeded
from its name, so the bytes depend only on the arguments.  Tensors are generated and
written in bounded chunks (a few tens of MB at a time), so a 2 GB checkpoint needs no
2 GB of memory.  Generate under /tmp; never commit the output.

The generator is ``tests/helpers/synthetic_gptq.py`` (the tests build small
checkpoints with it); this is its command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a plain script from a fresh checkout
    sys.path.insert(0, str(REPO))

from tests.helpers.synthetic_gptq import write_gptq  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--kv", type=int, default=1024)
    ap.add_argument("--blocks", type=int, default=14)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bias", action="store_true")
    a = ap.parse_args(argv)
    info = write_gptq(
        a.folder,
        hidden=a.hidden,
        intermediate=a.intermediate,
        kv=a.kv,
        blocks=a.blocks,
        vocab=a.vocab,
        shards=a.shards,
        group_size=a.group_size,
        seed=a.seed,
        bias=a.bias,
    )
    name, nb = info["largest_tensor"]
    print(
        f"wrote {a.folder}: {len(info['files'])} shards, {info['tensors']} tensors, {info['bytes'] / 1e9:.3f} GB; "
        f"largest tensor {name} = {nb / 1e6:.1f} MB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

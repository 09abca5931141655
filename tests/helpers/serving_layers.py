"""Random Marlin layers covering the routes a serving model meets (the torch-op and
packed-launch GPU tests share them)."""

from __future__ import annotations

from typing import Any

import numpy as np

#: (K, N, group_size, act_order, bias, padded N): the routes a serving model meets on
#: sm_80..90: persistent Hopper kernels with B unit-major or with the stages inline,
#: the small-layer route, the decode and tile kernels, act-order, per-channel, a
#: padded head.
LAYERS = [
    (4096, 4096, 128, False, False, None),
    (4096, 1024, 128, True, False, None),
    (4096, 14336, 128, False, False, None),
    (1024, 4096, 64, True, True, None),
    (512, 192, -1, False, True, None),
    (256, 200, 128, False, False, 256),
]


def make_layer(k: int, n: int, gs: int, act: bool, bias: bool, padded: int | None, seed: int) -> Any:
    """A ``MarlinLinear`` with random codes, scales, deltas (and perm, bias) of one ``LAYERS`` row."""
    from converter.gpu.api import MarlinLinear

    rng = np.random.default_rng(seed)
    p = padded or n
    g = 1 if gs == -1 else k // gs
    B = rng.integers(-(2**31), 2**31, (k // 16, 2 * p), dtype=np.int64).astype(np.int32)
    s = rng.uniform(1e-3, 2e-2, (g, p)).astype(np.float16)
    d = rng.uniform(-0.05, 0.05, (g, p)).astype(np.float32)
    perm = rng.permutation(k).astype(np.int32) if act else None
    b = rng.standard_normal(n).astype(np.float16) if bias else None
    return MarlinLinear("layer", k, n, k if gs == -1 else gs, B, s, d, perm, b, padded_n=padded)


def assert_replays_match_eager(mods: list[Any], eager: Any = None, replays: int = 3) -> None:
    """Chain ``mods`` at M = 1, 8 and 64 and capture the chain once in a CUDA graph (after
    two warm-up calls on a side stream); each replay on new inputs must give, bit for bit,
    what the chain gives eagerly on them. ``eager``: a context-manager factory entered
    around the eager reference run (to switch the launch path), or None."""
    import contextlib

    import torch

    xs = {m: [torch.zeros(m, mod.in_features, dtype=torch.float16, device="cuda") for mod in mods] for m in (1, 8, 64)}

    def step() -> list:
        return [mod(x) for m in xs for mod, x in zip(mods, xs[m], strict=True)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    gen = torch.Generator(device="cuda").manual_seed(3)
    for _ in range(replays):
        for m in xs:
            for x in xs[m]:
                x.copy_(torch.randn(x.shape, generator=gen, device="cuda", dtype=torch.float16))
        graph.replay()
        torch.cuda.synchronize()
        with eager() if eager is not None else contextlib.nullcontext():
            want = step()
        for got, w in zip(outs, want, strict=True):
            assert np.array_equal(got.cpu().numpy().view(np.uint16), w.cpu().numpy().view(np.uint16))

"""The grid the planner's decisions are pinned over (``tests/data/plan_snapshot.json.gz``).

Every layer shape of seven real models (q/k/v/o/gate/up/down/lm_head, K x N, GQA), M =
1..256 and 512..4096, group sizes 128/64/32/per-channel, with and without the delta, on
sm_80/86/89/90 device descriptions. A decision is what the launcher works out without a
GPU: the pipe (``default_pipe``), the variant (``kernel_variant``: gpi, smem, name) and
the plan (``plan_gemm``, with a fixed register count, as the compiled one is unknown
on the CPU), or the KernelError's message.

Regenerate (only when a routing change is meant): ``python -m tests.gpu.plan_grid --write``.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from converter.errors import KernelError

SNAPSHOT = Path(__file__).resolve().parents[1] / "data" / "plan_snapshot.json.gz"

#: (model, hidden, intermediate, kv width, vocab): layer shapes K x N of each.
MODELS = (
    ("llama-2-7b", 4096, 11008, 4096, 32000),
    ("llama-2-13b", 5120, 13824, 5120, 32000),
    ("llama-2-70b", 8192, 28672, 1024, 32000),
    ("llama-3-8b", 4096, 14336, 1024, 128256),
    ("llama-3-70b", 8192, 28672, 1024, 128256),
    ("mistral-7b", 4096, 14336, 1024, 32000),
    ("qwen2.5-7b", 3584, 18944, 512, 152064),
)


def shapes() -> list[tuple[int, int]]:
    """Every distinct (K, N) of the models' q, k/v, o, gate/up, down and lm_head layers."""
    seen: dict[tuple[int, int], None] = {}
    for _, h, inter, kv, vocab in MODELS:
        for kn in ((h, h), (h, kv), (h, h), (h, inter), (inter, h), (h, vocab)):
            seen[kn] = None
    return list(seen)


MS = (*range(1, 257), 512, 1024, 2048, 4096)
GROUPS = (128, 64, 32, -1)


@dataclasses.dataclass(frozen=True)
class Device:
    arch: str
    sm_count: int
    smem_per_block_optin: int
    smem_per_sm: int

    @property
    def hopper(self) -> bool:
        return self.arch == "sm_90"


DEVICES = (
    Device("sm_80", 108, 163 * 1024, 164 * 1024),  # A100
    Device("sm_86", 84, 99 * 1024, 100 * 1024),  # RTX 3090 / A40 class
    Device("sm_89", 142, 99 * 1024, 100 * 1024),  # L40S
    Device("sm_90", 132, 227 * 1024, 228 * 1024),  # H100 SXM / H200
)
#: Registers per thread assumed for every variant (the compiled count needs a GPU).
REGS = 128


def decide(m: int, k: int, n: int, g: int, dev: Device, *, plan: bool = True) -> list:
    """One decision as plain JSON values: the route (pipe, gpi, smem, the two names)
    and, with ``plan``, the launch (plan_gemm's fields); or the KernelError's message."""
    from converter.gpu.plan import default_pipe, kernel_variant, plan_gemm

    try:
        gs = k if g == -1 else g
        pipe = default_pipe(m, k, n, gs // 16, dev.smem_per_block_optin, hopper=dev.hopper)
        var = kernel_variant(k, n, g, pipe, smem_limit=dev.smem_per_block_optin, arch=dev.arch)
        route = [str(pipe.kind), pipe.r, pipe.u, pipe.ns, var.gpi, var.smem, var.name(False), var.name(True)]
        if not plan:
            return route
        p = plan_gemm(m, k, n, var, regs=REGS, device=dev)
    except KernelError as e:
        return ["error", str(e)]
    return [*route, p.smem, p.rows, p.m_chunks, p.wk, p.splits, p.tiles_per_split, p.warps, p.blocks, p.resident_warps]


def keys() -> Iterator[tuple[Device, int, int, int]]:
    for dev in DEVICES:
        for k, n in shapes():
            for g in GROUPS:
                yield dev, k, n, g


def key_name(dev: Device, k: int, n: int, g: int) -> str:
    return f"{dev.arch} {k}x{n} g{g}"


def digest(dev: Device, k: int, n: int, g: int, ms: tuple[int, ...], *, plan: bool) -> str:
    """Digest of the decisions of every M in ``ms`` for one (device, shape, group)."""
    h = hashlib.sha256()
    for m in ms:
        h.update(json.dumps([m, decide(m, k, n, g, dev, plan=plan)]).encode())
    return h.hexdigest()[:16]


#: M of the plans checked in the quick test (and of the readable sample): the routes'
#: edges and a few beyond. The slow test checks the plans of every M of :data:`MS`.
PLAN_MS = (1, 8, 9, 16, 17, 24, 32, 33, 48, 64, 65, 96, 97, 128, 129, 192, 256, 4096)


def snapshot() -> dict:
    digests = {
        name: {
            "routes": digest(*key, MS, plan=False),
            "plans": digest(*key, PLAN_MS, plan=True),
            "plans_all": digest(*key, MS, plan=True),
        }
        for key in keys()
        for name in [key_name(*key)]
    }
    sample = {f"{key_name(*key)} m{m}": decide(m, *key[1:], key[0]) for key in keys() if key[3] == 128 for m in PLAN_MS}
    return {"ms": list(MS), "plan_ms": list(PLAN_MS), "regs": REGS, "digests": digests, "sample": sample}


ROUTE_MAP = Path(__file__).resolve().parents[2] / "docs" / "routing-map.md"


def route_map() -> str:
    """docs/routing-map.md: for each layer shape (groups of 128), the M bands of 1..256 and
    the variant each gets, on sm_90 and on sm_80 (from the route tables, no GPU)."""
    from converter.gpu.plan import default_pipe

    out = [
        "# Route map",
        "",
        "Which GEMM variant `(kind, R, U, NS)` serves each M band of the seven models' layers",
        "(K x N, groups of 128). Generated from the route tables in `converter/gpu/plan/routing.py`",
        "by `python -m tests.gpu.plan_grid --write-map`; `tests/gpu/test_plan.py` fails when it",
        "is stale, so a routing change shows here as a diff. Why each route: [notes/routing.md](notes/routing.md).",
    ]
    for dev in (DEVICES[3], DEVICES[0]):
        out += ["", f"## {dev.arch} ({dev.sm_count} SMs, {dev.smem_per_block_optin // 1024} KB shared per block)", ""]
        out += ["| K x N | M bands |", "| --- | --- |"]
        for k, n in sorted(shapes()):
            bands: list[list] = []
            for m in range(1, 257):
                pipe = default_pipe(m, k, n, 8, dev.smem_per_block_optin, hopper=dev.hopper)
                if bands and bands[-1][2] == pipe:
                    bands[-1][1] = m
                else:
                    bands.append([m, m, pipe])
            cells = ", ".join(f"{a}-{b}: {p.kind.value} {p.r}x{p.u}x{p.ns}" for a, b, p in bands)
            out.append(f"| {k} x {n} | {cells} |")
    return "\n".join(out) + "\n"


def load() -> dict:
    with gzip.open(SNAPSHOT, "rt") as f:
        return json.load(f)


if __name__ == "__main__" and "--write-map" in sys.argv:
    ROUTE_MAP.write_text(route_map())
    print(ROUTE_MAP)
elif __name__ == "__main__" and "--write" in sys.argv:
    data = snapshot()
    with gzip.GzipFile(SNAPSHOT, "wb", mtime=0) as f:
        f.write(json.dumps(data, indent=0, sort_keys=True).encode())
    print(f"{SNAPSHOT}: {len(data['digests'])} rows x {len(MS)} M, {len(data['sample'])} sample decisions")

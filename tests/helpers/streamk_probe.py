"""The persistent Hopper kernel with probe hooks, and what the scripts that time it share
(scripts/probe_streamk.py, probe_block_skew.py, ab_streamk_variants.py).

The patches are plain text replacements on ``kernels/marlin_streamk.cu``; each asserts
that its anchor is still there once, so that a kernel edit breaks the probe loudly (and
tests/test_probe_streamk.py in CI) instead of timing the wrong thing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The L2 the weight copies must rotate past (an H200 has 60 MB; 3 x that, so that no call
#: finds its layer there).
L2_ROTATION_BYTES = 3 * 60 * 2**20

# The source's text the patches anchor on. A kernel edit that moves one of these makes
# the script fail loudly (AssertionError naming the anchor) instead of timing the wrong thing.
_NOLOAD = [
    (  # thread 0 still arrives on the stage's barrier, with no bytes to wait for
        "                if (pt == 0) {  // the activations, read by wgmma through the async proxy\n",
        "                if (pt == 0 && PROBE_NOLOAD_V) mbar_expect_tx(bar, 0);\n"
        "                if (pt == 0 && !PROBE_NOLOAD_V) {"
        "  // the activations, read by wgmma through the async proxy\n",
    ),
    (
        "                if (!b_units) {  // Marlin's order",
        "                if (!b_units && !PROBE_NOLOAD_V) {  // Marlin's order",
    ),
]
_FAKE = "af[v % WG_DEPTH][0][0] ^ af[v % WG_DEPTH][0][1] ^ af[v % WG_DEPTH][1][0] ^ af[v % WG_DEPTH][1][1]"
_WORK = [
    (
        "    gs_fragments(bw[0], af[0]);\n    gs_fragments(bw[1], af[1]);",
        "    GSF(bw[0], af[0]);\n    GSF(bw[1], af[1]);",
    ),
    (
        "            gs_fragments(bw[u], af[u % WG_DEPTH]);\n"
        "            gs_fragments(bw[u + 1], af[(u + 1) % WG_DEPTH]);",
        "            GSF(bw[u], af[u % WG_DEPTH]);\n            GSF(bw[u + 1], af[(u + 1) % WG_DEPTH]);",
    ),
    (
        "            Wgmma<T>::mma(gp[0], af[v % WG_DEPTH][0], desc, v > 0);\n"
        "            Wgmma<T>::mma(gp[1], af[v % WG_DEPTH][1], desc, v > 0);\n"
        "            Wgmma<T>::mma(gx, cf, desc, v > 0);",
        "#ifdef PROBE_NOMMA\n"
        f"            gp[0][0] += __uint_as_float({_FAKE} ^ cf[v & 3]) + (float)desc;\n"
        "#else\n"
        "            Wgmma<T>::mma(gp[0], af[v % WG_DEPTH][0], desc, v > 0);\n"
        "            Wgmma<T>::mma(gp[1], af[v % WG_DEPTH][1], desc, v > 0);\n"
        "            Wgmma<T>::mma(gx, cf, desc, v > 0);\n"
        "#endif",
    ),
    (
        "                        weight_fragments_pairs<HAS_DELTA, 2>(bw[u], s2, d2, af[u % WG_DEPTH]);",
        "#ifdef PROBE_NODQ\n"
        "                        for (int j_ = 0; j_ < 2; ++j_) for (int e_ = 0; e_ < 4; ++e_)"
        " af[u % WG_DEPTH][j_][e_] = bw[u][j_] + e_ + s2[0] + d2[1];\n"
        "#else\n"
        "                        weight_fragments_pairs<HAS_DELTA, 2>(bw[u], s2, d2, af[u % WG_DEPTH]);\n"
        "#endif",
    ),
    (
        "                            Wgmma<T>::mma(acc[0], af[v % WG_DEPTH][0], desc);\n"
        "                            Wgmma<T>::mma(acc[1], af[v % WG_DEPTH][1], desc);",
        "#ifdef PROBE_NOMMA\n"
        f"                            acc[0][0] += __uint_as_float({_FAKE}) + (float)desc;\n"
        "#else\n"
        "                            Wgmma<T>::mma(acc[0], af[v % WG_DEPTH][0], desc);\n"
        "                            Wgmma<T>::mma(acc[1], af[v % WG_DEPTH][1], desc);\n"
        "#endif",
    ),
]
_STAMPS = [
    (
        "    const int tid = threadIdx.x, lane = tid & 31;\n",
        "    const int tid = threadIdx.x, lane = tid & 31;\n    if (tid == 0) STAMP(0);\n",
    ),
    ("    __syncthreads();\n    auto piece_at", "    __syncthreads();\n    if (tid == 0) STAMP(1);\n    auto piece_at"),
    (
        "    mbar_wait(full0 + 8 * slot, (q / NS) & 1u);\n    const u32 sb = ring + slot * STAGE;",
        "    mbar_wait(full0 + 8 * slot, (q / NS) & 1u);\n    if (q == 0 && threadIdx.x == 0) STAMP(2);\n"
        "    const u32 sb = ring + slot * STAGE;",
    ),
    (
        "                mbar_wait(full0 + 8 * slot, (q / NS) & 1u);\n"
        "                const u32 sb = ring + slot * L::STAGE;\n"
        "                const unsigned long long desc0",
        "                mbar_wait(full0 + 8 * slot, (q / NS) & 1u);\n"
        "                if (q == 0 && tid == 0) STAMP(2);\n"
        "                const u32 sb = ring + slot * L::STAGE;\n                const unsigned long long desc0",
    ),
    (
        "        return;  // every copy completes",
        "        if (pt == 0) STAMP(5);\n        return;  // every copy completes",
    ),
    (
        "        wgmma_wait<0>();\n        __syncwarp();\n"
        "        if (lane == 0) mbar_arrive(empty0 + 8 * ((q - 1) % NS));\n",
        "        wgmma_wait<0>();\n        __syncwarp();\n"
        "        if (lane == 0) mbar_arrive(empty0 + 8 * ((q - 1) % NS));\n"
        "        if (tid == 0 && i >= i1) STAMP(3);\n",
    ),
    (
        "        // ---- epilogue: acc + bias in fp32, one rounding, stored from registers ----\n",
        "        if (tid == 0 && i >= i1) STAMP(6);\n"
        "        // ---- epilogue: acc + bias in fp32, one rounding, stored from registers ----\n",
    ),
]
_HEAD = """#ifdef PROBE_NOLOAD
#define PROBE_NOLOAD_V 1
#else
#define PROBE_NOLOAD_V 0
#endif
"""
_HELPERS = r"""
#ifdef PROBE_NODQ
#define GSF(bw, af) { for (int j_ = 0; j_ < 2; ++j_) for (int e_ = 0; e_ < 4; ++e_) af[j_][e_] = bw[j_] + e_; }
#else
#define GSF(bw, af) gs_fragments(bw, af)
#endif
__device__ unsigned long long probe_ts[1024][8];
__device__ __forceinline__ unsigned long long probe_now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
#ifdef PROBE_TS
#define STAMP(i) do { probe_ts[blockIdx.x][i] = probe_now(); } while (0)
#else
#define STAMP(i) do {} while (0)
#endif
"""
VARIANTS = {
    "base": (),
    "noload": ("-DPROBE_NOLOAD",),
    "nodq_nomma": ("-DPROBE_NODQ", "-DPROBE_NOMMA"),
    "none": ("-DPROBE_NOLOAD", "-DPROBE_NODQ", "-DPROBE_NOMMA"),
}
# stamp slot -> what it marks, in the order of a call
STAMP_NAMES = {0: "entry", 1: "setup", 2: "first_data", 5: "producer_done", 3: "loop_done", 6: "fixup_done", 4: "exit"}


def instrumented_source(kernel_dir: Path) -> str:
    """kernels/marlin_streamk.cu with the PROBE_* hooks (every anchor checked)."""
    src = (kernel_dir / "marlin_streamk.cu").read_text(encoding="utf-8")
    for old, new in _NOLOAD + _WORK + _STAMPS:
        assert src.count(old) == 1, f"anchor not found once in marlin_streamk.cu: {old[:70]!r}"
        src = src.replace(old, new)
    tail = "            }\n    }\n}\n"
    assert src.endswith(tail), "the kernel's closing lines moved"
    src = src[: -len("    }\n}\n")] + "    }\n    if (tid == 0) STAMP(4);\n}\n"
    anchor = "template <int T, int U, int NS, bool HAS_DELTA, int STAGE"
    assert src.count(anchor) == 1, "gs_stage's template line moved"
    i = src.index(anchor)
    return _HEAD + src[:i] + _HELPERS + src[i:]


def weight_copies(size_k: int, size_n: int) -> int:
    """How many copies of a K x N INT4 layer a timing rotates over: at least 2, and enough
    that their codes exceed ``L2_ROTATION_BYTES``."""
    return max(2, -(-L2_ROTATION_BYTES // (size_k * size_n // 2)))


def persistent_cases(spec: str, tuning: Any = None) -> dict[tuple[int, int, int], tuple]:
    """``"K:N:M,..."`` as ``{(K, N, M): the planner's pipe on an H200}`` (group 128),
    with ``tuning`` (default: the default knobs; bf16 calls pass ``for_act``'s).

    Raises:
        ValueError: a row the persistent kinds (``hopper_sk``, ``hopper_skg``) do not
            serve, naming it and the kind that does.
    """
    from converter.gpu.plan import DEFAULT_TUNING, KernelKind, default_pipe

    pipes = {}
    for c in spec.split(","):
        k, n, m = (int(v) for v in c.split(":"))
        pipe = default_pipe(m, k, n, 8, tuning=tuning or DEFAULT_TUNING, hopper=True)
        if pipe[0] not in (KernelKind.HOPPER_SK, KernelKind.HOPPER_SKG):
            raise ValueError(f"{k}x{n} at M={m} is served by {pipe[0].value}, not the persistent kernel")
        pipes[(k, n, m)] = pipe
    return pipes


def random_layers(cp: Any, rng: Any, size_k: int, size_n: int, *, unit_major: bool) -> list[dict[str, Any]]:
    """:func:`weight_copies` random group-128 layers on the GPU, each as ``marlin_gemm``
    keyword arguments: ``B`` (random codes), ``scales``, ``delta`` (fp16 operand) and
    ``b_units`` (the unit-major copy when ``unit_major``, else None)."""
    import numpy as np

    from converter.gpu import kernels

    g = size_k // 128
    layers = []
    for _ in range(weight_copies(size_k, size_n)):
        b = cp.asarray(rng.integers(-(2**31), 2**31, (size_k // 16, 2 * size_n), dtype=np.int64).astype(np.int32))
        s = cp.asarray((rng.uniform(0.5, 2, (g, size_n)) / 64).astype(np.float16))
        d = kernels.prepare_delta(cp.asarray(rng.normal(0, 0.01, (g, size_n)).astype(np.float32)))
        units = kernels.prepare_b_units(b, size_k, size_n) if unit_major else None
        layers.append({"B": b, "scales": s, "delta": d, "b_units": units})
    return layers


def route_streamk(build: Any, lookup: Callable[[str], Any]) -> Callable[[], None]:
    """Serve ``marlin_streamk.cu``'s kernels from ``lookup(name)`` (``kernels.marlin_gemm``
    resolves ``build.function`` at each call); returns the function that undoes it."""
    shipped = build.function

    def function(source: str, name: str, act: str = "float16") -> Any:
        return lookup(name) if source == "marlin_streamk.cu" else shipped(source, name, act)

    build.function = function

    def restore() -> None:
        build.function = shipped

    return restore

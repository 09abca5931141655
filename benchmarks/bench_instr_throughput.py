"""Throughput of the instructions the weight paths spend per B word, on this GPU.

Each op runs in 8 independent chains a thread (so latency is hidden), 16 x 8 a loop
trip, on 8 blocks of 256 threads per SM; the result is instructions per SM per clock at
the device's nominal clock, and each op's rate over fp32 FFMA's, timed in the same run.
Run on the GPU machine: PYTHONPATH=$PWD python3 benchmarks/bench_instr_throughput.py
[--json-out FILE]. It answers which of the bf16 weight's instructions (docs/notes/bf16.md)
are full rate: an issue-bound kernel's time follows the count of half-rate ones.

The mixes (``a+b``: half the chains run ``a``, half ``b``) answer which of them share a
pipe: two half-rate ops on one pipe together issue at about one op's rate, on two pipes
at about twice it.
"""

from __future__ import annotations

import argparse
import json

SOURCE = r"""
extern "C" __global__ void probe(unsigned* out, int iters, unsigned seed) {
    unsigned x[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = seed + threadIdx.x * 8 + i;
    for (int it = 0; it < iters; ++it) {
#pragma unroll
        for (int r = 0; r < 16; ++r) {
#pragma unroll
            for (int i = 0; i < 8; ++i) { BODY }
        }
    }
    unsigned s = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) s ^= x[i];
    if (s == 0x12345678u) out[0] = s;  // keeps the chains live
}
"""

#: One instruction on x[i] in place (typed registers moved through .b32: the moves are free).
OPS = {
    "ffma_f32": 'asm volatile("{.reg .f32 a; mov.b32 a, %0; fma.rn.f32 a, a, a, a; mov.b32 %0, a;}" : "+r"(x[i]));',
    "cvt_bf16x2_f32": 'asm volatile("{.reg .f32 a; mov.b32 a, %0; cvt.rn.bf16x2.f32 %0, a, a;}" : "+r"(x[i]));',
    "fma_bf16x2": 'asm volatile("fma.rn.bf16x2 %0, %0, %0, %0;" : "+r"(x[i]));',
    "fma_f16x2": 'asm volatile("fma.rn.f16x2 %0, %0, %0, %0;" : "+r"(x[i]));',
    "lop3": 'asm volatile("lop3.b32 %0, %0, 0x000F0000, 0x43000000, 0xEA;" : "+r"(x[i]));',
    "shf": 'asm volatile("shf.r.wrap.b32 %0, %0, %0, 8;" : "+r"(x[i]));',
    "cvt_f32_f16": 'asm volatile("{.reg .b16 lo, hi; .reg .f32 a; mov.b32 {lo, hi}, %0; '
    'cvt.f32.f16 a, lo; mov.b32 %0, a;}" : "+r"(x[i]));',
    # a multiplier the compiler cannot fold into a shift (the seed is a kernel argument)
    "mul_hi_u32": 'asm volatile("mul.hi.u32 %0, %0, %1;" : "+r"(x[i]) : "r"(seed));',
}

#: Pairs timed together (even chains run the first, odd chains the second).
MIXES = (
    ("lop3", "shf"),
    ("lop3", "ffma_f32"),
    ("lop3", "cvt_bf16x2_f32"),
    ("lop3", "cvt_f32_f16"),
    ("cvt_bf16x2_f32", "cvt_f32_f16"),
    ("cvt_f32_f16", "ffma_f32"),
    ("lop3", "mul_hi_u32"),
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args()
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    sms, clk_khz = props["multiProcessorCount"], props["clockRate"]
    res: dict = {"device": props["name"].decode(), "sms": sms, "clock_khz_nominal": clk_khz, "per_sm_per_clock": {}}
    threads, blocks = 256, sms * 8
    out = cp.zeros(1, cp.uint32)
    bodies = dict(OPS)
    for a, b in MIXES:
        bodies[f"{a}+{b}"] = f"if (i & 1) {{ {OPS[b]} }} else {{ {OPS[a]} }}"
    for name, body in bodies.items():
        k = cp.RawKernel(SOURCE.replace("BODY", body), "probe")
        args_k = (out, cp.int32(args.iters), cp.uint32(7))
        k((blocks,), (threads,), args_k)
        cp.cuda.runtime.deviceSynchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        best = float("inf")
        for _ in range(5):
            start.record()
            k((blocks,), (threads,), args_k)
            end.record()
            end.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(start, end) * 1e-3)
        n = blocks * threads * args.iters * 16 * 8
        res["per_sm_per_clock"][name] = round(n / best / sms / (clk_khz * 1e3), 1)
    ffma = res["per_sm_per_clock"]["ffma_f32"]
    print(res["device"])
    for name, rate in res["per_sm_per_clock"].items():
        print(f"{name:16s} {rate:6.1f} per SM per clock   {rate / ffma:.2f}x FFMA")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

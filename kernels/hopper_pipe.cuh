// hopper_pipe.cuh: the pieces both Hopper GEMMs (sm_90a) build on: marlin_wgmma.cu
// (one block per K split, every warp copies and computes) and marlin_streamk.cu
// (persistent, a producer warpgroup and two consumer warpgroups). wgmma's no-swizzle and
// 128-byte-swizzle descriptors, the weights as its register operand, mbarriers and bulk copies; all from
// the PTX ISA (sections "Asynchronous Warpgroup Level Matrix Multiply-Accumulate",
// "mbarrier", "cp.async.bulk"), no library code.

#ifndef HOPPER_PIPE_CUH
#define HOPPER_PIPE_CUH

#include "marlin_common.cuh"

// The no-swizzle shared-memory matrix descriptor of wgmma (PTX ISA, "Matrix
// Descriptor"): start address, leading byte offset (K direction) and stride byte
// offset (token direction), each in 16-byte units, swizzle mode 0.
__device__ __forceinline__ unsigned long long wg_desc(u32 addr, u32 k_step) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | ((unsigned long long)(k_step >> 4) << 16) |
           ((unsigned long long)(128 >> 4) << 32);
}

// The 128-byte-swizzled K-major descriptor (PTX ISA, "Matrix Descriptor", swizzle mode
// 1): rows of 64 fp16 values (128 bytes), 8 rows a 1024-byte atom whose 16-byte chunk
// j of row r sits at chunk j ^ r (the bulk tensor copy's CU_TENSOR_MAP_SWIZZLE_128B
// writes exactly this), atoms 1024 bytes apart along the tokens (stride byte offset);
// the leading byte offset is unused for a K-major swizzled operand whose 16 K-values
// lie in one row, and is set to 1 as the ISA suggests. The atom must start 1024-byte
// aligned (base offset 0); the k-th 16-value step within a row is the start address
// moved on by 32 k bytes, the hardware applying the XOR to the address it forms.
__device__ __forceinline__ unsigned long long wg_desc_sw128(u32 addr) {
    return (unsigned long long)((addr & 0x3FFFFu) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}

// J consecutive 32-bit words of shared memory (4 J bytes, 4 J-byte aligned): the B
// words of a lane's J tiles, or the fp16 pairs of its 2 J scales.
template <int J>
__device__ __forceinline__ void lds_words(u32 addr, u32 (&w)[J]) {
    if constexpr (J == 4) {
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(addr) : "memory");
    } else if constexpr (J == 2) {
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "r"(addr) : "memory");
    } else {
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(w[0]) : "r"(addr) : "memory");
    }
}

template <int J>
__device__ __forceinline__ void splat_cols(u32 addr, u32 (&h)[2 * J]) {
    u32 w[J];
    lds_words<J>(addr, w);
#pragma unroll
    for (int p = 0; p < 2 * J; ++p) h[p] = h_splat((u16)(w[p >> 1] >> (16 * (p & 1))));
}

// One k-tile of one warp: dequantize its J words into the A fragments of wgmma
// jj = 0..J-1 (slot p = 2 jj + h of the scales is column 16 (J fg + jj) + g + 8 h of
// the warp's block).
template <bool HAS_DELTA, int J>
__device__ __forceinline__ void weight_fragments(const u32 (&w)[J], const u32 (&s2)[2 * J], const u32 (&d2)[2 * J],
                                                 u32 (&af)[J][4]) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
        u32 m[4];
        codes_minus8(w[j], m);
        u32 b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            b[i] = HAS_DELTA ? h2_fma(m[i], s2[2 * j + (i >> 1)], d2[2 * j + (i >> 1)]) : h2_mul(m[i], s2[2 * j + (i >> 1)]);
        af[j][0] = b[0];
        af[j][1] = b[2];
        af[j][2] = b[1];
        af[j][3] = b[3];
    }
}

// The descriptor `d` moved on by `bytes` (a multiple of 16) in shared memory: only the
// start-address field changes and it cannot carry out (shared addresses are below
// 2^18), so one 32-bit add on the low word does it.
__device__ __forceinline__ unsigned long long wg_desc_at(unsigned long long d, u32 bytes) {
    return (d & 0xFFFFFFFF00000000ull) | (u32)((u32)d + (bytes >> 4));
}

// a * {s, s} + {d, d} (fma.rn.f16x2) for the fp16 halves s of `s_pair` and d of `d_pair`
// picked by H: the splat is written as a PTX vector move, which ptxas folds into the
// HFMA2's operand selectors (.H0_H0 / .H1_H1) instead of spending instructions on it.
template <int H, bool HAS_DELTA>
__device__ __forceinline__ u32 h2_scale_half(u32 a, u32 s_pair, u32 d_pair) {
    u32 r;
    if constexpr (HAS_DELTA) {
        asm("{\n.reg .f16 s0, s1, d0, d1;\n.reg .b32 ss, dd;\n"
            "mov.b32 {s0, s1}, %2;\nmov.b32 {d0, d1}, %3;\n"
            "mov.b32 ss, {s%4, s%4};\nmov.b32 dd, {d%4, d%4};\n"
            "fma.rn.f16x2 %0, %1, ss, dd;\n}"
            : "=r"(r) : "r"(a), "r"(s_pair), "r"(d_pair), "n"(H));
    } else {
        asm("{\n.reg .f16 s0, s1;\n.reg .b32 ss;\n"
            "mov.b32 {s0, s1}, %2;\nmov.b32 ss, {s%3, s%3};\n"
            "mul.rn.f16x2 %0, %1, ss;\n}"
            : "=r"(r) : "r"(a), "r"(s_pair), "n"(H));
    }
    return r;
}

// weight_fragments for either activation type, the columns' scales and deltas as WCol
// (marlin_common.cuh): slot 2 j is column 16 (J fg + j) + g, 2 j + 1 that + 8.
template <bool HAS_DELTA, int J>
__device__ __forceinline__ void weight_fragments_cols(const u32 (&w)[J], const WCol (&c)[2 * J], u32 (&af)[J][4]) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
        u32 m[4];
        word_weights<HAS_DELTA>(w[j], c[2 * j], c[2 * j + 1], m);
        af[j][0] = m[0];
        af[j][1] = m[2];
        af[j][2] = m[1];
        af[j][3] = m[3];
    }
}

// weight_fragments with the scales and deltas as loaded: s_pair[j] (d_pair[j]) holds
// the fp16 scales (deltas) of columns 16 (J fg + j) + g and + 8 of the warp's block,
// low half first, exactly as the S (D) slot stores them. The same arithmetic and bits.
// fp16 only: the bf16 weight needs the scales in fp32, which the caller converts once
// per group and passes to weight_fragments_cols.
template <bool HAS_DELTA, int J>
__device__ __forceinline__ void weight_fragments_pairs(const u32 (&w)[J], const u32 (&s_pair)[J],
                                                       const u32 (&d_pair)[J], u32 (&af)[J][4]) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
        u32 m[4];
        codes_minus8(w[j], m);
        af[j][0] = h2_scale_half<0, HAS_DELTA>(m[0], s_pair[j], d_pair[j]);
        af[j][1] = h2_scale_half<1, HAS_DELTA>(m[2], s_pair[j], d_pair[j]);
        af[j][2] = h2_scale_half<0, HAS_DELTA>(m[1], s_pair[j], d_pair[j]);
        af[j][3] = h2_scale_half<1, HAS_DELTA>(m[3], s_pair[j], d_pair[j]);
    }
}

// --- mbarrier and bulk copies (PTX ISA: mbarrier, cp.async.bulk) ---
__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// size bytes (a multiple of 16, 16-byte aligned ends) from global to this block's shared
// memory; completes on `bar` as transaction bytes (the async proxy: no generic fence).
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// A tensor map (the driver's CUtensorMap: 128 opaque bytes, 64-byte aligned), passed
// by value as a __grid_constant__ kernel parameter so that its address is usable by
// the bulk tensor copy (PTX ISA: "Tensor map").
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};
// One box of a 2-D tensor map at coordinates (c0, c1), innermost first, into this
// block's shared memory, laid out as the map says (its swizzle included); completes on
// `bar` as the box's bytes, out-of-range elements included (they arrive as zeros).
__device__ __forceinline__ void tensor_load_2d(u32 dst, const TensorMap* map, int c0, int c1, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
        "[%4];" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}
// An arrival on `bar` when every cp.async this thread issued before has landed; the
// barrier's count includes it (.noinc).
__device__ __forceinline__ void cp_async_arrive_noinc(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// One arrival on `bar` (the consumers' "slot is free" signal to the producer).
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// The same when `cond` holds, as a predicated instruction rather than a branch.
__device__ __forceinline__ void mbar_arrive_if(u32 bar, bool cond) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(bar),
        "r"((int)cond)
        : "memory");
}
// Hand registers between the warpgroups of a block (every warp of the warpgroup runs
// it; the kernel needs a register cap at entry, __launch_bounds__(threads, 1)).
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
}
// Named barrier `id` over `count` threads (whole warps): the consumer warpgroups meet
// without the producer warpgroup, which never waits on a block-wide barrier after setup.
__device__ __forceinline__ void named_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}
// A counter another block moved, read with acquire: its writer's fenced stores are
// visible to this thread after it.
__device__ __forceinline__ int ld_acquire(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ float ldcg_f32(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

#endif  // HOPPER_PIPE_CUH

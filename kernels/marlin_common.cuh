// marlin_common.cuh: small device helpers shared by marlin_gemm.cu, dequant.cu and
// asym_correction.cu, which `#include` it; converter/gpu/kernels.py passes this folder
// to NVRTC with -I. No CUDA header is pulled in, so NVRTC needs no toolkit include path.
//
// Everything here is written against the PTX ISA (fp16x2 arithmetic, mma.m16n8k16
// fragment layouts) and the layout facts of checkpoint-formats.md section 4.
// Values of fp16 type travel as raw bits: `unsigned short` for one, `unsigned int`
// holding two (low half = lower index) for a pair.
//
// The activation type ("act": A and C) is fp16, or bf16 when NVRTC gets -DMARLIN_BF16
// (converter/gpu/build.py compiles a file once per type it is asked for). Scales,
// deltas and biases stay fp16 in both: the artifact's operands. What differs is kept
// to this file (codes, weights, conversions) and the mma type string ACT_PTX; the
// arithmetic of the bf16 forms is argued in docs/notes/bf16.md.

#ifndef MARLIN_COMMON_CUH
#define MARLIN_COMMON_CUH

typedef unsigned int u32;
typedef unsigned short u16;

// fp16x2 arithmetic with explicit round-to-nearest. The `.rn` suffix stops ptxas from
// contracting a mul+add pair into an fma, which would change the bits that the NumPy
// twins (converter/gpu/reference.py) reproduce exactly.
__device__ __forceinline__ u32 h2_sub(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ u32 h2_mul(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ u32 h2_fma(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ u16 f32_to_h(float x) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
__device__ __forceinline__ float h_to_f32(u16 h) {
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h));
    return x;
}
__device__ __forceinline__ u32 h_splat(u16 h) { return (u32)h | ((u32)h << 16); }

// Bits as fp32 (a register move; no header is included for __uint_as_float).
__device__ __forceinline__ float u32_as_f32(u32 b) {
    float x;
    asm("mov.b32 %0, %1;" : "=f"(x) : "r"(b));
    return x;
}

#ifdef MARLIN_BF16
#define ACT_PTX "bf16"
// bf16 -> fp32 is exact: the bf16 bits are the top half of the fp32 ones.
__device__ __forceinline__ float act_to_f32(u16 h) { return u32_as_f32((u32)h << 16); }
__device__ __forceinline__ u16 f32_to_act(float x) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
#else
#define ACT_PTX "f16"
__device__ __forceinline__ float act_to_f32(u16 h) { return h_to_f32(h); }
__device__ __forceinline__ u16 f32_to_act(float x) { return f32_to_h(x); }
#endif

// Read-only, non-coherent loads of operands no kernel writes while it runs. No L2
// cache-policy hint is used anywhere (upstream's hinted async load is what crashed on
// Hopper, issue 6).
__device__ __forceinline__ float ldg_f32(const float* p) {
    float v;
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u16 ldg_u16(const u16* p) {
    u16 v;
    asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}
// L2-only load: partial sums written by other multiprocessors must not be served from
// a stale L1 line.
__device__ __forceinline__ float2 ldcg_f2(const float2* p) {
    float2 v;
    asm volatile("ld.global.cg.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "l"(p));
    return v;
}

// The fp16 exponent trick (checkpoint-formats.md 4.2). OR-ing a nibble into the
// mantissa of 1024.0 (0x6400) gives 1024 + q exactly, so one subtraction of 1032 gives
// q - 8. A nibble sitting 4 bits higher gives 1024 + 16 q, and (x / 16) - 72 = q - 8,
// done as one fma whose every step is exact.
#define FP16_EXP_BITS 0x64006400u
#define FP16_1032 0x64086408u
#define FP16_ONE_16TH 0x2C002C00u
#define FP16_MINUS_72 0xD480D480u

// Codes (r, c) of one B word for a lane with r0 = 2 (lane % 4), c0 = lane / 4
// (section 4.3), nibbles 0..7: (r0,c0) (r0+8,c0) (r0,c0+8) (r0+8,c0+8) (r0+1,c0)
// (r0+9,c0) (r0+1,c0+8) (r0+9,c0+8). Out: q - 8 as fp16x2 for the mma B fragments:
//   m[0] = {r0, r0+1} at c0      m[1] = {r0+8, r0+9} at c0
//   m[2] = {r0, r0+1} at c0+8    m[3] = {r0+8, r0+9} at c0+8
__device__ __forceinline__ u32 lop3_and_or(u32 a, u32 mask, u32 bits) {
    // (a & mask) | bits in one LOP3 (ptxas splits it in two when both are immediates).
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(mask), "r"(bits));
    return d;
}
#ifndef MARLIN_BF16
__device__ __forceinline__ void codes_minus8(u32 w, u32 m[4]) {
    const u32 hi = w >> 8;
    const u32 lo_mask = 0x000F000Fu, hi_mask = 0x00F000F0u, ex = FP16_EXP_BITS;
    m[0] = h2_sub(lop3_and_or(w, lo_mask, ex), FP16_1032);
    m[1] = h2_fma(lop3_and_or(w, hi_mask, ex), FP16_ONE_16TH, FP16_MINUS_72);
    m[2] = h2_sub(lop3_and_or(hi, lo_mask, ex), FP16_1032);
    m[3] = h2_fma(lop3_and_or(hi, hi_mask, ex), FP16_ONE_16TH, FP16_MINUS_72);
}
#else
// bf16 has 8 bits of precision: OR-ing a nibble into the mantissa of 128.0 (0x4300)
// gives 128 + q exactly, and 128 + q - 136 = q - 8 is exact too. Bit 7 of a bf16 half
// is its exponent's lowest bit, so the fp16 form's "nibble 4 bits up" has no bf16 twin:
// each nibble is shifted down to bits 0-3 first (3 more shifts per word). The
// subtraction is an fma with 1.0 because sub.bf16x2 needs sm_90 and fma.bf16x2 sm_80.
#define BF16_EXP_BITS 0x43004300u
#define BF16X2_ONES 0x3F803F80u
#define BF16X2_MINUS_136 0xC308C308u
__device__ __forceinline__ u32 bf2_fma(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ void codes_minus8(u32 w, u32 m[4]) {
    const u32 lo_mask = 0x000F000Fu, ex = BF16_EXP_BITS;
    m[0] = bf2_fma(lop3_and_or(w, lo_mask, ex), BF16X2_ONES, BF16X2_MINUS_136);
    m[1] = bf2_fma(lop3_and_or(w >> 4, lo_mask, ex), BF16X2_ONES, BF16X2_MINUS_136);
    m[2] = bf2_fma(lop3_and_or(w >> 8, lo_mask, ex), BF16X2_ONES, BF16X2_MINUS_136);
    m[3] = bf2_fma(lop3_and_or(w >> 12, lo_mask, ex), BF16X2_ONES, BF16X2_MINUS_136);
}
#endif

// The per-weight paths' weights W = (q - 8) s (+ d) of one B word, as the four mma
// fragments codes_minus8 orders them (m[0] = {r0, r0+1} at column a, m[1] = {r0+8, r0+9}
// at a, m[2], m[3] the same at column b = a + 8), from the two columns' scale and delta
// held as a WCol (wcol(): from the fp16 bits, once per group).
#ifndef MARLIN_BF16
// fp16: fma.rn.f16x2 on splats; the weight rounded once to fp16.
struct WCol {
    u32 s2, d2;
};
template <bool HAS_DELTA>
__device__ __forceinline__ WCol wcol(u16 s, u16 d) {
    return WCol{h_splat(s), HAS_DELTA ? h_splat(d) : 0u};
}
template <bool HAS_DELTA>
__device__ __forceinline__ u32 weight2(u32 m, const WCol& c) {
    return HAS_DELTA ? h2_fma(m, c.s2, c.d2) : h2_mul(m, c.s2);
}
template <bool HAS_DELTA>
__device__ __forceinline__ void word_weights(u32 w, const WCol& a, const WCol& b, u32 m[4]) {
    codes_minus8(w, m);
    m[0] = weight2<HAS_DELTA>(m[0], a);
    m[1] = weight2<HAS_DELTA>(m[1], a);
    m[2] = weight2<HAS_DELTA>(m[2], b);
    m[3] = weight2<HAS_DELTA>(m[3], b);
}
#else
// bf16: the fp16 scale and delta do not fit bf16's 8 bits, so the weight is formed in
// fp32 and rounded to bf16 by one cvt.rn per pair (docs/notes/bf16.md). The codes come
// out as the fp16 paths make them, two to a word by one lop3 with no arithmetic: nibbles
// at bits 0-3 and 16-19 OR-ed into 0x6400 (1024.0 in fp16, unit 1) are 1024 + q, at bits
// 4-7 and 20-23 they are 1024 + 16 q; the word shifted right by 8 gives the other four.
// Each half then goes to fp32 (cvt.f32.f16: exact, and on the FMA pipe, where the lop3,
// the shift and the cvt.rn to bf16 all share the ALU pipe, which bounded the first bf16
// forms: notes/bf16.md), and
//   W = fma(1024 + q, s, d - 1032 s)  or  fma(1024 + 16 q, s / 16, d - 72 s)
// with the constants rounded to fp32 once per column (wcol; s / 16 is exact): the rows
// r0 + 8, r0 + 9 of each fragment (the odd nibbles: bits 4-7 and 20-23 of the word and of
// the word shifted) take the second. Per word:
// 1 shift, 4 lop3, 8 cvt.f32.f16, 8 FFMA, 4 cvt.rn (9 on the ALU pipe; the form with
// the codes OR-ed straight into fp32 took 15). W is the fp32 fma of the exact
// (q - 8) s + d whenever the constant is exact, which holds for the converter's
// delta = s (8 - z): d = fp16(delta) is at most 8 s with s's unit or a coarser one, so
// d - 1032 s needs at most 22 bits; in general the twin (reference_bf16.dequant) rounds
// the constants as the kernel does.
struct WCol {
    float s, c, s16, c16;  // c for the codes 1024 + q; s16, c16 for 1024 + 16 q
};
template <bool HAS_DELTA>
__device__ __forceinline__ WCol wcol(u16 s, u16 d) {
    const float sf = h_to_f32(s), df = HAS_DELTA ? h_to_f32(d) : 0.f;
    return WCol{sf, fmaf(-1032.f, sf, df), sf * 0.0625f, fmaf(-72.f, sf, df)};
}
// The weights of a pair of fp16 codes (low half first) as one bf16x2.
__device__ __forceinline__ u32 weight_pair(u32 codes, float s, float c) {
    float lo, hi;
    asm("{\n.reg .b16 l, h;\nmov.b32 {l, h}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, h;\n}"
        : "=f"(lo), "=f"(hi) : "r"(codes));
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(fmaf(hi, s, c)), "f"(fmaf(lo, s, c)));
    return r;
}
template <bool HAS_DELTA>
__device__ __forceinline__ void word_weights(u32 w, const WCol& a, const WCol& b, u32 m[4]) {
    // nibble i of the word is m[i % 4]'s low half (i < 4) or high half (i >= 4)
    const u32 w8 = w >> 8;
    m[0] = weight_pair(lop3_and_or(w, 0x000F000Fu, 0x64006400u), a.s, a.c);
    m[1] = weight_pair(lop3_and_or(w, 0x00F000F0u, 0x64006400u), a.s16, a.c16);
    m[2] = weight_pair(lop3_and_or(w8, 0x000F000Fu, 0x64006400u), b.s, b.c);
    m[3] = weight_pair(lop3_and_or(w8, 0x00F000F0u, 0x64006400u), b.s16, b.c16);
}
#endif

// Offset codes (the per-group arithmetic with a delta: marlin_decode.cu and the
// persistent kernel's GS form in marlin_streamk.cu): the codes as the mma's A operand
// with no fp16 arithmetic, 4 lop3 and 1 shift per 8 codes instead of 4 more sub / fma.
// A k-row r < 8 of a 16-row tile (m[0], m[2]) gets 1024 + q (the nibble in the mantissa
// of 1024.0), a row r >= 8 (m[1], m[3], the nibble 4 bits up) 64 + q (in the mantissa
// of 64.0, whose unit is 1/16); both exact. A tile's mma then sums A (q - 8) plus
// A (1032 | 72); one more mma per k-tile, with OFFSET_SUMS_A as its A operand (-1032 |
// -72 in the rows g of the fragment, ones in the rows g + 8), sums Y = -A (1032 | 72)
// beside X = sum A, and the group's close adds Y back. The two sums cancel to fp32
// rounding of values ~1000x the result's size (reference.gemm_error_bound).
#define FP16X2_ONES 0x3C003C00u
#define FP16X2_MINUS_1032 0xE408E408u
#define FP16X2_64 0x54005400u
#ifndef MARLIN_BF16
__device__ __forceinline__ void offset_codes(u32 w, u32 m[4]) {
    const u32 hi = w >> 8;
    const u32 lo_mask = 0x000F000Fu, hi_mask = 0x00F000F0u;
    m[0] = lop3_and_or(w, lo_mask, FP16_EXP_BITS);
    m[1] = lop3_and_or(w, hi_mask, FP16X2_64);
    m[2] = lop3_and_or(hi, lo_mask, FP16_EXP_BITS);
    m[3] = lop3_and_or(hi, hi_mask, FP16X2_64);
}
// The A fragment {a0, a1, a2, a3} of the offset-sum mma: rows g give Y, rows g + 8 X.
#define OFFSET_SUMS_A {FP16X2_MINUS_1032, FP16X2_ONES, FP16_MINUS_72, FP16X2_ONES}
#else
// bf16: every row's codes are 128 + q (each nibble shifted to bits 0-3, as in
// codes_minus8), so one offset, 136, and Y = -136 A in rows g of both k halves. The
// sums cancel from values of at most 144 |A| (docs/notes/bf16.md).
__device__ __forceinline__ void offset_codes(u32 w, u32 m[4]) {
    const u32 lo_mask = 0x000F000Fu;
    m[0] = lop3_and_or(w, lo_mask, BF16_EXP_BITS);
    m[1] = lop3_and_or(w >> 4, lo_mask, BF16_EXP_BITS);
    m[2] = lop3_and_or(w >> 8, lo_mask, BF16_EXP_BITS);
    m[3] = lop3_and_or(w >> 12, lo_mask, BF16_EXP_BITS);
}
#define OFFSET_SUMS_A {BF16X2_MINUS_136, BF16X2_ONES, BF16X2_MINUS_136, BF16X2_ONES}
#endif

// Columns col and col + 1 (col even) of one row of C, a row of n_out columns: one 32-bit
// store when both exist and the pair is 4-byte aligned (n_out even), else a 16-bit
// store per existing column. n_out < N only for a layer whose N was padded to the
// layout's 64 (the padding is computed, never stored).
__device__ __forceinline__ void store_pair(u16* row, int col, int n_out, u16 lo, u16 hi) {
    if (col + 1 < n_out && !(n_out & 1)) {
        *reinterpret_cast<u32*>(row + col) = (u32)lo | ((u32)hi << 16);
    } else {
        if (col < n_out) row[col] = lo;
        if (col + 1 < n_out) row[col + 1] = hi;
    }
}
__device__ __forceinline__ float bias_at(const u16* bias, int n, int n_out) {
    return (bias != nullptr && n < n_out) ? h_to_f32(ldg_u16(bias + n)) : 0.f;
}

// Position of natural column n inside a row of Marlin-permuted scales.
//   grouped (G > 1): 8x8 transpose in each 64-column chunk, new[8i+j] = old[8j+i];
//   per-channel (G == 1): the 32-entry list, inverted in closed form: old column
//   c = 8a + b of a 32-chunk sits at 8 (b / 2) + 2 a + (b % 2).
__device__ __forceinline__ int scale_pos(int n, int per_channel) {
    if (per_channel) {
        const int c = n & 31;
        return (n & ~31) + 8 * ((c & 7) >> 1) + 2 * (c >> 3) + (c & 1);
    }
    const int c = n & 63;
    return (n & ~63) + 8 * (c & 7) + (c >> 3);
}

// --- asynchronous copies and shared-memory fragment loads (sm_80+) ---
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// 16-byte global -> shared copy that bypasses L1 (.cg): the weight stream is read once.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void sts_zero16(u32 dst) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(dst), "r"(0u) : "memory");
}
__device__ __forceinline__ int4 lds_v4(u32 a) {
    int4 v;
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a) : "memory");
    return v;
}
__device__ __forceinline__ float lds_f32(u32 a) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(a) : "memory");
    return v;
}
// Four 8x8 b16 matrices; lane l gives the row address of matrix l / 8, row l % 8.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a) : "memory");
}

// Two 8x8 b16 matrices; lanes 0..15 give the row addresses (lanes 16..31 are ignored).
__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], u32 a) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(a) : "memory");
}

#endif  // MARLIN_COMMON_CUH

// asym_correction.cu: the two-kernel asymmetric correction of checkpoint-formats.md
// 4.6, applied after a symmetric marlin_gemm:
//   xsum[m, g] = sum_{k in group g} A[m, k]                         (group_sums)
//   C[m, n]    = fp16(float(C[m, n]) + sum_g xsum[m, g] * delta[g, n])  (add_correction)
// The fused alternative lives in marlin_gemm.cu (HAS_DELTA), with no extra launch.
// Layouts:
//   A     fp16 [M, K] row-major, rows in Marlin K order (after any act-order gather),
//         so every group is a contiguous run of group_size columns.
//   xsum  fp32 [M, G]
//   delta fp32 [G, ld_delta], natural column order (NOT scale-permuted); ld_delta >= N
//         (a padded layer's delta has its padded width, C only the real N columns)
//   C     fp16 [M, N] row-major, updated in place
// Launch geometry:
//   group_sums:     grid ceil(M * G / 4), block 128: one warp per (m, g); each lane
//                   sums a fixed stride of the group in fp32 and a fixed xor-shuffle
//                   tree combines lanes, so the result is deterministic.
//   add_correction: grid (N / 128, ceil(M / 8)), block 128: thread n of the block
//                   owns column n for 8 rows; xsum is staged in shared memory 256
//                   groups at a time; the g loop runs in order (deterministic).
// Constraints: K % group_size == 0, group_size even; add_correction takes any N
//   (columns past N are skipped). Valid on sm_53+.
// NumPy references: converter.gpu.reference.group_sums, .add_correction.

#include "marlin_common.cuh"

extern "C" __global__ void __launch_bounds__(128)
group_sums(const u16* __restrict__ A, float* __restrict__ xsum, int M, int K, int group_size) {
    const int G = K / group_size;
    const long long unit = (long long)blockIdx.x * 4 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (unit >= (long long)M * G) return;
    const int m = (int)(unit / G), g = (int)(unit % G);
    const u16* p = A + (size_t)m * K + (size_t)g * group_size;
    float s = 0.f;
    for (int k = 2 * lane; k < group_size; k += 64) {
        const u32 v = *reinterpret_cast<const u32*>(p + k);
        s += act_to_f32((u16)v) + act_to_f32((u16)(v >> 16));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) xsum[(size_t)m * G + g] = s;
}

extern "C" __global__ void __launch_bounds__(128)
add_correction(u16* __restrict__ C, const float* __restrict__ xsum, const float* __restrict__ delta,
               int M, int N, int G, int ld_delta) {
    constexpr int ROWS = 8, GCHUNK = 256;
    __shared__ float xs[ROWS][GCHUNK];
    const int n = blockIdx.x * 128 + threadIdx.x;
    const int m0 = blockIdx.y * ROWS;
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
    for (int g0 = 0; g0 < G; g0 += GCHUNK) {
        const int gn = min(GCHUNK, G - g0);
        __syncthreads();
        for (int e = threadIdx.x; e < ROWS * GCHUNK; e += 128) {
            const int r = e / GCHUNK, gg = e % GCHUNK;
            xs[r][gg] = (m0 + r < M && gg < gn) ? xsum[(size_t)(m0 + r) * G + g0 + gg] : 0.f;
        }
        __syncthreads();
        if (n < N) {
            for (int gg = 0; gg < gn; ++gg) {
                const float d = delta[(size_t)(g0 + gg) * ld_delta + n];
#pragma unroll
                for (int r = 0; r < ROWS; ++r) acc[r] = fmaf(xs[r][gg], d, acc[r]);
            }
        }
    }
    if (n >= N) return;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int m = m0 + r;
        if (m < M) {
            u16* c = C + (size_t)m * N + n;
            *c = f32_to_act(act_to_f32(*c) + acc[r]);
        }
    }
}

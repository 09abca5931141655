// dequant.cu: marlin_B + marlin_scales (+ marlin_delta) -> W [K, N], row-major,
// rows in Marlin K order (act-order layers keep their permuted row order; the caller
// maps row k to source channel perm[k]).
//   W[k, n] = fp16((q[k, n] - 8) * s[g, n])                    (HAS_DELTA = false)
//   W[k, n] = fp16((q[k, n] - 8) * s[g, n] + fp16(delta[g, n])) (HAS_DELTA = true)
// computed with exactly the fp16x2 operations marlin_gemm.cu feeds its mma, so the two
// agree bit for bit. Built with -DMARLIN_BF16, W is the bf16 weight those kernels form
// instead (marlin_common.cuh word_weights; twin converter.gpu.reference_bf16.dequant). Layouts:
//   B      int32 [K/16, 2N], Marlin tile order (checkpoint-formats.md 4.3)
//   scales fp16  [G, N], Marlin-permuted (4.4; per-channel list when G == 1)
//   delta  fp32  [G, N], natural column order (4.6)
//   W      fp16 (bf16)  [K, N]
// Launch geometry: grid (N/64, K/16), block 128 threads; block (nb, kt) owns the 16x64
// tile whose 128 words are B[kt, 128 nb : 128 nb + 128]. Thread i dequantizes word i
// (lane t = i / 4, tile j = i % 4, section 4.3) into a shared-memory tile, then the
// block writes the tile as 16-byte row pieces, so both global streams are coalesced.
// Constraints: K % 16 == 0, N % 64 == 0, group_size % 16 == 0 dividing K (G == K /
// group_size); K/16 <= 65535; W 16-byte aligned. Valid on sm_53 and newer.
// NumPy reference: converter.gpu.reference.dequant.

#include "marlin_common.cuh"

template <bool HAS_DELTA>
__global__ void __launch_bounds__(128)
marlin_dequant(const u32* __restrict__ B, const u16* __restrict__ S, const float* __restrict__ D,
               u16* __restrict__ W, int K, int N, int group_size, int per_channel) {
    // +8 halves of padding per row keeps the 16-byte row reads conflict-light.
    __shared__ __align__(16) u16 tile[16][64 + 8];
    const int nb = blockIdx.x, kt = blockIdx.y;
    const int i = threadIdx.x;
    const int t = i >> 2, j = i & 3;
    const int r0 = 2 * (t & 3), c0 = t >> 2;
    const int g = per_channel ? 0 : (kt * 16) / group_size;

    const u32 w = __ldg(B + (size_t)kt * 2 * N + 128 * nb + i);
    WCol wc[2];  // h = 0: column c0 + 16 j; h = 1: column c0 + 16 j + 8
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int n = 64 * nb + 16 * j + c0 + 8 * h;
        wc[h] = wcol<HAS_DELTA>(S[(size_t)g * N + scale_pos(n, per_channel)],
                                HAS_DELTA ? f32_to_h(D[(size_t)g * N + n]) : (u16)0);
    }
    u32 m[4];
    word_weights<HAS_DELTA>(w, wc[0], wc[1], m);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int c = 16 * j + c0 + 8 * h;
        // rows {r0, r0 + 1} and {r0 + 8, r0 + 9}
        const u32 lo = m[2 * h], hi = m[2 * h + 1];
        tile[r0][c] = (u16)lo;
        tile[r0 + 1][c] = (u16)(lo >> 16);
        tile[r0 + 8][c] = (u16)hi;
        tile[r0 + 9][c] = (u16)(hi >> 16);
    }
    __syncthreads();
    const int row = i >> 3, piece = i & 7;
    const uint4 v = *reinterpret_cast<const uint4*>(&tile[row][8 * piece]);
    *reinterpret_cast<uint4*>(W + (size_t)(16 * kt + row) * N + 64 * nb + 8 * piece) = v;
}

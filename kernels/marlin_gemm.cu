// marlin_gemm.cu: C[M, N] (fp16) = A[M, K] (fp16) @ W (+ optional bias), where
//   W[k, n] = fp16((q[k, n] - 8) * s[g(k), n])                     (symmetric)
//   W[k, n] = fp16((q[k, n] - 8) * s[g(k), n] + fp16(delta[g, n]))  (HAS_DELTA, fused
//             asymmetric correction: one fma per weight pair, no extra launch)
// with q and s read straight from the artifact tensors:
//   B      int32 [K/16, 2N], Marlin tile order (checkpoint-formats.md 4.3): the 16x64
//          block (kt, nb) is the 128 consecutive words B[kt, 128 nb : 128 nb + 128];
//          word 4 t + j belongs to lane t and 16-column tile j.
//   scales fp16  [G, N], Marlin-permuted (4.4): 8x8 transpose per 64 columns when
//          G > 1, the 32-entry per-channel list when G == 1.
//   delta  fp32  [G, N], natural column order (4.6); only read when HAS_DELTA.
//   A      fp16  [M, K] row-major, rows already in Marlin K order (act-order callers
//          run gather_columns first, below).
//   bias   fp16  [N] natural order or nullptr.
//   C      fp16  [M, N] row-major.
// Group g(k) = k / group_size; G == 1 means per-channel. The dequantized weight is
// bit-identical to dequant.cu's output, and fp32 accumulation is exact per product.
//
// Launch geometry (converter/gpu/kernels.py picks it):
//   block = 128 threads = 4 independent warps; grid.x = ceil(units / 4).
//   A unit (one warp) = (m-chunk of 16*MT rows, 64-column block nb, K split). The
//   warp streams its K range U k-tiles (16 rows each) at a time: one 16-byte B load
//   per lane per k-tile, mma.sync.m16n8k16 (fp32 accumulate) into 8 n8 fragments per
//   16-row m-tile. Units are numbered m-chunk fastest, then nb, then split, so the 4
//   warps of a block read adjacent 512-byte pieces of B and share A through L1.
//   K splits > 1: each warp writes fp32 partials to `ws` [splits, M, N]; the last warp
//   to arrive for (m-chunk, nb) (counter in `locks`, which it resets to 0) sums them
//   in split order, so the result is bitwise deterministic whatever the arrival order.
//   No shared memory, no block barrier.
// Constraints: M >= 1; K % 16 == 0 with (K/16) % U == 0 (U = 8 for MT == 1, else 4:
//   so K % 128 == 0 always works and K % 64 == 0 works through the U = 4 variants);
//   N % 64 == 0; gcd(group_size/16, U) * GPI == U (group sizes that are multiples of
//   32, and per-channel); 16-byte aligned B/scales, 4-byte aligned A;
//   locks zeroed before first use and never shared by two launches in flight.
// Valid on sm_80 and newer (mma.sync.m16n8k16.f16, ld.global.nc); no sm_90a feature.
// NumPy reference: converter.gpu.reference.marlin_gemm (gather_columns for the gather).

#include "marlin_common.cuh"

__device__ __forceinline__ void mma_16816(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Raw per-group operands of one lane: 8 scales for columns c0 + 8 jj (jj = 0..7) and,
// when fused, the 8 deltas of the same columns.
struct GroupRaw {
    u16 s[8];
    float d[8];
};

template <bool HAS_DELTA>
__device__ __forceinline__ void load_group(GroupRaw& r, const u16* __restrict__ S,
                                           const float* __restrict__ D, int g, int N,
                                           int nb, int c0, int per_channel) {
    const int col0 = 64 * nb + c0;
    if (per_channel) {
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) r.s[jj] = ldg_u16(S + scale_pos(col0 + 8 * jj, 1));
    } else {
        // The 8x8 transpose puts exactly this lane's 8 columns in one 16-byte vector.
        const int4 v = ldg_v4(reinterpret_cast<const int4*>(S + (size_t)g * N + 64 * nb + 8 * c0));
        const u32 w[4] = {(u32)v.x, (u32)v.y, (u32)v.z, (u32)v.w};
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) r.s[jj] = (u16)(w[jj >> 1] >> (16 * (jj & 1)));
    }
    if (HAS_DELTA) {
        const float* drow = D + (size_t)g * N + col0;
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) r.d[jj] = ldg_f32(drow + 8 * jj);
    }
}

template <int MT, int U, int GPI, bool HAS_DELTA>
__global__ void __launch_bounds__(128)
marlin_gemm(const u16* __restrict__ A, const int4* __restrict__ B, const u16* __restrict__ S,
            const float* __restrict__ D, const u16* __restrict__ bias, u16* __restrict__ C,
            float* __restrict__ ws, int* __restrict__ locks, int M, int K, int N,
            int group_tiles, int per_channel, int splits, int tiles_per_split) {
    constexpr int SUB = U / GPI;  // k-tiles per group slot; a slot never straddles groups
    const int lane = threadIdx.x & 31;
    const int nblk = N >> 6;
    const int m_chunks = (M + 16 * MT - 1) / (16 * MT);
    const long long unit = (long long)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (unit >= (long long)m_chunks * nblk * splits) return;
    const int mc = (int)(unit % m_chunks);
    const int nb = (int)((unit / m_chunks) % nblk);
    const int split = (int)(unit / ((long long)m_chunks * nblk));

    const int g4 = lane >> 2, t4 = lane & 3;
    const int KT = K >> 4;
    const int kt0 = split * tiles_per_split;
    const int kt1 = min(kt0 + tiles_per_split, KT);

    float acc[MT][8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int f = 0; f < 8; ++f)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][f][e] = 0.f;

    // Row pointers of this lane's two A rows per m-tile; rows past M read as zero.
    const u16* arow[MT][2];
    bool aok[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = mc * 16 * MT + 16 * mt + g4 + 8 * h;
            aok[mt][h] = r < M;
            arow[mt][h] = A + (size_t)(aok[mt][h] ? r : 0) * K + 2 * t4;
        }

    const int4* bcol = B + 32 * nb + lane;  // int4 index of (kt = 0, nb, lane)
    const size_t brow = (size_t)(N >> 1);   // int4 per B row

    u32 s2[8], d2[8];  // current group's scales / deltas as fp16x2 splats
    int cur_g = -1;

    for (int kt = kt0; kt < kt1; kt += U) {
        // ---- issue every load of this step before any use ----
        int4 bq[U];
#pragma unroll
        for (int u = 0; u < U; ++u) bq[u] = ldg_v4(bcol + (size_t)(kt + u) * brow);

        int gs[GPI];
        bool need[GPI];
        GroupRaw raw[GPI];
#pragma unroll
        for (int gi = 0; gi < GPI; ++gi) {
            gs[gi] = (kt + gi * SUB) / group_tiles;
            need[gi] = gs[gi] != (gi ? gs[gi - 1] : cur_g);
            if (need[gi]) load_group<HAS_DELTA>(raw[gi], S, D, gs[gi], N, nb, g4, per_channel);
        }

        u32 af[U][MT][4];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const int k = (kt + u) * 16;
                af[u][mt][0] = aok[mt][0] ? ldg_u32(arow[mt][0] + k) : 0u;
                af[u][mt][1] = aok[mt][1] ? ldg_u32(arow[mt][1] + k) : 0u;
                af[u][mt][2] = aok[mt][0] ? ldg_u32(arow[mt][0] + k + 8) : 0u;
                af[u][mt][3] = aok[mt][1] ? ldg_u32(arow[mt][1] + k + 8) : 0u;
            }

        // ---- dequantize in registers and multiply ----
#pragma unroll
        for (int gi = 0; gi < GPI; ++gi) {
            if (need[gi]) {
#pragma unroll
                for (int jj = 0; jj < 8; ++jj) {
                    s2[jj] = h_splat(raw[gi].s[jj]);
                    d2[jj] = HAS_DELTA ? h_splat(f32_to_h(raw[gi].d[jj])) : 0u;
                }
            }
#pragma unroll
            for (int uu = 0; uu < SUB; ++uu) {
                const int u = gi * SUB + uu;
                const u32 w[4] = {(u32)bq[u].x, (u32)bq[u].y, (u32)bq[u].z, (u32)bq[u].w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    u32 m[4];
                    codes_minus8(w[j], m);
                    u32 b[4];
                    // m[0], m[1]: columns c0 + 16 j (slot jj = 2 j); m[2], m[3]: + 8.
                    if (HAS_DELTA) {
                        b[0] = h2_fma(m[0], s2[2 * j], d2[2 * j]);
                        b[1] = h2_fma(m[1], s2[2 * j], d2[2 * j]);
                        b[2] = h2_fma(m[2], s2[2 * j + 1], d2[2 * j + 1]);
                        b[3] = h2_fma(m[3], s2[2 * j + 1], d2[2 * j + 1]);
                    } else {
                        b[0] = h2_mul(m[0], s2[2 * j]);
                        b[1] = h2_mul(m[1], s2[2 * j]);
                        b[2] = h2_mul(m[2], s2[2 * j + 1]);
                        b[3] = h2_mul(m[3], s2[2 * j + 1]);
                    }
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma_16816(acc[mt][2 * j], af[u][mt], b[0], b[1]);
                        mma_16816(acc[mt][2 * j + 1], af[u][mt], b[2], b[3]);
                    }
                }
            }
        }
        cur_g = gs[GPI - 1];
    }

    // ---- epilogue ----
    // Fragment f covers columns 64 nb + 8 f + 2 t4 + {0, 1}; c[0..1] row g4, c[2..3] row g4 + 8.
    const int colbase = 64 * nb + 2 * t4;
    if (splits > 1) {
        float* wp = ws + (size_t)split * M * N;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = mc * 16 * MT + 16 * mt + g4 + 8 * h;
                if (r < M) {
#pragma unroll
                    for (int f = 0; f < 8; ++f)
                        *reinterpret_cast<float2*>(wp + (size_t)r * N + colbase + 8 * f) =
                            float2{acc[mt][f][2 * h], acc[mt][f][2 * h + 1]};
                }
            }
        __threadfence();  // partials visible device-wide before the counter moves
        int prev = 0;
        if (lane == 0) prev = atomicAdd(locks + (size_t)mc * nblk + nb, 1);
        prev = __shfl_sync(0xffffffffu, prev, 0);
        if (prev != splits - 1) return;
        __threadfence();
        // Last to arrive: sum all partials in split order (deterministic).
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int f = 0; f < 8; ++f)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[mt][f][e] = 0.f;
        for (int s = 0; s < splits; ++s) {
            const float* sp = ws + (size_t)s * M * N;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = mc * 16 * MT + 16 * mt + g4 + 8 * h;
                    if (r < M) {
#pragma unroll
                        for (int f = 0; f < 8; ++f) {
                            const float2 v = ldcg_f2(reinterpret_cast<const float2*>(
                                sp + (size_t)r * N + colbase + 8 * f));
                            acc[mt][f][2 * h] += v.x;
                            acc[mt][f][2 * h + 1] += v.y;
                        }
                    }
                }
        }
        if (lane == 0) locks[(size_t)mc * nblk + nb] = 0;  // ready for the next launch
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = mc * 16 * MT + 16 * mt + g4 + 8 * h;
            if (r < M) {
#pragma unroll
                for (int f = 0; f < 8; ++f) {
                    const int col = colbase + 8 * f;
                    float x0 = acc[mt][f][2 * h], x1 = acc[mt][f][2 * h + 1];
                    if (bias != nullptr) {
                        x0 += h_to_f32(ldg_u16(bias + col));
                        x1 += h_to_f32(ldg_u16(bias + col + 1));
                    }
                    const u32 packed = (u32)f32_to_h(x0) | ((u32)f32_to_h(x1) << 16);
                    *reinterpret_cast<u32*>(C + (size_t)r * N + col) = packed;
                }
            }
        }
}

// Act-order: out[m, k] = A[m, perm[k]] (fp16 bits, [M, K] row-major both). perm is the
// artifact's marlin_perm (int32 [K]): Marlin row k holds source channel perm[k].
// One thread per output element. NumPy reference: converter.gpu.reference.gather_columns.
extern "C" __global__ void gather_columns(const u16* __restrict__ A, const int* __restrict__ perm,
                                          u16* __restrict__ out, int M, int K) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)M * K) return;
    const int m = (int)(i / K), k = (int)(i % K);
    out[i] = A[(size_t)m * K + perm[k]];
}

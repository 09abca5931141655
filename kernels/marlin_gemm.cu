// marlin_gemm.cu, the tile kernel (larger M; marlin_decode.cu serves small M):
// C[M, N] = A[M, K] @ W (+ optional bias), A and C fp16, or bf16 in the build with
// -DMARLIN_BF16 (marlin_common.cuh says what differs: there W is formed in fp32 and
// rounded to bf16), where
//   W[k, n] = fp16((q[k, n] - 8) * s[g(k), n])                 (symmetric)
//   W[k, n] = fp16((q[k, n] - 8) * s[g(k), n] + d[g(k), n])    (HAS_DELTA, fused
//             asymmetric correction: one fma per weight pair, no extra launch)
// with the operands of marlin_stream.cuh:
//   B      int32 [K/16, 2N], Marlin tile order (checkpoint-formats.md 4.3).
//   scales fp16  [G, N], Marlin-permuted (4.4): 8x8 transpose per 64 columns when
//          G > 1, the 32-entry per-channel list when G == 1.
//   D      fp16  [G, N], d = fp16(delta) (delta: artifact fp32, 4.6), permuted like
//          the scales (kernels.prepare_delta); only read when HAS_DELTA.
//   A      fp16  [M, K] row-major, columns already in Marlin K order (act-order callers
//          run gather_columns first, below).
//   bias   fp16  [N] natural order or nullptr.
//   C      fp16  [M, n_out] row-major: the first n_out <= N columns (n_out < N only for a
//          layer whose N was padded to a multiple of 64; the padding is never stored).
// Group g(k) = k / group_size; G == 1 means per-channel. The dequantized weight is
// bit-identical to dequant.cu's output, and fp32 accumulation is exact per product.
//
// Launch geometry (converter/gpu/kernels.py, gemm_plan, picks it):
//   block = 128 threads = 4 warps; grid.x = m_chunks * ceil(N / 64 / (4 / wk)) * splits
//   blocks; dynamic shared memory = 4 * max(NS * Ring<16 MT, U, GPI>::STAGE, MT * 4096).
//   A block owns an m-chunk of 16 MT rows, a K split of tiles_per_split 16-row k-tiles
//   and 4 / wk 64-column blocks; wk warps share each column block and take contiguous
//   parts of the K range (wk = 4 when N is too narrow to fill the device, else 1).
//   Each warp streams its K range U k-tiles per step through its own NS-stage
//   cp.async ring in shared memory (B, A and the step's scales/deltas), so NS - 1
//   steps are in flight while one is dequantized in registers (once per B fragment,
//   used by MT m-tiles) and fed to mma.sync.m16n8k16 (fp32 accumulate) as 8 n8
//   fragments per m-tile. Blocks are numbered m-chunk fastest, then N, then split.
//   With wk > 1 the warps' sums meet in shared memory (added in warp order).
//   K splits > 1: one warp per (m-chunk, column block) writes fp32 partials to `ws`
//   [splits, M, N]; the last to arrive (counter in `locks`, which it resets to 0) sums
//   them in split order, so the result is bitwise deterministic whatever the order.
// Template: MT m-tiles per warp (1, 2, 4); U k-tiles per step (4 or 8 for MT = 1, 4 for
//   MT = 2, 2 for MT = 4); GPI = U / gcd(group tiles, U) group slots per step; NS ring
//   stages; HAS_DELTA.
// Constraints: M >= 1; K % (16 U) == 0 (K % 64 always works); N % 64 == 0; group size
//   any multiple of 16 dividing K, or per-channel; 16-byte aligned A/B/scales/delta;
//   tiles_per_split % U == 0; `locks` zeroed before first use and never shared by two
//   launches in flight.
// Valid on sm_80 and newer (cp.async, ldmatrix, mma.sync.m16n8k16.f16); no sm_90a
// feature, no L2 cache-policy hint.
// NumPy reference: converter.gpu.reference.marlin_gemm (gather_columns for the gather).

#include "marlin_stream.cuh"

template <int MT, int U, int GPI, bool HAS_DELTA>
__device__ __forceinline__ void compute_stage(u32 st, int kt, int lane, GroupWalk& walk, int group_tiles,
                                              int per_channel, WCol (&wc)[8],
                                              float (&acc)[MT][8][4]) {
    using R = Ring<16 * MT, U, GPI>;
    constexpr int SUB = U / GPI;
    const int c0 = lane >> 2;
    // ldmatrix row address of this lane: matrix q = lane / 8 is (rows 8 (q % 2) .., k 8 (q / 2) ..).
    const int q = lane >> 3;
    const u32 a_lane = st + R::A_OFF + ((lane & 7) + 8 * (q & 1)) * 32 + 16 * (q >> 1);
    static_assert(R::A_TILE == MT * 512, "m-tile (u, mt) sits at A_OFF + (u MT + mt) 512");
#pragma unroll
    for (int gi = 0; gi < GPI; ++gi) {
        if (!per_channel && walk.step(kt + gi * SUB, group_tiles)) {
            const int4 v = lds_v4(st + R::S_OFF + gi * 128 + 16 * c0);
            // the deltas are permuted like the scales: same offsets
            const int4 dv = HAS_DELTA ? lds_v4(st + R::D_OFF + gi * 128 + 16 * c0) : int4{0, 0, 0, 0};
            const u32 w[4] = {(u32)v.x, (u32)v.y, (u32)v.z, (u32)v.w};
            const u32 dw[4] = {(u32)dv.x, (u32)dv.y, (u32)dv.z, (u32)dv.w};
#pragma unroll
            for (int jj = 0; jj < 8; ++jj)
                wc[jj] = wcol<HAS_DELTA>((u16)(w[jj >> 1] >> (16 * (jj & 1))), (u16)(dw[jj >> 1] >> (16 * (jj & 1))));
        }
#pragma unroll
        for (int uu = 0; uu < SUB; ++uu) {
            const int u = gi * SUB + uu;
            const int4 bv = lds_v4(st + R::B_OFF + u * 512 + 16 * lane);
            u32 af[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(af[mt], a_lane + (u * MT + mt) * 512);
            const u32 w[4] = {(u32)bv.x, (u32)bv.y, (u32)bv.z, (u32)bv.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                u32 b[4];
                // b[0], b[1]: columns c0 + 16 j (slot jj = 2 j); b[2], b[3]: + 8.
                word_weights<HAS_DELTA>(w[j], wc[2 * j], wc[2 * j + 1], b);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816(acc[mt][2 * j], af[mt], b[0], b[1]);
                    mma_16816(acc[mt][2 * j + 1], af[mt], b[2], b[3]);
                }
            }
        }
    }
}

// A block's shared memory: each warp's ring, padded to hold the warp's sums for the
// in-block reduction. converter/gpu/plan/catalog.py (ring_smem) repeats BYTES; tests/gpu
// compares them.
template <int MT, int U, int GPI, int NS>
struct GemmSmem {
    static constexpr int RING = NS * Ring<16 * MT, U, GPI>::STAGE;
    static constexpr int WARP = RING > MT * 4096 ? RING : MT * 4096;
    static constexpr int BYTES = 4 * WARP;
};

template <int MT, int U, int GPI, int NS, bool HAS_DELTA>
__global__ void __launch_bounds__(128, MT == 1 ? 4 : (MT == 2 ? 3 : 2))
marlin_gemm(const u16* __restrict__ A, const int4* __restrict__ B, const u16* __restrict__ S,
            const u16* __restrict__ D, const u16* __restrict__ bias, u16* __restrict__ C,
            float* __restrict__ ws, int* __restrict__ locks, int M, int K, int N, int n_out,
            int group_tiles, int per_channel, int splits, int tiles_per_split, int wk) {
    extern __shared__ __align__(16) unsigned char smem[];
    using R = Ring<16 * MT, U, GPI>;
    constexpr int WARP_SMEM = GemmSmem<MT, U, GPI, NS>::WARP;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nblk = N >> 6;
    const int m_chunks = (M + 16 * MT - 1) / (16 * MT);
    // wk warps share one 64-column block and split its K range (wk = 4), or the 4
    // warps take 4 adjacent column blocks with the whole range each (wk = 1).
    const int wn = 4 / wk;
    const int nbb = (nblk + wn - 1) / wn;
    const int mc = (int)(blockIdx.x % m_chunks);
    const int nb = (int)((blockIdx.x / m_chunks) % nbb) * wn + warp / wk;
    const int split = (int)(blockIdx.x / (m_chunks * nbb));
    const int kq = warp % wk;
    const bool live = nb < nblk;  // a last block of a ragged N has idle warps

    const int g4 = lane >> 2, t4 = lane & 3;
    const int KT = K >> 4;
    const int tpw = tiles_per_split / wk;
    const int kt0 = live ? min(split * tiles_per_split + kq * tpw, KT) : KT;
    const int kt1 = min(kt0 + tpw, KT);
    const int mrow0 = 16 * MT * mc;

    float acc[MT][8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int f = 0; f < 8; ++f)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][f][e] = 0.f;

    WCol wc[8];  // current group's scales / deltas, as the weight arithmetic holds them
    if (per_channel && live) {  // one group for all of K: read once, straight to registers
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
            const int col = 64 * nb + g4 + 8 * jj;
            wc[jj] = wcol<HAS_DELTA>(ldg_u16(S + scale_pos(col, 1)), HAS_DELTA ? ldg_u16(D + scale_pos(col, 1)) : (u16)0);
        }
    }

    // Per-lane running source pointers of the copies (advanced by one step per issue).
    const size_t brow = (size_t)(N >> 1);  // int4 per B row
    const int4* bptr = B + (size_t)kt0 * brow + 32 * nb + lane;
    ARows<16 * MT> arows;
    arows.init(A, lane, mrow0, M, K, kt0);
    GroupWalk issue_walk, compute_walk;
    issue_walk.init(kt0, group_tiles);
    compute_walk.init(kt0, group_tiles);

    const u32 ring = smem_addr(smem) + warp * WARP_SMEM;
    const u32 ring_end = ring + NS * R::STAGE;
    arows.zero_missing(ring, R::STAGE, R::A_OFF, NS, U, lane);
    u32 issue_slot = ring;
#define ISSUE(kt)                                                                                          \
    do {                                                                                                   \
        issue_stage<16 * MT, U, GPI, HAS_DELTA>(issue_slot, issue_slot, kt, lane, true, arows, bptr, brow, issue_walk, S, D, \
                                                N, nb, group_tiles, per_channel);                          \
        issue_slot = issue_slot + R::STAGE == ring_end ? ring : issue_slot + R::STAGE;                     \
    } while (0)
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) {
        if (kt0 + s * U < kt1) ISSUE(kt0 + s * U);
        cp_async_commit();
    }
    u32 slot = ring;
    for (int kt = kt0; kt < kt1; kt += U) {
        cp_async_wait<NS - 2>();  // this lane's copies of step `kt` have landed ...
        __syncwarp();             // ... and every lane's; also: all lanes are done with slot - 1
        if (kt + (NS - 1) * U < kt1) ISSUE(kt + (NS - 1) * U);
        cp_async_commit();
        compute_stage<MT, U, GPI, HAS_DELTA>(slot, kt, lane, compute_walk, group_tiles, per_channel, wc,
                                             acc);
        slot = slot + R::STAGE == ring_end ? ring : slot + R::STAGE;
    }
#undef ISSUE
    cp_async_wait<0>();
    __syncwarp();

    // ---- in-block reduction (wk > 1): the K-quarter warps 1..3 park their sums in their
    // own (now idle) ring, warp 0 adds them in warp order. MT * 4 KB fits in a ring. ----
    if (wk > 1) {
        if (kq != 0) {
            float* park = reinterpret_cast<float*>(smem + warp * WARP_SMEM);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int f = 0; f < 8; ++f)
#pragma unroll
                    for (int e = 0; e < 4; ++e) park[((mt * 8 + f) * 4 + e) * 32 + lane] = acc[mt][f][e];
        }
        __syncthreads();
        if (kq != 0) return;
#pragma unroll 1
        for (int w = warp + 1; w < warp + wk; ++w) {
            const float* park = reinterpret_cast<const float*>(smem + w * WARP_SMEM);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int f = 0; f < 8; ++f)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[mt][f][e] += park[((mt * 8 + f) * 4 + e) * 32 + lane];
        }
    }
    if (!live) return;

    // ---- epilogue ----
    // Fragment f covers columns 64 nb + 8 f + 2 t4 + {0, 1}; c[0..1] row g4, c[2..3] row g4 + 8.
    const int colbase = 64 * nb + 2 * t4;
    if (splits > 1) {
        float* wp = ws + (size_t)split * M * N;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = mrow0 + 16 * mt + g4 + 8 * h;
                if (r < M) {
#pragma unroll
                    for (int f = 0; f < 8; ++f)
                        *reinterpret_cast<float2*>(wp + (size_t)r * N + colbase + 8 * f) =
                            float2{acc[mt][f][2 * h], acc[mt][f][2 * h + 1]};
                }
            }
        __syncwarp();  // every lane's partials, before lane 0 publishes them (atom_add_acq_rel)
        int prev = 0;
        if (lane == 0) prev = atom_add_acq_rel(locks + (size_t)mc * nblk + nb, 1);
        prev = __shfl_sync(0xffffffffu, prev, 0);
        if (prev != splits - 1) return;
        __syncwarp();  // lane 0's acquire, before every lane reads the partials
        // Last to arrive: sum all partials in split order (deterministic). The loads of
        // RB splits are issued before any add, so RB L2 round trips overlap.
        constexpr int RB = 4;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = mrow0 + 16 * mt + g4 + 8 * h;
                if (r >= M) continue;
                const float* rowp = ws + (size_t)r * N + colbase;
                float2 sum[8];
#pragma unroll
                for (int f = 0; f < 8; ++f) sum[f] = float2{0.f, 0.f};
                for (int s0 = 0; s0 < splits; s0 += RB) {
                    float2 v[RB][8];
#pragma unroll
                    for (int b = 0; b < RB; ++b)
#pragma unroll
                        for (int f = 0; f < 8; ++f)
                            v[b][f] = s0 + b < splits ? ldcg_f2(reinterpret_cast<const float2*>(
                                                            rowp + (size_t)(s0 + b) * M * N + 8 * f))
                                                      : float2{0.f, 0.f};
#pragma unroll
                    for (int b = 0; b < RB; ++b)
#pragma unroll
                        for (int f = 0; f < 8; ++f) {
                            sum[f].x += v[b][f].x;
                            sum[f].y += v[b][f].y;
                        }
                }
#pragma unroll
                for (int f = 0; f < 8; ++f) {
                    acc[mt][f][2 * h] = sum[f].x;
                    acc[mt][f][2 * h + 1] = sum[f].y;
                }
            }
        if (lane == 0) locks[(size_t)mc * nblk + nb] = 0;  // ready for the next launch
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = mrow0 + 16 * mt + g4 + 8 * h;
            if (r < M) {
#pragma unroll
                for (int f = 0; f < 8; ++f) {
                    const int col = colbase + 8 * f;
                    store_pair(C + (size_t)r * n_out, col, n_out,
                               f32_to_act(acc[mt][f][2 * h] + bias_at(bias, col, n_out)),
                               f32_to_act(acc[mt][f][2 * h + 1] + bias_at(bias, col + 1, n_out)));
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

// marlin_decode.cu, the decode kernel (M <= 32; marlin_gemm.cu serves larger M):
// C[M, N] = A[M, K] @ W (+ optional bias), A and C fp16, or bf16 in the build with
// -DMARLIN_BF16 (marlin_common.cuh says what differs), on the operands of
// marlin_stream.cuh (B, permuted scales S, permuted fp16 deltas D, A in Marlin K order),
// computed as
//   C[m, n] = fp16( sum_g ( s[g, n] * P[g, m, n] + d[g, n] * X[g, m] ) + bias[n] )
//   P[g, m, n] = sum_{k in g} A[m, k] (q[k, n] - 8)      X[g, m] = sum_{k in g} A[m, k]
// P and X are fp32 sums of exact products (q - 8 is a small integer, exact in fp16);
// the scale and the delta are applied once per group and column in fp32 instead of
// once per weight in fp16. That is what makes the kernel cheap at small M, where the
// per-weight fp16 arithmetic, not the memory, was the limit (docs/notes/perf_notes.md):
// a weight costs 9 instructions per 8 codes (4 lop3, 1 shift, 4 fp16x2 sub/fma), with
// no scale multiply; with a delta 5 (offset_codes: P is then the difference of two
// larger fp32 sums, closed per group, per step when per-channel).
//
// Why the weights are the mma's A operand ("transposed" mma): m16n8k16 multiplies a
// 16 x 16 A by a 16 x 8 B. With the 16 columns of a B tile as the 16 rows of A and up
// to 8 rows of activations as the 8 columns of B, one mma consumes 256 weights instead
// of 128, so small M needs half the mma instructions. The Marlin layout already fits:
// a lane's word j holds, for 16-column tile j, exactly the A fragment
// {k 2t..2t+1 at n g, at n g+8; k 2t+8..2t+9 at n g, at n g+8} (t = lane % 4,
// g = lane / 4; codes_minus8's m[0], m[2], m[1], m[3]). The accumulator element e of
// (j, nt) is column n = 64 nb + 16 j + g + 8 (e / 2) and row m = 8 nt + 2 t + e % 2.
// With HAS_DELTA, X comes from one more mma per k-tile (ones in the A operand's rows
// g + 8), whose rows g also sum the offsets of offset_codes (marlin_common.cuh).
//
// Launch geometry: as marlin_gemm.cu, with m-chunks of 8 NT rows: block = 4 warps,
// grid.x = m_chunks * ceil(N / 64 / (4 / wk)) * splits; dynamic shared memory, with
// R = SplitRing<8 NT, U, GPI>: wk = 1, NS * (R::A_STAGE + 4 R::W_STAGE); wk > 1,
// 4 * max(NS * (R::A_STAGE + R::W_STAGE), NT * 2048). K splits > 1: every warp writes
// its fp32 partials to `ws` [splits, M, N]; the last to arrive per (m-chunk, column
// block) sums them in split order (deterministic) and writes C.
// Template: NT = 1, 2, 4 activation n8 tiles (M <= 8, 16, 32 per chunk); U k-tiles per
//   step; GPI group slots per step (U / gcd(group tiles, U)); NS ring stages; HAS_DELTA;
//   GS: the per-group fp32 scaling above (true), or (false) the tile kernel's fp16
//   weight fp16((q - 8) s + d) per element, which needs no per-group sums and so half
//   the accumulator registers (used where NT = 4 would otherwise run 2 blocks per SM).
// Constraints: as marlin_gemm.cu (K % (16 U) == 0, N % 64 == 0, group size a multiple
//   of 16 dividing K or per-channel, 16-byte aligned operands, tiles_per_split % U == 0).
// Valid on sm_80 and newer (cp.async, ldmatrix, mma.sync.m16n8k16.f16); no sm_90a
// feature, no L2 cache-policy hint.
// NumPy reference: converter.gpu.reference.marlin_gemm(arith="group"), or
// arith="weight" for GS = false.

#include "marlin_stream.cuh"

// offset_codes, OFFSET_SUMS_A: marlin_common.cuh. Without a delta there is no X mma to share, and
// one more mma costs more than the sub / fma it saves (measured: docs/notes/perf_notes.md).

// Eight fp16 values (a 16-byte shared-memory piece) to fp32; slot p = 2 j + h is the
// column 16 j + g + 8 h of this lane (permuted order, section 4.4).
__device__ __forceinline__ void lds_h8_f32(u32 addr, float (&f)[8]) {
    const int4 v = lds_v4(addr);
    const u32 w[4] = {(u32)v.x, (u32)v.y, (u32)v.z, (u32)v.w};
#pragma unroll
    for (int p = 0; p < 8; ++p) f[p] = h_to_f32((u16)(w[p >> 1] >> (16 * (p & 1))));
}

// Ends a group: acc += s * P (+ d * X), then P = X = 0. With HAS_DELTA the codes were
// offset (offset_codes): P = gp + Y, and gx[nt] = {Y, Y, X, X} for this lane's two
// activation rows 2 t, 2 t + 1.
template <int NT, bool HAS_DELTA>
__device__ __forceinline__ void close_group(float (&acc)[4][NT][4], float (&gp)[4][NT][4], float (&gx)[NT][4],
                                            const float (&sf)[8], const float (&df)[8]) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int p = 2 * j + (e >> 1);
                const float pg = HAS_DELTA ? gp[j][nt][e] + gx[nt][e & 1] : gp[j][nt][e];
                float v = fmaf(sf[p], pg, acc[j][nt][e]);
                if (HAS_DELTA) v = fmaf(df[p], gx[nt][2 + (e & 1)], v);
                acc[j][nt][e] = v;
                gp[j][nt][e] = 0.f;
            }
    if (HAS_DELTA) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) gx[nt][e] = 0.f;
    }
}

// Block-shared A (wk = 1: the 4 warps of a block take 4 column blocks over the same K
// range and need the same A tiles). The block copies each step's U x AR x 16 A values
// once, as P 16-byte pieces spread over its 128 threads, into the block's one A ring
// (SplitRing); every warp reads them from there.
// Piece p: tile p / (2 AR), row (p / 2) % AR, half p % 2.
template <int AR, int U, int A_OFF, int A_TILE>
struct ABlock {
    static constexpr int P = U * AR * 2;
    static constexpr int CNT = (P + 127) / 128;
    bool have[CNT], ok[CNT];
    const u16* ptr[CNT];
    u32 dst[CNT];
    __device__ __forceinline__ void init(const u16* A, int tid, int mrow0, int M, int K, int kt0) {
#pragma unroll
        for (int i = 0; i < CNT; ++i) {
            const int p = tid + 128 * i;
            const int u = p / (2 * AR), r = (p >> 1) % AR, h = p & 1;
            have[i] = p < P;
            ok[i] = have[i] && mrow0 + r < M;
            ptr[i] = A + (size_t)(ok[i] ? mrow0 + r : 0) * K + (kt0 + u) * 16 + 8 * h;
            dst[i] = A_OFF + u * A_TILE + r * 32 + 16 * h;
        }
    }
    __device__ __forceinline__ void issue(u32 stage) {
#pragma unroll
        for (int i = 0; i < CNT; ++i) {
            if (ok[i]) cp_async16(stage + dst[i], ptr[i]);
            ptr[i] += U * 16;
        }
    }
    // Rows past M: zeroed once in every stage, never copied.
    __device__ __forceinline__ void zero_missing(u32 ring0, int stage_bytes, int ns) const {
#pragma unroll
        for (int i = 0; i < CNT; ++i)
            if (have[i] && !ok[i])
                for (int t = 0; t < ns; ++t) sts_zero16(ring0 + t * stage_bytes + dst[i]);
    }
};

// Eight columns' fp16 scales (and deltas) as the weight path holds them (WCol: the
// GS = false form).
template <bool HAS_DELTA>
__device__ __forceinline__ void lds_h8_cols(u32 s_addr, u32 d_addr, WCol (&c)[8]) {
    const int4 v = lds_v4(s_addr);
    const int4 dv = HAS_DELTA ? lds_v4(d_addr) : int4{0, 0, 0, 0};
    const u32 w[4] = {(u32)v.x, (u32)v.y, (u32)v.z, (u32)v.w};
    const u32 dw[4] = {(u32)dv.x, (u32)dv.y, (u32)dv.z, (u32)dv.w};
#pragma unroll
    for (int p = 0; p < 8; ++p)
        c[p] = wcol<HAS_DELTA>((u16)(w[p >> 1] >> (16 * (p & 1))), (u16)(dw[p >> 1] >> (16 * (p & 1))));
}

template <int NT, int U, int GPI, bool HAS_DELTA, bool GS>
__device__ __forceinline__ void decode_stage(u32 st, u32 sa, int kt, int lane, GroupWalk& walk, int group_tiles,
                                             int per_channel, bool& open, float (&sf)[8], float (&df)[8],
                                             WCol (&wc)[8],
                                             float (&acc)[4][NT][4], float (&gp)[4][NT][4], float (&gx)[NT][4]) {
    using R = SplitRing<8 * NT, U, GPI>;
    constexpr int SUB = U / GPI;
    const int g4 = lane >> 2;
    // ldmatrix row address: matrix q = lane / 8 is rows 8 (q / 2) .. of a 16-row chunk at
    // k 8 (q % 2) .., so matrices (0, 1) are n8 tile 2c's fragment and (2, 3) tile 2c+1's.
    const int q = lane >> 3;
    const u32 a_lane = sa + R::A_OFF + ((lane & 7) + 8 * (q >> 1)) * 32 + 16 * (q & 1);
#pragma unroll
    for (int gi = 0; gi < GPI; ++gi) {
        if (per_channel) {
            // One group over all of K would let the offset sums grow over K / 16 steps
            // (a NumPy model of the fp32 sums: 5e-5 of the result at K = 14336); its scale
            // and delta stay in registers, so the group is closed at every step instead
            // (the kernel's end closes the last).
            if (GS && HAS_DELTA && gi == 0) close_group<NT, true>(acc, gp, gx, sf, df);
        } else if (walk.step(kt + gi * SUB, group_tiles)) {
            if (GS) {
                if (open) close_group<NT, HAS_DELTA>(acc, gp, gx, sf, df);
                open = true;
                lds_h8_f32(st + R::S_OFF + gi * 128 + 16 * g4, sf);
                if (HAS_DELTA) lds_h8_f32(st + R::D_OFF + gi * 128 + 16 * g4, df);
            } else {
                lds_h8_cols<HAS_DELTA>(st + R::S_OFF + gi * 128 + 16 * g4, st + R::D_OFF + gi * 128 + 16 * g4, wc);
            }
        }
#pragma unroll
        for (int uu = 0; uu < SUB; ++uu) {
            const int u = gi * SUB + uu;
            const int4 bv = lds_v4(st + R::B_OFF + u * 512 + 16 * lane);
            u32 xf[NT][2];  // activation fragments: the mma's B operand
            if (NT == 1) {
                ldmatrix_x2(xf[0], a_lane + u * R::A_TILE);
            } else {
#pragma unroll
                for (int c = 0; c < NT / 2; ++c) {
                    u32 r[4];
                    ldmatrix_x4(r, a_lane + u * R::A_TILE + c * 512);
                    xf[2 * c][0] = r[0];
                    xf[2 * c][1] = r[1];
                    xf[2 * c + 1][0] = r[2];
                    xf[2 * c + 1][1] = r[3];
                }
            }
            const u32 w[4] = {(u32)bv.x, (u32)bv.y, (u32)bv.z, (u32)bv.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                u32 m[4];
                if (GS) {
                    if (HAS_DELTA)
                        offset_codes(w[j], m);
                    else
                        codes_minus8(w[j], m);
                    const u32 wa[4] = {m[0], m[2], m[1], m[3]};
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) mma_16816(gp[j][nt], wa, xf[nt][0], xf[nt][1]);
                } else {  // the tile kernel's 16-bit weight, bit for bit (dequant.cu)
                    word_weights<HAS_DELTA>(w[j], wc[2 * j], wc[2 * j + 1], m);
                    const u32 wa[4] = {m[0], m[2], m[1], m[3]};
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) mma_16816(acc[j][nt], wa, xf[nt][0], xf[nt][1]);
                }
            }
            if (GS && HAS_DELTA) {  // rows g: Y = -(1032 A[k < 8] + 72 A[k >= 8]); rows g + 8: X
                const u32 c[4] = OFFSET_SUMS_A;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) mma_16816(gx[nt], c, xf[nt][0], xf[nt][1]);
            }
        }
    }
}

// A block's shared memory. wk > 1: warp w owns [w WARP, (w + 1) WARP): its A ring, its
// weight ring, and afterwards its parked sums. wk = 1: one A ring, then the 4 weight
// rings. converter/gpu/plan/catalog.py (ring_smem) repeats bytes(wk); tests/gpu compares them.
template <int NT, int U, int GPI, int NS>
struct DecodeSmem {
    using R = SplitRing<8 * NT, U, GPI>;
    static constexpr int A_RING = NS * R::A_STAGE;
    static constexpr int W_RING = NS * R::W_STAGE;
    static constexpr int OWN = A_RING + W_RING;
    static constexpr int SUMS = 16 * NT * 128;  // a warp's parked fp32 accumulators
    static constexpr int WARP = OWN > SUMS ? OWN : SUMS;
    static constexpr int SHARED_A = A_RING + 4 * W_RING;
    __host__ __device__ static constexpr int bytes(int wk) { return wk == 1 ? SHARED_A : 4 * WARP; }
};

template <int NT, int U, int GPI, int NS, bool HAS_DELTA, bool GS>
__global__ void __launch_bounds__(128, NT == 1 ? 4 : (NT == 2 ? (U == 8 ? 3 : 4) : (GS ? 2 : 3)))
marlin_decode(const u16* __restrict__ A, const int4* __restrict__ B, const u16* __restrict__ S,
              const u16* __restrict__ D, const u16* __restrict__ bias, u16* __restrict__ C,
              float* __restrict__ ws, int* __restrict__ locks, int M, int K, int N, int n_out,
              int group_tiles, int per_channel, int splits, int tiles_per_split, int wk) {
    extern __shared__ __align__(16) unsigned char smem[];
    constexpr int AR = 8 * NT;
    using R = SplitRing<AR, U, GPI>;
    using DS = DecodeSmem<NT, U, GPI, NS>;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nblk = N >> 6;
    const int m_chunks = (M + AR - 1) / AR;
    const int wn = 4 / wk;
    const int nbb = (nblk + wn - 1) / wn;
    const int mc = (int)(blockIdx.x % m_chunks);
    const int nb = (int)((blockIdx.x / m_chunks) % nbb) * wn + warp / wk;
    const int split = (int)(blockIdx.x / (m_chunks * nbb));
    const int kq = warp % wk;
    const bool live = nb < nblk;

    // wk = 1: A is staged once per block (ABlock) and the barrier per step is the
    // block's. A warp past a ragged N then streams the last column block too (its
    // result is dropped) so that it keeps copying its share of A and meets every barrier.
    const bool share_a = wk == 1;
    const int nb_src = live ? nb : nblk - 1;
    const int g4 = lane >> 2, t4 = lane & 3;
    const int KT = K >> 4;
    const int tpw = tiles_per_split / wk;
    const int kt0 = (live || share_a) ? min(split * tiles_per_split + kq * tpw, KT) : KT;
    const int kt1 = min(kt0 + tpw, KT);
    const int mrow0 = AR * mc;

    float acc[4][NT][4], gp[4][NT][4], gx[NT][4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[j][nt][e] = gp[j][nt][e] = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) gx[nt][e] = 0.f;

    // the open group's scales and deltas of this lane's 8 columns: fp32 (GS) or WCol
    float sf[8], df[8];
    WCol wc[8];
#pragma unroll
    for (int p = 0; p < 8; ++p) {
        sf[p] = df[p] = 0.f;
        wc[p] = wcol<HAS_DELTA>(0, 0);
    }
    bool open = false;
    if (per_channel) {  // one group for all of K: read once, straight to registers
#pragma unroll
        for (int p = 0; p < 8; ++p) {
            const int pos = scale_pos(64 * nb_src + 8 * p + g4, 1);
            const u16 sv = ldg_u16(S + pos), dv = HAS_DELTA ? ldg_u16(D + pos) : (u16)0;
            sf[p] = h_to_f32(sv);
            df[p] = h_to_f32(dv);
            wc[p] = wcol<HAS_DELTA>(sv, dv);
        }
        open = GS;
    }

    const size_t brow = (size_t)(N >> 1);  // int4 per B row
    const int4* bptr = B + (size_t)kt0 * brow + 32 * nb_src + lane;
    ARows<AR> arows;
    arows.init(A, lane, mrow0, M, K, kt0);
    ABlock<AR, U, R::A_OFF, R::A_TILE> ablock;
    ablock.init(A, threadIdx.x, mrow0, M, K, kt0);
    GroupWalk issue_walk, compute_walk;
    issue_walk.init(kt0, group_tiles);
    compute_walk.init(kt0, group_tiles);

    const u32 smem0 = smem_addr(smem);
    const u32 a_ring = share_a ? smem0 : smem0 + warp * DS::WARP;
    const u32 w_ring = share_a ? smem0 + DS::A_RING + warp * DS::W_RING : a_ring + DS::A_RING;
    if (share_a)
        ablock.zero_missing(a_ring, R::A_STAGE, NS);
    else
        arows.zero_missing(a_ring, R::A_STAGE, R::A_OFF, NS, U, lane);
    int issue_s = 0;  // ring stage of the next copy; both rings step together
#define ISSUE(kt)                                                                                             \
    do {                                                                                                      \
        const u32 sa = a_ring + issue_s * R::A_STAGE;                                                         \
        issue_stage<AR, U, GPI, HAS_DELTA, R>(w_ring + issue_s * R::W_STAGE, sa, kt, lane, !share_a, arows,   \
                                              bptr, brow, issue_walk, S, D, N, nb_src, group_tiles,           \
                                              per_channel);                                                   \
        if (share_a) ablock.issue(sa);                                                                        \
        issue_s = issue_s + 1 == NS ? 0 : issue_s + 1;                                                        \
    } while (0)
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) {
        if (kt0 + s * U < kt1) ISSUE(kt0 + s * U);
        cp_async_commit();
    }
    int slot = 0;
    for (int kt = kt0; kt < kt1; kt += U) {
        cp_async_wait<NS - 2>();  // this thread's copies of step `kt` have landed ...
        if (share_a)              // ... and every thread's; also: all are done with slot - 1
            __syncthreads();
        else
            __syncwarp();
        if (kt + (NS - 1) * U < kt1) ISSUE(kt + (NS - 1) * U);
        cp_async_commit();
        decode_stage<NT, U, GPI, HAS_DELTA, GS>(w_ring + slot * R::W_STAGE, a_ring + slot * R::A_STAGE, kt, lane,
                                                compute_walk, group_tiles, per_channel, open, sf, df, wc, acc,
                                                gp, gx);
        slot = slot + 1 == NS ? 0 : slot + 1;
    }
#undef ISSUE
    if (GS && open) close_group<NT, HAS_DELTA>(acc, gp, gx, sf, df);
    cp_async_wait<0>();
    __syncwarp();

    // ---- in-block reduction (wk > 1): warps 1..3 of a column block park their sums in
    // their own (now idle) ring, its warp 0 adds them in warp order ----
    if (wk > 1) {
        if (kq != 0) {
            float* park = reinterpret_cast<float*>(smem + warp * DS::WARP);
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) park[((j * NT + nt) * 4 + e) * 32 + lane] = acc[j][nt][e];
        }
        __syncthreads();
        if (kq != 0) return;
#pragma unroll 1
        for (int w = warp + 1; w < warp + wk; ++w) {
            const float* park = reinterpret_cast<const float*>(smem + w * DS::WARP);
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[j][nt][e] += park[((j * NT + nt) * 4 + e) * 32 + lane];
        }
    }
    if (!live) return;

    // ---- epilogue: element (j, nt, e) is C[mrow0 + 8 nt + 2 t4 + e % 2, 64 nb + 16 j + g4 + 8 (e / 2)] ----
    const int nbase = 64 * nb + g4;
    const int mbase = mrow0 + 2 * t4;
    if (splits == 1) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int m = mbase + 8 * nt + (e & 1), n = nbase + 16 * j + 8 * (e >> 1);
                    if (m < M && n < n_out) C[(size_t)m * n_out + n] = f32_to_act(acc[j][nt][e] + bias_at(bias, n, n_out));
                }
        return;
    }
    float* wp = ws + (size_t)split * M * N;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int m = mbase + 8 * nt + (e & 1), n = nbase + 16 * j + 8 * (e >> 1);
                if (m < M) wp[(size_t)m * N + n] = acc[j][nt][e];
            }
    __syncwarp();  // every lane's partials, before lane 0 publishes them (atom_add_acq_rel)
    int prev = 0;
    if (lane == 0) prev = atom_add_acq_rel(locks + (size_t)mc * nblk + nb, 1);
    prev = __shfl_sync(0xffffffffu, prev, 0);
    if (prev != splits - 1) return;
    __syncwarp();  // lane 0's acquire, before every lane reads the partials
    // Last to arrive: lane l sums columns 64 nb + 2 l, + 1 of every row of the chunk over
    // the splits in split order; RR rows x RS splits of loads are in flight at once.
    constexpr int RR = 4, RS = 4;
    const int rows = min(M - mrow0, AR);
    const int col = 64 * nb + 2 * lane;
    const float b0 = bias_at(bias, col, n_out), b1 = bias_at(bias, col + 1, n_out);
    for (int r0 = 0; r0 < rows; r0 += RR) {
        float2 sum[RR];
#pragma unroll
        for (int rr = 0; rr < RR; ++rr) sum[rr] = float2{0.f, 0.f};
        for (int s0 = 0; s0 < splits; s0 += RS) {
            float2 v[RR][RS];
#pragma unroll
            for (int rr = 0; rr < RR; ++rr)
#pragma unroll
                for (int b = 0; b < RS; ++b)
                    v[rr][b] = (r0 + rr < rows && s0 + b < splits)
                                   ? ldcg_f2(reinterpret_cast<const float2*>(
                                         ws + ((size_t)(s0 + b) * M + mrow0 + r0 + rr) * N + col))
                                   : float2{0.f, 0.f};
#pragma unroll
            for (int rr = 0; rr < RR; ++rr)
#pragma unroll
                for (int b = 0; b < RS; ++b) {
                    sum[rr].x += v[rr][b].x;
                    sum[rr].y += v[rr][b].y;
                }
        }
#pragma unroll
        for (int rr = 0; rr < RR; ++rr)
            if (r0 + rr < rows)
                store_pair(C + (size_t)(mrow0 + r0 + rr) * n_out, col, n_out, f32_to_act(sum[rr].x + b0),
                           f32_to_act(sum[rr].y + b1));
    }
    if (lane == 0) locks[(size_t)mc * nblk + nb] = 0;  // ready for the next launch
}

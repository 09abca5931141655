// marlin_wgmma.cu, the Hopper GEMM (sm_90a only; marlin_decode.cu and marlin_gemm.cu
// serve sm_80..89 and the calls this kernel does not take):
// C[M, N] (fp16) = A[M, K] (fp16) @ W (+ optional bias) on the operands of
// marlin_stream.cuh (B in Marlin tile order, permuted scales S, permuted fp16 deltas D,
// A in Marlin K order), with the tile kernel's per-weight arithmetic
//   W[k, n] = fp16((q - 8) s + d)   (fma.rn.f16x2; d = 0 and mul.rn when !HAS_DELTA)
// and fp32 accumulation. NumPy reference: converter.gpu.reference.marlin_gemm
// (arith="weight"), bounded by reference.gemm_error_bound.
//
// Why the weights are the register operand ("transposed" wgmma): wgmma multiplies a
// 64 x 16 A, from registers, by a 16 x T B from shared memory, T = 8 .. 256 in steps of
// 8. With 64 output features as A's rows and the T activation rows (tokens) as B's
// columns, one instruction family covers every batch size without padding M to 64,
// and each weight is dequantized once, in registers, by the warp that owns it. The
// Marlin layout already is the A fragment: lane l's word j of a 16 x 64 block is, for
// 16-column tile j, {k 2t..2t+1 at n g, at n g+8; k 2t+8..2t+9 at n g, at n g+8}
// (t = l % 4, g = l / 4), which codes_minus8 returns as m[0], m[2], m[1], m[3].
//
// Block: WGS warpgroups (128 WGS threads). The block owns 256 output features (4
// Marlin column blocks; warp w of every warpgroup reads block 4 nb4 + w) and one K
// range of tiles_per_split k-tiles. Its warpgroups split the 16-column tiles of those
// blocks J at a time (FG = 4 / J feature groups) and the block's tokens T at a time
// (TG = WGS / FG token groups, TOK = T TG tokens): warpgroup wg = FG tg + fg issues J
// wgmma per k-tile, wgmma jj having as its 64 rows tile j = J fg + jj of each warp's
// block, so accumulator acc[jj][4 i + e] of warp w, lane (g, t) is feature 64 w + 16 j
// + g + 8 (e / 2), token T tg + 8 i + 2 t + e % 2. J = 4 (one feature group): a
// warpgroup dequantizes all 256 features (with WGS = 2, for half the tokens each). J = 1
// (four feature groups): each weight is dequantized once per block however many
// tokens it holds, and the accumulators of T tokens take T / 2 registers, not 2 T,
// so one wgmma can be 128 tokens wide.
//
// Pipeline: an NS-stage ring in shared memory; each stage holds U k-tiles:
//   W  U x 2048 B   the 4 column blocks' B words of each k-tile, laid out as in global
//                   memory (2 KB contiguous per k-tile row); cp.async, 16 bytes a thread
//   X  U x TOK x 32 B   the activations of the stage as wgmma's no-swizzle K-major core
//                   matrices: chunk c (k 8 c .. 8 c + 7) of token r at c TOK 16 + r 16,
//                   i.e. leading byte offset TOK 16 (along K), stride byte offset 128
//                   (along the tokens); 2 U bulk copies (cp.async.bulk) from `At`, the
//                   activations re-laid out by hopper_activations (below)
//   S  GPI x 512 B  the 4 blocks' 64 permuted scales of each group slot; cp.async
//   D  GPI x 512 B  the same for fp16(delta) (HAS_DELTA); cp.async
// Why the two copy engines: wgmma reads X through the async proxy, and shared memory
// written by ordinary (generic-proxy) stores, cp.async included, would need a
// fence.proxy.async, which also waits for every cp.async in flight and so drained the
// pipeline each stage (measured: the copies alone ran at 1.6 TB/s at M = 64; with X by
// bulk copy, at 3.1 TB/s). W, S and D are read with ordinary loads, so cp.async suits
// them, and a bulk copy completes on the stage's mbarrier.
// NS - 2 stages are in flight while one is computed. The stage computed two iterations
// ago is the one the copies may overwrite: every warpgroup retired its products before
// the barrier of this iteration. J = 4: one wgmma group per k-tile, waited for one
// k-tile behind (wait_group 1), each k-tile's A fragments in the other of two register
// sets than the k-tile before. J * U <= 8 ("STAGED"): one group per stage, its U
// k-tiles' fragments in U register sets, waited for (wait_group 0) at the next stage
// before they are rewritten. (Per-stage `empty` mbarriers instead of the block-wide
// barrier, so that warps may drift a stage apart, measured 3-5 % slower on an H200.)
//
// K splits > 1: every block writes its fp32 accumulators to `ws` in register order
// ([split][unit][register][thread], coalesced), then bumps the unit's counter; the last
// to arrive sums all splits in split order (deterministic), resets the counter and
// writes C. The epilogue adds the bias in fp32, rounds once to fp16, stages the tile in
// shared memory and stores 16-byte rows of C.
//
// Launch geometry (converter/gpu plans it): hopper_activations first (one thread per
// 16-byte piece of At); then block = 128 WGS threads; grid.x = m_chunks * ceil(N / 256)
// * splits, m-chunk fastest (chunks that read the same weights run side by side, so the
// second read hits L2); dynamic shared memory = NS * STAGE bytes (WgLayout); m_pad =
// m_chunks * TOK.
// Constraints: K % (16 U) == 0, N % 64 == 0, group size a multiple of 16 dividing K or
// per-channel, GPI = U / gcd(group tiles, U) (1 for per-channel), tiles_per_split %
// U == 0, U % WGS == 0, 16-byte aligned operands, `locks` zeroed before first use and
// never shared by two launches in flight. Needs sm_90a (wgmma); no L2 cache-policy hint.

#include "marlin_stream.cuh"
#ifdef MARLIN_BF16
#error "marlin_wgmma.cu has fp16 forms only (no route sends bf16 here; hopper_activations copies bits and serves both)"
#endif
#include "wgmma_ops.cuh"
#include "hopper_pipe.cuh"

// Measurement switches (docs/notes/perf_notes.md, "where the time goes"): compile with
// -DWG_NODQ=1 to feed the raw words to wgmma, -DWG_NOMMA=1 to skip the products. The
// results are wrong then; the time of what remains is what they are for. (With J = 1,
// WG_NODQ makes ptxas add warpgroup arrives (C7519): not comparable with J = 4.)
#ifndef WG_NODQ
#define WG_NODQ 0
#endif
#ifndef WG_NOMMA
#define WG_NOMMA 0
#endif

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "marlin_wgmma.cu uses wgmma: build it for sm_90a (--gpu-architecture=sm_90a)"
#endif

template <int T, int WGS, int U, int GPI, int NS, bool HAS_DELTA, int J = 4>
struct WgLayout {
    static constexpr int FG = 4 / J;
    static constexpr int TG = WGS / FG;
    static constexpr int TOK = T * TG;
    static constexpr int NTHR = 128 * WGS;
    static constexpr int W_OFF = 0;
    static constexpr int W_TILE = 2048;
    static constexpr int X_OFF = U * W_TILE;
    static constexpr int X_TILE = TOK * 32;
    static constexpr int S_OFF = X_OFF + U * X_TILE;
    static constexpr int D_OFF = S_OFF + GPI * 512;
    static constexpr int STAGE = D_OFF + (HAS_DELTA ? GPI * 512 : 0);
    static constexpr int RING = NS * STAGE;
    // epilogue: the block's C tile as fp16 rows of 256 features, padded by 16 bytes so
    // that the 4 token rows a warp's store touches fall in different banks
    static constexpr int C_PITCH = 264;
    static constexpr int NACC = J * T / 2;  // fp32 accumulators per thread: J wgmma x T / 2
    static_assert(J == 1 || J == 2 || J == 4, "a warpgroup takes 1, 2 or 4 of a block's 16-column tiles");
    static_assert(WGS % FG == 0 && TG >= 1, "whole feature groups");
    static_assert(U % WGS == 0, "every thread copies the same number of weight rows");
    static_assert(TOK * C_PITCH * 2 <= RING, "the C tile must fit in the ring");
    static_assert(U % 2 == 0, "A fragments alternate between two register sets per k-tile");
    static_assert(NS >= 3, "NS - 2 stages in flight");
};

// The activations in the layout the bulk copies want, chunk-major in blocks of `tok`
// token rows: At[b][c][r][0..7] = A[b tok + r][8 c .. 8 c + 7] (m_pad / tok blocks of K/8
// chunks of tok rows of 16 bytes), rows >= M zero, after the act-order gather
// A[r][perm[k]] when perm != nullptr. A stage's tokens of one chunk are then tok * 16
// contiguous bytes (and, within a block, a stage's chunks follow each other), and in
// shared memory they form wgmma's no-swizzle K-major core matrices with a leading byte
// offset of tok * 16 (K) and a stride byte offset of 128 (tokens). marlin_wgmma takes
// tok = m_pad (one block: [c][r], its m-chunks side by side in each chunk row);
// marlin_streamk takes its token chunk, so that a stage is one bulk copy, and `swizzle`
// = 1: each block's rows then go by boxes of 64 values of K (x = c / 8), tok rows of 128
// bytes, the 16-byte chunk j = c % 8 of row r stored at chunk j ^ r % 8: the slot
// marlin_streamk's tensor map writes (K % 64 == 0). Launch: one thread per 16-byte
// piece, grid.x = ceil(K / 8 * m_pad / 256), block 256; m_pad % tok == 0. NumPy
// reference: converter.gpu.reference.hopper_activations.
extern "C" __global__ void hopper_activations(const u16* __restrict__ A, const int* __restrict__ perm,
                                             u16* __restrict__ At, int M, int K, int m_pad, int tok, int swizzle) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long k8 = K >> 3;
    const long long total = k8 * m_pad;
    if (i >= total) return;
    const long long rest = i / tok;
    const int r = (int)((rest / k8) * tok + i % tok), c = (int)(rest % k8);
    u32 v[4] = {0u, 0u, 0u, 0u};
    if (r < M) {
        const u16* row = A + (size_t)r * K;
        if (perm == nullptr) {
            const int4 x = *reinterpret_cast<const int4*>(row + 8 * c);
            v[0] = (u32)x.x; v[1] = (u32)x.y; v[2] = (u32)x.z; v[3] = (u32)x.w;
        } else {
#pragma unroll
            for (int h = 0; h < 4; ++h)
                v[h] = (u32)row[perm[8 * c + 2 * h]] | ((u32)row[perm[8 * c + 2 * h + 1]] << 16);
        }
    }
    // the piece's place: i itself, or swizzled within its box (block b = r / tok)
    const long long to = swizzle ? (((rest / k8) * (k8 >> 3) + (c >> 3)) * tok + i % tok) * 8 + ((c & 7) ^ (r & 7)) : i;
    *reinterpret_cast<int4*>(At + (size_t)to * 8) = make_int4((int)v[0], (int)v[1], (int)v[2], (int)v[3]);
}

template <int T, int WGS, int U, int GPI, int NS, bool HAS_DELTA, int J = 4>
__global__ void __launch_bounds__(128 * WGS, 1)
marlin_wgmma(const u16* __restrict__ At, const int4* __restrict__ B, const u16* __restrict__ S,
             const u16* __restrict__ D, const u16* __restrict__ bias, u16* __restrict__ C,
             float* __restrict__ ws, int* __restrict__ locks, int M, int m_pad, int K, int N, int n_out,
             int group_tiles, int per_channel, int splits, int tiles_per_split) {
    using L = WgLayout<T, WGS, U, GPI, NS, HAS_DELTA, J>;
    constexpr int TOK = L::TOK, NTHR = L::NTHR, SUB = U / GPI, FG = L::FG;
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) unsigned long long full[NS];
    __shared__ int arrived;

    const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, wg = tid >> 7;
    const int fg = wg % FG, tg = wg / FG;
    const int j0 = J * fg;  // this warpgroup's first 16-column tile of each warp's block
    const int g4 = lane >> 2, t4 = lane & 3;
    const int nblk = N >> 6;
    const int nbb = (nblk + 3) >> 2;
    const int m_chunks = m_pad / TOK;
    const int units = m_chunks * nbb;
    const int unit = (int)(blockIdx.x % units);
    const int mc = unit % m_chunks, nb4 = unit / m_chunks;
    const int split = (int)(blockIdx.x / units);
    const int KT = K >> 4;
    const int kt0 = min(split * tiles_per_split, KT);
    const int kt1 = min(kt0 + tiles_per_split, KT);
    const int mrow0 = mc * TOK;
    const int nb = 4 * nb4 + warp;
    // Past a ragged N a warp computes on whatever its block's slot holds (wgmma needs all
    // 4 warps); its features are never stored. Only the live blocks are copied.
    const int nb_src = min(nb, nblk - 1);
    const int live_blocks = min(4, nblk - 4 * nb4);

    float acc[J][T / 2];
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int i = 0; i < T / 2; ++i) acc[j][i] = 0.f;

    u32 s2[2 * J], d2[2 * J];  // the open group's scales / deltas of this lane's 2 J features, fp16x2 splats
#pragma unroll
    for (int p = 0; p < 2 * J; ++p) s2[p] = d2[p] = 0u;
    if (per_channel) {  // one group for all of K: straight to registers
#pragma unroll
        for (int p = 0; p < 2 * J; ++p) {
            const int pos = scale_pos(64 * nb_src + 16 * (j0 + (p >> 1)) + g4 + 8 * (p & 1), 1);
            s2[p] = h_splat(ldg_u16(S + pos));
            if (HAS_DELTA) d2[p] = h_splat(ldg_u16(D + pos));
        }
    }

    const u32 ring = smem_addr(smem);
    const u32 bar0 = smem_addr(full);
    if (tid == 0) {
        for (int s = 0; s < NS; ++s) mbar_init(bar0 + 8 * s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    // Copies of a stage: the weights (thread t: lane t % 32 of block (t / 32) % 4 of
    // k-tiles t / 128, + NTHR / 128, ...) and the scales/deltas of the groups that start
    // in it (threads 0..63) by cp.async, read back with ordinary loads; the activations,
    // which wgmma reads through the async proxy, by bulk copies (warp 0, lane c: chunk c)
    // that complete on the stage's barrier, so no proxy fence (which would also wait for
    // every cp.async in flight) is needed.
    const size_t brow = (size_t)(N >> 1);  // int4 per B row (k-tile)
    const int w_u0 = tid >> 7;
    const int4* wptr = B + (size_t)(kt0 + w_u0) * brow + 32 * min(4 * nb4 + ((tid >> 5) & 3), nblk - 1) + lane;
    const u32 w_dst = L::W_OFF + w_u0 * L::W_TILE + (tid & 127) * 16;
    const int sq = tid & 31, sblk = sq >> 3;
    const u32 s_src = 64u * (u32)min(4 * nb4 + sblk, nblk - 1) + 8u * (u32)(sq & 7);
    const u32 s_dst = (u32)(sblk * 128 + (sq & 7) * 16);
    const u16* xsrc = At + ((size_t)(2 * kt0 + lane) * m_pad + mrow0) * 8;
    constexpr u32 X_BYTES = 2u * U * TOK * 16u;
    GroupWalk issue_walk, compute_walk;
    issue_walk.init(kt0, group_tiles);
    compute_walk.init(kt0, group_tiles);
    auto issue = [&](int stage, int kt) {
        const u32 st = ring + stage * L::STAGE, bar = bar0 + 8 * stage;
        if (tid == 0) mbar_expect_tx(bar, X_BYTES);
        if (tid < 32) {
            __syncwarp();
            if (lane < 2 * U) bulk_load(st + L::X_OFF + lane * TOK * 16, xsrc, TOK * 16, bar);
        }
        xsrc += (size_t)2 * U * m_pad * 8;
#pragma unroll
        for (int u = 0; u < U; u += NTHR / 128) cp_async16(st + w_dst + u * L::W_TILE, wptr + u * brow);
        wptr += U * brow;
        if (!per_channel) {
#pragma unroll
            for (int gi = 0; gi < GPI; ++gi) {
                if (issue_walk.step(kt + gi * SUB, group_tiles)) {
                    const size_t off = (size_t)issue_walk.g * N + s_src;
                    if (tid < 32)
                        cp_async16(st + L::S_OFF + gi * 512 + s_dst, S + off);
                    else if (HAS_DELTA && tid < 64)
                        cp_async16(st + L::D_OFF + gi * 512 + s_dst, D + off);
                }
            }
        }
    };
    static_assert(2 * U <= 32, "one lane per activation chunk");

    const int steps = (kt1 - kt0) / U;
#pragma unroll
    for (int s = 0; s < NS - 2; ++s) {
        if (s < steps) issue(s, kt0 + s * U);
        cp_async_commit();
    }

    // STAGED (J * U <= 8: J = 1, 2 at U = 4): a warpgroup dequantizes a whole stage into
    // U register sets and issues its U k-tiles' wgmma back to back as one group, retired
    // at the next stage; the products run while the warps meet at the barrier, issue the
    // next copies and load the next B words. Else (J = 4, whose 4 A fragments per k-tile
    // fill the registers): one group per k-tile, waited for one k-tile behind, in two
    // register sets.
    constexpr bool STAGED = J * U <= 8;
    u32 af[STAGED ? U : 2][J][4];
    const u32 x_wg = (u32)(tg * (T / 8) * 128);  // this warpgroup's first token inside a chunk
    const u32 w_lane = L::W_OFF + warp * 512 + lane * 16 + 4 * j0;
    auto fragments = [&](const u32 (&bw)[J], u32 (&a)[J][4]) {
#if WG_NODQ
#pragma unroll
        for (int j = 0; j < J; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) a[j][i] = bw[j] ^ (u32)i;
#else
        weight_fragments<HAS_DELTA, J>(bw, s2, d2, a);
#endif
    };
    auto products = [&](const u32 (&a)[J][4], unsigned long long desc) {
#if WG_NOMMA
#pragma unroll
        for (int j = 0; j < J; ++j)
            asm volatile("" ::"r"(a[j][0]), "r"(a[j][1]), "r"(a[j][2]), "r"(a[j][3]), "l"(desc));
#else
#pragma unroll
        for (int j = 0; j < J; ++j) Wgmma<T>::mma(acc[j], a[j], desc);
#endif
    };
    for (int it = 0; it < steps; ++it) {
        const int stage = it % NS;
        const int kt = kt0 + it * U;
        cp_async_wait<NS - 3>();  // this thread's weight and scale copies of the stage landed
        mbar_wait(bar0 + 8 * stage, (u32)(it / NS) & 1u);  // and its activations
        // ... every thread's; and every warp has retired the products that read the stage
        // of iteration it - 2 (STAGED: at the wgmma_wait<0> of iteration it - 1; else at
        // its first wgmma_wait<1>): that stage may be refilled.
        __syncthreads();
        if (it + NS - 2 < steps) issue((it + NS - 2) % NS, kt + (NS - 2) * U);
        cp_async_commit();
        const u32 st = ring + stage * L::STAGE;
        auto walk_groups = [&](auto&& per_tile) {
#pragma unroll
            for (int gi = 0; gi < GPI; ++gi) {
                if (!per_channel && compute_walk.step(kt + gi * SUB, group_tiles)) {
                    splat_cols<J>(st + L::S_OFF + gi * 512 + warp * 128 + 16 * g4 + 4 * j0, s2);
                    if (HAS_DELTA) splat_cols<J>(st + L::D_OFF + gi * 512 + warp * 128 + 16 * g4 + 4 * j0, d2);
                }
#pragma unroll
                for (int uu = 0; uu < SUB; ++uu) per_tile(gi * SUB + uu);
            }
        };
        if constexpr (STAGED) {
            u32 bw[U][J];
#pragma unroll
            for (int u = 0; u < U; ++u) lds_words<J>(st + w_lane + u * L::W_TILE, bw[u]);
#if !WG_NOMMA
            wgmma_wait<0>();  // the stage before is done: its register sets may be refilled
#endif
            walk_groups([&](int u) { fragments(bw[u], af[u]); });
#if !WG_NOMMA
            wgmma_fence();
#endif
#pragma unroll
            for (int u = 0; u < U; ++u) products(af[u], wg_desc(st + L::X_OFF + 2 * u * TOK * 16 + x_wg, TOK * 16));
#if !WG_NOMMA
            wgmma_commit();
#endif
        } else {
            walk_groups([&](int u) {
                const int SET = u & 1;  // the other register set than the k-tile before
                u32 bw[J];
                lds_words<J>(st + w_lane + u * L::W_TILE, bw);
                fragments(bw, af[SET]);
#if !WG_NOMMA
                wgmma_fence();
#endif
                products(af[SET], wg_desc(st + L::X_OFF + 2 * u * TOK * 16 + x_wg, TOK * 16));
#if !WG_NOMMA
                wgmma_commit();
                wgmma_wait<1>();  // the k-tile before is done: its register set may be refilled
#endif
            });
        }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int i = 0; i < T / 2; ++i) reg_fence(acc[j][i]);
    cp_async_wait<0>();
    __syncthreads();  // the ring is free: it becomes the C tile below

    if (splits > 1) {
        float* mine = ws + (size_t)(split * units + unit) * L::NACC * NTHR + tid;
#pragma unroll
        for (int j = 0; j < J; ++j)
#pragma unroll
            for (int i = 0; i < T / 2; ++i) mine[(j * (T / 2) + i) * NTHR] = acc[j][i];
        __syncthreads();  // every thread's partials, before thread 0 publishes them (atom_add_acq_rel)
        if (tid == 0) arrived = atom_add_acq_rel(locks + unit, 1);
        __syncthreads();
        if (arrived != splits - 1) return;
#pragma unroll
        for (int j = 0; j < J; ++j)
#pragma unroll
            for (int i = 0; i < T / 2; ++i) acc[j][i] = 0.f;
        for (int s = 0; s < splits; ++s) {  // split order: the sum does not depend on who came last
            const float* part = ws + (size_t)(s * units + unit) * L::NACC * NTHR + tid;
#pragma unroll
            for (int j = 0; j < J; ++j)
#pragma unroll
                for (int i = 0; i < T / 2; ++i) {
                    float v;
                    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(part + (j * (T / 2) + i) * NTHR));
                    acc[j][i] += v;
                }
        }
        if (tid == 0) locks[unit] = 0;  // ready for the next launch
    }

    // ---- epilogue: acc + bias in fp32, one rounding, through shared memory to C ----
    float bf[2 * J];
#pragma unroll
    for (int p = 0; p < 2 * J; ++p)
        bf[p] = nb < nblk ? bias_at(bias, 64 * nb + 16 * (j0 + (p >> 1)) + g4 + 8 * (p & 1), n_out) : 0.f;
    u16* tile = reinterpret_cast<u16*>(smem);
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
        for (int i = 0; i < T / 2; ++i) {
            const int e = i & 3;
            const int tok = tg * T + 8 * (i >> 2) + 2 * t4 + (e & 1);
            const int f = 64 * warp + 16 * (j0 + j) + g4 + 8 * (e >> 1);
            tile[tok * L::C_PITCH + f] = f32_to_h(acc[j][i] + bf[2 * j + (e >> 1)]);
        }
    __syncthreads();
    const int rows = min(M - mrow0, TOK);
    const int fcols = min(64 * live_blocks, n_out - 256 * nb4);
    const bool vec = (n_out & 7) == 0;  // 16-byte rows of C (always, unless N was padded)
    for (int c = tid; c < TOK * 32; c += NTHR) {
        const int tok = c >> 5, f8 = 8 * (c & 31);
        if (tok >= rows || f8 >= fcols) continue;
        u16* dst = C + (size_t)(mrow0 + tok) * n_out + 256 * nb4 + f8;
        const u16* src = tile + tok * L::C_PITCH + f8;
        if (vec) {
            *reinterpret_cast<int4*>(dst) = *reinterpret_cast<const int4*>(src);
        } else {
            for (int e = 0; e < 8 && f8 + e < fcols; ++e) dst[e] = src[e];
        }
    }
}

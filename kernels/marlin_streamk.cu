// marlin_streamk.cu, the persistent Hopper GEMM (sm_90a only):
// C[M, N] = A[M, K] @ W (+ optional bias), A and C fp16, or bf16 in the build with
// -DMARLIN_BF16 (marlin_common.cuh says what differs), on the operands of
// marlin_stream.cuh (B in Marlin tile order, permuted scales S, permuted fp16 deltas D)
// and the activations (A itself through a tensor map, gathered first under act-order; or
// A re-laid out by hopper_activations, the path without NVIDIA's cuda-bindings), in two
// forms:
//   GS = false ("hopper_sk"): marlin_wgmma.cu's per-weight arithmetic
//     W[k, n] = fp16((q - 8) s + d)   (fma.rn.f16x2; mul.rn when !HAS_DELTA);
//   GS = true ("hopper_skg"): marlin_decode.cu's per-group arithmetic, the offset codes
//     and the activations' sums multiplied in fp32 and closed per stage (below);
// fp32 accumulation. NumPy reference: converter.gpu.reference.marlin_gemm (arith
// "weight" / "group"), bounded by reference.gemm_error_bound.
//
// Why another Hopper kernel. marlin_wgmma.cu has every warp issue its share of a
// stage's copies, wait for the whole stage and meet at a block barrier before it
// dequantizes and multiplies, one K split per block in waves over the multiprocessors.
// Measured on an H200 (docs/notes/perf_notes.md): its copies alone stream 2.6-3.3 TB/s,
// it spends half its instructions on the copy issue, and 224 blocks on 132
// multiprocessors leave a third of them idle for half the kernel. Here:
//   * one block per multiprocessor, each taking an equal run of the work (stream-K):
//     the work is units (256 output features x one chunk of T tokens) x stages (U
//     k-tiles), numbered unit-major; block b takes stages [b L, b L + L);
//   * a producer warpgroup that only copies, NS stages ahead of the consumers: per
//     stage its 128 threads copy the U weight rows (2 KB each, 4 Marlin column blocks)
//     and the scales / deltas of the groups that start in it (GS: of every stage) by
//     16-byte cp.async (B in Marlin's order; with B unit-major, thread 0 copies all of
//     them by bulk copies instead, below), and
//     thread 0 the stage's activations (U T 32 bytes): U / 4 tensor copies from A
//     itself, each a box of 64 values of K x T tokens (T rows of 128 bytes), which the
//     copy engine writes 128-byte swizzled, wgmma's swizzled K-major operand, and
//     zero-fills past M (no re-layout kernel first); or, without a map, one 1-D copy of
//     `At`, A laid out the same way by hopper_activations (marlin_wgmma.cu) before this
//     kernel.
//     (A first map of 16-byte rows, box (8, T, 2 U), beat the re-layout by 3-11 % at
//     8-24 tokens but lost 5-13 % from 48, its boxes 768+ rows long.) The stage's
//     `full` mbarrier completes when every thread's copies have landed
//     (cp.async.mbarrier.arrive.noinc) and the bulk copy's bytes have arrived; a slot
//     is refilled when its `empty` mbarrier says all 8 consumer warps are done with it.
//     (Every operand by bulk copy, issued by lanes of one warp, ran ~1000 cycles a
//     stage whatever the token count: 115 us at M = 1 on 8192 x 57344, see
//     docs/notes/perf_notes.md);
//   * two consumer warpgroups that only dequantize and multiply: warpgroup c takes the
//     16-column tiles 2c, 2c + 1 of each warp's Marlin block (128 features, two
//     `wgmma m64nTk16` per k-tile, weights as the register operand exactly as in
//     marlin_wgmma.cu), one wgmma group per pair of k-tiles, one pair multiplied while
//     the next is dequantized, a lane's B words of a whole stage loaded at its start.
// Units cut by block boundaries: every block that holds a piece of one parks its fp32
// sums in `ws` and bumps the unit's counter; the last to arrive adds the pieces in piece
// (= block) order, whoever it is, so the result depends on the problem and the grid
// only, and stores C. No block waits for another without bound (a unit's first block
// polls the counter a fixed number of times, OWNER_POLLS, before it parks): two of these
// GEMMs running concurrently (two streams of one device, each with its own workspace) or
// a grid that does not get every multiprocessor cannot deadlock. (An owner that waited
// for its successors' pieces, the first design, could: it assumed every block of the
// grid runs at once.) Parking and claiming take one acquire-release add by one thread
// after a barrier (atom_add_acq_rel, marlin_stream.cuh), not a fence in every thread.
//
// Shared memory: NS stages (StreamkLayout), each
//   W  U x 2048 B       the 4 column blocks' B words of each k-tile, as in global memory
//   X  U x T x 32 B     the stage's activations, 1024-byte aligned. From `xmap` (A as the
//                       2-D [M][K], box (64, T) at (16 k-tile + 64 b, T x chunk)):
//                       box b at b T 128, token r's 16-byte chunk j (k 64 b + 8 j ..) at
//                       r 128 + 16 (j ^ r % 8) (wg_desc_sw128); `At` holds the same bytes
//                       (hopper_activations with swizzle = 1), a stage's run contiguous
//   S  GPI x 512 B      the 4 blocks' 64 permuted scales of each group slot
//   D  GPI x 512 B      the same for fp16(delta) (reserved without HAS_DELTA too: stages
//                       stay whole 1024-byte atoms)
// Only the live column blocks are copied when N is ragged (N / 64 not a multiple of 4;
// the unit-major weights are copied whole, the last unit's padding included): the warps
// past them compute on whatever their slot holds and store nothing.
// The consumers read W, S and D with ordinary loads, which the cp.async (generic proxy)
// writes, and wgmma reads X through the async proxy, which the bulk copies write. With B
// unit-major the bulk copies (async proxy) also write W, S and D, after the consumers'
// ordinary reads of the slot's previous stage: those reads have returned (their values
// fed the stage's wgmma) before each consumer warp arrives on the slot's `empty` barrier,
// which the producer's wait acquires before it issues the copy. A fence.proxy.async
// between the two cost 9-16 % at 1-16 rows on an H200 and is left out
// (docs/notes/streamk_variants/proxy_fence.patch, docs/notes/perf_notes.md); racecheck is clean.
//
// B: Marlin's tile order, or (b_units = 1) the same 2 KB pieces unit-major: unit u's
// k-tile t at (u K / 16 + t) x 2 KB, a last ragged unit padded to 4 column blocks
// (kernels.prepare_b_units; reference.b_units is its twin). The weight stream's order is
// the same; its addresses are one contiguous run per block instead of a 2 KB strip
// down rows N / 2 int4 apart (which a read-only probe streamed 12-19 % slower,
// docs/notes/perf_notes.md), so that one thread moves a stage by a few bulk copies.
// MarlinLinear keeps B unit-major where this kernel serves every M.
// B with the scales and deltas inline (b_units = 2, group size 128 only): per unit and
// group, its 8 k-tiles' 2 KB pieces, then the group's 512-byte scale row and 512-byte delta
// row of the unit's 256 features (permuted as S and D, zero past N), 17408 bytes
// (kernels.prepare_b_stages; reference.b_stages is its twin). An 8-tile stage is then one
// bulk copy of weights, scales and deltas (a slot holds W, S, D and then X in this mode),
// where the separate copies were three: 2-6 % faster at 1-16 rows and 7-11 % at 32 on the
// 70B layers of an H200, 0-3 % on the 7B ones (docs/notes/perf_notes.md). The global S and D
// are then not read (the host gives this mode to groups of 128 only, never per-channel).
//
// Launch geometry (converter/gpu plans it): `xmap` encoded by converter/gpu/tensormap.py
// (after gather_columns under act-order) and At null, or hopper_activations with tok = T
// and swizzle = 1 first and `xmap` unused; block = 384 threads (consumer warpgroups 0-1, producer
// warpgroup 2), grid = ceil(units x K / (16 U) / iters) blocks (at most one per
// multiprocessor), dynamic shared memory StreamkLayout::RING (the ring and 1024 bytes
// that align it); `ws` holds 2 x grid x T x 256 floats (two piece slots a block),
// `flags` grid ints (the counter of the cut unit that starts in block b is flags[b]),
// zero before the first launch and zero again after each (the last arriver resets it).
// Constraints: K % (16 U) == 0, N % 64 == 0, group size a multiple of 16 dividing K
// or per-channel, GPI = U / gcd(group tiles, U) (1 for per-channel; GS: group tiles a
// multiple of U, so GPI = 1 and a stage lies in one group), 16-byte aligned operands; `ws` and `flags` never shared by two launches in flight. Needs sm_90a
// (wgmma); no L2 cache-policy hint.

#include "marlin_stream.cuh"
#include "wgmma_ops.cuh"
#include "hopper_pipe.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "marlin_streamk.cu uses wgmma: build it for sm_90a (--gpu-architecture=sm_90a)"
#endif

// Registers per thread after the roles split (setmaxnreg): 128 x 56 + 256 x 224 = 64512
// of the multiprocessor's 65536.
constexpr int PRODUCER_REGS = 56;
constexpr int CONSUMER_REGS = 224;
// How many more times a unit's first block reads the unit's counter, where the runs are
// aligned, before it parks its own piece (12 L2 round trips at most; docs/notes/perf_notes.md
// has the H200 measurements).
constexpr int OWNER_POLLS = 12;
// Register sets of A fragments a consumer warpgroup cycles through, one per k-tile: a
// wgmma group holds a pair of k-tiles (one fence, commit and wait per two, and
// two independent dequantizations for the scheduler to interleave), and while one pair
// is multiplied the next is dequantized into the other two sets (wait_group 1).
constexpr int WG_DEPTH = 4;

template <int T, int U, int GPI, int NS, bool HAS_DELTA>
struct StreamkLayout {
    static constexpr int W_OFF = 0;
    static constexpr int W_TILE = 2048;
    static constexpr int X_OFF = U * W_TILE;
    static constexpr int X_BYTES = U * T * 32;
    static constexpr int X_BOX = T * 128;  // one swizzled box: 64 values of K x T tokens
    static constexpr int S_OFF = X_OFF + X_BYTES;
    static constexpr int D_OFF = S_OFF + GPI * 512;
    // The delta rows are reserved in the symmetric variant too: every stage, and so every
    // X slot, stays a multiple of the swizzle atom (1024 bytes) from the aligned ring.
    static constexpr int STAGE = D_OFF + GPI * 512;
    // B with the scales and deltas inline (b_units = 2, kernels.prepare_b_stages): the
    // stage's scale and delta rows right after its weights, as in global memory, so that
    // one bulk copy moves all three; the activations after them.
    static constexpr int S_OFF_INL = U * W_TILE;
    static constexpr int X_OFF_INL = S_OFF_INL + GPI * 1024;
    static_assert(X_OFF_INL % 1024 == 0, "swizzle atoms 1024-byte aligned");
    static constexpr int ALIGN = 1024;
    static constexpr int RING = NS * STAGE + ALIGN;  // + the slack that aligns the ring
    static_assert(STAGE % ALIGN == 0 && X_OFF % ALIGN == 0, "swizzle atoms 1024-byte aligned");
    static_assert(U % 4 == 0, "a stage's activations are whole 64-value boxes");
    static constexpr int CONSUMERS = 256;  // two warpgroups
    static constexpr int THREADS = CONSUMERS + 128;  // + the producer warpgroup
    static constexpr int NACC = T;  // fp32 accumulators per consumer thread: 2 wgmma x T / 2
    static_assert(U % WG_DEPTH == 0 && WG_DEPTH == 4, "pairs of k-tiles cycle through the register sets, each stage from set 0");
    static_assert(T % 8 == 0 && T <= 128, "wgmma n8 .. n128");
};

// Where k-tile u of a stage starts in the X slot: box u / 4 (64 values of K x T rows of
// 128 bytes), then 32 bytes per k-tile along the (swizzled) rows. u is a compile-time
// constant wherever this is called.
template <int T>
__device__ __forceinline__ constexpr u32 x_step(int u) {
    return (u >> 2) * T * 128 + (u & 3) * 32;
}

// The stage sequence of one block: its run [i0, i1) of (unit, stage) numbers cut at
// unit boundaries into pieces, each one unit's stages [s0, s0 + n). The producer and
// the consumers walk the same sequence.
struct Piece {
    int unit, s0, n;
};

// ---- the GS form (per-group arithmetic, as marlin_decode.cu's) ----
// Per stage (U k-tiles, all in one group: the planner's rule) each consumer warpgroup
// multiplies the offset codes (marlin_common.cuh) into fp32 sums P of its 128 features
// x T tokens, and the constant OFFSET_SUMS_A into Y (rows g) and X (rows g + 8) of the
// stage's tokens, one wgmma each per k-tile, the stage's first starting from zero
// (scale-d). The stage is then closed into the accumulators in fp32:
//   acc += s (P + Y) + d X
// with the stage's group's scale s and fp16 delta d, so a weight costs 5 instructions
// per 8 codes instead of 13. The close reads wgmma accumulators, which ptxas allows only
// outside a run of in-flight products (else it serializes every wgmma: C7514, even
// after a wait_group 0 in the middle of the run); so a stage first dequantizes its first
// pair of k-tiles while the stage before still multiplies, then drains (wait_group 0), closes
// the stage before and starts its own products.
template <int T, bool HAS_DELTA>
__device__ __forceinline__ void gs_close(float (&acc)[2][T / 2], const float (&gp)[2][T / 2], const float (&gx)[T / 2],
                                         const float (&sf)[4], const float (&df)[4]) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < T / 2; ++e) {
            // element e: token 8 (e / 4) + 2 t + e % 2, feature row g + 8 ((e / 2) % 2)
            const int r = e & 3, i4 = e & ~3, v = 2 * j + (r >> 1);
            float t = fmaf(sf[v], gp[j][e] + gx[i4 + (r & 1)], acc[j][e]);
            if (HAS_DELTA) t = fmaf(df[v], gx[i4 + 2 + (r & 1)], t);
            acc[j][e] = t;
        }
}

// A lane's two B words of every k-tile of a stage, loaded at once when the stage is
// ready: a k-tile's dequantization then starts without a shared-memory round trip of
// its own (every load, fence and wgmma is a volatile asm the compiler keeps in order, so
// it cannot hoist them itself), which had made each consumer warp's k-tile a serial
// chain of ~140 cycles on an H200 (docs/notes/perf_notes.md).
template <int U, int W_TILE>
__device__ __forceinline__ void stage_words(u32 sb_w, u32 (&bw)[U][2]) {
#pragma unroll
    for (int u = 0; u < U; ++u) lds_words<2>(sb_w + u * W_TILE, bw[u]);
}

// The A fragments of one k-tile's two wgmma: the offset codes of the lane's two words.
__device__ __forceinline__ void gs_fragments(const u32 (&bw)[2], u32 (&af)[2][4]) {
#pragma unroll
    for (int jj = 0; jj < 2; ++jj) {
        u32 m[4];
        offset_codes(bw[jj], m);
        af[jj][0] = m[0];
        af[jj][1] = m[2];
        af[jj][2] = m[1];
        af[jj][3] = m[3];
    }
}

// One ring stage of the GS form (stage `st` of its piece): the stage before it is closed
// here (at a piece's start the sums and scales are zero, so that close adds nothing).
// Per-channel (`pc_s`, `pc_d`: the layer's one scale and delta pair per tile, read by
// the caller) every stage takes those; the producer copies no scale rows then.
template <int T, int U, int NS, bool HAS_DELTA, int STAGE, int W_TILE>
__device__ __forceinline__ void gs_stage(u32& q, int st, u32 ring, u32 full0, u32 empty0, u32 x_off, u32 w_lane, u32 s_lane,
                                         int lane, bool per_channel, const u32 (&pc_s)[2], const u32 (&pc_d)[2],
                                         float (&acc)[2][T / 2], float (&gp)[2][T / 2], float (&gx)[T / 2],
                                         float (&sf)[4], float (&df)[4], u32 (&af)[WG_DEPTH][2][4]) {
    const u32 slot = q % NS;
    mbar_wait(full0 + 8 * slot, (q / NS) & 1u);
    const u32 sb = ring + slot * STAGE;
    const unsigned long long desc0 = wg_desc_sw128(sb + x_off);
    u32 ns2[2], nd2[2];
    lds_words<2>(sb + s_lane, ns2);  // s_lane: from the slot's start (the scale rows' offset included)
    if (HAS_DELTA) lds_words<2>(sb + s_lane + 512, nd2);
    u32 bw[U][2];
    stage_words<U, W_TILE>(sb + w_lane, bw);
    gs_fragments(bw[0], af[0]);
    gs_fragments(bw[1], af[1]);
    wgmma_wait<0>();
    // the stage before is multiplied: its slot is free and its sums are closed
    __syncwarp();
    mbar_arrive_if(empty0 + 8 * ((q + NS - 1) % NS), lane == 0 && st > 0);
    gs_close<T, HAS_DELTA>(acc, gp, gx, sf, df);
#pragma unroll
    for (int v = 0; v < 4; ++v) {
        const u32 sp = per_channel ? pc_s[v >> 1] : ns2[v >> 1], dp = per_channel ? pc_d[v >> 1] : nd2[v >> 1];
        sf[v] = h_to_f32((u16)(sp >> (16 * (v & 1))));
        df[v] = HAS_DELTA ? h_to_f32((u16)(dp >> (16 * (v & 1)))) : 0.f;
    }
    const u32 cf[4] = OFFSET_SUMS_A;
#pragma unroll
    for (int u = 0; u < U; u += 2) {  // a pair of k-tiles per wgmma group (see WG_DEPTH)
        if (u > 0) {
            gs_fragments(bw[u], af[u % WG_DEPTH]);
            gs_fragments(bw[u + 1], af[(u + 1) % WG_DEPTH]);
        }
        wgmma_fence();
#pragma unroll
        for (int v = u; v < u + 2; ++v) {
            const unsigned long long desc = wg_desc_at(desc0, x_step<T>(v));
            Wgmma<T>::mma(gp[0], af[v % WG_DEPTH][0], desc, v > 0);
            Wgmma<T>::mma(gp[1], af[v % WG_DEPTH][1], desc, v > 0);
            Wgmma<T>::mma(gx, cf, desc, v > 0);
        }
        wgmma_commit();
        wgmma_wait<WG_DEPTH / 2 - 1>();
    }
    ++q;
}

template <int T, int U, int GPI, int NS, bool HAS_DELTA, bool GS = false>
__global__ void __launch_bounds__(384, 1)
marlin_streamk(const __grid_constant__ TensorMap xmap, const u16* __restrict__ At, const int4* __restrict__ B,
               const u16* __restrict__ S,
               const u16* __restrict__ D, const u16* __restrict__ bias, u16* __restrict__ C,
               float* __restrict__ ws, int* __restrict__ flags, int M, int K, int N, int n_out, int group_tiles,
               int per_channel, int iters, int b_units) {
    using L = StreamkLayout<T, U, GPI, NS, HAS_DELTA>;
    constexpr int SUB = U / GPI;
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ __align__(8) unsigned long long full[NS], empty[NS];
    // Thread 0's reading of a counter, for the other consumer threads: [0] for the piece
    // that starts the block's run, [1] for the one that ends it. Two words, because no
    // barrier separates the other threads' read of the first from thread 0's write of
    // the second (a racecheck hazard with one word).
    __shared__ int arrived[2];

    const int tid = threadIdx.x, lane = tid & 31;
    const int nblk = N >> 6;
    const int m_chunks = (M + T - 1) / T;
    const int KS = (K >> 4) / U;  // stages per unit
    const int total = m_chunks * ((nblk + 3) >> 2) * KS;
    const int i0 = blockIdx.x * iters, i1 = min(i0 + iters, total);
    // The swizzled boxes need 1024-byte aligned atoms; the dynamic area's start is only
    // as aligned as the static shared memory before it leaves it, hence L::ALIGN of slack.
    const u32 ring = (smem_addr(smem) + (L::ALIGN - 1)) & ~(u32)(L::ALIGN - 1), full0 = smem_addr(full), empty0 = smem_addr(empty);
    // B with the scales and deltas inline (b_units = 2; the host gives it to group size 128 only)
    const bool inl = GPI == 1 && b_units == 2;
    const u32 x_off = inl ? L::X_OFF_INL : L::X_OFF;  // the activations' place in a slot
    if (tid == 0) {
        for (int s = 0; s < NS; ++s) {
            // every producer thread's cp.async arrive, and one arrive with the activations' bytes
            mbar_init(full0 + 8 * s, 128 + 1);
            mbar_init(empty0 + 8 * s, 8);  // one arrive per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto piece_at = [&](int i) {
        Piece p;
        p.unit = i / KS;
        p.s0 = i - p.unit * KS;
        p.n = min(KS - p.s0, i1 - i);
        return p;
    };

    if (tid >= L::CONSUMERS) {
        // ---------------- producer warpgroup: copies only ----------------
        // Registers move to the consumers (setmaxnreg acts on whole warpgroups): a
        // 12-warp block starts at 168 a thread, the consumers' 128-token accumulators
        // and their weight register sets need more, the copy loop far fewer.
        setmaxnreg_dec<PRODUCER_REGS>();
        const int pt = tid - L::CONSUMERS;  // 0..127: the 16-byte piece of each 2 KB weight row
        // Where a unit's k-tile t starts, in int4: B in Marlin's order has one row of
        // N / 2 int4 per k-tile, the unit's 2 KB at 128 nb4 in it; the unit-major copy
        // (b_units, kernels.prepare_b_units) has every unit's K / 16 k-tiles one after
        // another, so that a block's run is one contiguous stretch of memory.
        const size_t brow = b_units ? 128 : (size_t)(N >> 1);
        const size_t bunit = b_units ? (size_t)(K >> 4) * 128 : 128;
        const size_t k8 = (size_t)(K >> 3);
        u32 q = 0;  // stages issued by this block
        for (int i = i0; i < i1;) {
            const Piece p = piece_at(i);
            const int mc = p.unit % m_chunks, nb4 = p.unit / m_chunks;
            const int live = min(4, nblk - 4 * nb4);
            const bool w_live = pt < 32 * live;
            const int4* wsrc = B + (size_t)p.s0 * U * brow + bunit * nb4 + (w_live ? pt : 0);
            // scales (threads 0..31) and deltas (32..63): 8 pieces of 16 bytes per live block
            const bool s_live = (pt & 31) < 8 * live && (pt < 32 || (HAS_DELTA && pt < 64));
            const u16* ssrc = (pt < 32 ? S : D) + 256 * nb4 + 8 * (pt & 31);
            const u32 s_dst = (pt < 32 ? L::S_OFF : L::D_OFF) + 16 * (pt & 31);
            const u16* xsrc = At + ((size_t)mc * k8 + (size_t)2 * p.s0 * U) * T * 8;  // (At only)
            GroupWalk walk;
            walk.init(p.s0 * U, group_tiles);
            for (int st = 0; st < p.n; ++st, ++q) {
                const u32 slot = q % NS;
                // the slot's previous contents (stage q - NS) are consumed
                if (q >= NS) mbar_wait(empty0 + 8 * slot, (q / NS - 1) & 1u);
                const u32 sb = ring + slot * L::STAGE, bar = full0 + 8 * slot;
                const int kt = (p.s0 + st) * U;
                // Which group rows open in this stage (every thread walks the same groups).
                bool sd_open[GPI];
                int sd_g[GPI];
#pragma unroll
                for (int gi = 0; gi < GPI; ++gi) {
                    // GS: every stage's group (it is closed per stage); else a group's at its
                    // start. Per-channel scales are read once, by the consumers.
                    const bool opens = !per_channel && walk.step(kt + gi * SUB, group_tiles);
                    sd_open[gi] = GS ? !per_channel : opens;
                    sd_g[gi] = walk.g;
                }
                // Unit-major B: the stage's U k-tiles are one contiguous U x 2 KB run, and each
                // open group's scales (and deltas) one contiguous 128 x live bytes: thread 0
                // copies them all by bulk copy: 0-4.8 % faster than Marlin's order by 128
                // threads' cp.async on every row measured, M 1-64 on the 7B and 70B layers
                // (docs/notes/results/h200/bench_gemm_h200_b_order.json).
                if (pt == 0) {  // the activations, read by wgmma through the async proxy
                    u32 bytes = L::X_BYTES;
                    if (inl) {
                        // B with the scales and deltas inline (kernels.prepare_b_stages): unit
                        // nb4's group g is one run of its 8 k-tiles (2 KB each) and then its
                        // 512-byte scale and delta rows, 1088 int4 (group size 128: GPI = 1). An
                        // 8-tile stage is that whole run, one bulk copy; a 4-tile stage half the
                        // k-tiles, and the two rows where the group opens.
                        const int4* grun = B + ((size_t)nb4 * (size_t)(K >> 7) + (size_t)(kt >> 3)) * 1088;
                        const bool sd = sd_open[0];
                        mbar_expect_tx(bar, bytes + U * L::W_TILE + (sd ? 1024 : 0));
                        bulk_load(sb + L::W_OFF, grun + (kt & 7) * 128, U * L::W_TILE + (U == 8 && sd ? 1024 : 0), bar);
                        if (U != 8 && sd) bulk_load(sb + L::S_OFF_INL, grun + 1024, 1024, bar);
                    } else {
                        if (b_units) {
                            bytes += U * L::W_TILE;
#pragma unroll
                            for (int gi = 0; gi < GPI; ++gi) bytes += sd_open[gi] ? (HAS_DELTA ? 2 : 1) * 128 * live : 0;
                        }
                        mbar_expect_tx(bar, bytes);
                        if (b_units) {
                            bulk_load(sb + L::W_OFF, wsrc - (w_live ? pt : 0), U * L::W_TILE, bar);
#pragma unroll
                            for (int gi = 0; gi < GPI; ++gi) {
                                if (!sd_open[gi]) continue;
                                const size_t at = 256 * (size_t)nb4 + (size_t)sd_g[gi] * N;
                                bulk_load(sb + L::S_OFF + gi * 512, S + at, 128 * live, bar);
                                if (HAS_DELTA) bulk_load(sb + L::D_OFF + gi * 512, D + at, 128 * live, bar);
                            }
                        }
                    }
                    if (At) {  // one contiguous run of the re-laid-out activations
                        bulk_load(sb + x_off, xsrc, L::X_BYTES, bar);
                    } else {  // U / 4 boxes of 64 values of K x T tokens, swizzled, tokens past M zero
#pragma unroll
                        for (int b = 0; b < U / 4; ++b)
                            tensor_load_2d(sb + x_off + b * L::X_BOX, &xmap, 16 * kt + 64 * b, mc * T, bar);
                    }
                }
                if (!b_units) {  // Marlin's order: a 2 KB strip down each k-tile's row, 16 bytes a thread
                    if (w_live) {
#pragma unroll
                        for (int u = 0; u < U; ++u) cp_async16(sb + L::W_OFF + u * L::W_TILE + 16 * pt, wsrc + u * brow);
                    }
#pragma unroll
                    for (int gi = 0; gi < GPI; ++gi)
                        if (sd_open[gi] && s_live) cp_async16(sb + s_dst + gi * 512, ssrc + (size_t)sd_g[gi] * N);
                }
                // this thread's copies of the stage arrive on its barrier when they land
                cp_async_arrive_noinc(bar);
                wsrc += U * brow;
                xsrc += (size_t)2 * U * T * 8;
            }
            i += p.n;
        }
        return;  // every copy completes on a barrier the consumers wait for before they exit
    }

    // ---------------- consumer warpgroups: dequantize and multiply ----------------
    setmaxnreg_inc<CONSUMER_REGS>();
    const int warp = (tid >> 5) & 3, wg = tid >> 7;
    const int j0 = 2 * wg;  // this warpgroup's first 16-column tile of each warp's block
    const int g4 = lane >> 2, t4 = lane & 3;
    float acc[2][T / 2];
    u32 s2[2], d2[2];  // the open group's scales / deltas of this lane's 4 features, as fp16 pairs
    u32 af[WG_DEPTH][2][4];  // register sets of the two wgmma's weight fragments, one per k-tile (two a group)
    float gp[2][T / 2], gx[T / 2], sf[4], df[4];  // GS: the last stage's sums, scales and deltas
    const u32 w_lane = L::W_OFF + warp * 512 + lane * 16 + 4 * j0;
    const u32 s_lane = (inl ? L::S_OFF_INL : L::S_OFF) + (u32)(warp * 128 + 16 * g4 + 4 * j0);
    u32 q = 0;  // stages consumed by this block (unsigned: q % NS a cheap remainder)
    for (int i = i0; i < i1;) {
        const Piece p = piece_at(i);
        i += p.n;
        const int mc = p.unit % m_chunks, nb4 = p.unit / m_chunks;
        const int nb = 4 * nb4 + warp;
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < T / 2; ++e) acc[j][e] = 0.f;
#pragma unroll
        for (int v = 0; v < 2; ++v) s2[v] = d2[v] = 0u;
        if (per_channel) {  // one group for all of K: straight to registers
            const int nb_src = min(nb, nblk - 1);
#pragma unroll
            for (int v = 0; v < 4; ++v) {
                const int pos = scale_pos(64 * nb_src + 16 * (j0 + (v >> 1)) + g4 + 8 * (v & 1), 1);
                s2[v >> 1] |= (u32)ldg_u16(S + pos) << (16 * (v & 1));
                if (HAS_DELTA) d2[v >> 1] |= (u32)ldg_u16(D + pos) << (16 * (v & 1));
            }
        }
        if constexpr (GS) {
#pragma unroll
            for (int e = 0; e < T / 2; ++e) gp[0][e] = gp[1][e] = gx[e] = 0.f;
#pragma unroll
            for (int v = 0; v < 4; ++v) sf[v] = df[v] = 0.f;
            for (int st = 0; st < p.n; ++st)
                gs_stage<T, U, NS, HAS_DELTA, L::STAGE, L::W_TILE>(
                    q, st, ring, full0, empty0, x_off, w_lane, s_lane, lane, per_channel, s2, d2, acc, gp, gx, sf, df, af);
            wgmma_wait<0>();
            gs_close<T, HAS_DELTA>(acc, gp, gx, sf, df);
        } else {
            GroupWalk walk;
            walk.init(p.s0 * U, group_tiles);
            for (int st = 0; st < p.n; ++st, ++q) {
                const u32 slot = q % NS;
                mbar_wait(full0 + 8 * slot, (q / NS) & 1u);
                const u32 sb = ring + slot * L::STAGE;
                const unsigned long long desc0 = wg_desc_sw128(sb + x_off);
                const int kt = (p.s0 + st) * U;
                u32 bw[U][2];
                stage_words<U, L::W_TILE>(sb + w_lane, bw);
#pragma unroll
                for (int gi = 0; gi < GPI; ++gi) {
                    // A group opens at the run's first slot and wherever a boundary is reached.
                    // Without a branch: a branch between two wgmma makes ptxas serialize them
                    // all (C7513) once more than two groups are in flight. A slot where no group
                    // opens holds stale values, loaded and dropped.
                    const int t = kt + gi * SUB;
                    const bool hit = t >= walk.next;
                    walk.next += hit ? group_tiles : 0;
                    const bool open = !per_channel && (hit || t == walk.first);
                    u32 ns2[2], nd2[2];
                    lds_words<2>(sb + s_lane + gi * 512, ns2);
                    if (HAS_DELTA) lds_words<2>(sb + s_lane + (GPI + gi) * 512, nd2);
#pragma unroll
                    for (int v = 0; v < 2; ++v) {
                        s2[v] = open ? ns2[v] : s2[v];
                        if (HAS_DELTA) d2[v] = open ? nd2[v] : d2[v];
                    }
#ifdef MARLIN_BF16  // the bf16 weight is formed in fp32: the slot's columns converted once
                    WCol cw[4];
#pragma unroll
                    for (int v = 0; v < 4; ++v)
                        cw[v] = wcol<HAS_DELTA>((u16)(s2[v >> 1] >> (16 * (v & 1))),
                                                HAS_DELTA ? (u16)(d2[v >> 1] >> (16 * (v & 1))) : (u16)0);
#endif
#pragma unroll
                    for (int uu = 0; uu < SUB; ++uu) {
                        const int u = gi * SUB + uu;
#ifdef MARLIN_BF16
                        weight_fragments_cols<HAS_DELTA, 2>(bw[u], cw, af[u % WG_DEPTH]);
#else
                        weight_fragments_pairs<HAS_DELTA, 2>(bw[u], s2, d2, af[u % WG_DEPTH]);
#endif
                        if (u % 2 == 0) continue;  // a pair of k-tiles per wgmma group (see WG_DEPTH)
                        wgmma_fence();
#pragma unroll
                        for (int v = u - 1; v <= u; ++v) {
                            const unsigned long long desc = wg_desc_at(desc0, x_step<T>(v));
                            Wgmma<T>::mma(acc[0], af[v % WG_DEPTH][0], desc);
                            Wgmma<T>::mma(acc[1], af[v % WG_DEPTH][1], desc);
                        }
                        wgmma_commit();
                        // the pair before is done: its register sets may be refilled
                        wgmma_wait<WG_DEPTH / 2 - 1>();
                        if (u == 1) {
                            // ... and with it the stage before: its slot is free. Predicated,
                            // not branched: a branch between two wgmma makes ptxas serialize
                            // every wgmma of the kernel (warning C7513).
                            __syncwarp();
                            mbar_arrive_if(empty0 + 8 * ((q + NS - 1) % NS), lane == 0 && st > 0);
                        }
                    }
                }
            }
        }
        wgmma_wait<0>();
        __syncwarp();
        if (lane == 0) mbar_arrive(empty0 + 8 * ((q - 1) % NS));
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < T / 2; ++e) reg_fence(acc[j][e]);

        // ---- a cut unit's piece: park it; the last of the unit's pieces to arrive adds them ----
        if (p.n < KS) {
            // The unit's pieces, in order: the last piece of the run of block `first`
            // (where the unit starts), then the first piece of blocks first + 1 ..
            // first + count. Piece 0 parks in slot 2 b + 1 of its block b, a later piece
            // (its block's first) in slot 2 b: a block holds at most one piece of each
            // kind, so no slot is written twice in a launch.
            const int first = (p.unit * KS) / iters, count = (p.unit * KS + KS - 1) / iters - first;
            const int j = blockIdx.x - first;
            // Piece 0 ends its block's run, and the others start theirs, so it is usually
            // the last to arrive: when the counter already holds every other piece, it
            // adds them without parking its own (a T x 256 x 4-byte write and read).
            // Where the runs are whole divisors of the unit (aligned, see plan.streamk_pieces),
            // every piece of the unit ends its block's run, so the others finish about when
            // this one does: it reads the counter up to OWNER_POLLS more times before it
            // parks too (a park, an add and a read of a T x 256 x 4-byte piece saved;
            // bounded, so no block waits on another's progress).
            bool in = false;
            if (j == 0) {
                if (tid == 0) {
                    int seen = ld_acquire(flags + first);
                    const int polls = KS % iters == 0 ? OWNER_POLLS : 0;
                    for (int r = 0; r < polls && seen != count; ++r) seen = ld_acquire(flags + first);
                    arrived[1] = seen;
                }
                named_sync(1, L::CONSUMERS);
                in = arrived[1] == count;
            }
            if (!in) {
                float* mine = ws + ((size_t)2 * blockIdx.x + (j == 0 ? 1 : 0)) * L::NACC * L::CONSUMERS + tid;
#pragma unroll
                for (int jj = 0; jj < 2; ++jj)
#pragma unroll
                    for (int e = 0; e < T / 2; ++e) mine[(jj * (T / 2) + e) * L::CONSUMERS] = acc[jj][e];
                named_sync(1, L::CONSUMERS);  // every consumer's sums, then one publishing add
                if (tid == 0) arrived[j == 0] = atom_add_acq_rel(flags + first, 1);
                named_sync(1, L::CONSUMERS);
                if (arrived[j == 0] != count) continue;  // a later piece will finish the unit
            }
            // Thread 0's acquire (the read above or the add), then the barrier: the other
            // pieces' sums are visible to every consumer thread here.
            if (tid == 0) flags[first] = 0;  // every piece has arrived: ready for the next launch
            // Last to arrive: the sum in piece order, whoever came last (deterministic).
            // Piece 0 comes from its slot unless it is this block's own, still in registers.
            if (j != 0) {
                const float* part = ws + ((size_t)2 * first + 1) * L::NACC * L::CONSUMERS + tid;
#pragma unroll
                for (int jj = 0; jj < 2; ++jj)
#pragma unroll
                    for (int e = 0; e < T / 2; ++e) acc[jj][e] = ldcg_f32(part + (jj * (T / 2) + e) * L::CONSUMERS);
            }
            const float* part = ws + (size_t)2 * (first + 1) * L::NACC * L::CONSUMERS + tid;
#pragma unroll 4
            for (int c = 1; c <= count; ++c) {
#pragma unroll
                for (int jj = 0; jj < 2; ++jj)
#pragma unroll
                    for (int e = 0; e < T / 2; ++e) acc[jj][e] += ldcg_f32(part + (jj * (T / 2) + e) * L::CONSUMERS);
                part += (size_t)2 * L::NACC * L::CONSUMERS;
            }
        }
        // ---- epilogue: acc + bias in fp32, one rounding, stored from registers ----
        if (nb >= nblk) continue;
        const int mrow0 = mc * T;
        float bf[4];
#pragma unroll
        for (int v = 0; v < 4; ++v) bf[v] = bias_at(bias, 64 * nb + 16 * (j0 + (v >> 1)) + g4 + 8 * (v & 1), n_out);
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < T / 2; ++e) {
                const int r = e & 3;
                const int tok = mrow0 + 8 * (e >> 2) + 2 * t4 + (r & 1);
                const int f = 64 * nb + 16 * (j0 + j) + g4 + 8 * (r >> 1);
                if (tok < M && f < n_out) C[(size_t)tok * n_out + f] = f32_to_act(acc[j][e] + bf[2 * j + (r >> 1)]);
            }
    }
}

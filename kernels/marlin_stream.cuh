// marlin_stream.cuh: the weight-streaming pipeline shared by the two GEMM kernels,
// marlin_gemm.cu (tile kernel, large M) and marlin_decode.cu (decode kernel, small M).
// Both stream each warp's K range of weights through cp.async rings in shared memory
// and differ in how a staged step is turned into mma instructions (and in where A
// lives: the decode kernel's 4 warps share one A ring when they share the rows).
//
// Operand forms (the launchers in converter/gpu/kernels.py prepare them):
//   B      int32 [K/16, 2N], Marlin tile order (checkpoint-formats.md 4.3): the 16x64
//          block (kt, nb) is the 128 consecutive words B[kt, 128 nb : 128 nb + 128];
//          word 4 l + j belongs to lane l and 16-column tile j.
//   S      fp16  [G, N], Marlin-permuted (4.4).
//   D      fp16  [G, N], fp16(delta) permuted exactly like S (kernels.prepare_delta),
//          so that a lane finds its scales and its deltas at the same offsets.
//   A      fp16  [M, K] row-major, Marlin K order.

#ifndef MARLIN_STREAM_CUH
#define MARLIN_STREAM_CUH

#include "marlin_common.cuh"

// Split-K counters. The threads of a block (or warp) that parked partial sums meet at a
// barrier (bar.sync / __syncwarp order their stores before what one thread does next),
// then one thread adds 1 to the counter with acquire-release semantics at GPU scope: the
// release half publishes every store the barrier ordered before it (PTX memory model:
// release is cumulative), and the acquire half makes the earlier arrivers' published
// sums visible to this thread, and, through the next barrier, to the others. One fenced
// RMW a block instead of a fence in every thread: 0.3-0.5 us less per call on an H200
// (docs/notes/perf_notes.md).
__device__ __forceinline__ int atom_add_acq_rel(int* p, int v) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
    return old;
}

// D (fp32 x4) += A (16x16 fp16, row) * B (16x8 fp16, col); PTX ISA fragment layouts.
__device__ __forceinline__ void mma_16816(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32." ACT_PTX "." ACT_PTX ".f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The tile kernel's shared-memory ring, per warp: NS stages, each one step of U k-tiles:
//   B  U x 512 bytes        lane l's 16-byte B piece of tile u at u * 512 + 16 l
//   A  U x AR x 32 bytes    AR rows x 16 fp16 of A per tile, row-major (32 bytes a row),
//                           in 16-row chunks of 512 bytes (AR = 8: one half chunk)
//   S  GPI x 128 bytes      the 64 permuted scales of each group slot (grouped layers)
//   D  GPI x 128 bytes      the 64 permuted fp16 deltas of each group slot (HAS_DELTA)
// Every byte is copied with 16-byte cp.async (the ring keeps NS - 1 steps in flight
// without holding registers); lanes read pieces other lanes copied, so each step is
// fenced by wait_group + __syncwarp (+ __syncthreads where the block shares A), which
// also orders the reuse of a slot. converter/gpu/plan/catalog.py (ring_smem) repeats this size.
template <int AR, int U, int GPI>
struct Ring {
    static constexpr int B_OFF = 0;
    static constexpr int A_OFF = U * 512;
    static constexpr int A_TILE = AR * 32;
    static constexpr int S_OFF = A_OFF + U * A_TILE;
    static constexpr int D_OFF = S_OFF + GPI * 128;
    static constexpr int STAGE = D_OFF + GPI * 128;
    static constexpr int A_CHUNKS = (AR + 15) / 16;
};

// The decode kernel's stage, in two parts held in two rings: the A part (U tiles of the
// AR rows) and the weight part (B tiles, scales, deltas). With wk = 1 the block's 4 warps
// read the same A, so one A ring serves them all and only the weight part is per warp:
// at AR = 16, U = 8 that is 64512 bytes a block instead of 101376, 3 blocks per
// multiprocessor instead of 2. Offsets: A_OFF from an A slot, the others from a weight
// slot.
// converter/gpu/plan/catalog.py (ring_smem) repeats these sizes.
template <int AR, int U, int GPI>
struct SplitRing {
    static constexpr int A_OFF = 0;
    static constexpr int A_TILE = AR * 32;
    static constexpr int A_STAGE = U * A_TILE;
    static constexpr int B_OFF = 0;
    static constexpr int S_OFF = U * 512;
    static constexpr int D_OFF = S_OFF + GPI * 128;
    static constexpr int W_STAGE = D_OFF + GPI * 128;
};

// Walks the group boundaries of one warp's K range without dividing: slots start at
// increasing tiles, SUB (which divides the group's tile count) apart, so a slot starts
// a new group exactly when it reaches `next`, and then crosses one boundary only.
struct GroupWalk {
    int g, next, first;
    __device__ __forceinline__ void init(int kt0, int group_tiles) {
        g = kt0 / group_tiles;
        next = (g + 1) * group_tiles;
        first = kt0;
    }
    __device__ __forceinline__ bool step(int t, int group_tiles) {
        if (t == first) return true;
        if (t < next) return false;
        ++g;
        next += group_tiles;
        return true;
    }
};

// Which A rows this lane copies: in chunk c, row 16 c + lane / 2, halves 8 (lane % 2) ..
// `in_tile`: the row exists in the ring's A area; `ok`: it is also a row of A (< M).
template <int AR>
struct ARows {
    static constexpr int CH = (AR + 15) / 16;
    bool in_tile[CH], ok[CH];
    const u16* ptr[CH];
    __device__ __forceinline__ void init(const u16* A, int lane, int mrow0, int M, int K, int kt0) {
#pragma unroll
        for (int c = 0; c < CH; ++c) {
            const int rr = 16 * c + (lane >> 1);
            const int r = mrow0 + rr;
            in_tile[c] = rr < AR;
            ok[c] = in_tile[c] && r < M;
            ptr[c] = A + (size_t)(ok[c] ? r : 0) * K + kt0 * 16 + 8 * (lane & 1);
        }
    }
    // Rows past M are zeroed once in every stage and never copied, so the mma sees 0.
    __device__ __forceinline__ void zero_missing(u32 ring, int stage_bytes, int a_off, int ns, int u_steps,
                                                 int lane) const {
#pragma unroll
        for (int c = 0; c < CH; ++c)
            if (in_tile[c] && !ok[c])
                for (int t = 0; t < ns * u_steps; ++t)
                    sts_zero16(ring + (t / u_steps) * stage_bytes + a_off + (t % u_steps) * AR * 32 + c * 512 +
                               16 * lane);
    }
};

// Copies one step (U k-tiles starting at kt) into the slots of layout L (Ring: `st`
// holds all of it and sa == st; SplitRing: weights to `st`, A to `sa`) and advances the
// running source pointers.
// copy_a = false: the caller stages A itself (the decode kernel's block-shared A).
template <int AR, int U, int GPI, bool HAS_DELTA, class L = Ring<AR, U, GPI>>
__device__ __forceinline__ void issue_stage(u32 st, u32 sa, int kt, int lane, bool copy_a, ARows<AR>& arows,
                                            const int4*& bptr, size_t brow, GroupWalk& walk,
                                            const u16* __restrict__ S, const u16* __restrict__ D, int N, int nb,
                                            int group_tiles, int per_channel) {
    using R = L;
    constexpr int SUB = U / GPI;
#pragma unroll
    for (int u = 0; u < U; ++u) cp_async16(st + R::B_OFF + u * 512 + 16 * lane, bptr + u * brow);
    bptr += U * brow;
    if (copy_a) {
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int c = 0; c < ARows<AR>::CH; ++c)
                if (arows.ok[c])
                    cp_async16(sa + R::A_OFF + u * R::A_TILE + c * 512 + 16 * lane, arows.ptr[c] + u * 16);
#pragma unroll
        for (int c = 0; c < ARows<AR>::CH; ++c) arows.ptr[c] += U * 16;
    }
    if (!per_channel) {
#pragma unroll
        for (int gi = 0; gi < GPI; ++gi) {
            if (walk.step(kt + gi * SUB, group_tiles)) {
                const size_t off = (size_t)walk.g * N + 64 * nb;
                if (lane < 8)
                    cp_async16(st + R::S_OFF + gi * 128 + 16 * lane, S + off + 8 * lane);
                else if (HAS_DELTA && lane < 16)
                    cp_async16(st + R::D_OFF + gi * 128 + 16 * (lane - 8), D + off + 8 * (lane - 8));
            }
        }
    }
}

#endif  // MARLIN_STREAM_CUH

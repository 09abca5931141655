"""GEMM planning: which kernel serves a call, which compiled variant, and how K is split.

Pure Python, no CuPy and no module state: everything a plan depends on is an argument
(the problem, the device's limits, the variant's register count, and the
:class:`Tuning` knobs measured on an H200, scripts/perf_notes.md), so the same inputs
always give the same :class:`GemmPlan`, on any machine, GPU or not.

Kernel kinds (:class:`KernelKind`) are a table (:data:`KINDS`): each names its
``.cu`` file, its template instantiation, its arithmetic (what its NumPy twin in
:mod:`converter.gpu.reference` computes) and the shape of its shared-memory rings.
Adding a kind is a member, a :class:`KindSpec`, its variants in :data:`GEMM_PIPES`,
and a routing rule in :func:`gemm_path`. The Hopper kinds run only on sm_90 (they are
built for sm_90a): routing takes ``hopper`` (the device has it) as an argument.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from types import MappingProxyType
from typing import NamedTuple, Protocol

from ..constants import KERNEL_N_MULTIPLE, MARLIN_TILE
from ..errors import KernelError
from ..marlin.shapes import kernel_layer_sizes

#: Warps per GEMM block (``kernels/marlin_stream.cuh``: each streams its own weights).
BLOCK_WARPS = 4


class KernelKind(str, enum.Enum):
    """The GEMM kernels (JSON-visible values, as ``--sweep`` and the benchmark record them)."""

    def __str__(self) -> str:
        return str(self.value)

    TILE = "tile"
    """``kernels/marlin_gemm.cu``: 16-row m-tiles of A per warp, per-weight fp16 scaling."""
    DECODE = "decode"
    """``kernels/marlin_decode.cu``: 8-row activation tiles, per-group fp32 scale and delta."""
    DECODE_W = "decode_w"
    """The decode kernel with the tile kernel's per-weight fp16 scaling."""
    HOPPER = "hopper"
    """``kernels/marlin_wgmma.cu`` (sm_90a): weights as wgmma's register operand, R
    8-token tiles per block (8 R tokens; R = 16 is two warpgroups of 64), per-weight
    fp16 scaling."""
    HOPPER_FS = "hopper_fs"
    """The same kernel with its 4 warpgroups splitting the block's 256 features (one
    ``wgmma`` of 64 features per k-tile each, ``J = 1``) instead of its tokens: every
    weight dequantized once per block of 8 R tokens, up to 128."""
    HOPPER_SK = "hopper_sk"
    """``kernels/marlin_streamk.cu`` (sm_90a): persistent, one block per multiprocessor
    taking an equal run of (256 features x 8 R tokens) x k-stage work (stream-K); a
    producer warpgroup streams the weights by ``cp.async`` and the activations by bulk
    copy, two consumer warpgroups dequantize and multiply (``J = 2``), per-weight fp16
    scaling."""
    HOPPER_SKG = "hopper_skg"
    """The persistent kernel with the decode kernel's per-group fp32 scale and delta
    (offset codes: 5 instructions per 8 codes instead of 13), 8 k-tiles a stage, each
    stage's sums closed into the accumulators; up to 32 tokens (its two stage sums
    and accumulators: 2.5 T registers a thread). Serves group sizes that are multiples
    of 128 (a stage within one group) and per-channel."""


class Arith(str, enum.Enum):
    """What a kernel multiplies, as its twin (``reference.marlin_gemm(arith=...)``) names it."""

    def __str__(self) -> str:
        return str(self.value)

    WEIGHT = "weight"
    """The fp16 weight ``fp16((q - 8) s + fp16(delta))``."""
    GROUP = "group"
    """``A (q - 8)`` and A summed per group in fp32; ``s`` and ``fp16(delta)`` applied there."""


class Pipe(NamedTuple):
    """One compiled GEMM variant: ``(kind, R, U, NS)``.

    R: A-row tiles per warp (16-row m-tiles for the tile kernel, 8-row activation tiles
    for the decode kernels), or per block (8-token tiles, the Hopper kernel); U: k-tiles
    per pipeline step; NS: shared-memory ring stages.
    Plain tuples ``("tile", 1, 4, 3)`` are accepted wherever a Pipe is (:meth:`of`).
    """

    kind: KernelKind
    r: int
    u: int
    ns: int

    def __repr__(self) -> str:  # as the plain tuple reads, in messages and benchmark logs
        return repr((self.kind.value, self.r, self.u, self.ns))

    @classmethod
    def of(cls, pipe: tuple[str, int, int, int]) -> Pipe:
        kind, r, u, ns = pipe
        return cls(KernelKind(kind), int(r), int(u), int(ns))

    @property
    def spec(self) -> KindSpec:
        return KINDS[self.kind]

    def name(self, gpi: int, delta: bool) -> str:
        """The template instantiation of this variant with ``gpi`` group slots per step."""
        t, wgs = hopper_split(self.r, self.kind)
        return self.spec.template.format(
            r=self.r, u=self.u, gpi=gpi, ns=self.ns, delta=str(delta).lower(), t=t, wgs=wgs
        )

    def smem(self, gpi: int, wk: int | None = None) -> int:
        """Dynamic shared memory of one block run with ``wk`` warps per output unit
        (None: the most any of the kind's block shapes needs), bytes."""
        if wk is None:
            return max(self.spec.smem(self, gpi, w) for w in self.spec.block_shapes)
        return self.spec.smem(self, gpi, wk)

    @property
    def threads(self) -> int:
        """Threads per block."""
        return self.spec.threads(self)


#: Threads of a persistent Hopper block: two consumer warpgroups and a producer
#: warpgroup (``kernels/marlin_streamk.cu``).
STREAMK_THREADS = 384
#: The most rows :func:`persistent_every_m` checks one by one (the per-weight persistent
#: kind's threshold, ``Tuning.hopper_sk_min_m``, is 17 by default).
EVERY_M_CHECKED = 1024
#: The persistent kind's token chunks, in 8-token tiles: 8 .. 128 tokens (wgmma n8 ..
#: n128; M beyond 128 in 128-token chunks).
HOPPER_SK_RS = (1, 2, 3, 4, 6, 8, 12, 16)
#: The same for its per-group form (``hopper_skg``): 8 .. 32 tokens. The default routing
#: takes 8 and 16 (1-16 rows, and the small layers' chunks of :func:`small_chunk`); 24 and
#: 32 are built for forced calls and sweeps.
HOPPER_SKG_RS = (1, 2, 3, 4)
#: The persistent kind's chunks that also have 8-tile stages (NS = 6): 24 .. 64 tokens.
#: (At 8 and 16 tokens on the large layers, where ``hopper_skg`` serves, they were no
#: faster than it.)
HOPPER_SK8_RS = (3, 4, 6, 8)

#: Tokens one warpgroup of the token-split Hopper kind (``hopper``) takes at most (its
#: accumulators: 2 T registers per thread, 128 at T = 64; ``hopper_fs`` needs T / 2).
HOPPER_MAX_T = 64


#: The token-split Hopper kind's block sizes below 128 tokens, in 8-token tiles: its
#: time grows with the tokens a block holds, not with M, so 24, 48 and 96 (wgmma n24
#: and n48) serve M = 17-24, 33-48 and 65-96 (the last only on the layers ``hopper_fs``
#: does not take; scripts/perf_notes.md).
HOPPER_RS = (1, 2, 3, 4, 6, 8, 12)
#: The same for the feature-split kind (``hopper_fs``), routed from 33 rows: 48, 64, 96
#: and 128 tokens. Its 32- and 64-token blocks (r = 4, 8) also serve the thin layers
#: (1024 <= N < 4096 with K N >= 2^23, ``Tuning.hopper_fs_thin_min_m``) in chunks where
#: the small layers' persistent route does not (above 4096² weights, or beyond its rows,
#: ``Tuning.hopper_small_*``).
HOPPER_FS_RS = (6, 8, 12)


def hopper_split(r: int, kind: KernelKind = KernelKind.HOPPER) -> tuple[int, int]:
    """``(T, WGS)`` of a Hopper block of ``8 r`` tokens: T tokens per warpgroup, WGS
    warpgroups. ``hopper``: one warpgroup up to :data:`HOPPER_MAX_T` tokens, else two
    that halve them; ``hopper_fs``: four that split the features, each with all
    tokens."""
    tokens = 8 * r
    j = KINDS[kind].wg_tiles
    if 0 < j < 4:  # 4 / J warpgroups split the features, each with all the tokens
        return tokens, 4 // j
    return (tokens, 1) if tokens <= HOPPER_MAX_T else (tokens // 2, 2)


def hopper_smem(pipe: Pipe, gpi: int, wk: int = 1) -> int:
    """Dynamic shared memory of a Hopper block (``kernels/marlin_wgmma.cu``, WgLayout, and
    the persistent ``kernels/marlin_streamk.cu``, StreamkLayout, whose stage is the same):
    NS stages of U 2 KB weight rows, U x tokens x 32 bytes of activations and GPI
    512-byte scale and delta rows (the delta rows counted always)."""
    tokens = 8 * pipe.r
    return pipe.ns * (pipe.u * 2048 + pipe.u * tokens * 32 + 2 * gpi * 512)


#: Bytes of a 128-byte-swizzle atom (8 rows of 128 bytes): the persistent kernel's
#: activation slots start at a multiple of it (``kernels/marlin_streamk.cu``).
SWIZZLE_ATOM = 1024


def streamk_smem(pipe: Pipe, gpi: int, wk: int = 1) -> int:
    """Dynamic shared memory of the persistent Hopper block (``kernels/marlin_streamk.cu``,
    StreamkLayout::RING): :func:`hopper_smem`'s stages (the delta rows reserved always,
    so every stage is whole swizzle atoms) and :data:`SWIZZLE_ATOM` bytes of slack that
    align the ring's start."""
    return hopper_smem(pipe, gpi, wk) + SWIZZLE_ATOM


def ring_smem(pipe: Pipe, gpi: int, wk: int = BLOCK_WARPS) -> int:
    """Shared memory of one 4-warp block of the ring kernels, run with ``wk`` warps per
    output unit (``kernels/marlin_stream.cuh``: per stage U 512-byte B tiles, U tiles of
    the A rows, and GPI 128-byte scale and delta rows).

    Each warp has its own ring, padded to hold its fp32 sums for the in-block reduction;
    except that a kind which ``shares_a`` run with ``wk = 1`` (struct SplitRing) has one
    A ring for the block and per warp only the weight part, and parks no sums."""
    spec = pipe.spec
    rows, sums = spec.tile_rows * pipe.r, spec.sums_bytes * pipe.r
    a_stage = pipe.u * rows * 32
    w_stage = pipe.u * 512 + gpi * 128 + gpi * 128
    if spec.shares_a and wk == 1:
        return pipe.ns * (a_stage + BLOCK_WARPS * w_stage)
    return BLOCK_WARPS * max(pipe.ns * (a_stage + w_stage), sums)


@dataclasses.dataclass(frozen=True)
class KindSpec:
    """What the planner and the module builder need to know about one kernel kind.

    Attributes:
        source: the ``.cu`` file under ``kernels/``.
        template: its instantiation name, with ``{r} {u} {gpi} {ns} {delta}`` fields.
        arith: what it multiplies (:class:`Arith`).
        tile_rows: A rows per unit of R.
        sums_bytes: bytes of fp32 sums a warp parks in shared memory, per unit of R.
        shares_a: with one output unit per block (``wk == 1``) its 4 warps stage A once.
        wg_tiles: for a kind of the Hopper kernel (sm_90 only; its activations re-laid
            out by ``hopper_activations`` first, or for the persistent kinds read through
            a tensor map; its unit 256 columns of one token chunk), the 16-column tiles of
            each warp's Marlin block one warpgroup takes (the kernel's J: 4 splits the
            tokens, 1 the features); 0 for the others.
        smem: shared memory of a block, ``smem(pipe, gpi, wk)`` bytes.
        threads: threads per block, ``threads(pipe)``.
        block_shapes: the ``wk`` values it runs (1: a block takes 4 column blocks
            over the whole K range; 4: one column block, a quarter of the range per warp).
        reduce_weight: the split reduction's cost relative to the ring kernels' (the
            Hopper kernel's, per wave: 0.32, fitted on an H200).
        reduces_chunk: the reduction moves a whole chunk of rows whatever M is (the
            Hopper kernel stores its accumulators in register order).
        reduces_per_wave: the reduction is paid once per wave of blocks, not once per
            call (the Hopper kernel's blocks each write and fix up their partial sums at
            the end of their K range, one wave after another; fitted to a sweep of every
            split count on an H200, scripts/perf_notes.md).
        persistent: one block per multiprocessor, each an equal run of the work
            (stream-K; planned by :func:`plan_streamk`, not by the split model).
    """

    source: str
    template: str
    arith: Arith
    tile_rows: int
    sums_bytes: int
    shares_a: bool
    smem: Callable[[Pipe, int, int], int] = ring_smem
    threads: Callable[[Pipe], int] = lambda pipe: BLOCK_WARPS * 32
    block_shapes: tuple[int, ...] = (1, BLOCK_WARPS)
    reduce_weight: float = 1.0
    reduces_chunk: bool = False
    reduces_per_wave: bool = False
    wg_tiles: int = 0
    persistent: bool = False

    @property
    def wgmma(self) -> bool:
        """A kind of the Hopper kernel (see ``wg_tiles``)."""
        return self.wg_tiles > 0


def _hopper_spec(j: int) -> KindSpec:
    # J = 4 is the template's default: the token-split names are spelled without it.
    return KindSpec(
        "marlin_wgmma.cu",
        "marlin_wgmma<{t}, {wgs}, {u}, {gpi}, {ns}, {delta}" + ("" if j == 4 else f", {j}") + ">",
        Arith.WEIGHT,
        tile_rows=8,
        sums_bytes=0,
        shares_a=True,
        smem=hopper_smem,
        threads=lambda pipe: 128 * hopper_split(pipe.r, pipe.kind)[1],
        block_shapes=(1,),
        reduce_weight=0.32,
        reduces_chunk=True,
        reduces_per_wave=True,
        wg_tiles=j,
    )


def _streamk_spec(gs: str, arith: Arith) -> KindSpec:
    """The persistent kernel (marlin_streamk.cu): its per-weight form, or (``gs`` =
    ", true") its per-group form."""
    return KindSpec(
        "marlin_streamk.cu",
        "marlin_streamk<{t}, {u}, {gpi}, {ns}, {delta}" + gs + ">",
        arith,
        tile_rows=8,
        sums_bytes=0,
        shares_a=True,
        smem=streamk_smem,
        threads=lambda pipe: STREAMK_THREADS,
        block_shapes=(1,),
        wg_tiles=2,
        persistent=True,
    )


KINDS: MappingProxyType[KernelKind, KindSpec] = MappingProxyType(
    {
        KernelKind.TILE: KindSpec(
            "marlin_gemm.cu",
            "marlin_gemm<{r}, {u}, {gpi}, {ns}, {delta}>",
            Arith.WEIGHT,
            tile_rows=16,
            sums_bytes=4096,
            shares_a=False,
        ),
        KernelKind.DECODE: KindSpec(
            "marlin_decode.cu",
            "marlin_decode<{r}, {u}, {gpi}, {ns}, {delta}, true>",
            Arith.GROUP,
            tile_rows=8,
            sums_bytes=2048,
            shares_a=True,
        ),
        KernelKind.DECODE_W: KindSpec(
            "marlin_decode.cu",
            "marlin_decode<{r}, {u}, {gpi}, {ns}, {delta}, false>",
            Arith.WEIGHT,
            tile_rows=8,
            sums_bytes=2048,
            shares_a=True,
        ),
        KernelKind.HOPPER: _hopper_spec(4),
        KernelKind.HOPPER_FS: _hopper_spec(1),
        KernelKind.HOPPER_SK: _streamk_spec("", Arith.WEIGHT),
        KernelKind.HOPPER_SKG: _streamk_spec(", true", Arith.GROUP),
    }
)
#: The arithmetic of each kind (``KINDS[kind].arith``), keyed by kind.
ARITH: MappingProxyType[KernelKind, Arith] = MappingProxyType({k: s.arith for k, s in KINDS.items()})

#: The variants compiled, each for every GPI (group slots per step) in GEMM_GPIS[U],
#: with and without the fused delta.
GEMM_PIPES: tuple[Pipe, ...] = tuple(
    Pipe(KernelKind(k), r, u, ns)
    for k, r, u, ns in (
        ("tile", 1, 4, 3),
        ("tile", 1, 8, 3),
        ("tile", 2, 4, 3),
        ("tile", 4, 2, 3),
        ("decode", 1, 4, 3),
        ("decode", 1, 8, 3),
        ("decode", 2, 4, 3),
        ("decode", 2, 8, 3),
        ("decode", 4, 4, 3),
        ("decode_w", 2, 8, 3),
        ("decode_w", 4, 4, 3),
        ("hopper", 1, 4, 4),
        ("hopper", 2, 4, 4),
        ("hopper", 3, 4, 4),
        ("hopper", 4, 4, 4),
        ("hopper", 6, 4, 6),
        ("hopper", 8, 4, 6),
        ("hopper", 12, 4, 6),
        ("hopper", 16, 4, 6),
        ("hopper_fs", 4, 4, 6),
        ("hopper_fs", 6, 4, 6),
        ("hopper_fs", 8, 4, 6),
        ("hopper_fs", 12, 4, 4),
        ("hopper_fs", 16, 4, 4),
        *(("hopper_sk", r, 4, 8) for r in HOPPER_SK_RS),
        *(("hopper_sk", r, 8, 6) for r in HOPPER_SK8_RS),
        *(("hopper_skg", r, 8, 6) for r in HOPPER_SKG_RS),
    )
)
GEMM_GPIS: MappingProxyType[int, tuple[int, ...]] = MappingProxyType({8: (1,), 4: (1, 2, 4), 2: (1, 2)})


def kernel_names(source: str) -> list[str]:
    """Every GEMM instantiation compiled from ``source``, in :data:`GEMM_PIPES` order."""
    return [
        p.name(gpi, d) for p in GEMM_PIPES if p.spec.source == source for gpi in GEMM_GPIS[p.u] for d in (False, True)
    ]


@dataclasses.dataclass(frozen=True)
class Tuning:
    """The planner's knobs, measured on an H200 (scripts/perf_notes.md); the defaults
    are what every launch uses unless a caller (a test, the benchmark) passes others.

    Attributes:
        group_max_m: the decode kernel with per-group scaling serves up to 8 rows
            always, and 9..group_max_m rows when N >= wide_n (enough column blocks keep
            the device busy without deep K splits) or, on sm_90, on the small layers of
            hopper_decode_small_kn (in 8-row chunks, at most 16 rows).
        decode_max_m: the per-weight decode variant serves 17..decode_max_m rows when
            N > wide_n; the tile kernel serves everything else.
        wide_n: see above.
        waves: target number of full waves of resident warps for the K split.
        latency_tiles: a block's pipeline fill, in k-tile times, charged per wave.
        reduce_tiles: the split's reduction cost per extra split and 8 rows, in k-tile
            times (4096 x 4096 at M = 1 ran 7.5 us with 4 splits against 8.5 us with 8).
        a_weight: cost of staging one A row of a k-tile, in B-tile units per 16 rows
            (A comes from L2, B from DRAM).
        force_wk: 1 or 4 forces the block shape; None lets the cost model choose.
        saturation: ``((kind, rows, blocks), ...)``: once a chunk holds at least
            ``rows`` rows of A, a multiprocessor's throughput on that kind saturates at
            ``blocks`` resident blocks, so the split model charges each multiprocessor
            its share of the blocks, ``ceil(blocks / SMs)``, run ``min(resident,
            blocks)`` at a time, instead of whole waves of resident blocks. An entry
            applies only where more than ``blocks`` blocks fit on a multiprocessor (with
            at most ``blocks`` resident, nothing saturates and the waves model holds).
            On an H200
            the decode kernel's 16-row chunks (9-16 rows, 3 blocks resident) run no
            faster with a third block than with two; with 8 rows and fewer the waves
            model picked as well (a sweep of every split count at M = 1, 8, 12 and 16:
            scripts/bench_gemm_h200_decode_splits.json). The tile kernel's 32-row
            chunks (168 registers, 3 blocks resident) likewise: on 14336 x 4096 and
            8192 x 8192 at M = 16-32 its 2-block splits ran 7-12 % faster than the
            one-wave-of-3 splits the waves model chose (scripts/bench_gemm_h200_tile_splits.json).
            ``waves`` does not apply there.
        force_splits: forces the K split count where the block shape allows it (the
            split sweep of ``scripts/bench_gemm.py --sweep-splits``); None lets the cost
            model choose.
        occupancy_cap: ``((kind, blocks per SM), ...)``: the split counts on at most
            that many resident blocks of a kind (fewer resident warps stream the
            weights faster at small M); kinds not listed get as many as fit.
        hopper: use the Hopper kernel where the device has it (sm_90).
        hopper_wide_n, hopper_wide_min_m: it serves M >= hopper_wide_min_m on layers
            of N >= hopper_wide_n;
        hopper_big_kn, hopper_big_min_m: M >= hopper_big_min_m on layers of at least
            hopper_big_kn weights;
        hopper_large_m: M >= hopper_large_m on layers of N >= 8192;
        hopper_huge_m, hopper_small_kn: M >= hopper_huge_m on layers of more than
            hopper_small_kn weights (N >= 4096 always; with the defaults ``hopper_sk``
            and ``hopper_fs`` take those rows first, so this serves only when both are
            switched off).
            Everywhere else the decode and tile kernels were as fast or faster on an
            H200 (scripts/perf_notes.md: narrow N needs deep K splits, and the decode
            kernel streams better at M <= 16).
        hopper_fs_min_m, hopper_fs_narrow_min_m: with ``hopper_sk`` switched off, the
            feature-split Hopper kernel (``hopper_fs``) serves M >= hopper_fs_min_m on
            every layer of N >= 4096 and at least hopper_small_kn weights, and M >= hopper_fs_narrow_min_m on
            those of N == 4096 (where it beat the tile kernel; on wider layers the
            token-split kernel is faster below 65 rows).
        hopper_fs_thin_min_m, hopper_fs_thin_kn: it also serves M >=
            hopper_fs_thin_min_m on layers of 1024 <= N < 4096 and at least
            hopper_fs_thin_kn weights, in 32-token chunks (64 beyond 128 rows): there
            the tile kernel's few column blocks leave the device idle, and 8192 x 1024
            ran 17.6-23.0 us against its 20.8-24.1 at M = 48-128
            (scripts/bench_gemm_h200_thin_splits.json; the only thin layer measured:
            the others of the class are an extrapolation). The small layers' persistent
            route (hopper_small_*) now takes those of at most 4096² weights first, up to
            256 rows.
        hopper_sk_min_m: the persistent Hopper kernel (``hopper_sk``) serves M >=
            hopper_sk_min_m on every layer of N >= 4096 and at least hopper_small_kn
            weights, ahead of the other Hopper kinds and the tile kernel (which then
            serve those rows only when it is switched off, say with 10**9). On an H200
            it was 1.10-1.45x faster than the kernels it replaced on every such
            benchmark row from 24 rows (4096² at 96 rows: 0.99x), and the decode
            kernel 1.2-1.5x faster than it at 1-16 rows (scripts/perf_notes.md);
            17-23 rows were not measured (the threshold sits between 16 and 24).
        hopper_sk_small_min_m, hopper_sk_small_kn: on the layers above
            hopper_small_kn and up to hopper_sk_small_kn weights it serves M >=
            hopper_sk_small_min_m already. At 16 rows on an H200 (the 16:54Z run's
            hopper_sk sweep column beside the routed kernel, fused us): 4096 x 14336
            20.4 against the decode kernel's 21.0, 14336 x 4096 20.2 against the tile
            kernel's 22.0, 8192 x 8192 21.4 against 24.3; the decode kernel stays
            faster at 8 rows on every layer (0.83-0.99x) and at 16 on the 70B layers
            (89.9 / 98.8, 52.2 / 54.4 us), and 4096 x 4096 was even (11.9 / 11.6).
            9-15 rows were not timed: both kernels run the same 16-row chunk there.
        hopper_sk_mid_tok, hopper_sk_mid_min_m, hopper_sk_mid_max_m: on those
            mid-sized layers (N >= 4096, above hopper_small_kn and up to
            hopper_sk_small_kn weights) at hopper_sk_mid_min_m..hopper_sk_mid_max_m rows
            ``hopper_sk`` cuts M into even chunks of at most hopper_sk_mid_tok tokens
            instead of one chunk, where 8-tile stages hold the group (in 4-tile stages
            two 64-token chunks ran slower than one of 128: 36.6 / 39.4 against 35.5 /
            38.3 on 4096 x 14336 / 8192² at 128 rows): more units, fewer cut pieces. On an
            H200 (scripts/bench_gemm_h200_mid_chunks.json, 15:06Z, fused us, the sweep
            columns p8x8x6w1 / p16x4x8w1) at 112 / 128 rows: 14336 x 4096 34.2 / 34.8
            against 37.3 / 38.5, 8192² 36.8 / 37.2 against 37.2 / 38.2, 4096 x 14336
            34.8 / 35.2 against 34.5 / 35.3; at 65-96 rows one 96-token chunk stays
            faster (p12x4x8w1 against p6x8x6w1: 4096 x 14336 28.4-29.5 against 30.3-30.7,
            8192² 29.5-31.2 against 32.0-32.5; on 14336 x 4096 two of 48 were even to 1 us
            faster, 29.5-30.1 against 29.6-31.1), and on 28672 x 8192 one 128-token chunk
            (97.9 against 114.2 at 128 rows, scripts/bench_gemm_h200_mid_sweep.json).
            In the full run of 15:12Z at 128 rows: 14336 x 4096 34.3 (38.2 at 14:08Z),
            8192² 36.7 (38.1), 4096 x 14336 34.6 (35.4).
        hopper_skg_min_m, hopper_skg_max_m: the persistent kernel's per-group form
            (``hopper_skg``) serves hopper_skg_min_m..hopper_skg_max_m rows on every
            layer of N >= 4096 and more than hopper_small_kn weights whose group size
            it serves (multiples of 128, per-channel; K a multiple of 128), ahead of the
            decode kernel and ``hopper_sk``. On an H200 (scripts/perf_notes.md, fused
            us, same-process probes) at 8 rows: 8192 x 57344 74.9 against the decode
            kernel's 77.8, 28672 x 8192 42.7 / 45.8, 14336 x 4096 16.2 / 18.9; at 16
            rows 81.7 / 91.2 (decode), 46.0 / 52.2, and 18.3-18.7 against hopper_sk's
            20.3-21.4 (14336 x 4096, 4096 x 14336, 8192²). From 1 row since the
            kernel's 8-tile stages and tensor-map activations (2026-12-03T14:00Z, fused
            us, its 8-token chunk against the decode kernel at 1 / 2 / 4 / 6 rows,
            scripts/bench_gemm_h200_skg_small_m.json): 8192 x 57344 65.8 / 66.1 / 66.2 /
            66.1 against 67.6 / 68.9 / 71.1 / 75.3; 14336 x 4096 14.1 / 14.1 / 14.1 / 14.3
            against 14.5 / 14.6 / 15.3 / 17.6; 28672 x 8192 37.1 / 37.2 / 37.2 / 37.1
            against 36.8 / 37.0 / 38.7 / 41.8; 8192² 15.1 / 15.1 / 14.9 / 15.1 against
            14.7 / 15.3 / 15.6 / 17.8; 4096 x 14336 14.7 / 15.0 / 14.8 / 14.8 against
            14.4 / 15.2 / 16.1 / 17.8. At 1 row a tie (ahead on two layers, 0.8-2.7 %
            behind on three; in the full run of 14:08Z 0.5-2.7 % behind on 4096 x 14336,
            8192² and 28672 x 8192 at 1 row); from 4 rows ahead everywhere: the decode
            kernel's A copies and mma grow with the rows, the persistent kernel's 8-token
            chunk costs the same at 1 row as at 8. One rule for all: at 1 row it is even
            over a 70B model's layers (8192 x 57344 + 28672 x 8192 + 8192²: 118.0
            against 119.1 us). At 24-32
            rows ``hopper_sk`` with 8-tile stages and the tensor-map activations is
            faster (scripts/bench_gemm_h200_skg_sweep.json, one run: 8192 x 57344
            M = 24 96.7 / 102.5, M = 32 107.4 / 109.5; 28672 x 8192 52.7 / 55.4,
            54.9 / 58.3; the 7B shapes not compared there).
        hopper_xmap_max_tok: the persistent kinds read A in place through a tensor map
            (converter/gpu/tensormap.py: boxes of 64 values of K x T tokens, 128-byte
            swizzled) when their token chunk is at most this many tokens, and A re-laid
            out by ``hopper_activations`` beyond (one more kernel a call; the path
            without cuda-bindings). At the default every chunk reads the map: on an H200
            (scripts/bench_gemm_h200_xmap.json, one run, fused us, map / re-laid out)
            0-3 % faster on 8192 x 57344, 6-13 % on 28672 x 8192 (M = 128 103.8 / 110.6,
            M = 256 184.7 / 208.2) and 6-14 % on the 7B shapes, 8192² and 4096² (8192²
            M = 32 20.8 / 23.1); the decode-routed rows even.
        hopper_small_lo_kn, hopper_small_min_m, hopper_small_max_m,
        hopper_small_n4096_max_m, hopper_small_units, hopper_small_max_tok,
        hopper_small_skg_min_m, hopper_small_skg_max_tok:
            small layers (1024 <= N <= 4096, hopper_small_lo_kn .. hopper_small_kn
            weights) take the persistent kernel ahead of every other rule at
            hopper_small_min_m .. hopper_small_max_m rows (hopper_small_n4096_max_m
            on N = 4096, where the large layers' 128-token chunks win beyond), in the
            chunks of :func:`small_chunk`: the fewest tokens that make
            hopper_small_units units of 256 features x one chunk, at most
            hopper_small_max_tok, M then cut evenly. A unit cut by many blocks is
            added up by the last of them alone (T x 256 floats a piece), so a layer
            of few column blocks wants more, shorter chunks (each dequantizes the
            L2-resident layer again). The per-group form (``hopper_skg``, 8-tile
            stages) serves from hopper_small_skg_min_m rows in chunks of at most
            hopper_small_skg_max_tok tokens where its stages hold the group;
            ``hopper_sk`` in 4-tile stages the rest (any group; only groups 128 and 64
            were timed). On an H200 (fused us, routed, the full run
            scripts/bench_gemm_h200.json of 2026-12-03T15:12Z, against the routing
            before in the run of 14:08Z):
            8192 x 1024 at 16 / 24 / 32 / 48 / 64 / 96 / 128 / 256 rows 9.2 / 9.9 / 9.8
            / 11.5 / 11.4 / 13.2 / 14.1 / 19.2 against 10.4 / 11.7 / 12.7 / 14.2 / 14.3
            / 14.4 / 14.7 / 19.6 (cuBLAS fp16 9.9-10.3 up to 64 rows); 4096² at 48 / 64
            / 96 / 128 rows 12.6 / 13.2 / 17.0 / 18.8 against 14.0 / 14.0 / 18.0 / 19.2,
            8-32 rows unchanged. 4096 x 2048, not routed here before, ran 8.2-8.4 at 8-16
            rows and 9.3-9.4 at 17-32 (fp16 9.6-9.8; scripts/bench_gemm_h200_small_chunks.json,
            15:06Z, where the columns p3x4x8w1 and p4x4x8w1 show the even cut: at 40-48
            rows of 4096² two 24-token chunks 12.6-12.7 against 13.2-13.3 for two of 32,
            at 80-96 rows of 8192 x 1024 24-token chunks 13.2-13.3 against 13.7-13.9).
            The per-group form at 8 tokens ran 9.8-9.9 against ``hopper_sk``'s 10.9 at
            24-32 rows of 8192 x 1024 but 9.8 against 9.1 at 16
            (scripts/bench_gemm_h200_small_units_sweep.json). Group 64
            (scripts/bench_gemm_h200_small_g64.json, the route against the ones before):
            8192 x 1024 at 40 / 64 / 128 rows 12.3 / 12.2 / 14.1 against ``hopper_fs``'s
            18.2 / 18.4 / 24.1 (at 256 rows 19.8; the route before was not timed there);
            4096² at 64 / 128 rows 13.4 / 19.3 against 15.5 / 24.8. Three layers
            measured; the rest of the class is an extrapolation. Still slower than
            cuBLAS fp16 from 48 rows on 8192 x 1024 (even at 24) and from 64 on 4096²
            (the fp16 GEMM runs 10-17 us whatever M): there the kernel's fixed cost and
            the serial sum of the cut units bound it.
        streamk_fix: the persistent kind's cost of adding one more
            block's piece of a unit, in stage times per 32 tokens of the chunk
            (:func:`plan_streamk`).
        streamk_misalign: the cost of a run that neither divides nor is a multiple of
            the unit's stage count, as a fraction of the run, in chunks of up to 64
            tokens (where the weight stream bounds the kernel): its blocks then start at
            different stages of their units, and the device's blocks stream B rows far
            apart at once. A read-only probe of the same bytes (plain 16-byte loads,
            scripts/bench_stream_patterns.py) streamed 4.3 TB/s with the blocks on
            neighbouring columns of the same rows and 3.6-3.8 TB/s with each block on its
            own column strip at its own rows. On an H200 (the aligned run against the
            planner's shortest; scripts/bench_gemm_h200_streamk_align_1.json, 14:14Z,
            fused us): 28672 x 8192 runs of 56 stages (128 blocks) against 55 (131) at 1
            / 8 / 16 / 32 / 64 rows 35.3 / 35.6 / 40.5 / 45.1 / 62.7 against 36.7 / 37.0 /
            41.8 / 46.3 / 62.6; 4096 x 14336 16 (112 blocks) against 14 (128) at 1 / 8 /
            16 rows 14.6 / 14.7 / 16.4 against 14.7 / 15.1 / 16.5. After the change
            (scripts/bench_gemm_h200_streamk_align_2.log, 14:40Z, symmetric us, new /
            old run forced): 28672 x 8192 at 1 / 8 / 16 / 32 / 64 / 96 / 128 / 256 rows
            34.5 / 34.6 / 40.0 / 44.6 / 59.5 / 77.0 / 96.9 / 177.4 against 36.1 / 36.4 /
            40.8 / 46.2 / 61.1 / 78.5 / 102.8 / 177.8; 4096 x 14336 at 1 / 8 / 16 / 24 /
            32 rows 14.1 / 14.3 / 15.7 / 16.5 / 17.9 against 14.5 / 14.6 / 16.2 / 16.9 /
            17.8; at 256 rows 14336 x 4096 54.7 / 59.1, 8192² 58.4 / 61.7 (there the piece
            count alone picks the aligned run, a candidate now). 8192 x 57344 in runs of
            two whole units (128 stages, 112 blocks) lost (71.6 against 66.5 fused at 1
            row) and in runs of one (64 stages, 224 blocks) did not gain (66.8 / 66.5):
            the cost keeps the shortest there (109 + 1 piece + 5 % < 128).
        streamk_iters: forces the persistent kind's stages per block (sweeps); None
            lets :func:`plan_streamk` choose.
        hopper_decode_small_kn: on sm_90, layers of N <= 4096 and at most this many
            weights take the decode kernel in 8-row chunks (two per call at 9-16 rows)
            at 9..group_max_m rows instead of the tile kernel, whose few column blocks
            leave most multiprocessors idle there: 4096² ran 11.8 / 11.6 us (symmetric)
            against the tile kernel's 12.6 / 13.2 at M = 12 / 16, 8192 x 1024 10.5 /
            10.6 against 11.4 (H200 sweep, scripts/perf_notes.md); 14336 x 4096 was
            even at M = 16, so larger layers keep the tile kernel (up to 8192 x 8192
            weights the persistent kernel now takes them first). Only those two
            shapes were measured: narrower or deeper layers of the class (say
            65536 x 256) are an extrapolation. With the small layers' persistent route
            (hopper_small_*, from 8 rows) both measured shapes now take ``hopper_sk``
            there; this rule serves the rest of the class (N < 1024, fewer than 2^23
            weights).
    """

    group_max_m: int = 16
    decode_max_m: int = 32
    wide_n: int = 8192
    waves: int = 1
    latency_tiles: float = 6
    reduce_tiles: float = 2.5
    a_weight: float = 0.5
    force_wk: int | None = None
    force_splits: int | None = None
    occupancy_cap: tuple[tuple[KernelKind, int], ...] = ()
    saturation: tuple[tuple[KernelKind, int, int], ...] = ((KernelKind.DECODE, 9, 2), (KernelKind.TILE, 9, 2))
    hopper: bool = True
    hopper_wide_n: int = 14336
    hopper_wide_min_m: int = 17
    hopper_big_kn: int = 2**27
    hopper_big_min_m: int = 17
    hopper_large_m: int = 64
    hopper_huge_m: int = 129
    hopper_small_kn: int = 4096 * 4096
    hopper_fs_min_m: int = 65
    hopper_fs_narrow_min_m: int = 33
    hopper_fs_thin_min_m: int = 33
    hopper_fs_thin_kn: int = 8192 * 1024
    hopper_decode_small_kn: int = 4096 * 4096
    hopper_sk_min_m: int = 17
    hopper_sk_small_min_m: int = 9
    hopper_sk_small_kn: int = 8192 * 8192
    hopper_sk_mid_tok: int = 64
    hopper_sk_mid_min_m: int = 97
    hopper_sk_mid_max_m: int = 128
    hopper_skg_min_m: int = 1
    hopper_skg_max_m: int = 16
    hopper_xmap_max_tok: int = 128
    hopper_small_lo_kn: int = 8192 * 1024
    hopper_small_min_m: int = 8
    hopper_small_max_m: int = 256
    hopper_small_n4096_max_m: int = 128
    hopper_small_units: int = 16
    hopper_small_max_tok: int = 32
    hopper_small_skg_min_m: int = 17
    hopper_small_skg_max_tok: int = 16
    streamk_fix: float = 1.0
    streamk_misalign: float = 0.05
    streamk_iters: int | None = None

    def cap(self, kind: KernelKind) -> int | None:
        """The occupancy cap of ``kind``, or None."""
        return dict(self.occupancy_cap).get(kind)

    def saturates_at(self, kind: KernelKind, rows: int) -> int | None:
        """The blocks per multiprocessor at which ``kind`` saturates with chunks of
        ``rows`` rows of A, or None (see ``saturation``)."""
        return next((b for k, least, b in self.saturation if k == kind and rows >= least), None)


DEFAULT_TUNING = Tuning()


class DeviceLimits(Protocol):
    """What the planner needs of a device (:class:`converter.gpu.runtime.DeviceInfo` has it)."""

    sm_count: int
    smem_per_block_optin: int
    smem_per_sm: int


@dataclasses.dataclass(frozen=True)
class Variant:
    """A compiled variant chosen for one layer's sizes: the pipe, its group slots per
    step (``gpi``), its shared memory (the most any of its block shapes needs), and the
    layer's group facts."""

    pipe: Pipe
    gpi: int
    smem: int
    group_tiles: int
    per_channel: bool

    def name(self, delta: bool) -> str:
        return self.pipe.name(self.gpi, delta)


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """Kernel variant and K split of one GEMM call.

    Attributes:
        kind, r, u, gpi, ns: the variant (``Pipe(kind, r, u, ns)`` with ``gpi`` slots).
        smem: dynamic shared memory per block (of the plan's ``wk``), bytes.
        regs: registers per thread of the variant.
        rows: A rows per chunk (``tile_rows * r``).
        m_chunks: chunks of A rows.
        wk: 1 (a block takes 4 column units with the whole K range) or 4 (one unit,
            a quarter of the range per warp).
        splits: contiguous K ranges per unit; tiles_per_split: k-tiles in each.
        warps, blocks: the launch; resident_warps: warps the device holds at once.
    """

    kind: KernelKind
    r: int
    u: int
    gpi: int
    ns: int
    smem: int
    regs: int
    rows: int
    m_chunks: int
    wk: int
    splits: int
    tiles_per_split: int
    warps: int
    blocks: int
    resident_warps: int

    @property
    def pipe(self) -> Pipe:
        return Pipe(self.kind, self.r, self.u, self.ns)

    @property
    def arith(self) -> Arith:
        """What this plan's kernel multiplies (its twin's ``arith``)."""
        return ARITH[self.kind]

    @property
    def threads(self) -> int:
        """Threads per block."""
        return self.pipe.threads


def gemm_path(
    m: int,
    size_n: int,
    tuning: Tuning = DEFAULT_TUNING,
    *,
    hopper: bool = False,
    size_k: int = 0,
    group_tiles: int | None = None,
) -> KernelKind:
    """The kernel kind that serves an (M, N) call (see :class:`Tuning`).

    Args:
        m, size_n: rows of A, N.
        tuning: the knobs.
        hopper: the device can run the Hopper kernel (sm_90); False gives the sm_80..89 rule.
        size_k: K (only the Hopper rules use it: small and thin layers).
        group_tiles: group size / 16 (K / 16 per-channel), or None (the Hopper rules
            then assume a group the per-group persistent form serves).
    """
    if hopper and tuning.hopper:
        kn = size_k * size_n
        if _small_route(m, size_k, size_n, tuning):
            skg_fits = group_tiles is None or _stage8(size_k, group_tiles)
            tokens = small_chunk(m, size_n, tuning)
            skg_tok = min(tuning.hopper_small_skg_max_tok, 8 * HOPPER_SKG_RS[-1])
            if skg_fits and m >= tuning.hopper_small_skg_min_m and tokens <= skg_tok:
                return KernelKind.HOPPER_SKG
            return KernelKind.HOPPER_SK
        if (
            size_n >= 4096
            and kn > tuning.hopper_small_kn
            and tuning.hopper_skg_min_m <= m <= min(tuning.hopper_skg_max_m, 8 * HOPPER_SKG_RS[-1])
            and (group_tiles is None or _stage8(size_k, group_tiles))
        ):
            return KernelKind.HOPPER_SKG
        if size_n >= 4096 and kn >= tuning.hopper_small_kn and m >= tuning.hopper_sk_min_m:
            return KernelKind.HOPPER_SK
        if size_n >= 4096 and tuning.hopper_small_kn < kn <= tuning.hopper_sk_small_kn:
            if m >= tuning.hopper_sk_small_min_m:
                return KernelKind.HOPPER_SK
        if _thin_fs(m, size_k, size_n, tuning) or (
            size_n >= 4096
            and kn >= tuning.hopper_small_kn
            and (m >= tuning.hopper_fs_min_m or (size_n == 4096 and m >= tuning.hopper_fs_narrow_min_m))
        ):
            return KernelKind.HOPPER_FS
        if size_n >= 4096 and (
            (size_n >= tuning.hopper_wide_n and m >= tuning.hopper_wide_min_m)
            or (kn >= tuning.hopper_big_kn and m >= tuning.hopper_big_min_m)
            or (size_n >= 8192 and m >= tuning.hopper_large_m)
            or (kn > tuning.hopper_small_kn and m >= tuning.hopper_huge_m)
        ):
            return KernelKind.HOPPER
        if _small_decode(m, size_k, size_n, tuning):
            return KernelKind.DECODE
    if m <= 8 or (m <= tuning.group_max_m and size_n >= tuning.wide_n):
        return KernelKind.DECODE
    if m <= tuning.decode_max_m and size_n > tuning.wide_n:
        return KernelKind.DECODE_W
    return KernelKind.TILE


def persistent_every_m(size_k: int, size_n: int, group_tiles: int, tuning: Tuning = DEFAULT_TUNING) -> bool:
    """On sm_90, a persistent kind serves this layer at every M (so it may keep ``B``
    unit-major only, ``kernels.prepare_b_units``): the rules give ``hopper_sk`` to every
    M >= ``tuning.hopper_sk_min_m`` on layers of N >= 4096 and at least
    ``hopper_small_kn`` weights, so the rows below that are checked one by one. A tuning
    that holds that kind back beyond ``EVERY_M_CHECKED`` rows (an experiment, e.g.
    ``hopper_sk_min_m=10**9``) answers False: ``B`` in Marlin's order serves every kernel.

    Args:
        size_k, size_n: K, N (N as the kernels see it: ``padded_n``).
        group_tiles: group size / 16 (K / 16 per-channel).
        tuning: the planner's knobs (the routing rules' thresholds).

    Returns:
        True when every M from 1 up is served by ``hopper_sk`` or ``hopper_skg``.
    """
    big = size_n >= 4096 and size_k * size_n >= tuning.hopper_small_kn and tuning.hopper
    if not big or tuning.hopper_sk_min_m > EVERY_M_CHECKED:
        return False
    rows = range(1, max(tuning.hopper_sk_min_m, 1) + 1)
    return all(
        KINDS[gemm_path(m, size_n, tuning, hopper=True, size_k=size_k, group_tiles=group_tiles)].persistent
        for m in rows
    )


def _small_persistent(size_k: int, size_n: int, tuning: Tuning) -> bool:
    """The small layers the persistent kernel serves in small units (see :class:`Tuning`)."""
    return 1024 <= size_n <= 4096 and tuning.hopper_small_lo_kn <= size_k * size_n <= tuning.hopper_small_kn


def _small_route(m: int, size_k: int, size_n: int, tuning: Tuning) -> bool:
    """The rows of a small layer that its own persistent route serves (see :class:`Tuning`)."""
    top = tuning.hopper_small_n4096_max_m if size_n >= 4096 else tuning.hopper_small_max_m
    return tuning.hopper_small_min_m <= m <= top and _small_persistent(size_k, size_n, tuning)


def small_chunk(m: int, size_n: int, tuning: Tuning = DEFAULT_TUNING) -> int:
    """Tokens per chunk of the small layers' persistent route: M cut into even chunks of
    at most the fewest tokens (8-token tiles of :data:`HOPPER_SK_RS`, at most
    ``tuning.hopper_small_max_tok``) that make ``tuning.hopper_small_units`` units of
    256 features x one chunk.

    A unit's stages are shared by the blocks that cut it, and the one that arrives last
    adds every piece alone (T x 256 floats each): a layer of few 256-feature column
    blocks needs more, shorter chunks to keep that serial sum short, at the price of
    dequantizing the (L2-resident) weights once per chunk.

    Args:
        m: rows of A. size_n: N.

    Returns:
        Tokens per chunk, a multiple of 8 (8 .. ``hopper_small_max_tok``).
    """
    cols = -(-size_n // 256)
    want = -(-m * cols // max(1, tuning.hopper_small_units))
    fits = [8 * r for r in HOPPER_SK_RS if 8 * r <= tuning.hopper_small_max_tok] or [8]
    return _even_chunk(m, next((t for t in fits if t >= want), fits[-1]))


def _even_chunk(m: int, top: int) -> int:
    """The fewest tokens of :data:`HOPPER_SK_RS` that hold m rows cut into as few chunks
    of at most ``top`` tokens as there can be, evenly (40 rows under 32: 24, not 32)."""
    top = min(max(top, 8), 8 * HOPPER_SK_RS[-1])
    rows = -(-m // -(-m // top))
    return 8 * next(r for r in HOPPER_SK_RS if 8 * r >= rows)


def _small_decode(m: int, size_k: int, size_n: int, tuning: Tuning) -> bool:
    """The small-layer route of the decode kernel on sm_90 (see :class:`Tuning`); at most
    16 rows, two 8-row chunks (measured no further)."""
    return 8 < m <= min(tuning.group_max_m, 16) and size_n <= 4096 and size_k * size_n <= tuning.hopper_decode_small_kn


def _thin_fs(m: int, size_k: int, size_n: int, tuning: Tuning) -> bool:
    """The thin-layer route of the feature-split Hopper kernel (see :class:`Tuning`)."""
    return 1024 <= size_n < 4096 and size_k * size_n >= tuning.hopper_fs_thin_kn and m >= tuning.hopper_fs_thin_min_m


def _stage8(size_k: int, group_tiles: int) -> bool:
    """8-tile stages hold one group slot: K a multiple of 128 and group sizes that are
    multiples of 128, or per-channel."""
    return (size_k // MARLIN_TILE) % 8 == 0 and group_tiles % 8 == 0


def gemm_arith(
    m: int,
    size_n: int,
    tuning: Tuning = DEFAULT_TUNING,
    *,
    hopper: bool = False,
    size_k: int = 0,
    group_tiles: int | None = None,
) -> Arith:
    """The arithmetic of the kernel that serves (M, N) (arguments as :func:`gemm_path`)."""
    return ARITH[gemm_path(m, size_n, tuning, hopper=hopper, size_k=size_k, group_tiles=group_tiles)]


def default_pipe(
    m: int,
    size_k: int,
    size_n: int,
    group_tiles: int,
    smem_limit: int = 227 * 1024,
    tuning: Tuning = DEFAULT_TUNING,
    *,
    hopper: bool = False,
) -> Pipe:
    """The GEMM variant for batch size m (measured on an H200, scripts/perf_notes.md).

    The kind from :func:`gemm_path`; the decode kernels with the fewest 8-row activation
    tiles that hold M (on sm_90 the small layers' 9-16 rows in two 8-row chunks), the
    tile kernel with 2 (M <= 32) or 4 m-tiles per warp.

    Args:
        m: rows of A. size_k, size_n: K, N. group_tiles: group size / 16 (K / 16
            per-channel).
        smem_limit: the device's opt-in shared memory per block, bytes.
        hopper: the device runs the Hopper kernel (sm_90).

    Returns:
        One of GEMM_PIPES. The persistent Hopper kernel's chunk is the fewest 8-token
        tiles of :data:`HOPPER_SK_RS` that hold M (128 tokens beyond): 8-tile stages,
        6 of them, where they hold one group slot and the chunk is one of
        :data:`HOPPER_SK8_RS` (at 24-64 rows 1-8 % faster than 4-tile stages on an
        H200), else 4-tile stages, 8 of them; on mid-sized layers at 97-128 rows two
        even chunks of up to 64 tokens (:class:`Tuning`: hopper_sk_mid_*); its
        per-group form (``hopper_skg``, 8-tile stages only: :func:`gemm_path` does not
        give it where they do not fit) the fewest of :data:`HOPPER_SKG_RS`. On the
        small layers (:class:`Tuning`: hopper_small_*) both take the chunks of
        :func:`small_chunk`, ``hopper_sk`` in 4-tile stages. The
        other Hopper kernel's block holds the fewest 8-token tiles
        (:data:`HOPPER_RS`, or 16) that hold M; beyond 128 rows, 128-token chunks
        (the feature-split kernel: 48, 64, 96 or 128 tokens; NS = 6 up to 64 tokens,
        4 above; on thin layers 32-token chunks, 64 beyond 128 rows).
    """
    kind = gemm_path(m, size_n, tuning, hopper=hopper, size_k=size_k, group_tiles=group_tiles)
    stage8 = _stage8(size_k, group_tiles)
    # the small layers' chunk (0: not a small layer's row), for both persistent forms
    small_r = (
        small_chunk(m, size_n, tuning) // 8
        if hopper and tuning.hopper and _small_route(m, size_k, size_n, tuning)
        else 0
    )
    if kind is KernelKind.HOPPER_SKG:
        return Pipe(kind, small_r or next((r for r in HOPPER_SKG_RS if 8 * r >= m), HOPPER_SKG_RS[-1]), 8, 6)
    if kind is KernelKind.HOPPER_SK:
        if small_r:
            return Pipe(kind, small_r, 4, 8)
        r = next(r for r in HOPPER_SK_RS if 8 * r >= min(m, 128))
        mid = hopper and size_n >= 4096 and tuning.hopper_small_kn < size_k * size_n <= tuning.hopper_sk_small_kn
        # only where 8-tile stages hold the group: two 64-token chunks in 4-tile stages
        # ran slower than one of 128 (scripts/bench_gemm_h200_mid_sweep.json)
        if mid and stage8 and tuning.hopper_sk_mid_min_m <= m <= tuning.hopper_sk_mid_max_m:
            r = _even_chunk(m, tuning.hopper_sk_mid_tok) // 8
        return Pipe(kind, r, 8, 6) if stage8 and r in HOPPER_SK8_RS else Pipe(kind, r, 4, 8)
    if kind is KernelKind.HOPPER_FS:
        if _thin_fs(m, size_k, size_n, tuning):
            return Pipe(kind, 4 if m <= 128 else 8, 4, 6)
        r = next((r for r in HOPPER_FS_RS if 8 * r >= m), 16)
        return Pipe(kind, r, 4, 6 if r <= 8 else 4)
    if kind is KernelKind.HOPPER:
        r = next((r for r in HOPPER_RS if 8 * r >= m), 16)
        return Pipe(kind, r, 4, 6 if r >= 6 else 4)
    if kind is KernelKind.TILE:
        return Pipe(kind, 2, 4, 3) if m <= 32 else Pipe(kind, 4, 2, 3)
    if kind is KernelKind.DECODE_W:
        return Pipe(kind, 4, 4, 3)
    if m <= 8 or (hopper and tuning.hopper and _small_decode(m, size_k, size_n, tuning)):
        return Pipe(kind, 1, 4, 3)
    # 8-tile steps when every step holds one group slot (group size >= 128, per-channel)
    u8 = stage8 and Pipe(kind, 2, 8, 3).smem(1) <= smem_limit
    return Pipe(kind, 2, 8 if u8 else 4, 3)


def kernel_variant(
    size_k: int,
    size_n: int,
    group_size: int,
    pipe: tuple[str, int, int, int],
    *,
    smem_limit: int,
    arch: str = "this device",
) -> Variant:
    """Check that ``pipe`` can run a layer and work out its group slots and shared memory.

    Raises:
        KernelError: the sizes break the kernels' rule (:func:`converter.marlin.shapes.kernel_layer_sizes`),
            an unknown pipe, K not a multiple of 16 U, a group size the pipe's U does
            not serve, or more shared memory than ``smem_limit`` (``arch`` names the device).
    """
    gs, _, per_channel = kernel_layer_sizes(size_k, size_n, group_size, error=KernelError)
    try:
        pipe = Pipe.of(pipe)
    except ValueError:
        raise KernelError(f"unknown GEMM variant {pipe}; built: {GEMM_PIPES}") from None
    if pipe not in GEMM_PIPES:
        raise KernelError(f"unknown GEMM variant {pipe}; built: {GEMM_PIPES}")
    kt = size_k // MARLIN_TILE
    if kt % pipe.u:
        raise KernelError(f"size_k={size_k}: K must be a multiple of {MARLIN_TILE * pipe.u} for this kernel")
    gt = kt if per_channel else gs // MARLIN_TILE
    gpi = 1 if per_channel else pipe.u // math.gcd(gt, pipe.u)
    if gpi not in GEMM_GPIS[pipe.u]:
        raise KernelError(f"group_size {group_size} is not supported by GEMM variant {pipe}")
    smem = pipe.smem(gpi)
    if smem > smem_limit:
        raise KernelError(
            f"GEMM variant {pipe} needs {smem} bytes of shared memory per block; {arch} allows {smem_limit}"
        )
    return Variant(pipe, gpi, smem, gt, per_channel)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _feasible_splits(kt: int, quantum: int) -> list[tuple[int, int]]:
    """``(splits, tiles_per_split)`` for every split count of ``kt`` k-tiles whose
    ranges are whole multiples of ``quantum`` (a warp's share is whole steps) and all
    non-empty."""
    return [
        (splits, tps)
        for splits in range(1, -(-kt // quantum) + 1)
        for tps in [_ceil_div(_ceil_div(kt, splits), quantum) * quantum]
        if _ceil_div(kt, tps) == splits
    ]


def resident_blocks(regs: int, smem: int, smem_per_sm: int, warps: int = BLOCK_WARPS) -> int:
    """Blocks of ``warps`` warps (a multiple of 4) one multiprocessor holds (sm_80..sm_90
    allocation rules).

    Each of the 4 sub-partitions has 16 K registers, given to a warp in units of 256
    (so 102 registers per thread cost 3328 per warp: 4 warps per sub-partition, not
    5); a block takes ``warps / 4`` warp slots in every sub-partition. Shared memory:
    1 KB is reserved per block. At most 64 warps.
    """
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    per_sub = warps // BLOCK_WARPS
    return max(1, min(16384 // (per_warp * per_sub), smem_per_sm // (smem + 1024), 64 // warps))


def plan_gemm(
    m: int,
    size_k: int,
    size_n: int,
    variant: Variant,
    *,
    regs: int,
    device: DeviceLimits,
    tuning: Tuning = DEFAULT_TUNING,
) -> GemmPlan:
    """The K split of one call of ``variant``.

    The work is ``m_chunks x N/64`` units (the variant's rows x 64 columns each), each
    split into ``splits`` contiguous K ranges; a 4-warp block takes either 4 units with
    the whole range (``wk = 1``) or one unit with a quarter of the range per warp
    (``wk = 4``). With ``R`` blocks resident on the device (from the variant's
    registers and the block shape's shared memory), the plan minimises
    ``ceil(blocks / R) * (tiles per warp + latency_tiles)`` (the slowest wave plus its
    pipeline fill) plus a small charge per split for the partial-sum reduction; a pipe
    with a ``tuning.saturation`` entry is charged per multiprocessor instead (see there).

    Args:
        m, size_k, size_n: the problem (the variant already checked the sizes).
        variant: from :func:`kernel_variant`.
        regs: registers per thread of the variant's compiled function.
        device: the device's multiprocessors and shared memory.
        tuning: the knobs.
    """
    pipe, spec = variant.pipe, variant.pipe.spec
    if spec.persistent:
        return plan_streamk(m, size_k, size_n, variant, regs=regs, device=device, tuning=tuning)
    kt = size_k // MARLIN_TILE
    warps_per_block = pipe.threads // 32
    cap = tuning.cap(pipe.kind)
    chunk_rows = spec.tile_rows * pipe.r
    m_chunks = -(-m // chunk_rows)
    nblk = size_n // KERNEL_N_MULTIPLE
    rows = min(m, chunk_rows)
    sat = tuning.saturates_at(pipe.kind, rows)
    best = None
    shapes = (tuning.force_wk,) if tuning.force_wk and tuning.force_wk in spec.block_shapes else spec.block_shapes
    feasible_by_wk = {wk: _feasible_splits(kt, wk * pipe.u) for wk in shapes}
    if any(tuning.force_splits in {sp for sp, _ in f} for f in feasible_by_wk.values()):
        # a forced count some block shape can run: only those shapes, at that count
        feasible_by_wk = {
            wk: [(sp, tps) for sp, tps in f if sp == tuning.force_splits] for wk, f in feasible_by_wk.items()
        }
    for wk in shapes:
        smem = pipe.smem(variant.gpi, wk)
        blocks_per_sm = resident_blocks(regs, smem, device.smem_per_sm, warps_per_block)
        if cap:
            blocks_per_sm = min(blocks_per_sm, cap)
        resident = device.sm_count * blocks_per_sm
        blocks_n = m_chunks * -(-nblk // (BLOCK_WARPS // wk))
        for splits, tps in feasible_by_wk[wk]:
            waves = -(-blocks_n * splits // (resident * tuning.waves))
            # slowest wave: per-warp tiles (each also moving its A rows, rows / 16 of a
            # B tile's bytes, once per block in the decode kernel's wk = 1 form) plus
            # the pipeline fill, then the final reduction (per extra split and 8 rows:
            # partial writes, the counter, reads)
            a_share = BLOCK_WARPS if (spec.shares_a and wk == 1) else 1
            tile_cost = 1 + tuning.a_weight * rows / MARLIN_TILE / a_share
            red_rows = chunk_rows if spec.reduces_chunk else rows
            reduce = spec.reduce_weight * tuning.reduce_tiles * (splits - 1) * -(-red_rows // 8)
            if spec.reduces_per_wave:
                reduce *= waves
            if sat and blocks_per_sm > sat:  # past `sat` resident blocks only (see Tuning.saturation)
                per_sm = -(-blocks_n * splits // device.sm_count)
                at_once = min(blocks_per_sm, sat, per_sm)
                rounds = -(-per_sm // blocks_per_sm)
                cost = per_sm / at_once * (tps // wk) * tile_cost + rounds * tuning.latency_tiles + reduce
            else:
                cost = waves * (tps // wk * tile_cost + tuning.latency_tiles) + reduce
            if best is None or cost < best[0]:
                best = (cost, wk, splits, tps, blocks_n * splits, smem, resident)
    assert best is not None
    _, wk, splits, tps, blocks, smem, resident = best
    return GemmPlan(
        kind=pipe.kind,
        r=pipe.r,
        u=pipe.u,
        gpi=variant.gpi,
        ns=pipe.ns,
        smem=smem,
        regs=regs,
        rows=chunk_rows,
        m_chunks=m_chunks,
        wk=wk,
        splits=splits,
        tiles_per_split=tps,
        warps=warps_per_block * blocks,
        blocks=blocks,
        resident_warps=warps_per_block * resident,
    )


def streamk_pieces(units: int, stages: int, iters: int) -> int:
    """The most blocks any unit is cut into when each of ``units`` units of ``stages``
    stages, numbered unit-major, is dealt out in runs of ``iters`` stages.

    Unit u starts ``r = u stages mod iters`` stages into a run and is cut into
    ``(r + stages - 1) // iters + 1`` pieces: ``p0 = ceil(stages / iters)`` when r is
    below ``t = p0 iters - stages + 1``, one more from t. The units whose offset reaches
    t are counted without listing them (:func:`_floor_sum`), in logarithmic time for any
    M (listing them took 0.4 s per plan at M = 65536).
    """
    p0 = -(-stages // iters)
    t = p0 * iters - stages + 1  # 1 <= t <= iters
    # u stages mod iters >= t exactly when floor((u stages + iters - t) / iters) steps
    # past floor(u stages / iters)
    reach = _floor_sum(units, iters, stages, iters - t) - _floor_sum(units, iters, stages, 0)
    return p0 + (reach > 0)


def _floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``sum(floor((a i + b) / m) for i in range(n))`` for n, m >= 1 and a, b >= 0, by the
    Euclid-like reduction (swap the roles of a and m while the line stays under m)."""
    total = 0
    while True:
        if a >= m:
            total += (n - 1) * n // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        y_max = a * n + b
        if y_max < m:
            return total
        n, b = divmod(y_max, m)
        m, a = a, m


def plan_streamk(
    m: int,
    size_k: int,
    size_n: int,
    variant: Variant,
    *,
    regs: int,
    device: DeviceLimits,
    tuning: Tuning = DEFAULT_TUNING,
) -> GemmPlan:
    """The run of the persistent kind (``kernels/marlin_streamk.cu``): stages per block.

    The work is ``m_chunks x ceil(N / 256)`` units of ``K / 16 / U`` stages; block b
    takes stages ``[b iters, (b + 1) iters)`` of them numbered unit-major, one block per
    multiprocessor at most. Every piece of a unit cut by block boundaries is parked,
    and the last to arrive adds them one after another, so the plan minimises
    ``iters + fix * (pieces - 1)``: the longest run plus the most pieces a unit has,
    each charged ``tuning.streamk_fix`` stage times per 32 tokens (a piece's partial
    sums are T x 256 floats), plus ``tuning.streamk_misalign * iters`` for a run that
    neither divides nor is a multiple of the unit's stages (chunks of up to 64 tokens).
    Candidates: the shortest run and up to 4x it, in steps and at every such aligned
    length.

    Returns:
        A :class:`GemmPlan` with ``blocks`` the grid, ``tiles_per_split`` the k-tiles of
        one run (``iters * U``) and ``splits`` the most pieces of a unit (the count of
        partial sums added, for the error bound).
    """
    pipe = variant.pipe
    tokens = 8 * pipe.r
    m_chunks = -(-m // tokens)
    stages = size_k // MARLIN_TILE // pipe.u
    units = m_chunks * -(-(size_n // KERNEL_N_MULTIPLE) // BLOCK_WARPS)
    total = units * stages
    least = -(-total // device.sm_count)
    if tuning.streamk_iters:
        best = min(max(tuning.streamk_iters, least), total)
    else:
        fix = tuning.streamk_fix * max(1.0, tokens / 32)
        top = min(total, 4 * least)
        aligned = {d for d in range(least, min(stages, top) + 1) if stages % d == 0}
        first = -(-least // stages) * stages
        aligned |= set(range(first, min(top, first + 16 * stages) + 1, stages))
        cands = sorted({least, *range(least, top + 1, max(1, least // 16)), *aligned, stages, total})
        cands = [c for c in cands if least <= c <= total]

        def cost(it: int) -> float:
            in_step = stages % it == 0 or it % stages == 0
            off = 0.0 if in_step or tokens > 64 else tuning.streamk_misalign * it
            return it + fix * (streamk_pieces(units, stages, it) - 1) + off

        best = min(cands, key=lambda it: (cost(it), it))
    blocks = -(-total // best)
    warps = pipe.threads // 32
    return GemmPlan(
        kind=pipe.kind,
        r=pipe.r,
        u=pipe.u,
        gpi=variant.gpi,
        ns=pipe.ns,
        smem=pipe.smem(variant.gpi),
        regs=regs,
        rows=tokens,
        m_chunks=m_chunks,
        wk=1,
        splits=streamk_pieces(units, stages, best),
        tiles_per_split=best * pipe.u,
        warps=warps * blocks,
        blocks=blocks,
        resident_warps=warps * device.sm_count,
    )

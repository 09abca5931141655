"""The kernel catalog: the GEMM kernel kinds, the variants compiled of each, and what a
variant needs (threads, shared memory, group slots per step) to run a layer.

Adding a kind is a :class:`KernelKind` member, a :class:`KindSpec` in :data:`KINDS`,
its variants in :data:`GEMM_PIPES` and a row in a route table
(:mod:`converter.gpu.plan.routing`). The Hopper kinds run only on sm_90 (built for
sm_90a).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from types import MappingProxyType
from typing import NamedTuple

from ...constants import MARLIN_TILE
from ...errors import KernelError
from ...marlin.shapes import kernel_layer_sizes

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
#: does not take; docs/notes/routing.md).
HOPPER_RS = (1, 2, 3, 4, 6, 8, 12)
#: The same for the feature-split kind (``hopper_fs``): 48, 64, 96 and 128 tokens. No
#: default route takes it since the persistent kind measured faster on every row it served
#: (docs/notes/routing.md#thin-layers); it serves a forced pipe or held-back persistent kinds.
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
            split count on an H200, docs/notes/routing.md).
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


def layer_groups(size_k: int, size_n: int, group_size: int) -> tuple[int, int, bool]:
    """``(group_size, group_tiles, per_channel)`` of a layer the kernels run: the one
    place the group-tile arithmetic lives (per-channel: one group of K, ``K / 16``
    tiles).

    Raises:
        KernelError: the sizes break the kernels' rule (:func:`converter.marlin.shapes.kernel_layer_sizes`).
    """
    gs, _, per_channel = kernel_layer_sizes(size_k, size_n, group_size, error=KernelError)
    gs = size_k if per_channel else gs
    return gs, gs // MARLIN_TILE, per_channel


def group_slots(group_tiles: int, u: int, per_channel: bool) -> int:
    """Group slots a step of U k-tiles holds (GPI): one per-channel, else U over the
    tiles U shares with a group."""
    return 1 if per_channel else u // math.gcd(group_tiles, u)


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
    _, gt, per_channel = layer_groups(size_k, size_n, group_size)
    try:
        pipe = Pipe.of(pipe)
    except ValueError:
        raise KernelError(f"unknown GEMM variant {pipe}; built: {GEMM_PIPES}") from None
    if pipe not in GEMM_PIPES:
        raise KernelError(f"unknown GEMM variant {pipe}; built: {GEMM_PIPES}")
    if (size_k // MARLIN_TILE) % pipe.u:
        raise KernelError(f"size_k={size_k}: K must be a multiple of {MARLIN_TILE * pipe.u} for this kernel")
    gpi = group_slots(gt, pipe.u, per_channel)
    if gpi not in GEMM_GPIS[pipe.u]:
        raise KernelError(f"group_size {group_size} is not supported by GEMM variant {pipe}")
    smem = pipe.smem(gpi)
    if smem > smem_limit:
        raise KernelError(
            f"GEMM variant {pipe} needs {smem} bytes of shared memory per block; {arch} allows {smem_limit}"
        )
    return Variant(pipe, gpi, smem, gt, per_channel)


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

"""Routing: which kernel variant serves an (M, K, N, group) call, read from a table.

A call is described once (:class:`GemmProblem`); the route tables (:data:`ROUTES_SM90`,
:data:`ROUTES_SM80`) are read top to bottom and the first row whose ``when`` holds
names the kernel kind and its chunk (``R, U, NS``). Each row says which
:class:`~converter.gpu.plan.tuning.Tuning` knobs it reads and where the measurements
behind it are (``evidence``: a section of docs/notes/routing.md). The map these
tables give the models' layers is docs/routing-map.md (regenerated and diffed by
tests/gpu/test_plan.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ...constants import MARLIN_TILE
from .catalog import (
    ARITH,
    HOPPER_FS_RS,
    HOPPER_RS,
    HOPPER_SK8_RS,
    HOPPER_SK_RS,
    HOPPER_SKG_RS,
    KINDS,
    Arith,
    KernelKind,
    Pipe,
)
from .tuning import DEFAULT_TUNING, Tuning

#: The most rows :func:`persistent_every_m` checks one by one (the per-weight persistent
#: kind's threshold, ``Tuning.hopper_sk_min_m``, is 17 by default).
EVERY_M_CHECKED = 1024
#: Tokens of the per-group persistent kind's largest chunk.
SKG_MAX_TOK = 8 * HOPPER_SKG_RS[-1]


def stage8(size_k: int, group_tiles: int) -> bool:
    """8-tile stages hold one group slot: K a multiple of 128 and group sizes that are
    multiples of 128, or per-channel."""
    return (size_k // MARLIN_TILE) % 8 == 0 and group_tiles % 8 == 0


def _even_chunk(m: int, top: int) -> int:
    """The fewest tokens of :data:`HOPPER_SK_RS` that hold m rows cut into as few chunks
    of at most ``top`` tokens as there can be, evenly (40 rows under 32: 24, not 32)."""
    top = min(max(top, 8), 8 * HOPPER_SK_RS[-1])
    rows = -(-m // -(-m // top))
    return 8 * next(r for r in HOPPER_SK_RS if 8 * r >= rows)


def small_chunk(m: int, size_n: int, tuning: Tuning = DEFAULT_TUNING) -> int:
    """Tokens per chunk of the small layers' persistent route: M cut into even chunks of
    at most the fewest tokens (of :data:`HOPPER_SK_RS`, at most
    ``tuning.hopper_small_max_tok``) that make ``tuning.hopper_small_units`` units of
    256 features x one chunk. A unit cut by many blocks is summed by the last of them
    alone, so a layer of few column blocks wants more, shorter chunks.

    Returns:
        Tokens per chunk, a multiple of 8 (8 .. ``hopper_small_max_tok``).
    """
    cols = -(-size_n // 256)
    want = -(-m * cols // max(1, tuning.hopper_small_units))
    fits = [8 * r for r in HOPPER_SK_RS if 8 * r <= tuning.hopper_small_max_tok] or [8]
    return _even_chunk(m, next((t for t in fits if t >= want), fits[-1]))


def _fewest(rs: tuple[int, ...], m: int, beyond: int) -> int:
    """The fewest 8-token tiles of ``rs`` that hold m rows, else ``beyond``."""
    return next((r for r in rs if 8 * r >= m), beyond)


@dataclasses.dataclass(frozen=True)
class GemmProblem:
    """One call as the route tables see it, computed once (:meth:`of`).

    Attributes:
        m, k, n: rows of A, K, N. kn: weights (K N).
        group_tiles: group size / 16 (K / 16 per-channel), or None (routing then
            assumes a group the per-group persistent kind serves).
        stage8: 8-tile stages hold one group slot (:func:`stage8`; True when
            ``group_tiles`` is None).
        smem_limit: the device's opt-in shared memory per block, bytes.
        t: the knobs.
        small: a small layer's row that its own persistent route serves (0 otherwise:
            ``small_tok`` is then 0 too).
        small_tok: that route's chunk (:func:`small_chunk`).
        mid: a mid-sized layer (N >= 4096, above ``hopper_small_kn`` and up to
            ``hopper_sk_small_kn`` weights).
    """

    m: int
    k: int
    n: int
    kn: int
    group_tiles: int | None
    stage8: bool
    smem_limit: int
    t: Tuning
    small: bool
    small_tok: int
    mid: bool

    @classmethod
    def of(
        cls,
        m: int,
        size_k: int,
        size_n: int,
        group_tiles: int | None,
        tuning: Tuning = DEFAULT_TUNING,
        smem_limit: int = 227 * 1024,
    ) -> GemmProblem:
        t, kn = tuning, size_k * size_n
        top = t.hopper_small_n4096_max_m if size_n >= 4096 else t.hopper_small_max_m
        small = (
            t.hopper_small_min_m <= m <= top
            and 1024 <= size_n <= 4096
            and t.hopper_small_lo_kn <= kn <= t.hopper_small_kn
        )
        return cls(
            m=m,
            k=size_k,
            n=size_n,
            kn=kn,
            group_tiles=group_tiles,
            stage8=group_tiles is None or stage8(size_k, group_tiles),
            smem_limit=smem_limit,
            t=tuning,
            small=small,
            small_tok=small_chunk(m, size_n, tuning) if small else 0,
            mid=size_n >= 4096 and t.hopper_small_kn < kn <= t.hopper_sk_small_kn,
        )

    @property
    def large(self) -> bool:
        """N >= 4096 and at least ``hopper_small_kn`` weights (the persistent kind's layers)."""
        return self.n >= 4096 and self.kn >= self.t.hopper_small_kn


# ----------------------------------------------------------------------------- chunks
# Each returns (R, U, NS) of the row's kind for a problem the row matched.

Chunk = Callable[[GemmProblem], tuple[int, int, int]]


def _small_skg(p: GemmProblem) -> tuple[int, int, int]:
    return p.small_tok // 8, 8, 6


def _small_sk(p: GemmProblem) -> tuple[int, int, int]:
    return p.small_tok // 8, 4, 8


def _skg(p: GemmProblem) -> tuple[int, int, int]:
    return _fewest(HOPPER_SKG_RS, p.m, HOPPER_SKG_RS[-1]), 8, 6


def _sk(p: GemmProblem) -> tuple[int, int, int]:
    """One chunk of up to 128 tokens; on mid-sized layers at hopper_sk_mid_* rows two
    even ones (only where 8-tile stages hold the group). 8-tile stages where they hold
    the group and the chunk has them (HOPPER_SK8_RS), else 4-tile stages."""
    r = _fewest(HOPPER_SK_RS, min(p.m, 128), HOPPER_SK_RS[-1])
    if p.mid and p.stage8 and p.t.hopper_sk_mid_min_m <= p.m <= p.t.hopper_sk_mid_max_m:
        r = _even_chunk(p.m, p.t.hopper_sk_mid_tok) // 8
    return (r, 8, 6) if p.stage8 and r in HOPPER_SK8_RS else (r, 4, 8)


def _thin_sk(p: GemmProblem) -> tuple[int, int, int]:
    return _fewest(HOPPER_SK_RS, min(p.m, 128), HOPPER_SK_RS[-1]), 4, 8


def _thin_k_sk(p: GemmProblem) -> tuple[int, int, int]:
    """As :func:`_thin_sk`, but two 64-token chunks in 8-tile stages (where they hold the
    group) at ``hopper_thin_k_tok64_m`` rows."""
    lo, hi = p.t.hopper_thin_k_tok64_m
    if p.stage8 and lo <= p.m <= hi:
        return 8, 8, 6
    return _thin_sk(p)


def _fs(p: GemmProblem) -> tuple[int, int, int]:
    r = _fewest(HOPPER_FS_RS, p.m, 16)
    return r, 4, (6 if r <= 8 else 4)


def _wgmma(p: GemmProblem) -> tuple[int, int, int]:
    r = _fewest(HOPPER_RS, p.m, 16)
    return r, 4, (6 if r >= 6 else 4)


def _decode8(p: GemmProblem) -> tuple[int, int, int]:
    return 1, 4, 3


def _decode16(p: GemmProblem) -> tuple[int, int, int]:
    """8-tile steps when every step holds one group slot and fits shared memory."""
    u8 = p.stage8 and Pipe(KernelKind.DECODE, 2, 8, 3).smem(1) <= p.smem_limit
    return 2, (8 if u8 else 4), 3


def _decode_w(p: GemmProblem) -> tuple[int, int, int]:
    return 4, 4, 3


def _tile(p: GemmProblem) -> tuple[int, int, int]:
    return (2, 4, 3) if p.m <= 32 else (4, 2, 3)


# ----------------------------------------------------------------------------- tables


@dataclasses.dataclass(frozen=True)
class Route:
    """One row of a route table: where ``when`` holds (and no row above it did),
    ``kind`` serves in the chunk ``chunk`` gives. ``evidence``: the section of
    docs/notes/routing.md with the measurements."""

    name: str
    when: Callable[[GemmProblem], bool]
    kind: KernelKind
    chunk: Chunk
    evidence: str


#: sm_80..89 (and the tail of sm_90's table).
ROUTES_SM80: tuple[Route, ...] = (
    Route("decode, up to 8 rows", lambda p: p.m <= 8, KernelKind.DECODE, _decode8, "sm80"),
    Route(
        "decode, wide layers (group_max_m, wide_n)",
        lambda p: p.m <= p.t.group_max_m and p.n >= p.t.wide_n,
        KernelKind.DECODE,
        _decode16,
        "sm80",
    ),
    Route(
        "per-weight decode, wider layers (decode_max_m, wide_n)",
        lambda p: p.m <= p.t.decode_max_m and p.n > p.t.wide_n,
        KernelKind.DECODE_W,
        _decode_w,
        "sm80",
    ),
    Route("tile, everything else", lambda p: True, KernelKind.TILE, _tile, "sm80"),
)

#: sm_90: the Hopper kinds first, then the sm_80 table.
ROUTES_SM90: tuple[Route, ...] = (
    Route(
        "small layers, per-group persistent (hopper_small_*, hopper_small_skg_*)",
        lambda p: (
            p.small
            and p.stage8
            and p.m >= p.t.hopper_small_skg_min_m
            and p.small_tok <= min(p.t.hopper_small_skg_max_tok, SKG_MAX_TOK)
        ),
        KernelKind.HOPPER_SKG,
        _small_skg,
        "small-layers",
    ),
    Route(
        "small layers, persistent (hopper_small_*)",
        lambda p: p.small,
        KernelKind.HOPPER_SK,
        _small_sk,
        "small-layers",
    ),
    Route(
        "large layers, few rows, per-group persistent (hopper_skg_*)",
        lambda p: (
            p.n >= 4096
            and p.kn > p.t.hopper_small_kn
            and p.t.hopper_skg_min_m <= p.m <= min(p.t.hopper_skg_max_m, SKG_MAX_TOK)
            and p.stage8
        ),
        KernelKind.HOPPER_SKG,
        _skg,
        "hopper-skg",
    ),
    Route(
        "large layers, persistent (hopper_sk_min_m)",
        lambda p: p.large and p.m >= p.t.hopper_sk_min_m,
        KernelKind.HOPPER_SK,
        _sk,
        "hopper-sk",
    ),
    Route(
        "mid-sized layers, persistent from 9 rows (hopper_sk_small_*)",
        lambda p: p.mid and p.m >= p.t.hopper_sk_small_min_m,
        KernelKind.HOPPER_SK,
        _sk,
        "hopper-sk-mid",
    ),
    Route(
        "thin layers, persistent in 4-tile stages (hopper_thin_*)",
        lambda p: 1024 <= p.n < 4096 and p.kn >= p.t.hopper_thin_kn and p.m >= p.t.hopper_thin_min_m,
        KernelKind.HOPPER_SK,
        _thin_sk,
        "thin-layers",
    ),
    Route(
        "wide layers of a short K, persistent (hopper_thin_k_*)",
        lambda p: p.n >= 8192 and p.kn < p.t.hopper_small_kn and p.m >= p.t.hopper_thin_k_min_m,
        KernelKind.HOPPER_SK,
        _thin_k_sk,
        "thin-k",
    ),
    Route(
        "large layers, feature-split wgmma (hopper_fs_*; only with hopper_sk held back)",
        lambda p: p.large and (p.m >= p.t.hopper_fs_min_m or (p.n == 4096 and p.m >= p.t.hopper_fs_narrow_min_m)),
        KernelKind.HOPPER_FS,
        _fs,
        "hopper-fs",
    ),
    Route(
        "token-split wgmma (hopper_wide_*, hopper_big_*, hopper_large_m, hopper_huge_m)",
        lambda p: (
            p.n >= 4096
            and (
                (p.n >= p.t.hopper_wide_n and p.m >= p.t.hopper_wide_min_m)
                or (p.kn >= p.t.hopper_big_kn and p.m >= p.t.hopper_big_min_m)
                or (p.n >= 8192 and p.m >= p.t.hopper_large_m)
                or (p.kn > p.t.hopper_small_kn and p.m >= p.t.hopper_huge_m)
            )
        ),
        KernelKind.HOPPER,
        _wgmma,
        "hopper-wgmma",
    ),
    Route(
        "small layers, decode in 8-row chunks (hopper_decode_small_kn)",
        lambda p: 8 < p.m <= min(p.t.group_max_m, 16) and p.n <= 4096 and p.kn <= p.t.hopper_decode_small_kn,
        KernelKind.DECODE,
        _decode8,
        "small-decode",
    ),
    *ROUTES_SM80,
)


def routes(hopper: bool, tuning: Tuning = DEFAULT_TUNING) -> tuple[Route, ...]:
    """The table of a device (``hopper``: sm_90; ``tuning.hopper`` False holds the
    Hopper kinds back)."""
    return ROUTES_SM90 if hopper and tuning.hopper else ROUTES_SM80


def route(problem: GemmProblem, hopper: bool) -> Route:
    """The first row of the device's table that holds for ``problem``."""
    return next(r for r in routes(hopper, problem.t) if r.when(problem))


# ----------------------------------------------------------------------------- the API


def gemm_path(
    m: int,
    size_n: int,
    tuning: Tuning = DEFAULT_TUNING,
    *,
    hopper: bool = False,
    size_k: int = 0,
    group_tiles: int | None = None,
) -> KernelKind:
    """The kernel kind that serves an (M, N) call (the route table's first match).

    Args:
        m, size_n: rows of A, N.
        tuning: the knobs.
        hopper: the device can run the Hopper kernel (sm_90); False gives the sm_80..89 table.
        size_k: K (only the sm_90 table uses it).
        group_tiles: group size / 16 (K / 16 per-channel), or None (see :class:`GemmProblem`).
    """
    return route(GemmProblem.of(m, size_k, size_n, group_tiles, tuning), hopper).kind


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
    """The GEMM variant for batch size m: the kind and chunk of the route table's first
    matching row.

    Args:
        m: rows of A. size_k, size_n: K, N. group_tiles: group size / 16 (K / 16
            per-channel).
        smem_limit: the device's opt-in shared memory per block, bytes.
        hopper: the device runs the Hopper kernel (sm_90).

    Returns:
        One of :data:`~converter.gpu.plan.catalog.GEMM_PIPES`.
    """
    problem = GemmProblem.of(m, size_k, size_n, group_tiles, tuning, smem_limit)
    row = route(problem, hopper)
    return Pipe(row.kind, *row.chunk(problem))


def persistent_every_m(size_k: int, size_n: int, group_tiles: int, tuning: Tuning = DEFAULT_TUNING) -> bool:
    """On sm_90, a persistent kind serves this layer at every M (so it may keep ``B``
    unit-major only, ``kernels.prepare_b_units``): the table gives ``hopper_sk`` to every
    M >= ``tuning.hopper_sk_min_m`` on the large layers, so the rows below are checked
    one by one. A tuning that holds that kind back beyond :data:`EVERY_M_CHECKED` rows
    answers False (``B`` in Marlin's order serves every kernel).
    """
    big = size_n >= 4096 and size_k * size_n >= tuning.hopper_small_kn and tuning.hopper
    if not big or tuning.hopper_sk_min_m > EVERY_M_CHECKED:
        return False
    rows = range(1, max(tuning.hopper_sk_min_m, 1) + 1)
    return all(
        KINDS[gemm_path(m, size_n, tuning, hopper=True, size_k=size_k, group_tiles=group_tiles)].persistent
        for m in rows
    )

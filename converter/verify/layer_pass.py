"""The one pass over the layers: each read chunk by chunk from the artifact (and the
source), compared bitwise and multiplied on a thread pool, its problems reported in one
place; then the pass-through tensors and the source's identity."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..artifact.problems import ProblemCode, Report
from ..artifact.reader import Artifact
from ..artifact.schema import LayerEntry
from ..constants import MARLIN_TILE, MARLIN_ZERO, PAD_CODE, PAD_DELTA, PAD_SCALE, Suffix
from ..digests import FileDigests
from ..formats.base import LayerPlan, Source
from ..marlin.layout import unpack_b, unpermute_scales
from ..native import lib as native_lib
from ..numerics import accumulate, relative_error
from ..quant_weight import QuantWeight
from ..safetensors_io import release_mapped_pages
from .against import _check_identity, _compare_passthrough, _compare_tensor_sets, _Diff, _facts_agree, _PaddingDiff
from .cpu_numerics import CPU_M, CPU_REL_TOL, _codes_and_reference, _widened

#: How much smaller than the conversion's the chunks are with the compiled loops, and
#: with the NumPy code (no compiled loops).
COMPILED_CHUNK_DIVISOR = 2
NUMPY_CHUNK_DIVISOR = 4
P = ProblemCode


def _layer_pass(
    art: Artifact,
    source: Source | None,
    digests: FileDigests | None,
    report: Report,
    rows: dict[str, dict[str, Any]],
    broken: set[str],
    numerics: bool,
    progress: Callable[[str, int], None] | None,
) -> dict[str, LayerPlan]:
    """``--against`` (when ``source``) and the CPU numerics (when ``numerics``), one read.

    Problems are reported in this order: the source's identity, what differs in the set
    of layers and tensors, per layer its facts and values, pass-through bytes, then
    numerics.  Returns ``{layer: source plan}`` of the layers compared with the source.
    """
    assert art.manifest is not None  # check_artifact stops on a manifest that does not fit
    identity_at = len(report.problems)
    plan_layers: dict[str, LayerPlan] = {}
    if source is not None:
        # An artifact without a padded layer was made with --no-pad, or needed no padding:
        # planned without it, the source gives the same layers either way (one plan).
        plan = source.plan(pad=any(rec.padded_n is not None for rec in art.layers.values()))
        plan_layers = {lay.name: lay for lay in plan.layers if lay.convertible}
        _compare_tensor_sets(art, source, plan, report)
    compared: dict[str, LayerPlan] = {}
    numeric_problems = Report(report.artifact)
    stage = " + ".join((["against source"] if source is not None else []) + (["CPU numerics"] if numerics else []))
    passthrough = [e.name for e in art.manifest.passthrough if e.name in art.file] if source is not None else []
    if progress:
        progress(stage, len(art.layers) + len(passthrough))
    rng = np.random.default_rng(0)
    buffers = _CodeBuffers()
    # Four workers: one chunk's two products and its comparison, and the next chunk's unpacking.
    with ThreadPoolExecutor(4, thread_name_prefix="marlin-verify") as pool:
        for name, rec in art.layers.items():
            # One x per checked layer, drawn in manifest order.
            x = rng.standard_normal((CPU_M, rec.size_k), dtype=np.float32) if numerics and name not in broken else None
            lay = plan_layers.get(name)
            if name not in broken and lay is not None and _facts_agree(rec, lay, report):
                compared[name] = lay
            else:
                lay = None
            if name not in broken and (lay is not None or numerics):
                src = source if lay is not None else None
                _check_layer(art, rec, src, lay, x, report, numeric_problems, rows, pool, buffers)
            if progress:
                progress("", 1)
        for name in passthrough:
            assert source is not None
            _compare_passthrough(art, source, name, report, pool)
            if progress:
                progress("", 1)
    if digests is not None:
        assert source is not None
        _check_identity(art, source, digests, report, identity_at)
    report.problems.extend(numeric_problems.problems)
    return compared


@dataclasses.dataclass
class _Chunk:
    """Rows ``[k0, k1)`` of a layer as the artifact stores them: ``b`` (its rows of
    ``marlin_B``, a view of the file), scales in natural column order (float16) and
    delta (float32) of groups from ``g0``, all ``layout_n`` columns wide."""

    k0: int
    k1: int
    g0: int
    b: np.ndarray
    scales: np.ndarray
    delta: np.ndarray


def _artifact_chunks(art: Artifact, rec: LayerEntry) -> Iterator[_Chunk]:
    from ..convert.plan import CHUNK_CODE_BYTES, chunk_rows

    p = rec.name + "."
    b = art.tensor(p + Suffix.B.value)
    s = art.tensor(p + Suffix.SCALES.value)
    d = art.tensor(p + Suffix.DELTA.value)
    single = rec.shape.num_groups == 1
    # The NumPy unpackers widen every code to 32 bits on the way (4 bytes of temporaries
    # per code, on three threads at once): a quarter of the chunk keeps them in the bound.
    # The compiled loops take half the conversion's chunk: the codes unpacked into one of
    # the two buffers are read again by both products, and at 12 MiB more of them are
    # still in cache (4 alternating runs on the 2.1 GB benchmark checkpoint: 3.54 s wall,
    # 5.84 s CPU against 3.66 s, 6.04 s with 24 MiB; 8 MiB 3.62 s).
    divisor = COMPILED_CHUNK_DIVISOR if native_lib() is not None else NUMPY_CHUNK_DIVISOR
    budget = CHUNK_CODE_BYTES // divisor
    step = chunk_rows(rec.size_k, rec.layout_n, rec.source_group_size or rec.group_size, budget)
    for k0 in range(0, rec.size_k, step):
        k1 = min(k0 + step, rec.size_k)
        g0, g1 = k0 // rec.group_size, -(-k1 // rec.group_size)
        yield _Chunk(
            k0,
            k1,
            g0,
            b[k0 // MARLIN_TILE : k1 // MARLIN_TILE],
            unpermute_scales(s[g0:g1], single=single),
            np.array(d[g0:g1], dtype=np.float32),
        )


class _CodeBuffers:
    """Two reused uint8 buffers for a layer's unpacked codes: chunk ``i`` unpacks into
    buffer ``i % 2`` while the products of chunk ``i - 1`` still read the other one, and
    a reused buffer costs no page faults (fresh multi-MB arrays do, on every chunk)."""

    def __init__(self) -> None:
        self._flat: list[np.ndarray] = [np.empty(0, np.uint8), np.empty(0, np.uint8)]
        self._turn = 0

    def next(self, shape: tuple[int, int]) -> np.ndarray:
        i, self._turn = self._turn, 1 - self._turn
        size = shape[0] * shape[1]
        if self._flat[i].size < size:
            self._flat[i] = np.empty(size, np.uint8)
        return self._flat[i][:size].reshape(shape)


def _check_layer(
    art: Artifact,
    rec: LayerEntry,
    source: Source | None,
    lay: LayerPlan | None,
    x: np.ndarray | None,
    report: Report,
    numeric_problems: Report,
    rows: dict[str, dict[str, Any]],
    pool: ThreadPoolExecutor,
    buffers: _CodeBuffers,
) -> None:
    """One layer, chunk by chunk: bitwise against ``source`` (when given) and the CPU
    product (when ``x`` is given), the artifact side as the kernel computes it (gather
    ``x[:, perm]``, ``(q - 8) * s`` summed per group, plus the group sums of ``x`` times
    ``delta``, over all ``layout_n`` columns), the reference from the source formula
    (or, without a source, from the artifact's own ``(q - 8) * s + delta`` per weight);
    the two are compared on the ``size_n`` real columns.

    Per chunk the artifact's codes are unpacked on ``pool`` while this thread reads the
    source's, and the two products run on ``pool`` while the next chunk is read.  The
    layer's problems are reported in one place, in the order: padding, permutation
    presence, codes, scales, delta, permutation values, bias."""
    name = rec.name
    row = rows[name]
    n, width = rec.size_n, rec.layout_n
    perm = np.asarray(art.tensor(f"{name}.{Suffix.PERM.value}")) if rec.act_order else None
    diffs = {
        "codes": _Diff(rec.size_k * n),
        "scales": _Diff(rec.shape.num_groups * n),
        "delta": _Diff(rec.shape.num_groups * n),
    }
    padding = {"codes": _PaddingDiff(PAD_CODE), "scales": _PaddingDiff(PAD_SCALE), "delta": _PaddingDiff(PAD_DELTA)}
    y = y_ref = xp = None
    if x is not None:
        y, y_ref = np.zeros((CPU_M, width), np.float32), np.zeros((CPU_M, width), np.float32)
        xp = x[:, perm] if perm is not None else x
    compared = source is not None and lay is not None
    first: QuantWeight | None = None
    pending: list[Future[None]] = []
    groups_done = 0
    for chunk in _artifact_chunks(art, rec):
        # This chunk is unpacked (into the buffer the chunk before last used, whose
        # products are done) and read from the source while the previous chunk's
        # products and comparison still run; those share y, y_ref and the diffs with this
        # chunk's, so they finish before this chunk's are queued.
        codes = pool.submit(unpack_b, chunk.b, width, out=buffers.next((chunk.k1 - chunk.k0, width)))
        # Where the source has its codes as packed words (4-bit GPTQ), they are compared
        # with the artifact's codes without being unpacked (_codes_and_reference).
        words: np.ndarray | None = None
        qw: QuantWeight | None = None
        if compared:
            assert source is not None and lay is not None
            fast = source.load_words(lay, chunk.k0, chunk.k1)
            words, qw = fast if fast is not None else (None, source.load_layer(lay, chunk.k0, chunk.k1))
        q = codes.result()
        for fut in pending:
            fut.result()
        pending = []
        # Drop the pages read so far, the artifact's and the source's: not earlier, as
        # the jobs just waited for read the source's words from its map.
        _release(source)
        # A per-channel layer hands its one group to every chunk: compare it once.
        skip = max(groups_done - chunk.g0, 0)
        groups_done = max(groups_done, chunk.g0 + chunk.scales.shape[0])
        if compared and rec.padded_n is not None:
            padding["codes"].check(q, rec, chunk.k0)
            padding["scales"].check(chunk.scales[skip:], rec, chunk.g0 + skip)
            padding["delta"].check(chunk.delta[skip:], rec, chunk.g0 + skip)
        if qw is not None:
            first = first or qw
            # The largest comparison runs beside the products; it only reads q.  From
            # words it is queued below, with the reference product that needs its result.
            if words is None:
                pending.append(pool.submit(diffs["codes"].compare, q[:, :n], qw.marlin_codes(), (chunk.k0, 0)))
            if skip < qw.num_groups:
                offset = (chunk.g0 + skip, 0)
                scales = np.asarray(qw.scales, dtype=np.float16)[skip:]
                diffs["scales"].compare(chunk.scales[skip:, :n], scales, offset)
                delta_src = np.asarray(qw.marlin_delta(), dtype=np.float32)[skip:]
                diffs["delta"].compare(chunk.delta[skip:, :n], delta_src, offset)
        if x is not None:
            assert xp is not None and y is not None and y_ref is not None
            xs = np.ascontiguousarray(xp[:, chunk.k0 : chunk.k1])
            s32 = chunk.scales.astype(np.float32)
            pending.append(
                pool.submit(accumulate, y, xs, q, rec.group_size, s32, MARLIN_ZERO, chunk.delta, factored=True)
            )
            if qw is not None and words is not None:
                pending.append(pool.submit(_codes_and_reference, diffs["codes"], words, q, qw, chunk.k0, y_ref, xs))
            elif qw is not None:
                xr = x[:, qw.perm[chunk.k0 : chunk.k1]] if qw.perm is not None else xs
                qs, a, c, b = _widened(qw, width)
                pending.append(pool.submit(accumulate, y_ref, xr, qs, rec.group_size, a, c, b, factored=False))
            else:
                pending.append(
                    pool.submit(accumulate, y_ref, xs, q, rec.group_size, s32, MARLIN_ZERO, chunk.delta, factored=False)
                )
        elif qw is not None and words is not None:
            pending.append(pool.submit(_codes_and_reference, diffs["codes"], words, q, qw, chunk.k0, None, None))
        del qw, words, chunk
    for fut in pending:
        fut.result()
    _release(source)
    if compared:
        assert first is not None
        if rec.padded_n is not None:
            for what, pad in padding.items():
                if pad.count:
                    report.add(
                        P.SOURCE_MISMATCH,
                        f"layer {name}: padding columns {n}..{width - 1} of {what} must all be {pad.value:g}; "
                        f"{pad.count} differ, first at {pad.first}",
                        name,
                    )
            row["padding_exact"] = not any(pad.count for pad in padding.values())
        if (perm is None) != (first.perm is None):
            report.add(
                P.SOURCE_MISMATCH,
                f"layer {name}: act-order permutation present in only one of artifact and source",
                name,
            )
        elif perm is not None and first.perm is not None:
            diffs["perm"] = _Diff(perm.size)
            diffs["perm"].compare(perm, np.asarray(first.perm), (0,))
        for what, diff in diffs.items():
            if diff.count:
                report.add(
                    P.SOURCE_MISMATCH, f"layer {name}: {what} not bit-identical to the source: {diff.message()}", name
                )
            row[f"{what}_exact"] = not diff.count
        if rec.has_bias:
            bias_name = f"{name}.{Suffix.BIAS.value}"
            raw = bytes(art.file.raw(bias_name))
            if first.bias is None or raw != np.ascontiguousarray(first.bias.data).tobytes():
                report.add(P.SOURCE_MISMATCH, f"{bias_name}: bias differs from the source", bias_name)
    if y is not None and y_ref is not None:
        err = relative_error(y[:, :n], y_ref[:, :n])
        row["cpu_rel_err"] = err
        if not err <= CPU_REL_TOL:
            numeric_problems.add(
                P.NUMERICS,
                f"layer {name}: CPU relative error {err:.3g} exceeds {CPU_REL_TOL:g}",
                name,
                CPU_REL_TOL,
                err,
            )


def _release(source: Source | None) -> None:
    """Drop the mapped pages of the artifact and the source (they stay in the page cache)."""
    release_mapped_pages()
    if source is not None:
        source.release_pages()

"""``marlin-verify``'s checks beyond structure: exact comparison with the source
(``--against``), CPU numerics, and (through ``converter.gpu``) GPU numerics.

Verification streams like conversion: layer by layer, in chunks of rows
(:func:`converter.convert.chunk_rows`), the artifact's and the source's tensors are read,
compared bitwise and multiplied, and the mapped pages of both are dropped before the
next chunk, so memory does not grow with the number of layers.  Stages, each named on
the progress bar: ``checksums`` (every tensor's xxh3-128), then per layer ``against
source`` and ``CPU numerics`` together (one read serves both), then GPU numerics.  The
source's sha256 (``source_differs``) is computed on a thread of its own from the start;
the CPU products of a chunk run on two more threads while the next chunk is read.

A padded layer is compared on its ``size_n`` real columns, and its padding columns
must be exactly code 8, scale 1.0 and delta +0.0; numerics use the real columns only.
A regrouped layer is read in chunks of whole source groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from .artifact.problems import Problem, ProblemCode, Report
from .artifact.reader import Artifact, open_artifact
from .artifact.schema import LayerEntry
from .artifact.validate import broken_layers, check_artifact
from .constants import (
    GPU_MEAN_REL_TOL,
    KERNEL_K_MULTIPLE,
    MARLIN_TILE,
    MARLIN_ZERO,
    PAD_CODE,
    PAD_DELTA,
    PAD_SCALE,
    Suffix,
)
from .digests import FileDigests
from .errors import ArtifactError, ConverterError, GpuUnavailableError
from .formats import open_source
from .formats.base import LayerPlan, Source, SourcePlan
from .formats.packing import first_code_diff, unpack_words
from .marlin.layout import unpack_b, unpermute_scales
from .native import lib as native_lib
from .numerics import ROWS, accumulate, relative_error
from .quant_weight import QuantWeight
from .safetensors_io import release_mapped_pages

#: Both sides of the CPU check are fp32; they differ only by fp32 rounding.
CPU_REL_TOL = 1e-5
#: Rows of random activations in the CPU check.
CPU_M = ROWS
#: Bytes of pass-through tensors compared at a time.
COMPARE_CHUNK_BYTES = 64 << 20
#: Pass-through chunks at least twice this size are compared in two halves on two threads.
SPLIT_COMPARE_BYTES = 1 << 20
#: How much smaller than the conversion's the chunks are with the compiled loops, and
#: with the NumPy code (no compiled loops).
COMPILED_CHUNK_DIVISOR = 2
NUMPY_CHUNK_DIVISOR = 4
P = ProblemCode


def unpack_layer(art: Artifact, rec: LayerEntry) -> dict[str, np.ndarray | None]:
    """Exact inverse of the conversion for one whole layer (the GPU check, tests).

    Returns:
        ``q`` uint8 ``(size_k, layout_n)`` in Marlin row order; ``scales`` float16
        ``(num_groups, layout_n)`` natural order; ``delta`` float32; ``perm`` int32 or
        None.  ``layout_n`` is ``padded_n`` for a padded layer: the columns from
        ``size_n`` on are its padding.
    """
    p = rec.name + "."
    return {
        "q": unpack_b(art.tensor(p + Suffix.B.value), rec.layout_n),
        "scales": unpermute_scales(art.tensor(p + Suffix.SCALES.value), single=rec.shape.num_groups == 1),
        "delta": np.asarray(art.tensor(p + Suffix.DELTA.value), dtype=np.float32),
        "perm": np.asarray(art.tensor(p + Suffix.PERM.value)) if rec.act_order else None,
    }


def artifact_weight(u: dict[str, np.ndarray | None], rec: LayerEntry) -> np.ndarray:
    """float32 ``(size_k, size_n)`` = ``(q - 8) * s + delta``, rows in SOURCE channel order
    (the real columns of a padded layer)."""
    g = np.arange(rec.size_k) // rec.group_size
    n = rec.size_n
    w = (u["q"][:, :n].astype(np.float32) - MARLIN_ZERO) * u["scales"][:, :n].astype(np.float32)[g] + u["delta"][g, :n]
    return _to_source_order(w, u["perm"])


def _to_source_order(w: np.ndarray, perm: np.ndarray | None) -> np.ndarray:
    if perm is None:
        return w
    out = np.empty_like(w)
    out[perm] = w
    return out


def _bits(a: np.ndarray) -> np.ndarray:
    # Bitwise comparison for floats: -0.0 vs 0.0 and NaN payloads count as different.
    return a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "f" else a


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    nat = native_lib()
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    if nat is not None and a.nbytes == b.nbytes:
        return nat.first_diff(a.view(np.uint8).reshape(-1), b.view(np.uint8).reshape(-1)) < 0
    return a.nbytes == b.nbytes and bool(np.array_equal(a.view(np.uint8), b.view(np.uint8)))


@dataclasses.dataclass
class _Diff:
    """Bitwise differences of one of a layer's quantities, gathered over its chunks."""

    size: int
    count: int = 0
    first: str = ""

    def compare(self, mine: np.ndarray, theirs: np.ndarray, offset: tuple[int, ...]) -> None:
        if _same_bytes(_bits(mine), _bits(theirs)):
            return
        bad = np.argwhere(_bits(mine) != _bits(theirs))
        if not self.first:
            idx = tuple(int(i) for i in bad[0])
            where = [i + o for i, o in zip(idx, offset, strict=True)]
            self.first = f"{where}: {mine[idx].item()} vs source {theirs[idx].item()}"
        self.count += len(bad)

    def message(self) -> str:
        return f"{self.count} of {self.size} differ; first at {self.first}"


@dataclasses.dataclass
class _PaddingDiff:
    """The padding columns ``[size_n, layout_n)`` of one quantity that are not ``value``
    (bitwise), gathered over the chunks."""

    value: float
    count: int = 0
    first: str = ""

    def check(self, a: np.ndarray, rec: LayerEntry, row0: int) -> None:
        pad = a[:, rec.size_n :]
        bad = np.argwhere(_bits(pad) != _bits(np.full_like(pad, self.value)))
        if bad.size:
            if not self.first:
                r, c = (int(i) for i in bad[0])
                self.first = f"[{row0 + r}, {rec.size_n + c}]: {pad[r, c].item()}"
            self.count += len(bad)


def verify(
    path: str | Path,
    *,
    shapes_only: bool = False,
    against: str | Path | None = None,
    gpu: bool | None = None,
    progress: Callable[[str, int], None] | None = None,
) -> Report:
    """Run ``marlin-verify``'s checks and return every problem found.

    Args:
        path: the artifact.
        shapes_only: structure and checksums only (plus ``against`` if given); no numerics.
        against: the source checkpoint, for exact comparison and a source reference.
        gpu: True forces GPU numerics (a problem if unavailable), False skips them,
            None runs them when CuPy and a GPU are present.
        progress: as for :func:`converter.convert.convert`: ``progress(stage, steps)``
            when a stage starts, ``progress("", 1)`` per step.

    Raises:
        ConverterError and subclasses: unreadable artifact or source (exit 2); an
            ``ArtifactError`` saying so when ``path`` is a source and ``against`` an
            artifact (the arguments swapped).
    """
    with ExitStack() as stack:
        try:
            art = stack.enter_context(open_artifact(path))
        except ArtifactError:
            if against is not None and _is_artifact(against):
                raise ArtifactError(
                    f"not an artifact, but --against {against} is one: the arguments are swapped; "
                    f"run marlin-verify {against} --against {path}",
                    path=path,
                ) from None
            raise
        source: Source | None = None
        digests: FileDigests | None = None
        if against is not None:
            source = stack.enter_context(open_source(against))
            digests = stack.enter_context(FileDigests(source.digest_files()))
        report = check_artifact(art, progress=progress)
        rows = {
            rec.name: {
                "name": rec.name,
                "size_k": rec.size_k,
                "size_n": rec.size_n,
                "group_size": rec.group_size,
                "bits": rec.bits,
                "symmetric": rec.symmetric,
                "act_order": rec.act_order,
                **({"source_group_size": rec.source_group_size} if rec.source_group_size is not None else {}),
                **({"padded_n": rec.padded_n} if rec.padded_n is not None else {}),
            }
            for rec in art.layers.values()
        }
        report.layers = list(rows.values())
        if any(p.code is P.SCHEMA_VIOLATION for p in report.problems):
            return report
        # Numbers computed from a structurally broken layer would only add noise (or
        # fail on the mismatched shapes): such layers are reported once, above.
        broken = broken_layers(report, set(art.layers))
        for name in broken:
            rows[name]["skipped"] = "structural problems (see problems)"
        numerics = not shapes_only
        compared: dict[str, LayerPlan] = {}
        if source is not None or numerics:
            compared = _layer_pass(art, source, digests, report, rows, broken, numerics, progress)
        if source is not None:
            report.checked["against"] = str(against)
        if shapes_only:
            return report
        report.checked["cpu_numerics"] = True
        if gpu is not False:
            _gpu_numerics(art, source, compared, report, rows, forced=bool(gpu), progress=progress, skip=broken)
    return report


def _is_artifact(path: str | Path) -> bool:
    """Whether ``path`` opens as a marlin-convert artifact (for the swapped-arguments hint)."""
    try:
        open_artifact(path).close()
    except ConverterError:
        return False
    return True


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


def _check_identity(art: Artifact, source: Source, digests: FileDigests, report: Report, at: int) -> None:
    """``source_differs`` (inserted where the source comparison starts) when the source
    files' sha256 are not those recorded at conversion."""
    assert art.manifest is not None
    recorded = {f.name: f.sha256 for f in art.manifest.source.files}
    actual = {f["name"]: f["sha256"] for f in source.describe(digests=digests.result())["files"]}
    changed = sorted(n for n in recorded.keys() & actual.keys() if recorded[n] != actual[n])
    if changed or not recorded.keys() & actual.keys():
        what = ", ".join(changed) if changed else "no file names in common"
        message = (
            f"the source is not the one this artifact was converted from (sha256 differs: {what}); "
            "the comparisons below will show where"
        )
        report.problems.insert(at, Problem(P.SOURCE_DIFFERS, message, str(source.path)))


def _compare_tensor_sets(art: Artifact, source: Source, plan: SourcePlan, report: Report) -> None:
    """The artifact holds exactly the layers and tensors a conversion of the source makes."""
    src_layers = {lay.name for lay in plan.layers if lay.convertible}
    for name in art.layers.keys() - src_layers:
        report.add(P.SOURCE_MISMATCH, f"layer {name} is in the artifact but not converted from the source", name)
    for name in src_layers - art.layers.keys():
        report.add(P.SOURCE_MISMATCH, f"layer {name} converts from the source but is missing from the artifact", name)
    from .convert import build_layout  # the conversion's own plan of the artifact

    expected = {n for n, _, _ in build_layout(plan, path=source.path)[0]}
    expected |= {i.name for i in plan.tensors} | set(plan.passthrough_reasons)
    for lay in plan.layers:
        if not lay.convertible:
            expected |= set(lay.source_tensors) | ({lay.bias.name} if lay.bias else set())
    present = set(art.file.infos)
    for name in sorted(expected - present):
        report.add(
            P.SOURCE_MISMATCH, f"{name}: a conversion of the source has this tensor; the artifact lacks it", name
        )
    for name in sorted(present - expected):
        report.add(
            P.SOURCE_MISMATCH, f"{name}: in the artifact, but a conversion of the source has no such tensor", name
        )


def _facts_agree(rec: LayerEntry, lay: LayerPlan, report: Report) -> bool:
    """Report every manifest fact of a layer that the source contradicts; values of
    differently shaped layers cannot be compared, so only agreeing layers go on."""
    facts = {
        "size_k": (rec.size_k, lay.size_k),
        "size_n": (rec.size_n, lay.size_n),
        "padded_n": (rec.padded_n, lay.padded_n),
        "group_size": (rec.group_size, lay.group_size),
        "source_group_size": (rec.source_group_size, lay.source_group_size),
        "bits": (rec.bits, lay.bits),
        "zero_convention": (rec.zero_convention.value, lay.zero_convention.value),
        "has_bias": (rec.has_bias, lay.bias is not None),
        "act_order": (rec.act_order, lay.act_order),
    }
    differ = [key for key, (mine, theirs) in facts.items() if mine != theirs]
    for key in differ:
        mine, theirs = facts[key]
        report.add(
            P.SOURCE_MISMATCH,
            f"layer {rec.name}: manifest says {key} = {mine}, the source gives {theirs}",
            rec.name,
            theirs,
            mine,
        )
    return not differ


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
    from .convert import CHUNK_CODE_BYTES, chunk_rows

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


def _codes_and_reference(
    diff: _Diff,
    words: np.ndarray,
    q: np.ndarray,
    qw: QuantWeight,
    k0: int,
    y_ref: np.ndarray | None,
    x: np.ndarray | None,
) -> None:
    """A chunk's codes against the source's 4-bit words (:meth:`Source.load_words`), then
    its reference product ``y_ref += x @ W_source`` when ``y_ref`` is given.

    ``q`` are the artifact's codes ``(rows, size_n)`` (an unpadded layer, natural row
    order), ``qw`` the chunk's scales and zeros (empty ``q``).  Where every code agrees
    the source's codes ARE ``q``, so the source formula is evaluated on ``q`` (the same
    numbers, bit for bit); otherwise the words are unpacked, the differences counted as
    :meth:`_Diff.compare` does, and the product uses the source's own codes."""
    src_q = q
    if first_code_diff(words, q, qw.bits) >= 0:
        src_q = unpack_words(words, qw.bits, axis=0)
        diff.compare(q, src_q, (k0, 0))
    if y_ref is not None:
        assert x is not None
        a, c, b = qw.source_formula()
        accumulate(y_ref, x, src_q, qw.group_size, a, c, b, factored=False)


def _widened(qw: QuantWeight, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | float, np.ndarray | None]:
    """The source chunk's codes and formula (:meth:`QuantWeight.source_formula`) with
    zero columns up to ``width`` (a padded layer's): scale 0 makes their weight 0."""
    a, c, b = qw.source_formula()
    extra = width - qw.size_n
    if not extra:
        return qw.q, a, c, b

    def wide(m: np.ndarray) -> np.ndarray:
        return np.pad(m, ((0, 0), (0, extra)))

    return wide(qw.q), wide(a), wide(c) if isinstance(c, np.ndarray) else c, None if b is None else wide(b)


def _compare_passthrough(
    art: Artifact, source: Source, name: str, report: Report, pool: ThreadPoolExecutor | None = None
) -> None:
    """A pass-through tensor's dtype, shape and bytes against the source's, in chunks;
    with ``pool``, each chunk's two halves on two of its threads (this runs after the
    layers, when the second core is otherwise idle)."""
    try:
        t = source.load_tensor(name)
    except (KeyError, ConverterError):
        report.add(P.SOURCE_MISMATCH, f"{name}: pass-through tensor not found in the source", name)
        return
    info = art.file.infos[name]
    if (info.dtype, info.shape) != (t.dtype, tuple(t.shape)):
        report.add(
            P.SOURCE_MISMATCH, f"{name}: {info.dtype} {list(info.shape)} vs source {t.dtype} {list(t.shape)}", name
        )
        return
    mine = np.frombuffer(art.file.raw(name), dtype=np.uint8)
    theirs = np.ascontiguousarray(t.data).reshape(-1).view(np.uint8) if t.data.size else np.zeros(0, np.uint8)
    same = mine.size == theirs.size
    for i in range(0, mine.size if same else 0, COMPARE_CHUNK_BYTES):
        a, b = mine[i : i + COMPARE_CHUNK_BYTES], theirs[i : i + COMPARE_CHUNK_BYTES]
        half = a.size // 2
        if pool is not None and half >= SPLIT_COMPARE_BYTES:
            parts = [pool.submit(_same_bytes, a[:half], b[:half]), pool.submit(_same_bytes, a[half:], b[half:])]
            same = all([f.result() for f in parts])
        else:
            same = _same_bytes(a, b)
        release_mapped_pages()
        source.release_pages()
        if not same:
            break
    if not same:
        report.add(P.SOURCE_MISMATCH, f"{name}: bytes differ from the source", name)


def _source_weight(qw: QuantWeight) -> np.ndarray:
    return _to_source_order(qw.source_weight(), qw.perm)


def _gpu_numerics(
    art: Artifact,
    source: Source | None,
    compared: dict[str, LayerPlan],
    report: Report,
    rows: dict[str, dict[str, Any]],
    *,
    forced: bool,
    progress: Callable[[str, int], None] | None,
    skip: set[str],
) -> None:
    try:
        from .gpu.runtime import require_gpu
        from .gpu.verify import verify_layer_gpu

        require_gpu()
    except (GpuUnavailableError, ImportError) as exc:
        msg = str(exc) if isinstance(exc, GpuUnavailableError) else f"GPU support is not installed ({exc})"
        if forced:
            report.add(P.GPU, f"--gpu given but {msg}")
        else:
            report.checked["gpu_numerics"] = f"skipped: {msg}"
        return
    if progress:
        progress("GPU numerics", len(art.layers))
    for name, rec in art.layers.items():
        if name in skip:
            continue
        if not rec.kernel_compatible:
            rows[name]["gpu"] = f"skipped: layer is outside our kernel's limits (K % {KERNEL_K_MULTIPLE} == 0)"
            report.add(P.GPU_SKIPPED, f"layer {name}: {rows[name]['gpu']}", name, severity="warning")
            continue
        # One layer at a time, its source read again: nothing is held across layers.
        u = unpack_layer(art, rec)
        if source is not None and name in compared:
            w_ref = _source_weight(source.load_layer(compared[name]))
        else:
            w_ref = artifact_weight(u, rec)
        p = name + "."
        res = verify_layer_gpu(
            np.asarray(art.tensor(p + Suffix.B.value)),
            np.asarray(art.tensor(p + Suffix.SCALES.value)),
            u["delta"],
            u["perm"],
            rec.size_k,
            rec.layout_n,
            rec.group_size,
            w_ref,
            n_out=rec.size_n,
        )
        del u, w_ref
        release_mapped_pages()
        if source is not None:
            source.release_pages()
        per_m = {str(m): v for m, v in res.items() if m != "ok"}
        rows[name]["gpu"] = {
            "mean_rel_err": max(max(v["mean_rel_err"], v.get("two_kernel_mean_rel_err", 0.0)) for v in per_m.values()),
            "max_rel_err": max(max(v["max_rel_err"], v.get("two_kernel_max_rel_err", 0.0)) for v in per_m.values()),
            "deterministic": all(
                v["deterministic"] and v.get("two_kernel_deterministic", True) for v in per_m.values()
            ),
            "unit_major_same": all(v.get("unit_major_same", True) for v in per_m.values()),
            "ok": bool(res["ok"]),
            "per_m": per_m,
        }
        if not res["ok"]:
            g = rows[name]["gpu"]
            report.add(
                P.GPU_NUMERICS,
                f"layer {name}: GPU mean relative error {g['mean_rel_err']:.3g} (limit {GPU_MEAN_REL_TOL:g}), "
                f"deterministic over repeats: {g['deterministic']}"
                + ("" if g["unit_major_same"] else "; B unit-major (as MarlinLinear serves it) gives other bits"),
                name,
                GPU_MEAN_REL_TOL,
                g["mean_rel_err"],
            )
        if progress:
            progress("", 1)
    report.checked["gpu_numerics"] = True

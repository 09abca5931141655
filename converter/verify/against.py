"""``--against``: what must equal the source bit for bit: the source's identity, the set
of layers and tensors, each layer's manifest facts, pass-through bytes, and the
per-quantity differences of a layer's chunks (:class:`_Diff`, :class:`_PaddingDiff`)."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..artifact.problems import Problem, ProblemCode, Report
from ..artifact.reader import Artifact
from ..artifact.schema import LayerEntry
from ..digests import FileDigests
from ..errors import ConverterError
from ..formats.base import LayerPlan, Source, SourcePlan
from ..native import lib as native_lib
from ..safetensors_io import release_mapped_pages

#: Bytes of pass-through tensors compared at a time.
COMPARE_CHUNK_BYTES = 64 << 20
#: Pass-through chunks at least twice this size are compared in two halves on two threads.
SPLIT_COMPARE_BYTES = 1 << 20


P = ProblemCode


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
    # Sorted, as the tensors below: a set's order changes from run to run.
    for name in sorted(art.layers.keys() - src_layers):
        report.add(P.SOURCE_MISMATCH, f"layer {name} is in the artifact but not converted from the source", name)
    for name in sorted(src_layers - art.layers.keys()):
        report.add(P.SOURCE_MISMATCH, f"layer {name} converts from the source but is missing from the artifact", name)
    from ..convert.plan import build_layout  # the conversion's own plan of the artifact

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

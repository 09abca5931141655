"""Source checkpoint -> Marlin artifact, streaming tensor by tensor.

Flow: ``plan`` (metadata and small tensors only; every check that can fail on the
input runs here, before anything is written), then stream each layer in K chunks
through :func:`~converter.marlin.layout.pack_b` into an
:class:`~converter.artifact.writer.ArtifactWriter` (one file, shards or a model
folder; temporary files, fsync, rename), hashing every tensor's bytes on the way.

A padded layer (``LayerPlan.padded_n``) gets its zero columns here, where the layout is
written: code 8, scale 1, delta 0 (``PAD_CODE``, ``PAD_SCALE``, ``PAD_DELTA`` in
:mod:`converter.constants`).  A regrouped layer arrives from its reader already at the
artifact's group size (:meth:`~converter.formats.base.LayerPlan.source_group_rows`).

Three threads share the work (docs/performance-cpu.md): the main one reads and packs
(the compiled packer releases the GIL), a write-behind thread hashes and writes the
chunks while the next is packed (splicing them into the file, copying pass-through
tensors file to file, and starting the disk's write-back as it goes), and one computes
the sha256 of the input files for the manifest from the start (overlapping planning,
when the second core is otherwise idle); the manifest is sized with placeholder
digests and sealed with the real ones last, so nothing waits for the hash before the
output checks have passed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from .artifact.hf_config import copied_files, file_checksums, folder_extras
from .artifact.manifest import layer_entry, new_manifest
from .artifact.schema import LayerEntry, Manifest, Passthrough, SourceInfo, from_json
from .artifact.shards import Layout, oversize_warnings, parse_size, plan_shards
from .artifact.target import InputGuard, OutputTarget
from .artifact.writer import ArtifactWriter
from .constants import (
    CHECKSUM_HEX_LEN,
    MARLIN_TILE,
    PACKED_ROW_BLOCK,
    PAD_CODE,
    PAD_DELTA,
    PAD_SCALE,
    SAFETENSORS_METADATA_KEY,
    Suffix,
)
from .digests import FileDigests
from .dtypes import nbytes
from .errors import ConfigError, SourceFormatError, UnsupportedQuantError
from .formats import open_source
from .formats.base import LayerPlan, Source, SourcePlan
from .jsonio import non_finite_path
from .marlin.layout import pack_b, permute_scales
from .marlin.shapes import LayerShape, marlin_shapes
from .safetensors_io import SafetensorsFile, StreamingWriter, release_mapped_pages

#: Bytes of uint8 codes unpacked at a time; bounds peak memory per layer.
CHUNK_CODE_BYTES = 24 << 20
#: Bytes copied at a time for pass-through tensors.
COPY_CHUNK_BYTES = 64 << 20
PLAIN_REASON = "not a quantized linear layer"

Progress = Callable[[str, int], None]


@dataclasses.dataclass(frozen=True)
class NotConverted:
    """A quantized layer that passes through: its name, why (the shape or format rule
    with the numbers), and its tensors (bias included), each listed in ``passthrough``."""

    name: str
    reason: str
    tensors: tuple[str, ...]


@dataclasses.dataclass
class ConvertReport:
    """What a conversion did (or, for a dry run, would do).

    Attributes:
        source: input path; output: artifact path (planned, for a dry run).
        source_format: detected format.
        converted: manifest records of the converted layers (``source_group_size`` set on a
            regrouped layer, ``padded_n`` on a padded one).
        passthrough: every carried-over tensor, with its reason.
        not_converted: the quantized layers among them.
        tensors: ``[(name, dtype, shape)]`` of the artifact.
        bytes_out: size of the tensor data written (or planned).
        dry_run: True when nothing was written.
        files: ``[{"name", "bytes"}]`` of every file written (or planned): the shards,
            folder mode's extra files, the index last.
        warnings: findings about the conversion as a whole.
    """

    source: str
    output: str | None
    source_format: str
    converted: list[LayerEntry]
    passthrough: list[Passthrough]
    tensors: list[tuple[str, str, tuple[int, ...]]]
    bytes_out: int
    dry_run: bool
    not_converted: list[NotConverted] = dataclasses.field(default_factory=list)
    files: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        # asdict would first deep-copy the per-tensor lists, replaced just below.
        d = dataclasses.asdict(dataclasses.replace(self, converted=[], passthrough=[], tensors=[], not_converted=[]))
        d["converted"] = [lay.to_json() for lay in self.converted]
        d["passthrough"] = [p.to_json() for p in self.passthrough]
        d["not_converted"] = [
            {"name": s.name, "reason": s.reason, "tensors": list(s.tensors)} for s in self.not_converted
        ]
        d["tensors"] = [{"name": n, "dtype": t, "shape": list(s)} for n, t, s in self.tensors]
        d["ok"] = True
        return d


def layer_tensor_names(layer: LayerPlan) -> dict[Suffix, tuple[str, tuple[int, ...], str]]:
    """``{suffix: (artifact name, shape, dtype)}`` for a convertible layer."""
    shapes = marlin_shapes(
        LayerShape(layer.size_k, layer.size_n, layer.group_size, layer.padded_n),
        act_order=layer.act_order,
        bias_dtype=layer.bias.dtype if layer.bias else None,
    )
    return {suf: (f"{layer.name}.{suf.value}", shape, dtype) for suf, (dtype, shape) in shapes.items()}


def build_layout(plan: SourcePlan, *, path: Path) -> tuple[Layout, list[LayerEntry], list[Passthrough]]:
    """The artifact's tensors, layer records and pass-through list.

    Raises:
        SourceFormatError: two artifact tensors would get the same name.
    """
    layout: Layout = []
    layers: list[LayerEntry] = []
    passthrough: list[Passthrough] = []
    for layer in plan.layers:
        if layer.convertible:
            layers.append(layer_entry(layer))
            for name, shape, dtype in layer_tensor_names(layer).values():
                layout.append((name, dtype, shape))
    for layer in plan.layers:
        if not layer.convertible:
            for t in layer.source_tensors + ((layer.bias.name,) if layer.bias else ()):
                passthrough.append(Passthrough(t, plan.passthrough_reasons.get(t, layer.reason)))
    for info in plan.tensors:
        passthrough.append(Passthrough(info.name, plan.passthrough_reasons.get(info.name, PLAIN_REASON)))
    known = {n for n, _, _ in layout}
    for entry in passthrough:
        if entry.name == SAFETENSORS_METADATA_KEY:
            raise SourceFormatError(
                f"a tensor may not be named {SAFETENSORS_METADATA_KEY!r}: safetensors reserves it; "
                "rename it in the source",
                path=path,
                tensor=entry.name,
            )
        if entry.name in known:
            raise SourceFormatError(
                "tensor name collides with a converted layer's artifact tensor; rename it in the source",
                path=path,
                tensor=entry.name,
            )
        known.add(entry.name)
    return layout, layers, passthrough


def _passthrough_infos(source: Source, plan: SourcePlan, names: list[str]) -> list[tuple[str, str, tuple[int, ...]]]:
    infos = {i.name: i for i in plan.tensors}
    out = []
    for name in names:
        info = infos.get(name)
        if info is None:
            t = source.load_tensor(name)
            out.append((name, t.dtype, tuple(t.shape)))
        else:
            out.append((name, info.dtype, tuple(info.shape)))
    return out


def chunk_rows(size_k: int, width: int, group_size: int, budget: int | None = None) -> int:
    """Rows of a layer read and packed (or verified) at a time: about ``budget`` bytes of
    codes (default :data:`CHUNK_CODE_BYTES`) over ``width`` columns, starting on
    boundaries of ``group_size`` rows (the source's groups; any 16-row boundary when
    per-channel) and on 32-row boundaries, so 2- and 3-bit words are never split."""
    unit = math.lcm(MARLIN_TILE if group_size >= size_k else group_size, PACKED_ROW_BLOCK)
    budget = CHUNK_CODE_BYTES if budget is None else budget
    rows = max(unit, (budget // max(width, 1)) // unit * unit)
    return min(rows, size_k)


def _chunk_rows(layer: LayerPlan) -> int:
    return chunk_rows(layer.size_k, layer.layout_n, layer.source_group_size or layer.group_size)


def _padded(a: np.ndarray, layer: LayerPlan, value: float) -> np.ndarray:
    """``a`` ``(rows, size_n)`` widened to ``(rows, padded_n)`` with ``value`` (same
    dtype); ``a`` itself when the layer is not padded."""
    if layer.padded_n is None:
        return a
    return np.pad(a, ((0, 0), (0, layer.padded_n - layer.size_n)), constant_values=value)


def convert(
    src_path: str | Path,
    out_path: str | Path,
    *,
    force: bool = False,
    dry_run: bool = False,
    progress: Progress | None = None,
    max_shard_size: int | str | None = None,
    pad: bool = True,
) -> ConvertReport:
    """Convert a checkpoint into one Marlin safetensors artifact.

    Args:
        src_path: ``.tinyloop`` file, or HF GPTQ folder / ``.safetensors`` / index.
        out_path: artifact path (``.safetensors``); any other path (an existing
            folder, a path ending in ``/``, or a name without that suffix, as with
            ``save_pretrained``) selects folder mode (``model.safetensors`` plus
            ``config.json`` and tokenizer files; see ``artifact/writer.py``).
        force: overwrite an existing output.
        max_shard_size: bytes (an int, or a string with its unit: ``"5GB"``) of tensor
            data per file; more data is written as HF shards plus
            ``<stem>.safetensors.index.json``. A layer (or tensor) larger than that gets
            a shard of its own, with a warning naming it.
        dry_run: plan and report, write nothing.
        pad: convert a layer whose N is not a multiple of 64 with its N padded
            (recorded as ``padded_n``); False passes it through.
        progress: called as ``progress(description, total_steps)`` once, then
            ``progress("", 1)`` per step.

    Returns:
        A :class:`ConvertReport`.

    Raises:
        ConverterError and subclasses: bad input (nothing is written), an existing
            output without ``force``, an output that would overwrite the input, or an
            output that cannot be written (a read-only folder, too little free space,
            the file-size or open-files limit), found without waiting for the input's
            sha256 (which runs in the background from the start, and is stopped).
        UnsupportedQuantError: the source has no quantized layer at all.
    """
    out_arg = out_path  # as given: Path() drops the trailing "/" that selects folder mode
    src_path = Path(src_path)
    if progress:
        progress(f"planning {src_path.name}", 1)
    with open_source(src_path) as source, contextlib.ExitStack() as stack:
        # Each input file's identity and state as first read: an input rewritten in place
        # while it is converted is refused before the commit (:meth:`InputStats.recheck`).
        stats = InputStats(source.input_files())
        # The input's sha256 (for the manifest) starts now, on its own thread, so that it
        # overlaps planning and conversion; it is read only when the manifest is sealed,
        # so an error in planning or in the output checks comes as early as without it
        # (and stops the thread). A dry run hashes nothing.
        digests = None if dry_run else stack.enter_context(FileDigests(source.digest_files()))
        plan = source.plan(pad=pad)
        if not plan.layers:
            raise UnsupportedQuantError(
                f"no quantized layers: the {source.format.value} checkpoint has no {source.layer_anchor}, so "
                "nothing would be converted; is it quantized (or already converted)?",
                path=src_path,
            )
        layout, layers, passthrough = build_layout(plan, path=src_path)
        layout += _passthrough_infos(source, plan, [p.name for p in passthrough])
        # Placeholder digests of the right length size the manifest now.
        desc = source.describe(digests=False)
        _refuse_non_finite(source, desc)
        _refuse_non_finite_bias(source, plan)
        bytes_out = sum(nbytes(d, s) for _, d, s in layout)
        max_bytes = parse_size(max_shard_size) if max_shard_size is not None else None
        shards = plan_shards(layout, [lay.name for lay in layers], max_bytes)
        target = OutputTarget(out_arg)
        artifact_path = target.path if len(shards) == 1 else target.index
        copied = list(copied_files(source).values()) if target.directory else []
        stats.add(copied)
        extras = folder_extras(source, desc, layers, artifact_path.name) if target.directory else {}
        guard = InputGuard([*source.input_files(), *copied], source.checkpoint_folder)
        # A dry run checks the output too, so it fails exactly when the real run would.
        target.check(guard, force, count=len(shards), extra_names=extras, create=not dry_run)
        # Placeholder checksums of the final length size the headers before any data; the
        # same map is filled with the real ones as the tensors are written (one map of
        # every tensor, one placeholder string: issue 42).
        manifest = new_manifest(desc, layers, passthrough, files=file_checksums(extras))
        checksums = dict.fromkeys((n for n, _, _ in layout), _PLACEHOLDER)
        manifest = dataclasses.replace(manifest, checksums=dataclasses.replace(manifest.checksums, tensors=checksums))
        reserves = ArtifactWriter.header_reserves(target, shards, manifest)  # each manifest text built once
        sizes = ArtifactWriter.file_sizes(target, shards, manifest, extras, reserves=reserves)
        try:
            target.preflight(sizes, artifact=artifact_path, inputs=len(source.input_files()))
        except BaseException:
            target.discard_created()
            raise
        report = ConvertReport(
            str(src_path),
            str(out_path),
            source.format.value,
            layers,
            passthrough,
            layout,
            bytes_out,
            dry_run,
            [
                NotConverted(lay.name, lay.reason, lay.source_tensors + ((lay.bias.name,) if lay.bias else ()))
                for lay in plan.layers
                if not lay.convertible
            ],
            files=[{"name": p.name, "bytes": n} for p, n in sizes.items()],
            warnings=_plan_warnings(plan, layers)
            + oversize_warnings(
                shards,
                [p.name for p in target.shard_paths(len(shards))],
                max_bytes,
                max_shard_size.strip() if isinstance(max_shard_size, str) else f"{max_shard_size} B",
            ),
        )
        if progress:
            progress("", 1)
        if digests is None:
            return report
        _write(source, plan, manifest, reserves, target, shards, guard, extras, digests, report, progress, stats)
    return report


#: The placeholder checksum (of the final length) of every tensor until it is written.
_PLACEHOLDER = "0" * CHECKSUM_HEX_LEN


def _write(
    source: Source,
    plan: SourcePlan,
    manifest: Manifest,
    reserves: list[int],
    target: OutputTarget,
    shards: list[Layout],
    guard: InputGuard,
    extras: dict[str, bytes | Path],
    digests: FileDigests,
    report: ConvertReport,
    progress: Progress | None,
    stats: InputStats,
) -> None:
    """Write the planned artifact: the layers, then the pass-through tensors, then the
    manifest sealed with the tensors' checksums (filled into ``manifest``'s placeholder
    map, in place) and the input's sha256."""
    steps = len(report.converted) + len(report.passthrough)
    if progress:
        progress(f"converting {Path(report.source).name}", steps)
    with ArtifactWriter(target, shards, manifest, guard=guard, extra_files=extras, reserves=reserves) as writer:
        report.output = str(writer.artifact_path)
        sums = manifest.checksums.tensors
        planned = len(sums)
        # One write-behind pool for all layers and pass-through tensors, so the pipeline
        # never drains between them; the digests are read once it has written everything.
        behind = _WriteBehind(writer)
        hashers: dict[str, Any] = {}
        # Descriptors of the input files that pass-through bytes are copied from (one
        # per file, closed once every copy is done).
        fds: dict[Path, int] = {}
        try:
            for layer in plan.layers:
                if layer.convertible:
                    hashers.update(_write_layer(source, layer, writer, behind))
                    if progress:
                        progress("", 1)
            small = _SmallTensors(behind)
            for entry in report.passthrough:
                tensor = source.load_tensor(entry.name)
                if tensor.data.nbytes <= SMALL_TENSOR_BYTES:
                    # hashed now, written in batches: no thread hand-off, map check or page
                    # release per tensor (400 k one-byte tensors stay linear and quick)
                    sums[tensor.name] = small.add(tensor.name, tensor.data)
                else:
                    where = _copy_source(source, tensor.name, tensor.data.nbytes, fds)
                    h = _copy_tensor(behind, tensor.name, tensor.data, source.release_pages, where)
                    sums[tensor.name] = h.hexdigest()  # hashed on this thread: complete now
                if progress:
                    progress("", 1)
            small.flush()
            source.release_pages()
            release_mapped_pages()
        finally:
            try:
                behind.close()
            finally:
                for fd in fds.values():
                    os.close(fd)
        for n, h in hashers.items():
            sums[n] = h.hexdigest()
        del hashers
        unsealed = next((n for n, v in sums.items() if v is _PLACEHOLDER), None)
        if unsealed is not None or len(sums) != planned:
            raise AssertionError(f"tensor {unsealed!r} was not written")  # a bug of ours, never an input's
        stats.recheck()  # after the last read
        hashed = digests.result()
        stats.recheck()  # after hashing: the sha256 is of the bytes that were converted
        manifest = dataclasses.replace(
            manifest, source=from_json(SourceInfo, source.describe(digests=hashed), "source")
        )
        writer.finish(manifest)


class InputStats:
    """Size, modification time and identity (device, inode) of every input file, taken
    when the input is opened; :meth:`recheck` refuses any change since.  An input
    rewritten in place (or replaced) during a conversion would otherwise give an
    artifact whose codes come from the old bytes and whose sha256 from the new."""

    def __init__(self, paths: list[Path]) -> None:
        self._stats: dict[Path, tuple[int, int, int, int] | None] = {}
        self.add(paths)

    @staticmethod
    def _stat(path: Path) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            return None
        return st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino

    def add(self, paths: list[Path]) -> None:
        for p in paths:
            self._stats.setdefault(Path(p), self._stat(Path(p)))

    def recheck(self) -> None:
        """Raises:
        SourceFormatError: a file's size, mtime or inode changed (or it vanished)."""
        for path, before in self._stats.items():
            now = self._stat(path)
            if now == before:
                continue
            what = (
                "was deleted"
                if now is None
                else "was replaced by another file"
                if before is None or now[2:] != before[2:]
                else f"changed size ({before[0]} -> {now[0]} bytes)"
                if now[0] != before[0]
                else "was modified (its mtime changed)"
            )
            raise SourceFormatError(
                f"{what} while being converted; nothing was written: convert it again once nothing writes to it",
                path=path,
            )


def _refuse_non_finite(source: Source, desc: dict[str, Any]) -> None:
    """The manifest records the quant config as found, and is standard JSON: a NaN or an
    infinity in it (Python's json reads them) is refused by name."""
    where = non_finite_path(desc.get("quant_config"))
    if where is not None:
        raise ConfigError(
            f"field {where} is NaN or infinite, which standard JSON cannot hold; the artifact's manifest "
            "records the quant config and must be standard JSON: fix the value",
            path=getattr(source, "cfg_path", source.path),
        )


def _refuse_non_finite_bias(source: Source, plan: SourcePlan) -> None:
    """A converted layer's bias goes into the kernels' epilogue, added to every output
    row: a NaN or infinity there is refused by name before anything is written (scales
    and zeros are checked by the readers' plans)."""
    for lay in plan.layers:
        if not (lay.convertible and lay.bias is not None):
            continue
        bad = source.load_tensor(lay.bias.name).non_finite()
        if bad:
            ckpt = getattr(source, "ckpt", None)
            raise SourceFormatError(
                f"{bad} NaN or Inf value(s); a converted layer's bias must be finite (the kernels add it to "
                "every output row)",
                path=ckpt.file_of(lay.bias.name) if ckpt is not None else source.path,
                tensor=lay.bias.name,
            )
    source.release_pages()


def _plan_warnings(plan: SourcePlan, layers: list[LayerEntry]) -> list[str]:
    """Findings about the conversion as a whole (layer findings are in each layer's record)."""
    if not layers:
        return [
            f"none of the {len(plan.layers)} quantized layers converts (each passes through with its reason, "
            "listed above): the artifact holds the source's tensors unchanged"
        ]
    return []


class _WriteBehind:
    """Writes chunks on a background thread while the next chunk is computed.

    One writer thread: ext4 serializes buffered writes to one file (the inode lock), so
    a second writer only spun on that lock (``rwsem_spin_on_owner``, ~3% of a
    conversion's CPU), and with the computed chunks spliced (``atomic.splice_write``)
    one thread keeps up.  It also hashes the computed chunks, in submission order,
    which takes xxh3 (0.2-0.35 s per 2.1 GB) off the packing thread, the busier one.
    Pass-through bytes, views of an input's map that the caller drops next, are hashed
    on the calling thread.  At most :data:`DEPTH` jobs are in flight (bounded memory);
    a failure re-raises on the next call.
    """

    DEPTH = 2

    def __init__(self, writer: StreamingWriter) -> None:
        self._writer = writer
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="marlin-write")
        self._pending: deque[Future[None]] = deque()

    def submit(self, jobs: list[tuple[str, np.ndarray, int, Any]], *, flat: bool = False) -> None:
        """Queue ``[(tensor, data, first row (or element, when flat), hasher)]``: hashed
        and written on the writer thread, or, when ``flat`` (pass-through bytes from a
        map), hashed now and written there."""
        if flat:
            for _, data, _, hasher in jobs:
                hasher.update(data)
        self._queue(self._run, jobs, flat)

    def submit_copy(self, name: str, data: np.ndarray, start: int, hasher: Any, where: _CopySource) -> None:
        """Hash ``data`` (elements ``start..`` of pass-through tensor ``name``, a view of
        its input file), then queue the copy of the same bytes file to file
        (:meth:`StreamingWriter.copy_flat`), or their write where that cannot copy."""
        hasher.update(data)
        self._queue(self._copy, name, data, start, where)

    def _queue(self, fn: Callable[..., None], *args: Any) -> None:
        while len(self._pending) >= self.DEPTH:
            self._pending.popleft().result()
        self._pending.append(self._pool.submit(fn, *args))

    def _copy(self, name: str, data: np.ndarray, start: int, where: _CopySource) -> None:
        byte_start = start * data.itemsize
        done = self._writer.copy_flat(name, where.fd, where.begin + byte_start, byte_start, data.nbytes)
        if done is None:  # the kernel cannot copy between these files
            self._writer.write_flat(name, data, start)
        elif done < data.nbytes:  # the input ended early: truncated by another program meanwhile
            where.file.check_size(os.fstat(where.fd).st_size)
            raise SourceFormatError(
                f"ended {data.nbytes - done} bytes early while being read; nothing was written", path=where.file.path
            )

    def _run(self, jobs: list[tuple[str, np.ndarray, int, Any]], flat: bool) -> None:
        for name, data, start, hasher in jobs:
            if flat:
                self._writer.write_flat(name, data, start)
            else:
                hasher.update(data)  # one writer thread: jobs run, and hash, in order
                self._writer.write(name, data, start)

    def _write_batch(self, jobs: list[tuple[str, np.ndarray, int, Any]]) -> None:
        for name, data, start, _ in jobs:
            self._writer.write_flat(name, data, start)

    def wait(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)


def _write_layer(source: Source, layer: LayerPlan, writer: StreamingWriter, behind: _WriteBehind) -> dict[str, Any]:
    """Queue one layer's tensors on ``behind``; returns ``{name: xxh3 hasher}``, complete
    once ``behind`` has been waited for."""
    names = {suf: n for suf, (n, _, _) in layer_tensor_names(layer).items()}
    hashers = {suf: xxhash.xxh3_128() for suf in names}
    step = _chunk_rows(layer)
    groups_done = 0
    for k0 in range(0, layer.size_k, step):
        k1 = min(k0 + step, layer.size_k)
        packed = source.load_packed(layer, k0, k1) if layer.padded_n is None else None
        if packed is None:
            qw = source.load_layer(layer, k0, k1)
            b = pack_b(_padded(qw.marlin_codes(), layer, PAD_CODE))
        else:  # same bits, without materialising the uint8 codes (4-bit: no code offset)
            b, qw = packed
        jobs: list[tuple[str, np.ndarray, int, Any]] = [(names[Suffix.B], b, k0 // MARLIN_TILE, hashers[Suffix.B])]
        g0 = k0 // layer.group_size
        # A per-channel layer returns its one group with every chunk: write it once.
        skip = max(groups_done - g0, 0)
        if skip < qw.num_groups:
            s = permute_scales(_padded(qw.scales[skip:], layer, PAD_SCALE), single=layer.num_groups == 1)
            delta = np.ascontiguousarray(_padded(qw.marlin_delta()[skip:], layer, PAD_DELTA), dtype=np.float32)
            jobs.append((names[Suffix.SCALES], s, g0 + skip, hashers[Suffix.SCALES]))
            jobs.append((names[Suffix.DELTA], delta, g0 + skip, hashers[Suffix.DELTA]))
            groups_done = g0 + qw.num_groups
        if k0 == 0:
            if Suffix.PERM in names:
                perm = np.ascontiguousarray(qw.perm, dtype=np.int32)
                jobs.append((names[Suffix.PERM], perm, 0, hashers[Suffix.PERM]))
            if Suffix.BIAS in names:
                assert qw.bias is not None
                jobs.append((names[Suffix.BIAS], np.array(qw.bias.data), 0, hashers[Suffix.BIAS]))
        behind.submit(jobs)
        del qw, packed
        # Drop the input pages this chunk touched: they would otherwise stay in RSS.
        release_mapped_pages()
        source.release_pages()  # readers with maps of their own (.tinyloop)
    return {names[s]: h for s, h in hashers.items()}


#: A pass-through tensor this small (bytes) is written in a batch with others (:class:`_SmallTensors`).
SMALL_TENSOR_BYTES = 64 << 10
#: Bytes of small tensors gathered before the batch is queued.
SMALL_BATCH_BYTES = 4 << 20
#: Tensors gathered before the batch is queued.
SMALL_BATCH_COUNT = 4096


class _SmallTensors:
    """Small pass-through tensors, hashed at once and written in batches on the
    write-behind thread: per tensor only a copy of its bytes and its digest are kept,
    and the batch in flight is bounded (:data:`SMALL_BATCH_BYTES`, :data:`SMALL_BATCH_COUNT`)."""

    def __init__(self, behind: _WriteBehind) -> None:
        self._behind = behind
        self._jobs: list[tuple[str, np.ndarray, int, Any]] = []
        self._bytes = 0

    def add(self, name: str, data: np.ndarray) -> str:
        """Queue ``data`` (the whole tensor) for writing; returns its xxh3-128 hex digest."""
        flat = np.array(data.reshape(-1) if data.size else data.reshape(0), copy=True)
        digest = xxhash.xxh3_128_hexdigest(flat)
        if flat.nbytes:
            self._jobs.append((name, flat, 0, None))
            self._bytes += flat.nbytes
            if self._bytes >= SMALL_BATCH_BYTES or len(self._jobs) >= SMALL_BATCH_COUNT:
                self.flush()
        return digest

    def flush(self) -> None:
        if self._jobs:
            jobs, self._jobs, self._bytes = self._jobs, [], 0
            self._behind._queue(self._behind._write_batch, jobs)


@dataclasses.dataclass(frozen=True)
class _CopySource:
    """A pass-through tensor's bytes in an input file: ``[begin, ...)`` of ``fd``, a
    descriptor of ``file``."""

    file: SafetensorsFile
    fd: int
    begin: int


def _copy_source(source: Source, name: str, nbytes: int, fds: dict[Path, int]) -> _CopySource | None:
    """Where pass-through tensor ``name``'s bytes can be copied from file to file, or None
    (a reader without such files, or an empty tensor); opens the file once into ``fds``."""
    stored = source.stored_bytes(name)
    if stored is None or not nbytes:
        return None
    file, begin, end = stored
    if end - begin != nbytes:  # not the bytes load_tensor returns: write those instead
        return None
    if file.path not in fds:
        fds[file.path] = file.open_data()
    return _CopySource(file, fds[file.path], begin)


def _copy_tensor(
    behind: _WriteBehind,
    name: str,
    data: np.ndarray,
    release: Callable[[], None],
    where: _CopySource | None = None,
) -> Any:
    """Queue a pass-through tensor's bytes on ``behind`` in chunks; returns its xxh3
    hasher, complete once ``behind`` has been waited for.

    With ``where`` (its bytes in an input file) each chunk is hashed from the map here
    and copied inside the kernel (``copy_file_range``, as ``cp`` does), instead of
    written from the map: on the CI-class VM the in-kernel copy of the 2.1 GB benchmark
    checkpoint's 0.52 GB of pass-through tensors took 0.17 s of CPU against 0.30 s for
    ``pwrite`` from the map (whose pages, dropped after hashing, fault in again)."""
    h = xxhash.xxh3_128()
    flat = data.reshape(-1) if data.size else data.reshape(0)
    step = max(1, COPY_CHUNK_BYTES // max(flat.itemsize, 1))
    for i in range(0, flat.size, step):
        part = np.ascontiguousarray(flat[i : i + step])
        if where is None:
            behind.submit([(name, part, i, h)], flat=True)
        else:
            behind.submit_copy(name, part, i, h, where)
        release_mapped_pages()
        release()
    return h

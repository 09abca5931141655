"""The write loop: each layer read and packed chunk by chunk, hashed and written on a
write-behind thread, then the pass-through tensors (small ones in batches, large ones
copied file to file), then the manifest sealed with the checksums."""

from __future__ import annotations

import dataclasses
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ..artifact.schema import Manifest, SourceInfo, from_json
from ..artifact.shards import Layout
from ..artifact.target import InputGuard, OutputTarget
from ..artifact.writer import ArtifactWriter
from ..constants import CHECKSUM_HEX_LEN, MARLIN_TILE, PAD_CODE, PAD_DELTA, PAD_SCALE, Suffix
from ..digests import FileDigests
from ..errors import SourceFormatError
from ..formats.base import LayerPlan, Source, SourcePlan
from ..marlin.layout import pack_b, permute_scales
from ..safetensors_io import SafetensorsFile, StreamingWriter, release_mapped_pages
from .plan import InputStats, chunk_rows, layer_tensor_names
from .report import ConvertReport, Progress

#: Bytes copied at a time for pass-through tensors.
COPY_CHUNK_BYTES = 64 << 20


def _chunk_rows(layer: LayerPlan) -> int:
    return chunk_rows(layer.size_k, layer.layout_n, layer.source_group_size or layer.group_size)


def _padded(a: np.ndarray, layer: LayerPlan, value: float) -> np.ndarray:
    """``a`` ``(rows, size_n)`` widened to ``(rows, padded_n)`` with ``value`` (same
    dtype); ``a`` itself when the layer is not padded."""
    if layer.padded_n is None:
        return a
    return np.pad(a, ((0, 0), (0, layer.padded_n - layer.size_n)), constant_values=value)


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

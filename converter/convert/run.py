"""convert(): plan the artifact from the source, check the output and size the manifest,
then hand over to the write loop (:mod:`.stream`); a dry run stops before it."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

from ..artifact.hf_config import copied_files, file_checksums, folder_extras
from ..artifact.manifest import new_manifest
from ..artifact.shards import oversize_warnings, parse_size, plan_shards
from ..artifact.target import InputGuard, OutputTarget
from ..artifact.writer import ArtifactWriter
from ..constants import TINYLOOP_MESSAGE
from ..digests import FileDigests
from ..dtypes import nbytes
from ..errors import UnsupportedQuantError
from ..formats import open_source
from .plan import (
    InputStats,
    _passthrough_infos,
    _plan_warnings,
    _refuse_non_finite,
    _refuse_non_finite_bias,
    build_layout,
    lone_shard_warnings,
)
from .report import ConvertReport, NotConverted, Progress
from .stream import _PLACEHOLDER, _write


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
            + lone_shard_warnings(source)
            + ([f"a model folder {TINYLOOP_MESSAGE}"] if target.directory and source.format.value == "tinyloop" else [])
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

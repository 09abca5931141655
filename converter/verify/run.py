"""verify(): open the artifact (and the source), check its structure, then run the layer
pass (``--against``, CPU numerics) and GPU numerics as asked."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

from ..artifact.problems import ProblemCode, Report
from ..artifact.reader import open_artifact
from ..artifact.validate import broken_layers, check_artifact
from ..constants import GPU_MEAN_REL_TOLS
from ..digests import FileDigests
from ..dtypes import DTYPE_ALIASES
from ..errors import ArtifactError, ConverterError
from ..formats import open_source
from ..formats.base import LayerPlan, Source
from .gpu_numerics import _gpu_numerics
from .layer_pass import _layer_pass

P = ProblemCode


def verify(
    path: str | Path,
    *,
    shapes_only: bool = False,
    against: str | Path | None = None,
    gpu: bool | None = None,
    progress: Callable[[str, int], None] | None = None,
    act: str = "float16",
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
        act: the activations of the GPU check, ``"float16"`` or ``"bfloat16"`` (or
            ``"fp16"`` / ``"bf16"``).

    Raises:
        ValueError: ``act`` is not an activation type of the kernels.
        ConverterError and subclasses: unreadable artifact or source (exit 2); an
            ``ArtifactError`` saying so when ``path`` is a source and ``against`` an
            artifact (the arguments swapped).
    """
    # checked before any work: the GPU check that uses it comes last
    act = DTYPE_ALIASES.get(act, act)
    if act not in GPU_MEAN_REL_TOLS:
        raise ValueError(f"act={act!r}: the kernels take float16 or bfloat16 activations (or fp16, bf16)")
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
            _gpu_numerics(
                art, source, compared, report, rows, forced=bool(gpu), progress=progress, skip=broken, act=act
            )
    return report


def _is_artifact(path: str | Path) -> bool:
    """Whether ``path`` opens as a marlin-convert artifact (for the swapped-arguments hint)."""
    try:
        open_artifact(path).close()
    except ConverterError:
        return False
    return True

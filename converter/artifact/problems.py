"""What ``marlin-verify`` finds: stable problem codes, one record per finding, the report.

The codes are part of the ``--json`` output that CI parses, so they are declared once
here (and listed, with what each means, in docs/verify.md, "Problem codes"; a test
keeps the two equal).  Retire a code by leaving its member commented out with
the reason; never reuse one for something else.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Literal

Severity = Literal["error", "warning"]


class ProblemCode(str, enum.Enum):
    """Every code a :class:`Problem` can carry (JSON-visible values)."""

    def __str__(self) -> str:  # formats as its value, as enum.StrEnum does (Python >= 3.11)
        return str(self.value)

    # -- the manifest
    MANIFEST_CHECKSUM = "manifest_checksum"
    SCHEMA_UNCHECKED = "schema_unchecked"
    SCHEMA_VIOLATION = "schema_violation"
    MANIFEST_INCONSISTENT = "manifest_inconsistent"
    DUPLICATE_ENTRY = "duplicate_entry"
    # -- the header outside the manifest
    HEADER_PADDING = "header_padding"
    METADATA = "metadata"
    # -- tensors against the manifest
    MISSING_TENSOR = "missing_tensor"
    SHAPE_MISMATCH = "shape_mismatch"
    DTYPE_MISMATCH = "dtype_mismatch"
    UNKNOWN_TENSOR = "unknown_tensor"
    LAYER_TENSOR_AS_PASSTHROUGH = "layer_tensor_as_passthrough"
    CHECKSUM_MISSING = "checksum_missing"
    CHECKSUM_ORPHAN = "checksum_orphan"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    NON_FINITE = "non_finite"
    FP16_OVERFLOW = "fp16_overflow"
    BAD_PERMUTATION = "bad_permutation"
    # -- folder mode's files beside the artifact (schema v2 checksums.files)
    FOLDER_FILE_MISSING = "folder_file_missing"
    FOLDER_FILE_MISMATCH = "folder_file_mismatch"
    # -- sharded artifacts
    MISSING_SHARD = "missing_shard"
    DUPLICATE_TENSOR = "duplicate_tensor"
    INDEX_MISMATCH = "index_mismatch"
    SHARD_MANIFEST = "shard_manifest"
    # -- against the source (--against)
    SOURCE_DIFFERS = "source_differs"
    SOURCE_MISMATCH = "source_mismatch"
    # -- numerics
    NUMERICS = "numerics"
    GPU = "gpu"
    GPU_SKIPPED = "gpu_skipped"
    GPU_NUMERICS = "gpu_numerics"
    # -- the whole model (marlin-verify --model, converter/model/verify.py)
    ARTIFACT = "artifact"
    MODEL_ERROR = "model_error"
    MODEL_TOP1 = "model_top1"
    LAYER_ERROR = "layer_error"
    LAYER_DTYPE = "layer_dtype"
    LAYER_NOT_IN_SOURCE = "layer_not_in_source"
    LAYER_NOT_RUN = "layer_not_run"
    MISSING_BIAS = "missing_bias"
    TENSOR_NOT_IN_SOURCE = "tensor_not_in_source"
    TENSOR_DTYPE = "tensor_dtype"
    TENSOR_BYTES = "tensor_bytes"
    NOT_CONVERTED = "not_converted"
    KERNEL_FALLBACK = "kernel_fallback"
    UNUSED_TENSORS = "unused_tensors"
    TIED_DIFFERS = "tied_differs"
    CONFIG_DIFFERS = "config_differs"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One finding.

    Attributes:
        code: the stable identifier (:class:`ProblemCode`).
        message: one line, naming the tensor and the rule.
        tensor: the tensor or layer concerned ("" for the whole file).
        expected, actual: the numbers or values compared, when there are any.
        severity: ``"error"`` (fails verification) or ``"warning"``.
    """

    code: ProblemCode
    message: str
    tensor: str = ""
    expected: Any = None
    actual: Any = None
    severity: Severity = "error"


@dataclasses.dataclass
class Report:
    """Outcome of ``marlin-verify``; ``to_json`` is what ``--json`` prints."""

    artifact: str
    schema_version: Any = None
    checked: dict[str, Any] = dataclasses.field(default_factory=dict)
    layers: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    problems: list[Problem] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    def add(
        self,
        code: ProblemCode,
        message: str,
        tensor: str = "",
        expected: Any = None,
        actual: Any = None,
        severity: Severity = "error",
    ) -> None:
        """Record one finding (see :class:`Problem`)."""
        self.problems.append(Problem(ProblemCode(code), message, tensor, expected, actual, severity))

    def extend(self, problems: list[Problem]) -> None:
        """Record findings made elsewhere (the sharded reader's)."""
        self.problems.extend(problems)

    def to_json(self) -> dict[str, Any]:
        return {
            "artifact": self.artifact,
            "ok": self.ok,
            "schema_version": self.schema_version,
            "checked": self.checked,
            "layers": self.layers,
            "problems": [{**dataclasses.asdict(p), "code": p.code.value} for p in self.problems],
        }

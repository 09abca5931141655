"""Exception hierarchy.

Every error the package raises on purpose is a :class:`ConverterError`.  Its message
names the file, the tensor (or field) and the rule that was broken, with expected and
found values, so the CLI can print ``str(err)`` as one line and exit 2.
"""

from __future__ import annotations

from pathlib import Path


class ConverterError(Exception):
    """Base class: bad input, bad usage or an environment we cannot run in.

    Args:
        message: the broken rule, with expected and found values.
        path: the file concerned, if any.
        tensor: the tensor, layer or config field concerned, if any.
    """

    exit_code = 2

    def __init__(self, message: str, *, path: str | Path | None = None, tensor: str | None = None) -> None:
        self.rule = message
        self.path = str(path) if path is not None else None
        self.tensor = tensor
        parts = [p for p in (self.path, tensor) if p]
        super().__init__(": ".join([*parts, message]))


class SourceFormatError(ConverterError):
    """An input file breaks its format's rules (container, header, tensor table, values)."""


class UnsupportedQuantError(ConverterError):
    """The input is well formed but uses a quantization this tool does not convert."""


class ConfigError(SourceFormatError):
    """A quantization config is missing, malformed, or contradicts the tensors."""


class ArtifactError(ConverterError):
    """An artifact cannot be read as a marlin-convert artifact at all."""


class SchemaVersionError(ArtifactError):
    """The artifact's schema version is not one this tool reads."""


class OutputExistsError(ConverterError):
    """The output exists and ``--force`` was not given."""


class GpuUnavailableError(ConverterError):
    """CuPy or a suitable GPU (sm_80+) is not available."""


class KernelError(ConverterError):
    """A CUDA kernel failed to compile or launch, or a launcher's argument is wrong."""

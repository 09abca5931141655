"""Exception hierarchy.

Every error the package raises on purpose is a :class:`ConverterError`.  Its message
names the file, the tensor (or field) and the rule that was broken, with expected and
found values, so the CLI can print ``str(err)`` as one line and exit 2.
"""

from __future__ import annotations

from pathlib import Path


def printable(text: str) -> str:
    """``text`` with every character that is not printable escaped (``\\x1b``, ``\\n``,
    ``\\u202e``, ``\\udcff``): names from a file (tensors, layers, file names) can hold
    terminal escape sequences, newlines, bidirectional overrides or undecodable bytes,
    and none of them may reach a terminal raw or break a one-line message."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def json_text(text: str) -> str:
    """``text`` as valid Unicode for a JSON document: a lone surrogate (an undecodable
    byte of a file name) becomes its ``\\udcXX`` spelling instead of an escape strict
    parsers reject."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


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

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


#: Characters of a name (tensor, layer, file) shown whole in a message; a longer one is
#: shortened by :func:`short_name`.
NAME_SHOWN = 160
#: Characters of a whole error line, at most (a message quoting long names).
LINE_SHOWN = 4096


def short_name(text: str, limit: int = NAME_SHOWN) -> str:
    """``text``, or for one longer than ``limit`` characters its start and end around
    ``...(N chars, xxh3 H)...``: a crafted 5-million-character tensor name must not make
    a 5 MB error line, and the length and hash still tell two such names apart."""
    if len(text) <= limit:
        return text
    import xxhash

    digest = xxhash.xxh3_64_hexdigest(text.encode("utf-8", "surrogatepass"))
    keep = max(limit // 2 - 20, 8)
    return f"{text[:keep]}...({len(text)} chars, xxh3 {digest})...{text[-keep // 2 :]}"


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
        self.rule = short_name(message, LINE_SHOWN)
        self.path = str(path) if path is not None else None
        # names from files are shortened (with their length and a hash) where too long
        self.tensor = short_name(tensor) if tensor is not None else None
        parts = [p for p in (short_name(self.path, LINE_SHOWN // 2) if self.path else None, self.tensor) if p]
        super().__init__(": ".join([*parts, self.rule]))


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


class OutputPathError(ConverterError):
    """The output's folder (or, for a new model folder, its parent) does not exist or
    cannot be created."""


class OptionValueError(ConverterError):
    """A command-line option's value is malformed (``--max-shard-size`` without a unit, say);
    ``tensor`` names the option."""


class GpuUnavailableError(ConverterError):
    """CuPy or a suitable GPU (sm_80+) is not available."""


class KernelError(ConverterError):
    """A CUDA kernel failed to compile or launch, or a launcher's argument is wrong."""

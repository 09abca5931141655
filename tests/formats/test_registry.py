"""The reader registry (converter/formats): every format, quant method and zero convention
is declared once, by the reader's class statement, and agrees with the enums and the
artifact schema.  Adding a format without its enum members or its schema enums fails here."""

from __future__ import annotations

import pytest

from converter.artifact import validate
from converter.artifact.schema import load_schema
from converter.constants import SourceFormat, ZeroConvention
from converter.formats import CONVENTIONS, HF_READERS, READABLE_METHODS, READERS
from converter.formats.awq import AwqSource
from converter.formats.base import Source
from converter.formats.compressed_tensors import CompressedTensorsSource
from converter.formats.gptq import GptqSource
from converter.formats.hf import HFSource
from converter.formats.tinyloop import TinyloopSource


def _schema_enums() -> tuple[list[str], list[str]]:
    schema = load_schema()
    formats = schema["properties"]["source"]["properties"]["format"]["enum"]
    conventions = schema["properties"]["layers"]["items"]["properties"]["zero_convention"]["enum"]
    return formats, conventions


def test_every_format_has_one_reader_and_is_in_the_schema() -> None:
    formats, _ = _schema_enums()
    assert set(READERS) == set(SourceFormat)
    assert {f.value for f in READERS} == set(formats)
    assert all(cls.format is fmt for fmt, cls in READERS.items())


def test_every_zero_convention_comes_from_a_reader_and_is_in_the_schema() -> None:
    _, conventions = _schema_enums()
    produced = [c for cls in READERS.values() for c in cls.zero_conventions]
    assert sorted(produced) == sorted(ZeroConvention)  # each exactly once
    assert {c.value for c in produced} == set(conventions)


def test_derived_tables() -> None:
    """The tables the package uses are the registry's (a new format adds to them by itself)."""
    known = {
        SourceFormat.AWQ: AwqSource, SourceFormat.COMPRESSED_TENSORS: CompressedTensorsSource,
        SourceFormat.GPTQ: GptqSource, SourceFormat.TINYLOOP: TinyloopSource,
    }  # fmt: skip
    assert known.items() <= READERS.items()
    assert {
        "awq": AwqSource,
        "compressed-tensors": CompressedTensorsSource,
        "gptq": GptqSource,
    }.items() <= HF_READERS.items()
    assert dict(HF_READERS) == {
        m: cls for cls in READERS.values() if issubclass(cls, HFSource) for m in cls.quant_methods
    }
    assert tuple(sorted(HF_READERS)) == READABLE_METHODS
    assert dict(CONVENTIONS) == {f.value: {c.value for c in cls.zero_conventions} for f, cls in READERS.items()}
    assert CONVENTIONS["gptq"] == {"gptq_v1", "gptq_v2"} and CONVENTIONS["tinyloop"] == {"tinyloop_additive"}
    assert validate.CONVENTIONS is CONVENTIONS


def test_only_tinyloop_claims_a_single_file(tmp_path) -> None:
    path = tmp_path / "m.tinyloop"
    path.write_bytes(b"TINYLOOP")
    assert [cls for cls in READERS.values() if cls.claims(path)] == [TinyloopSource]


def test_a_second_reader_for_a_format_is_refused() -> None:
    with pytest.raises(TypeError, match=r"format 'gptq' is already read by GptqSource"):

        class Again(HFSource, format=SourceFormat.GPTQ, methods=("gptq-again",), conventions=(ZeroConvention.GPTQ_V1,)):
            pass

    with pytest.raises(TypeError, match=r"quant_method 'awq' is already read by AwqSource"):

        class Thief(HFSource, format=SourceFormat.GPTQ, methods=("awq",), conventions=(ZeroConvention.GPTQ_V1,)):
            pass

    with pytest.raises(TypeError, match=r"must name the zero conventions it produces"):

        class NoConventions(Source, format=SourceFormat.TINYLOOP):
            pass

    assert READERS[SourceFormat.GPTQ] is GptqSource and READERS[SourceFormat.TINYLOOP] is TinyloopSource

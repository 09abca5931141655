"""Strict, memory-mapped safetensors reading and streaming, atomic writing.

Why our own code beside the ``safetensors`` package: its NumPy reader cannot hand
out BF16 tensors (we carry them over bit-exactly), it reports bad headers with
generic messages that name neither tensor nor rule, and it has no streaming writer
(it needs every tensor in memory at once).  The container rules follow the
reference implementation (docs/spec/checkpoint-formats.md section 7); tests check
that ``safetensors.safe_open`` reads what we write.

One module a job: ``reader`` (validation, lazy bounded maps), ``mapped_files`` (the
bound on maps, page release, which file shrank), ``header_json`` (the header written
in pieces, and its size), ``writer`` (:class:`StreamingWriter`).  Every name stays
importable from here.  Rebinding one here (a test's monkeypatch) does not reach the
module that uses it: patch that module (``converter.safetensors_io.writer``...).
"""

from .header_json import (
    _WIDEST,
    HEADER_CHUNK_CHARS,
    _encode_str,
    _encoded_chunks,
    _header_text,
    _json_text,
    _padded_size,
    header_size_for,
)
from .mapped_files import (
    _MAP_OWNERS,
    _OPEN_FILES,
    _POOL,
    MAX_MAPPED_FILES,
    _MapPool,
    drop_pages,
    register_map_owner,
    release_mapped_pages,
    set_map_limit,
    shrunk_files,
)
from .reader import (
    _DTYPE_CODES,
    _DTYPES,
    _ITEMSIZE,
    MAX_ARRAY_BYTES,
    MAX_DIM,
    MAX_NDIM,
    SafetensorsFile,
    _change,
    _identity,
    _pread_exact,
    _short,
)
from .writer import WRITEBACK_WINDOW, StreamingWriter, _cache_budget

__all__ = [
    "HEADER_CHUNK_CHARS",
    "MAX_ARRAY_BYTES",
    "MAX_DIM",
    "MAX_MAPPED_FILES",
    "MAX_NDIM",
    "WRITEBACK_WINDOW",
    "_DTYPES",
    "_DTYPE_CODES",
    "_ITEMSIZE",
    "_MAP_OWNERS",
    "_OPEN_FILES",
    "_POOL",
    "_WIDEST",
    "SafetensorsFile",
    "StreamingWriter",
    "_MapPool",
    "_cache_budget",
    "_change",
    "_encode_str",
    "_encoded_chunks",
    "_header_text",
    "_identity",
    "_json_text",
    "_padded_size",
    "_pread_exact",
    "_short",
    "drop_pages",
    "header_size_for",
    "register_map_owner",
    "release_mapped_pages",
    "set_map_limit",
    "shrunk_files",
]

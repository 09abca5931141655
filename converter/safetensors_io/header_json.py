"""The header JSON a writer emits, in pieces: a header of 100 k tensors or megabytes of
metadata is encoded chunk by chunk, never built whole, and its size is known before
the data is written (the reserve at the front of the file).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping

from ..constants import SAFETENSORS_METADATA_KEY

#: Characters of header JSON gathered before they are encoded and written (or counted).
HEADER_CHUNK_CHARS = 1 << 18
_encode_str = json.encoder.encode_basestring  # the string encoder of json.dumps(ensure_ascii=False)


def _json_text(value: object) -> Iterator[str]:
    """``value`` as ``json.dumps(value, separators=(",", ":"), ensure_ascii=False)``
    writes it, a long string in slices (each character is escaped on its own, so the
    slices' escapes join into the whole's)."""
    if type(value) is not str or len(value) <= HEADER_CHUNK_CHARS:
        yield json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        return
    yield '"'
    for i in range(0, len(value), HEADER_CHUNK_CHARS):
        yield _encode_str(value[i : i + HEADER_CHUNK_CHARS])[1:-1]
    yield '"'


def _header_text(
    items: Iterable[tuple[str, str, tuple[int, ...]]], offsets: Iterable[int] | None, metadata: Mapping[str, str]
) -> Iterator[str]:
    """The header JSON in pieces: exactly ``json.dumps({"__metadata__": dict(metadata),
    **entries}, separators=(",", ":"), ensure_ascii=False)`` for the entries
    ``{name: {"dtype", "shape", "data_offsets"}}`` of ``items`` in order, without building
    that map or the whole text (a header of 100 k tensors was built three times over).

    Args:
        items: ``(name, dtype, shape)`` in data order.
        offsets: each tensor's begin and, after the last, the end of the data; None puts
            the widest offsets (10**15) everywhere (what :func:`header_size_for` reserves).
    """
    yield '{"' + SAFETENSORS_METADATA_KEY + '":{'
    for i, (key, value) in enumerate(dict(metadata).items()):
        yield ("," if i else "") + _encode_str(key) + ":"
        yield from _json_text(value)
    yield "}"
    if offsets is None:
        for name, dtype, shape in items:
            yield (
                f',{_encode_str(name)}:{{"dtype":{_encode_str(dtype)},"shape":[{",".join(map(str, shape))}],'
                f'"data_offsets":[{_WIDEST},{_WIDEST}]}}'
            )
    else:
        it = iter(offsets)
        begin = next(it, 0)
        for (name, dtype, shape), end in zip(items, it, strict=True):
            yield (
                f',{_encode_str(name)}:{{"dtype":{_encode_str(dtype)},"shape":[{",".join(map(str, shape))}],'
                f'"data_offsets":[{begin},{end}]}}'
            )
            begin = end
    yield "}"


#: The offset :func:`header_size_for` reserves room for (a petabyte: 16 digits).
_WIDEST = 10**15


def _encoded_chunks(pieces: Iterable[str]) -> Iterator[bytes]:
    """UTF-8 bytes of ``pieces`` joined, in chunks of about :data:`HEADER_CHUNK_CHARS`
    characters (a lone surrogate in a name raises UnicodeEncodeError, as ``str.encode`` does)."""
    buf: list[str] = []
    size = 0
    for piece in pieces:
        buf.append(piece)
        size += len(piece)
        if size >= HEADER_CHUNK_CHARS:
            yield "".join(buf).encode("utf-8")
            buf, size = [], 0
    if buf:
        yield "".join(buf).encode("utf-8")


def _padded_size(size: int) -> int:
    return size + (-size % 8)  # keep tensor data 8-byte aligned, as the reference writer does


def header_size_for(entries_layout: Iterable[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str]) -> int:
    """Bytes the header will take for this layout and metadata (offsets at worst-case width)."""
    size = sum(len(chunk) for chunk in _encoded_chunks(_header_text(entries_layout, None, metadata)))
    return _padded_size(size)

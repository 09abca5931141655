"""Memory that does not grow with the model beyond its header (issue 42).

A checkpoint of many tiny pass-through tensors once cost about 2 KB of Python memory
per tensor (2.6 KB of RSS): the artifact's safetensors header was built as a dict of
dicts and as a string three times over, the manifest as JSON objects of every tensor,
and the write-back kept a record per write.  Now the header and the manifest's text are
written in pieces from compact per-tensor records; what is left per tensor is the
source header's entry, the artifact's tensor list, its checksum and its share of the
manifest text.  The bound below is on the whole in-process conversion (tracemalloc's
peak, which counts NumPy's buffers too), so any per-tensor copy that comes back fails
it; the pieces are checked against ``json.dumps`` byte for byte.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from converter.artifact import manifest as manifest_mod
from converter.artifact.manifest import dump_manifest, manifest_text, metadata_for
from converter.artifact.schema import Passthrough, checksum
from converter.convert import convert
from converter.safetensors_io import SafetensorsFile, StreamingWriter, header_size_for
from tests.helpers.producers import gptq_config, gptq_tensors, make_layer, write_checkpoint

#: Tiny pass-through tensors in the checkpoint of the bound (few: tracemalloc is slow).
TENSORS = 5_000
#: Bytes of traced memory per tiny tensor allowed at the conversion's peak, above the
#: peak of the same checkpoint without them.  Measured (Python 3.11, tracemalloc peak of
#: convert(), 5 k and 20 k tensors): 2200-2330 and 2006 B a tensor before issue 42 (the
#: test fails there), 748 and 713 B after (of which ~500 B is parsing the source's header).
BYTES_PER_TENSOR = 1200

#: Names that JSON escapes (quotes, backslashes, control characters) or that are not ASCII.
ODD_NAMES = ['q"uote', "back\\slash", "tab\tnew\nline", "\x00\x1f", "émoji 🙂", "ß/\u2028", "</script>"]


def _one_layer() -> dict[str, np.ndarray]:
    return gptq_tensors(
        "model.layers.0.mlp.up_proj", make_layer(np.random.default_rng(0), 128, 64, group_size=64), v1=True
    )


def _traced_peak(src: Path, out: Path) -> int:
    tracemalloc.start()
    try:
        convert(src, out)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_converting_many_tiny_tensors_costs_a_bounded_amount_per_tensor(tmp_path: Path) -> None:
    base = _traced_peak(write_checkpoint(tmp_path / "none", _one_layer(), gptq_config(4, 64)), tmp_path / "none.st")
    tensors = _one_layer()
    one = np.ones(1, np.uint8)
    for i in range(TENSORS):
        tensors[f"t.{i}"] = one
    src = write_checkpoint(tmp_path / "src", tensors, gptq_config(4, 64))
    del tensors
    out = tmp_path / "o.safetensors"
    per_tensor = (_traced_peak(src, out) - base) / TENSORS
    assert per_tensor < BYTES_PER_TENSOR, (
        f"converting {TENSORS} one-byte tensors peaked {per_tensor:.0f} B a tensor above the same checkpoint "
        f"without them (traced memory), more than {BYTES_PER_TENSOR} B"
    )
    with SafetensorsFile(out) as f:
        assert len(f.infos) == TENSORS + 3  # the layer's B, scales and delta, and every tiny tensor
        assert f.array(f"t.{TENSORS - 1}").tolist() == [1]


ITEMSIZE = {"F32": 4, "F16": 2, "U8": 1}
NP_DTYPE = {"F32": np.float32, "F16": np.float16, "U8": np.uint8}


def _reference_header(layout: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str], reserve: int) -> bytes:
    """The header as it was built before issue 42: a dict of every entry, one json.dumps."""
    entries, offset = {}, 0
    for name, dtype, shape in sorted(layout, key=lambda e: -ITEMSIZE[e[1]]):
        n = int(np.prod(shape)) * ITEMSIZE[dtype]
        entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":"), ensure_ascii=False).encode()
    size = max(len(raw), reserve)
    size += -size % 8
    return raw + b" " * (size - len(raw))


@pytest.mark.parametrize("chunk", [7, 1 << 18])
def test_the_header_written_in_pieces_is_the_one_json_dumps_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Byte for byte, with names and metadata JSON escapes, long metadata split across
    chunks (``chunk`` characters: every escape lands on a chunk boundary somewhere)."""
    import converter.safetensors_io as st

    # the header text is chunked in header_json, padded in writer: both read the constant
    monkeypatch.setattr(st.header_json, "HEADER_CHUNK_CHARS", chunk)
    monkeypatch.setattr(st.writer, "HEADER_CHUNK_CHARS", chunk)
    layout = [
        (f"{n}.{i}", ("U8", "F32", "F16")[i % 3], ((i % 4) + 1, 2) if i % 5 else ())
        for i, n in enumerate(ODD_NAMES * 3)
    ]
    long_value = ('{"a":"\\"é\n"}' * 40) + "🙂"
    metadata = {"format": "pt", 'k"ey': long_value, "empty": ""}
    reserve = header_size_for(layout, metadata)
    # room for the entries at their widest offsets (16 digits), rounded to 8 bytes
    widest = json.dumps(
        {
            "__metadata__": metadata,
            **{n: {"dtype": d, "shape": list(s), "data_offsets": [10**15] * 2} for n, d, s in layout},
        },
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode()
    assert reserve == len(widest) + (-len(widest) % 8)
    out = tmp_path / "o.safetensors"
    with StreamingWriter(out, layout, header_reserve=reserve) as w:
        for name, dtype, shape in layout:
            w.write_flat(name, np.zeros(shape, NP_DTYPE[dtype]).reshape(-1), 0)
        w.finish(metadata)
    raw = out.read_bytes()
    want = _reference_header(layout, metadata, reserve)
    assert int.from_bytes(raw[:8], "little") == len(want)
    assert raw[8 : 8 + len(want)] == want
    with SafetensorsFile(out) as f:
        assert f.metadata == metadata
        assert [(n, i.dtype, i.shape) for n, i in f.infos.items()] == [
            (n, d, tuple(s)) for n, d, s in sorted(layout, key=lambda e: -ITEMSIZE[e[1]])
        ]


def test_a_header_larger_than_its_reserve_is_refused_before_it_reaches_the_data(tmp_path: Path) -> None:
    layout = [("t", "U8", (4,))]
    out = tmp_path / "o.safetensors"
    w = StreamingWriter(out, layout, header_reserve=header_size_for(layout, {"a": "b"}))
    w.write_flat("t", np.arange(4, dtype=np.uint8), 0)
    with pytest.raises(ValueError, match=r"header needs \d+ bytes, only \d+ reserved"):
        w.finish({"a": "b" * 1000})
    assert list(tmp_path.iterdir()) == []


def test_the_manifest_text_written_in_pieces_is_dump_manifest_of_its_json(monkeypatch: pytest.MonkeyPatch) -> None:
    """The manifest of many tensors (long ``passthrough`` list and checksum map, written item
    by item) is the text ``dump_manifest(to_json())`` gives, and its checksum that text's."""
    import dataclasses

    from converter.formats import open_source
    from tests.helpers.paths import SAMPLE

    with open_source(SAMPLE) as source:
        desc = source.describe(digests=False)
    monkeypatch.setattr(manifest_mod, "_WHOLE_ITEMS", 3)
    monkeypatch.setattr(manifest_mod, "_CHUNK_CHARS", 50)
    names = [f"{n}.{i}" for i in range(4) for n in ODD_NAMES]
    m = manifest_mod.new_manifest(desc, [], [Passthrough(n, f"why {n}") for n in names])
    m = dataclasses.replace(
        m, checksums=dataclasses.replace(m.checksums, tensors={n: f"{i:032x}" for i, n in enumerate(reversed(names))})
    )
    text, digest = manifest_text(m)
    want = dump_manifest(m.to_json())
    assert text == want
    assert digest == checksum(want.encode("utf-8"))
    meta = metadata_for(m)
    assert meta["marlin.manifest"] == want and meta["marlin.manifest_checksum"] == digest

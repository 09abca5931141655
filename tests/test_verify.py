"""Streaming verification: chunk by chunk, differences are still found and located in the
whole layer, problems keep their order, and every stage is named on the progress bar."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from converter.artifact.reader import open_artifact
from converter.convert import convert
from converter.marlin.layout import pack_b, permute_scales, unpack_b, unpermute_scales
from converter.verify import verify
from tests.helpers.artifact_edit import rewrite_artifact_arrays
from tests.helpers.paths import SAMPLE
from tests.helpers.producers import gptq_config, gptq_tensors, make_layer, plain_tensors, write_checkpoint

L = "model.layers.0.mlp.down_proj"
K, N, G = 512, 256, 64


@pytest.fixture()
def chunked(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Small chunks, so a 512-row layer is checked in several (8 with the compiled
    loops' half-size chunks, 16 with the NumPy unpackers' quarter-size ones); the
    teardown checks that it was."""
    # Patched where they are used: converter.convert and .verify (the packages) are shadowed
    # by the functions the package exports, and a patch on a re-export would change nothing.
    monkeypatch.setattr(sys.modules["converter.convert.plan"], "CHUNK_CODE_BYTES", 128 * N)
    verify_mod = sys.modules["converter.verify.layer_pass"]
    seen: dict[str, int] = {}
    real = verify_mod._artifact_chunks

    def counted(art, rec):
        for chunk in real(art, rec):
            seen[rec.name] = seen.get(rec.name, 0) + 1
            yield chunk

    monkeypatch.setattr(verify_mod, "_artifact_chunks", counted)
    yield
    assert seen.get(L, 0) >= 4, seen


def _checkpoint(folder: Path, *, act_order: bool = False) -> Path:
    rng = np.random.default_rng(11)
    tensors = plain_tensors(rng) | gptq_tensors(L, make_layer(rng, K, N, group_size=G, act_order=act_order), v1=True)
    return write_checkpoint(folder, tensors, gptq_config(4, G), where="quantize_config.json")


def _edit_layer(art: Path, out: Path, change) -> Path:
    """Rewrite layer L's unpacked codes / natural-order scales / delta / perm with
    ``change(parts)`` and re-seal the checksums."""

    def edit(manifest: dict, t: dict) -> None:
        p = L + "."
        parts = {
            "q": unpack_b(t[p + "marlin_B"][1], N).copy(),
            "scales": unpermute_scales(t[p + "marlin_scales"][1]).copy(),
            "delta": t[p + "marlin_delta"][1].copy(),
        }
        if p + "marlin_perm" in t:
            parts["perm"] = t[p + "marlin_perm"][1].copy()
        change(parts)
        t[p + "marlin_B"] = ("I32", pack_b(parts["q"]))
        t[p + "marlin_scales"] = ("F16", permute_scales(parts["scales"]))
        t[p + "marlin_delta"] = ("F32", parts["delta"])
        if "perm" in parts:
            t[p + "marlin_perm"] = ("I32", parts["perm"])

    return rewrite_artifact_arrays(art, out, edit)


def test_differences_are_located_in_the_whole_layer(tmp_path: Path, chunked: None) -> None:
    src = _checkpoint(tmp_path / "src")
    art = Path(convert(src, tmp_path / "a.safetensors").output)
    assert verify(art, against=src, gpu=False).ok
    seen = {}

    def change(parts: dict) -> None:
        # One code in the third chunk, one scale and one delta of a group in the fourth.
        seen["q"] = int(parts["q"][300, 5])
        parts["q"][300, 5] = (seen["q"] + 3) % 16
        seen["s"] = float(parts["scales"][6, 7])
        parts["scales"][6, 7] = np.float16(seen["s"] * 2)
        seen["d"] = float(parts["delta"][7, 9])
        parts["delta"][7, 9] = np.float32(seen["d"] + 1)

    bad = _edit_layer(art, tmp_path / "bad.safetensors", change)
    assert verify(bad, shapes_only=True).ok  # re-sealed: only the source can tell
    rep = verify(bad, against=src, gpu=False)
    messages = [(p.code.value, p.message) for p in rep.problems]
    new_q = (seen["q"] + 3) % 16
    assert messages[:3] == [
        (
            "source_mismatch",
            f"layer {L}: codes not bit-identical to the source: 1 of {K * N} differ; "
            f"first at [300, 5]: {new_q} vs source {seen['q']}",
        ),
        (
            "source_mismatch",
            f"layer {L}: scales not bit-identical to the source: 1 of {K // G * N} differ; "
            f"first at [6, 7]: {float(np.float16(seen['s'] * 2))} vs source {seen['s']}",
        ),
        (
            "source_mismatch",
            f"layer {L}: delta not bit-identical to the source: 1 of {K // G * N} differ; "
            f"first at [7, 9]: {float(np.float32(seen['d'] + 1))} vs source {seen['d']}",
        ),
    ]
    # Numerics come after every comparison with the source.
    assert [c for c, _ in messages[3:]] == ["numerics"]
    row = next(r for r in rep.layers if r["name"] == L)
    assert (row["codes_exact"], row["scales_exact"], row["delta_exact"]) == (False, False, False)
    assert row["cpu_rel_err"] > 1e-3


def test_words_fast_path_gives_the_reports_of_unpacked_codes(
    tmp_path: Path, chunked: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verify --against compares a 4-bit GPTQ source's words with the artifact's codes
    (Source.load_words); with the reader's fast path switched off (its codes unpacked and
    compared, the reference product on them) the report is the same, every number bit
    for bit: agreeing, and with two codes changed in one chunk."""
    from converter.formats.gptq import GptqSource

    src = _checkpoint(tmp_path / "src")
    art = Path(convert(src, tmp_path / "a.safetensors").output)

    def change(parts: dict) -> None:
        parts["q"][300, 5] = (parts["q"][300, 5] + 3) % 16
        parts["q"][301, 200] = (parts["q"][301, 200] + 1) % 16

    bad = _edit_layer(art, tmp_path / "bad.safetensors", change)
    calls: list[int] = []
    real = GptqSource.load_words

    def counted(self, *args):
        got = real(self, *args)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(GptqSource, "load_words", counted)
    fast = [verify(a, against=src, gpu=False) for a in (art, bad)]
    assert calls and all(calls)
    monkeypatch.setattr(GptqSource, "load_words", lambda self, *args: None)
    slow = [verify(a, against=src, gpu=False) for a in (art, bad)]
    for f, s in zip(fast, slow, strict=True):
        assert [(p.code, p.message) for p in f.problems] == [(p.code, p.message) for p in s.problems]
        assert f.layers == s.layers
    assert fast[0].ok
    assert any(f"2 of {K * N} differ; first at [300, 5]" in p.message for p in fast[1].problems)
    assert next(r for r in fast[1].layers if r["name"] == L)["cpu_rel_err"] > 1e-3


def test_act_order_permutation_is_compared(tmp_path: Path, chunked: None) -> None:
    src = _checkpoint(tmp_path / "src", act_order=True)
    art = Path(convert(src, tmp_path / "a.safetensors").output)
    good = verify(art, against=src, gpu=False)
    assert good.ok and next(r for r in good.layers if r["name"] == L)["perm_exact"] is True

    def swap(parts: dict) -> None:
        parts["perm"][[10, 400]] = parts["perm"][[400, 10]]

    bad = _edit_layer(art, tmp_path / "bad.safetensors", swap)
    rep = verify(bad, against=src, gpu=False)
    msgs = [p.message for p in rep.problems if p.code.value == "source_mismatch"]
    assert len(msgs) == 1 and msgs[0].startswith(f"layer {L}: perm not bit-identical to the source: 2 of {K} differ")
    assert [p.code.value for p in rep.problems][-1] == "numerics"


def test_a_changed_source_file_is_reported_first(tmp_path: Path) -> None:
    src = _checkpoint(tmp_path / "src")
    art = Path(convert(src, tmp_path / "a.safetensors").output)
    with open(src / "quantize_config.json", "a") as fh:
        fh.write("\n")  # same config, other bytes
    rep = verify(art, against=src, gpu=False)
    assert [(p.code.value, p.message) for p in rep.problems] == [
        (
            "source_differs",
            "the source is not the one this artifact was converted from (sha256 differs: quantize_config.json); "
            "the comparisons below will show where",
        )
    ]


def test_layers_not_in_the_source_are_reported_in_name_order(tmp_path: Path) -> None:
    """Against the wrong source, the layer problems come sorted by name, the same on every run."""
    art = Path(convert(SAMPLE, tmp_path / "s.safetensors").output)
    names = sorted(open_artifact(art).layers)
    rep = verify(art, against=_checkpoint(tmp_path / "ckpt"), gpu=False)
    layer_lines = [p.message for p in rep.problems if p.message.startswith("layer ")]
    assert layer_lines == [f"layer {n} is in the artifact but not converted from the source" for n in names] + [
        f"layer {L} converts from the source but is missing from the artifact"
    ]


@pytest.mark.parametrize(
    "kw,stages",
    [
        ({"shapes_only": True}, ["checksums"]),
        ({"shapes_only": True, "against": True}, ["checksums", "against source"]),
        ({}, ["checksums", "CPU numerics"]),
        ({"against": True}, ["checksums", "against source + CPU numerics"]),
    ],
)
def test_progress_names_each_stage(tmp_path: Path, kw: dict, stages: list[str]) -> None:
    art = Path(convert(SAMPLE, tmp_path / "s.safetensors").output)
    calls: list[tuple[str, int]] = []
    if kw.pop("against", False):
        kw["against"] = SAMPLE
    rep = verify(art, gpu=False, progress=lambda d, n: calls.append((d, n)), **kw)
    assert rep.ok
    assert [d for d, _ in calls if d] == stages
    totals = dict(calls)
    assert totals["checksums"] == rep.checked["tensors"]
    with open_artifact(art) as a:
        passthrough = len(a.manifest.passthrough) if "against" in kw else 0
    if len(stages) > 1:  # a step per layer, and per pass-through tensor compared with the source
        assert totals[stages[1]] == len(rep.layers) + passthrough
    assert len(calls) == len(stages) + sum(n for d, n in calls if d)


def test_checksums_in_blocks_catch_a_late_flip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import converter.artifact.validate_bytes as validate_bytes

    monkeypatch.setattr(validate_bytes, "HASH_CHUNK_BYTES", 1000)  # every sample tensor above 1000 bytes in blocks
    art = Path(convert(SAMPLE, tmp_path / "s.safetensors").output)
    assert verify(art, shapes_only=True).ok
    with open_artifact(art) as a:
        name = max(a.file.infos, key=lambda n: a.file.byte_range(n)[1] - a.file.byte_range(n)[0])
        begin, end = a.file.byte_range(name)
    assert end - begin > 3000
    data = bytearray(art.read_bytes())
    data[end - 1] ^= 0x01  # in the last block
    art.write_bytes(bytes(data))
    rep = verify(art, shapes_only=True)
    assert [(p.code.value, p.tensor) for p in rep.problems if p.severity == "error"] == [("checksum_mismatch", name)]


@pytest.mark.parametrize("where", [None, 100, 1600, 1900, 4095])
def test_passthrough_chunks_compared_in_halves_find_any_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: int | None
) -> None:
    """Pass-through bytes compared in 1000-byte chunks, each in two halves on the pool:
    a byte changed in either half of a chunk (or the last one) is found, and an
    unchanged tensor passes."""
    verify_mod = sys.modules["converter.verify.against"]
    monkeypatch.setattr(verify_mod, "COMPARE_CHUNK_BYTES", 1000)
    monkeypatch.setattr(verify_mod, "SPLIT_COMPARE_BYTES", 200)
    src = _checkpoint(tmp_path / "src")
    art = Path(convert(src, tmp_path / "a.safetensors").output)
    name = "model.embed_tokens.weight"  # 32 x 64 float16: 4096 bytes

    def edit(manifest: dict, t: dict) -> None:
        if where is not None:
            raw = t[name][1].copy().view(np.uint8).reshape(-1)
            raw[where] ^= 0x40
            t[name] = (t[name][0], raw.view(np.float16).reshape(32, 64))

    out = rewrite_artifact_arrays(art, tmp_path / "b.safetensors", edit)
    rep = verify(out, against=src, gpu=False)
    bad = [(p.code.value, p.message) for p in rep.problems if p.tensor == name]
    assert bad == ([] if where is None else [("source_mismatch", f"{name}: bytes differ from the source")])

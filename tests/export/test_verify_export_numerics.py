"""``marlin-verify EXPORT --against SRC`` runs the CPU numerics, as on a Marlin artifact:
the export's layers (read back with our compressed-tensors reader) multiply random
activations, compared with the source's exact dequantization within ``CPU_REL_TOL``;
``--shapes`` skips them; a scale planted wrong in the export fails them."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import numpy as np
import pytest

import converter.export.verify as export_verify
from converter.export import check_export, export_compressed_tensors
from converter.verify import CPU_REL_TOL
from tests.export.fixtures import SIZES, synthetic
from tests.helpers.artifact_edit import read_st, write_st
from tests.helpers.clirun import run_cli

UP, DOWN = "model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj"
OK_LINE = "OK: 2 exported layers equal the source exactly; checked against source, CPU numerics"

FIXTURES = [
    pytest.param(4, 64, False, "F16", id="w4g64"),
    pytest.param(4, -1, False, "F16", id="w4-per-channel"),
    pytest.param(4, 32, True, "F16", id="w4g32-act-order"),
    pytest.param(4, 64, False, "BF16", id="w4g64-bf16"),
    pytest.param(2, 64, False, "F16", id="w2g64"),
    pytest.param(2, 32, True, "F16", id="w2g32-act-order"),
]


def _export(tmp_path: Path, bits: int, group_size: int, act_order: bool, scale_dtype: str = "F16") -> tuple[Path, Path]:
    src = synthetic(tmp_path / "src", bits=bits, group_size=group_size, act_order=act_order, scale_dtype=scale_dtype)
    out = tmp_path / "out"
    export_compressed_tensors(src, out, legacy_act_order=act_order)
    return src, out


def _verify_json(out: Path, src: Path, *extra: str) -> tuple[int, dict]:
    r = run_cli("marlin-verify", out, "--against", src, "--json", *extra)
    return r.returncode, json.loads(r.stdout)


@pytest.mark.parametrize(("bits", "group_size", "act_order", "scale_dtype"), FIXTURES)
def test_verify_runs_cpu_numerics_on_an_export(
    tmp_path: Path, bits: int, group_size: int, act_order: bool, scale_dtype: str
) -> None:
    src, out = _export(tmp_path, bits, group_size, act_order, scale_dtype)
    r = run_cli("marlin-verify", out, "--against", src)
    assert (r.returncode, r.stdout.strip(), r.stderr) == (0, OK_LINE, "")
    rc, doc = _verify_json(out, src)
    assert rc == 0 and doc["ok"] and doc["cpu_numerics"] is True and doc["problems"] == []
    assert sorted(doc["checked"]) == sorted(SIZES)
    assert sorted(row["name"] for row in doc["layers"]) == sorted(SIZES)
    for row in doc["layers"]:
        assert 0 <= row["cpu_rel_err"] <= CPU_REL_TOL, row


def test_three_bit_layers_are_not_read_back_so_get_no_numerics(tmp_path: Path) -> None:
    src, out = _export(tmp_path, 3, 64, False)
    r = run_cli("marlin-verify", out, "--against", src)
    assert r.returncode == 0
    assert r.stdout.strip() == (
        "OK: 0 exported layers equal the source exactly; not read back: 2; checked against source"
    )
    check = check_export(out, src)
    assert len(check.unchecked) == 2 and check.layers == [] and not check.problems
    assert check.cpu_numerics is False  # no layer was read back, so none ran


def test_shapes_skips_the_numerics(tmp_path: Path) -> None:
    src, out = _export(tmp_path, 4, 64, False)
    r = run_cli("marlin-verify", out, "--against", src, "--shapes")
    assert (r.returncode, r.stdout.strip()) == (
        0,
        "OK: 2 exported layers equal the source exactly; checked against source",
    )
    rc, doc = _verify_json(out, src, "--shapes")
    assert rc == 0 and doc["cpu_numerics"] is False and doc["layers"] == []


def _plant_scale(out: Path, layer: str, factor: float) -> None:
    """Multiply one of ``layer``'s stored scales by ``factor`` in the export's one file
    (its metadata, the export manifest included, kept as written)."""
    path = out / "model.safetensors"
    meta, tensors = read_st(path)
    dtype, shape, raw = tensors[f"{layer}.weight_scale"]
    assert dtype == "F16"
    scales = np.frombuffer(raw, dtype=np.float16).reshape(shape).copy()
    scales[3, 1] *= np.float16(factor)
    tensors[f"{layer}.weight_scale"] = (dtype, shape, scales.tobytes())
    write_st(path, tensors, meta)


def test_a_wrong_scale_in_the_export_fails_the_numerics(tmp_path: Path) -> None:
    src, out = _export(tmp_path, 4, 64, False)
    _plant_scale(out, UP, 2.0)
    r = run_cli("marlin-verify", out, "--against", src)
    assert r.returncode == 1
    assert r.stderr == ""  # the problems and the status line on stdout (docs/verify.md)
    lines = r.stdout.strip().splitlines()
    assert lines[0] == f"problem: {UP}: scales differ from the source"
    assert re.fullmatch(rf"problem: layer {re.escape(UP)}: CPU relative error \S+ exceeds 1e-05", lines[1]), lines
    assert lines[2:] == ["FAILED: 2 problem(s); checked against source, CPU numerics"]
    rc, doc = _verify_json(out, src)
    assert rc == 1 and not doc["ok"] and doc["cpu_numerics"] is True
    errs = {row["name"]: row["cpu_rel_err"] for row in doc["layers"]}
    assert errs[UP] > CPU_REL_TOL and errs[DOWN] <= CPU_REL_TOL
    assert doc["problems"][1].startswith(f"layer {UP}: CPU relative error ")
    # --shapes keeps the exact comparison, which finds it too, and skips the numerics.
    r = run_cli("marlin-verify", out, "--against", src, "--shapes")
    assert (r.returncode, r.stderr) == (1, "")
    assert r.stdout.strip().splitlines() == [
        f"problem: {UP}: scales differ from the source",
        "FAILED: 1 problem(s); checked against source",
    ]


def test_problems_past_the_cap_are_counted_and_verbose_lists_them(tmp_path: Path, monkeypatch) -> None:
    import converter.cli.verify_cmd as verify_cmd
    from tests.helpers.clirun import invoke

    src, out = _export(tmp_path, 4, 64, False)
    _plant_scale(out, UP, 2.0)  # two problems: the scales, then the numerics
    monkeypatch.setattr(verify_cmd, "PROBLEM_LINES", 1)
    res = invoke("marlin-verify", out, "--against", src)
    assert res.exit_code == 1
    assert res.stdout.splitlines() == [
        f"problem: {UP}: scales differ from the source",
        "... and 1 more; --verbose or --json lists every problem",
        "FAILED: 2 problem(s); checked against source, CPU numerics",
    ]
    res = invoke("marlin-verify", out, "--against", src, "--verbose")
    assert [ln for ln in res.stdout.splitlines() if ln.startswith("problem: ")][1].startswith(f"problem: layer {UP}: ")


@pytest.mark.parametrize(("group_size", "act_order"), [(32, True), (-1, False)])
def test_numerics_read_in_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group_size: int, act_order: bool
) -> None:
    """Both sides are read a chunk of rows at a time (memory bounded by the chunk, not the
    layer); many small chunks give the same verdict as one read."""
    src, out = _export(tmp_path, 4, group_size, act_order)
    whole = check_export(out, src)
    calls: list[int] = []
    product = export_verify._product

    def counting(y, x, qw, k0, k1, width, *, factored):
        calls.append(k1 - k0)
        product(y, x, qw, k0, k1, width, factored=factored)

    # One 32-row unit per chunk.
    monkeypatch.setattr(importlib.import_module("converter.convert.plan"), "CHUNK_CODE_BYTES", 1)
    monkeypatch.setattr(export_verify, "_product", counting)
    chunked = check_export(out, src)
    assert set(calls) == {32} and len(calls) == 2 * sum(k // 32 for k, _ in SIZES.values())
    assert not whole.problems and not chunked.problems and chunked.checked == whole.checked
    for a, b in zip(whole.layers, chunked.layers, strict=True):
        assert a["name"] == b["name"] and b["cpu_rel_err"] <= CPU_REL_TOL


def test_dtype_on_an_export_is_refused(tmp_path: Path) -> None:
    """An export's check runs no GPU, so --dtype (the GPU check's type) would do nothing."""
    from tests.helpers.clirun import assert_refused, invoke

    src, out = _export(tmp_path, 4, 128, False)
    line = assert_refused(invoke("marlin-verify", out, "--against", src, "--dtype", "bf16"))
    assert line == f"error: --dtype: {out} is a compressed-tensors export, whose check runs no GPU"


def test_gpu_on_an_export_is_refused(tmp_path: Path) -> None:
    """--gpu requires GPU numerics, which an export's check never runs: it passed silently."""
    from tests.helpers.clirun import assert_refused, invoke

    src, out = _export(tmp_path, 4, 128, False)
    line = assert_refused(invoke("marlin-verify", out, "--against", src, "--gpu"))
    assert line == f"error: --gpu: {out} is a compressed-tensors export, whose check runs no GPU"


def test_a_file_of_an_export_names_its_folder(tmp_path: Path) -> None:
    """marlin-verify takes an artifact's file or index; an export's file was refused as "not a
    marlin-convert artifact", which it is: the error says to give the folder."""
    from tests.helpers.clirun import assert_refused, invoke

    src, out = _export(tmp_path, 4, 128, False)
    shard = out / "model.safetensors"
    line = assert_refused(invoke("marlin-verify", shard, "--against", src))
    assert line == f"error: {shard}: a file of a compressed-tensors export: give its folder, {out}, to check the export"

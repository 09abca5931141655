"""``marlin-verify`` against crafted artifacts (issue 14): values the kernels' float16
cannot hold, folder mode's files (schema v2 ``checksums.files``), deep nesting, swapped
arguments, and sources that would not convert exactly.  Exit 1 with the problem code
and a message naming the tensor or file, or exit 2 with one line, never a traceback."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from converter.artifact.problems import ProblemCode
from converter.convert import convert
from converter.verify import verify
from tests.helpers.artifact_edit import rewrite_artifact_arrays
from tests.helpers.clirun import assert_refused, invoke, snapshot
from tests.helpers.paths import SAMPLE
from tests.helpers.producers import gptq_config, gptq_tensors, make_layer, plain_tensors, write_checkpoint

LAYER = "pre.0.attn_qkv"


@pytest.fixture(scope="module")
def art(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("art") / "s.safetensors"
    convert(SAMPLE, out)
    return out


def _codes(report) -> list[tuple[str, str]]:
    return [(p.code.value, p.tensor) for p in report.problems if p.severity == "error"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (1e6, "64 delta values overflow float16, which the kernels use (largest |delta| = 1e+06 at [group 0, column"),
        (70000.0, "delta values overflow float16, which the kernels use (largest |delta| = 70000"),
    ],
)
def test_a_delta_beyond_fp16_fails_verification(art: Path, tmp_path: Path, value: float, message: str) -> None:
    def edit(manifest: dict, t: dict) -> None:
        dtype, delta = t[f"{LAYER}.marlin_delta"]
        delta = delta.copy()
        delta[0, :64] = value
        t[f"{LAYER}.marlin_delta"] = (dtype, delta)
        next(e for e in manifest["layers"] if e["name"] == LAYER)["symmetric"] = False

    bad = rewrite_artifact_arrays(art, tmp_path / "bad.safetensors", edit)
    report = verify(bad, shapes_only=True, gpu=False)
    assert _codes(report) == [("fp16_overflow", LAYER)]
    (problem,) = report.problems
    assert problem.message.startswith(f"layer {LAYER}: ") and message in problem.message


def test_a_weight_beyond_fp16_fails_verification(art: Path, tmp_path: Path) -> None:
    """Finite scales and delta whose fp16 weight (q - 8) * s + delta overflows."""

    def edit(manifest: dict, t: dict) -> None:
        dtype, s = t[f"{LAYER}.marlin_scales"]
        t[f"{LAYER}.marlin_scales"] = (dtype, np.full_like(s, 9000.0))

    bad = rewrite_artifact_arrays(art, tmp_path / "bad.safetensors", edit)
    report = verify(bad, shapes_only=True, gpu=False)
    assert ("fp16_overflow", LAYER) in _codes(report)
    msg = next(p.message for p in report.problems if p.code is ProblemCode.FP16_OVERFLOW)
    assert "group columns form weights (q - 8) * s + delta that overflow float16, which the kernels use" in msg


def test_a_non_finite_delta_is_reported_once(art: Path, tmp_path: Path) -> None:
    def edit(manifest: dict, t: dict) -> None:
        dtype, delta = t[f"{LAYER}.marlin_delta"]
        delta = delta.copy()
        delta[0, 0] = np.inf
        t[f"{LAYER}.marlin_delta"] = (dtype, delta)

    bad = rewrite_artifact_arrays(art, tmp_path / "bad.safetensors", edit)
    assert _codes(verify(bad, shapes_only=True, gpu=False)) == [("non_finite", f"{LAYER}.marlin_delta")]


# --------------------------------------------------------------------------- folder files


@pytest.fixture()
def folder(tmp_path: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    tensors = gptq_tensors("model.layers.0.mlp.up_proj", make_layer(rng, 128, 64, group_size=64), v1=True)
    src = write_checkpoint(tmp_path / "src", tensors | plain_tensors(rng), gptq_config(4, 64))
    (src / "vocab.txt").write_text("a\nb\n")
    out = tmp_path / "out"
    convert(src, str(out) + "/")
    return src, out


def test_every_folder_file_is_checksummed_and_verified(folder: tuple[Path, Path]) -> None:
    src, out = folder
    report = verify(out, against=src, gpu=False)
    assert report.ok, report.problems
    from converter.artifact.reader import open_artifact

    with open_artifact(out) as a:
        assert a.manifest is not None
        assert sorted(f.name for f in a.manifest.checksums.files) == ["config.json", "tokenizer.json", "vocab.txt"]


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "vocab.txt"])
def test_an_edited_folder_file_fails_verification(folder: tuple[Path, Path], name: str) -> None:
    src, out = folder
    p = out / name
    p.write_bytes(p.read_bytes().replace(b"a", b"A", 1) if name == "vocab.txt" else p.read_bytes() + b" ")
    report = verify(out, shapes_only=True, gpu=False)
    assert _codes(report) == [("folder_file_mismatch", name)]
    assert "(changed since conversion)" in report.problems[0].message
    res = invoke("marlin-verify", out, "--shapes")
    assert res.exit_code == 1 and f"problem [folder_file_mismatch] {name}: " in res.stdout


def test_a_missing_or_replaced_folder_file(folder: tuple[Path, Path]) -> None:
    src, out = folder
    (out / "vocab.txt").unlink()
    (out / "tokenizer.json").unlink()
    os.mkfifo(out / "tokenizer.json")
    report = verify(out, shapes_only=True, gpu=False)
    assert _codes(report) == [("folder_file_mismatch", "tokenizer.json"), ("folder_file_missing", "vocab.txt")]
    fifo = next(p for p in report.problems if p.tensor == "tokenizer.json")
    assert fifo.message == "tokenizer.json: not a regular file (a FIFO); refusing to read it as a file"
    # The model file given directly: its folder's files are checked the same way.
    assert _codes(verify(out / "model.safetensors", shapes_only=True, gpu=False)) == _codes(report)


def test_a_folder_file_name_that_leaves_the_folder(folder: tuple[Path, Path], tmp_path: Path) -> None:
    src, out = folder

    def edit(manifest: dict, t: dict) -> None:
        manifest["checksums"]["files"][0]["name"] = "../src/config.json"

    rewrite_artifact_arrays(out / "model.safetensors", out / "model.safetensors", edit)
    report = verify(out, shapes_only=True, gpu=False)
    assert [p.message for p in report.problems] == [
        "'../src/config.json': not a plain file name in the artifact's folder"
    ]


# --------------------------------------------------------------------------- nesting, swaps, sources


@pytest.mark.parametrize(
    ("depth", "code", "needle"),
    [
        (60, 1, "metadata.total_size is "),
        (65, 2, "JSON file is not valid JSON: nested more than 64 levels deep"),
        (990, 2, "nested"),
        (100_000, 2, "JSON file is not valid JSON: nested too deeply"),
    ],
)
def test_a_deeply_nested_index(tmp_path: Path, depth: int, code: int, needle: str) -> None:
    out = tmp_path / "a.safetensors"
    convert(SAMPLE, out, max_shard_size="200KB")
    index = tmp_path / "a.safetensors.index.json"
    text = index.read_text()
    nested = "[" * depth + "]" * depth
    index.write_text(text.replace('"total_size": ', f'"total_size": {nested}, "x": ', 1))
    for extra in ([], ["--json"]):
        res = invoke("marlin-verify", index, "--shapes", *extra)
        assert res.exit_code == code and "Traceback" not in res.stdout + res.stderr
        if extra:
            doc = json.loads(res.stdout)  # one document, even for this
            assert res.stderr == "" and doc["ok"] is False
            assert needle in json.dumps(doc)
        elif code == 2:
            assert_refused(res, needle)
        else:
            assert needle in res.stdout and len(res.stdout.splitlines()[-2]) < 400  # the value is not dumped whole


@pytest.mark.parametrize("source", ["tinyloop", "hf"])
def test_swapped_arguments_are_named(tmp_path: Path, source: str) -> None:
    if source == "tinyloop":
        src = SAMPLE
    else:
        rng = np.random.default_rng(1)
        src = write_checkpoint(
            tmp_path / "hf",
            gptq_tensors("m.up", make_layer(rng, 128, 64, group_size=64), v1=True) | plain_tensors(rng),
            gptq_config(4, 64),
        )
    out = tmp_path / "a.safetensors"
    convert(src, out)
    before = snapshot(tmp_path)
    assert_refused(
        invoke("marlin-verify", src, "--against", out),
        f"{src}: not an artifact, but --against {out} is one: the arguments are swapped; "
        f"run marlin-verify {out} --against {src}",
    )
    assert_refused(
        invoke("marlin-verify", out, "--against", out),
        f"{out}: this is already a marlin-convert artifact, not a source checkpoint",
    )
    assert snapshot(tmp_path) == before


def test_against_a_source_whose_index_drops_a_tensor(tmp_path: Path) -> None:
    """Before, the tensor was silently left out of both the artifact and the check."""
    rng = np.random.default_rng(2)
    tensors = gptq_tensors("m.up", make_layer(rng, 128, 64, group_size=64), v1=True) | plain_tensors(rng)
    src = write_checkpoint(tmp_path / "hf", tensors, gptq_config(4, 64), shards=2)
    out = tmp_path / "a.safetensors"
    convert(src, out)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.lost.weight"] = "model-00002-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_refused(
        invoke("marlin-verify", out, "--against", src, "--shapes"),
        "model.lost.weight: the index names this tensor in model-00002-of-00002.safetensors, but no shard holds it",
    )


def test_against_a_source_with_scales_fp16_would_round(tmp_path: Path) -> None:
    """An artifact made (by an older version) with rounded f32 scales: --against never
    says exact; the source itself is refused with the numbers."""
    rng = np.random.default_rng(3)
    layer = make_layer(rng, 128, 64, group_size=64)
    exact = write_checkpoint(
        tmp_path / "exact", gptq_tensors("m.up", layer, v1=True) | plain_tensors(rng), gptq_config(4, 64)
    )
    out = tmp_path / "a.safetensors"
    convert(exact, out)
    layer.s = layer.s * np.float32(1.0001)  # no longer fp16 values
    lossy = write_checkpoint(
        tmp_path / "lossy",
        gptq_tensors("m.up", layer, v1=True) | plain_tensors(rng),
        gptq_config(4, 64),
        scale_dtype="F32",
    )
    assert_refused(
        invoke("marlin-verify", out, "--against", lossy, "--shapes"),
        "m.up.scales: 128 of 128 scales are not float16 values",
    )

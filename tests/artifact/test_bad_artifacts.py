"""Bad artifacts given to marlin-verify (issue 5, item 1): an unreadable manifest is an
ArtifactError (exit 2) naming the rule; a readable one with wrong content is a report
listing every problem with its stable code."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from converter.artifact.validate import validate_artifact
from converter.constants import META_MANIFEST, META_SCHEMA_VERSION
from converter.errors import ArtifactError, SchemaVersionError
from tests.helpers.artifact_edit import read_st, rewrite_artifact, write_st
from tests.helpers.checkpoints import arr, small_gptq_artifact
from tests.helpers.clirun import run_cli

LAYER = "model.layers.0.self_attn.q_proj"


def good_file(tmp_path: Path) -> Path:
    p = tmp_path / "good.safetensors"
    write_st(p, {"a": ("F32", [2, 2], arr("F32", [[1, 2], [3, 4]])), "b": ("I32", [3], arr("I32", [1, 2, 3]))})
    return p


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_gptq_artifact(tmp_path_factory.mktemp("art"))


# -- artifacts given to marlin-verify ----------------------------------------------------
def test_artifact_without_manifest(tmp_path: Path) -> None:
    p = good_file(tmp_path)
    with pytest.raises(
        ArtifactError,
        match=r"not a marlin-convert artifact: __metadata__ lacks 'marlin.schema_version' or 'marlin.manifest'",
    ):
        validate_artifact(p)


def test_artifact_future_schema_version(artifact: Path, tmp_path: Path) -> None:
    meta, tensors = read_st(artifact)
    meta[META_SCHEMA_VERSION] = "7"
    p = tmp_path / "future.safetensors"
    write_st(p, tensors, meta)
    with pytest.raises(
        SchemaVersionError,
        match=r"marlin.schema_version: artifact schema version '7' is not supported \(this tool reads 1, 2\); "
        r"upgrade marlin-convert",
    ):
        validate_artifact(p)


def test_artifact_manifest_not_json(artifact: Path, tmp_path: Path) -> None:
    meta, tensors = read_st(artifact)
    meta[META_MANIFEST] = meta[META_MANIFEST][:-5]
    p = tmp_path / "cut.safetensors"
    write_st(p, tensors, meta)
    with pytest.raises(ArtifactError, match=r"marlin.manifest: manifest is not valid JSON"):
        validate_artifact(p)


def test_artifact_manifest_not_object(artifact: Path, tmp_path: Path) -> None:
    meta, tensors = read_st(artifact)
    meta[META_MANIFEST] = "[1, 2]"
    p = tmp_path / "list.safetensors"
    write_st(p, tensors, meta)
    with pytest.raises(ArtifactError, match=r"marlin.manifest: manifest must be a JSON object, found list$"):
        validate_artifact(p)


def test_artifact_layer_missing_tensor(artifact: Path, tmp_path: Path) -> None:
    p = rewrite_artifact(artifact, tmp_path / "a.safetensors", lambda m, t: t.pop(f"{LAYER}.marlin_delta"))
    report, art = validate_artifact(p)
    art.close()
    msgs = [x.message for x in report.problems]
    assert f"{LAYER}.marlin_delta: missing (layer {LAYER} needs it)" in msgs


def test_artifact_shape_disagrees_with_manifest(artifact: Path, tmp_path: Path) -> None:
    def edit(m, t):
        d, s, raw = t[f"{LAYER}.marlin_scales"]
        t[f"{LAYER}.marlin_scales"] = (d, [1, 128], raw[: len(raw) // 2])

    p = rewrite_artifact(artifact, tmp_path / "a.safetensors", edit)
    report, art = validate_artifact(p)
    art.close()
    assert [x.code for x in report.problems] == ["shape_mismatch"]
    assert report.problems[0].expected == [2, 128] and report.problems[0].actual == [1, 128]


@pytest.mark.parametrize("tensor,dtype", [("marlin_delta", np.float32), ("marlin_scales", np.float16)])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_artifact_non_finite_values_reported(artifact: Path, tmp_path: Path, tensor: str, dtype, bad: float) -> None:
    """NaN/Inf written by a buggy producer, with checksums re-sealed: verify still reports it."""
    name = f"{LAYER}.{tensor}"

    def edit(m, t):
        d, s, raw = t[name]
        a = np.frombuffer(raw, dtype=dtype).copy()
        a[3] = bad
        t[name] = (d, s, a.tobytes())

    p = rewrite_artifact(artifact, tmp_path / "a.safetensors", edit)
    report, art = validate_artifact(p)
    art.close()
    assert not report.ok
    (prob,) = report.problems
    assert prob.code == "non_finite" and prob.tensor == name
    assert prob.message == f"{name}: 1 NaN or Inf value(s); {tensor[7:]} must be finite"
    r = run_cli("marlin-verify", p, "--shapes")
    assert r.returncode == 1 and "[non_finite]" in r.stdout


def test_artifact_manifest_schema_violation(artifact: Path, tmp_path: Path) -> None:
    def edit(m, t):
        m["layers"][0]["size_k"] = "128"

    p = rewrite_artifact(artifact, tmp_path / "a.safetensors", edit)
    report, art = validate_artifact(p)
    art.close()
    assert not report.ok
    assert any(x.code == "schema_violation" and "size_k" in x.message for x in report.problems)


def test_artifact_non_finite_bias_reported(tmp_path: Path) -> None:
    """A bias NaN in an artifact (re-sealed checksums) is reported like a NaN scale."""
    from converter.convert import convert
    from converter.verify import verify
    from tests.helpers.producers import gptq_config, gptq_tensors, make_layer, write_checkpoint

    name = "model.layers.0.mlp.up_proj"
    tensors = gptq_tensors(name, make_layer(np.random.default_rng(6), 256, 128, bias=True), v1=False)
    art = tmp_path / "a.safetensors"
    convert(write_checkpoint(tmp_path / "src", tensors, gptq_config(4, 128)), art)

    def edit(m, t):
        d, s, raw = t[f"{name}.bias"]
        a = np.frombuffer(raw, dtype=np.float16).copy()
        a[0] = np.nan
        t[f"{name}.bias"] = (d, s, a.tobytes())

    p = rewrite_artifact(art, tmp_path / "b.safetensors", edit)
    rep = verify(p, shapes_only=True)
    assert [(x.code, x.tensor, x.message) for x in rep.problems] == [
        ("non_finite", f"{name}.bias", f"{name}.bias: 1 NaN or Inf value(s); bias must be finite")
    ]

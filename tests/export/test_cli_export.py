"""``marlin-convert IN OUT --to compressed-tensors`` and ``marlin-verify EXPORT --against SRC``
as a user runs them: exit codes, the one-line errors, what is written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.clirun import assert_one_line_error, run_cli
from tests.helpers.paths import REALINPUT

AWQ = REALINPUT / "llama-tiny" / "autoawq-gemm-w4g128-asym"
ACT_ORDER = REALINPUT / "llama-tiny" / "gptqmodel-gptq-w4g128-asym-descact"
OTHER = REALINPUT / "llama-tiny" / "autoround-gptq-w4g128-asym"

pytestmark = pytest.mark.skipif(not AWQ.is_dir(), reason=f"needs {REALINPUT} (set MARLIN_SHARED)")


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cli-export") / "awq-ct"
    r = run_cli("marlin-convert", AWQ, out, "--to", "compressed-tensors", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["to"] == "compressed-tensors" and len(doc["layers"]) == 7
    return out


def test_export_writes_a_compressed_tensors_folder(export: Path) -> None:
    assert sorted(p.name for p in export.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    qc = json.loads((export / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["format"]) == ("compressed-tensors", "pack-quantized")
    assert {g["weights"]["symmetric"] for g in qc["config_groups"].values()} == {False}


def test_verify_against_the_source_passes_and_a_wrong_source_fails(export: Path) -> None:
    ok = run_cli("marlin-verify", export, "--against", AWQ)
    assert (ok.returncode, ok.stdout.strip()) == (
        0,
        "OK: 7 exported layers equal the source exactly; checked against source, CPU numerics",
    )
    bad = run_cli("marlin-verify", export, "--against", OTHER)
    # the problems and the status line on stdout, as on a Marlin artifact (docs/verify.md)
    assert bad.returncode == 1 and bad.stderr == ""
    lines = bad.stdout.splitlines()
    assert lines[0] == "problem: source file model.safetensors: sha256 differs from the one the export recorded"
    assert lines[-1].startswith("FAILED: ")
    bare = run_cli("marlin-verify", export)
    assert bare.returncode == 2
    assert "a compressed-tensors export is checked against its source: pass --against SRC" in bare.stderr


def test_act_order_is_refused_in_one_line_and_nothing_is_written(tmp_path: Path) -> None:
    out = tmp_path / "ct"
    r = run_cli("marlin-convert", ACT_ORDER, out, "--to", "compressed-tensors")
    assert r.returncode == 2 and not out.exists()
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "7 layer(s) have no exact compressed-tensors form (act-order (g_idx)" in lines[0]
    assert "model.layers.0.self_attn.q_proj, model.layers.0.self_attn.k_proj" in lines[0] and "and 3 more" in lines[0]
    # every layer refused: passing them all through would leave nothing, so only the
    # hint that works (--legacy-act-order) is given
    assert lines[0].endswith("nothing was written") and "--legacy-act-order" in lines[0]
    legacy = run_cli("marlin-convert", ACT_ORDER, out, "--to", "compressed-tensors", "--legacy-act-order")
    assert legacy.returncode == 0 and (out / "model.safetensors").is_file()


def test_bad_to_and_misplaced_flags_are_usage_errors(tmp_path: Path) -> None:
    r = run_cli("marlin-convert", AWQ, tmp_path / "x", "--to", "gguf")
    assert (r.returncode, r.stderr.strip()) == (2, "error: --to 'gguf': one of marlin, compressed-tensors")
    # each message names the options given, never one the user did not pass
    r = run_cli("marlin-convert", AWQ, tmp_path / "y", "--allow-passthrough")
    assert (r.returncode, r.stderr.strip()) == (2, "error: --allow-passthrough goes with --to compressed-tensors")
    r = run_cli("marlin-convert", AWQ, tmp_path / "y", "--legacy-act-order", "--allow-passthrough")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --allow-passthrough and --legacy-act-order go with --to compressed-tensors"
    r = run_cli("marlin-convert", AWQ, tmp_path / "z", "--to", "compressed-tensors", "--dry-run")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --dry-run is for the Marlin artifact, not --to compressed-tensors"
    r = run_cli("marlin-convert", AWQ, tmp_path / "z", "--to", "compressed-tensors", "--no-pad", "--dry-run")
    assert r.returncode == 2
    assert r.stderr.strip() == "error: --dry-run and --no-pad are for the Marlin artifact, not --to compressed-tensors"
    assert not any(tmp_path.iterdir())


def test_a_file_like_output_name_is_refused_not_made_a_folder(tmp_path: Path) -> None:
    out = tmp_path / "ct.safetensors"
    r = run_cli("marlin-convert", AWQ, out, "--to", "compressed-tensors")
    assert r.returncode == 2 and not out.exists()
    assert r.stderr.strip().endswith(
        "an export is a model folder (config.json, weights, tokenizer): give OUT without .safetensors"
    ), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_a_config_an_engine_would_read_differently_fails_the_check(export: Path, tmp_path: Path) -> None:
    # The tensors still equal the source: only config.json says symmetric (an engine
    # would drop the zero points), so the check must read the config too.
    edited = tmp_path / "sym"
    shutil.copytree(export, edited)
    cfg = json.loads((edited / "config.json").read_text())
    for group in cfg["quantization_config"]["config_groups"].values():
        group["weights"]["symmetric"] = True
    (edited / "config.json").write_text(json.dumps(cfg))
    r = run_cli("marlin-verify", edited, "--against", AWQ)
    assert r.returncode == 1 and r.stderr == ""
    problems = [ln for ln in r.stdout.splitlines() if ln.startswith("problem: ")]
    assert problems == [
        "problem: config group group_0: weights.symmetric is true, the layers need false "
        "(model.layers.0.mlp.down_proj, model.layers.0.mlp.gate_proj, model.layers.0.mlp.up_proj, "
        "model.layers.0.self_attn.k_proj and 3 more)"
    ], r.stdout


def test_a_malformed_export_manifest_is_one_error_line_naming_the_shard(export: Path, tmp_path: Path) -> None:
    from safetensors.numpy import load_file, save_file

    from converter.export.compressed_tensors import EXPORT_META_KEY
    from converter.safetensors_io import SafetensorsFile

    texts = [
        "{bad",
        "[" * 100_000 + "]" * 100_000,
        "[]",
        json.dumps({"source": {"files": "x"}, "layers": [{"name": 5}]}),
    ]
    for i, text in enumerate(texts):
        edited = tmp_path / f"m{i}"
        shutil.copytree(export, edited)
        shard = edited / "model.safetensors"
        meta = dict(SafetensorsFile(shard).metadata, **{EXPORT_META_KEY: text})
        save_file(load_file(shard), shard, metadata=meta)
        r = run_cli("marlin-verify", edited, "--against", AWQ)
        assert_one_line_error(r, str(shard), f"metadata {EXPORT_META_KEY}")
        assert r.stdout == ""
    assert "source.files is not a list; layers[0].name is not str; layers[0].exported is not bool" in r.stderr

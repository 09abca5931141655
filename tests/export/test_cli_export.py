"""``marlin-convert IN OUT --to compressed-tensors`` and ``marlin-verify EXPORT --against SRC``
as a user runs them: exit codes, the one-line errors, what is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.clirun import run_cli
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
    assert bad.returncode == 1 and bad.stdout.startswith("FAILED: ")
    assert "problem: source file model.safetensors: sha256 differs from the one the export recorded" in bad.stderr
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
    legacy = run_cli("marlin-convert", ACT_ORDER, out, "--to", "compressed-tensors", "--legacy-act-order")
    assert legacy.returncode == 0 and (out / "model.safetensors").is_file()


def test_bad_to_and_misplaced_flags_are_usage_errors(tmp_path: Path) -> None:
    r = run_cli("marlin-convert", AWQ, tmp_path / "x", "--to", "gguf")
    assert (r.returncode, r.stderr.strip()) == (2, "error: --to 'gguf': one of marlin, compressed-tensors")
    r = run_cli("marlin-convert", AWQ, tmp_path / "y", "--allow-passthrough")
    assert r.returncode == 2
    assert "--allow-passthrough and --legacy-act-order go with --to compressed-tensors" in r.stderr
    r = run_cli("marlin-convert", AWQ, tmp_path / "z", "--to", "compressed-tensors", "--dry-run")
    assert r.returncode == 2 and "--dry-run and --no-pad are for the Marlin artifact" in r.stderr
    assert not any(tmp_path.iterdir())


def test_a_file_like_output_name_is_refused_not_made_a_folder(tmp_path: Path) -> None:
    out = tmp_path / "ct.safetensors"
    r = run_cli("marlin-convert", AWQ, out, "--to", "compressed-tensors")
    assert r.returncode == 2 and not out.exists()
    assert r.stderr.strip().endswith(
        "an export is a model folder (config.json, weights, tokenizer): give OUT without .safetensors"
    ), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1

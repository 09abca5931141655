"""The two commands as a user runs them: help, main paths, JSON, exit codes, bad input
(exit 2 with one line naming the file, the tensor and the rule, no traceback, no output)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from converter.convert import convert
from tests.helpers.checkpoints import (
    LAYER,
    T,
    edit_tensor,
    only_shard,
    set_quant_config,
    small_gptq,
    small_gptq_artifact,
    st_bytes,
)
from tests.helpers.clirun import assert_one_line_error, run_cli

AUTOROUND = "llama-tiny/autoround-gptq-w4g128-asym"


@pytest.fixture()
def gptq_copy(realinput: Path, tmp_path: Path) -> Path:
    """A writable copy of a real GPTQ checkpoint (the original is never touched)."""
    dst = tmp_path / "ckpt"
    shutil.copytree(realinput / AUTOROUND, dst)
    return dst


@pytest.mark.parametrize(
    "tool,words",
    [
        ("marlin-convert", ["--force", "--dry-run", "--json", "Exit codes"]),
        ("marlin-verify", ["--shapes", "--against", "--gpu", "--cpu", "--json", "Exit codes"]),
    ],
)
def test_help(tool: str, words: list[str]) -> None:
    res = run_cli(tool, "--help")
    assert res.returncode == 0, res.stderr
    for w in words:
        assert w in res.stdout


def test_convert_then_verify_json(realinput: Path, tmp_path: Path) -> None:
    out = tmp_path / "a.safetensors"
    res = run_cli("marlin-convert", realinput / AUTOROUND, out, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] and not doc["dry_run"] and doc["source_format"] == "gptq"
    assert len(doc["converted"]) == 7 and out.is_file()
    res = run_cli("marlin-verify", out, "--shapes", "--against", realinput / AUTOROUND, "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    rep = json.loads(res.stdout)
    assert rep["ok"] and rep["problems"] == [] and rep["checked"]["checksums"] is True
    assert all(row["codes_exact"] for row in rep["layers"])
    res = run_cli("marlin-verify", out, "--cpu", "--json")
    rep = json.loads(res.stdout)
    assert res.returncode == 0 and all(row["cpu_rel_err"] < 1e-5 for row in rep["layers"])


def test_convert_human_output(realinput: Path, tmp_path: Path) -> None:
    out = tmp_path / "a.safetensors"
    res = run_cli("marlin-convert", realinput / AUTOROUND, out)
    assert res.returncode == 0
    assert res.stdout == ""  # results and progress go to stderr unless --json
    assert "7 layers converted, 4 tensors passed through" in res.stderr
    assert "model.layers.0.mlp.down_proj" in res.stderr
    res = run_cli("marlin-verify", out, "--shapes")
    assert res.returncode == 0
    assert "OK: 7 layers, 25 tensors; checked shapes, checksums" in res.stdout


def test_dry_run(realinput: Path, tmp_path: Path) -> None:
    out = tmp_path / "a.safetensors"
    res = run_cli("marlin-convert", realinput / AUTOROUND, out, "--dry-run")
    assert res.returncode == 0 and not out.exists()
    assert "would write" in res.stderr


def test_existing_output_needs_force(realinput: Path, tmp_path: Path) -> None:
    out = tmp_path / "a.safetensors"
    out.write_bytes(b"precious")
    res = run_cli("marlin-convert", realinput / AUTOROUND, out)
    assert res.returncode == 2
    assert res.stderr.strip() == f"error: {out}: output exists; pass --force to overwrite it"
    assert out.read_bytes() == b"precious"
    res = run_cli("marlin-convert", realinput / AUTOROUND, out, "--force", "-q")
    assert res.returncode == 0 and out.stat().st_size > 1_000_000


def test_missing_input(tmp_path: Path) -> None:
    res = run_cli("marlin-convert", tmp_path / "nope.tinyloop", tmp_path / "o.safetensors")
    assert res.returncode == 2
    assert "nope.tinyloop: no such file or directory" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "o.safetensors").exists()


def test_wrong_magic_safetensors(tmp_path: Path) -> None:
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\xff" * 64)
    res = run_cli("marlin-convert", bad, tmp_path / "o.safetensors")
    assert res.returncode == 2
    assert "header length 18446744073709551615 exceeds the 100000000-byte limit" in res.stderr


def test_truncated_checkpoint(gptq_copy: Path, tmp_path: Path) -> None:
    f = gptq_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    res = run_cli("marlin-convert", gptq_copy, tmp_path / "o.safetensors")
    assert res.returncode == 2
    assert "is past the end of the data buffer" in res.stderr and "file truncated?" in res.stderr
    assert not (tmp_path / "o.safetensors").exists()


def test_unsupported_bits(gptq_copy: Path, tmp_path: Path) -> None:
    cfg = gptq_copy / "quantization_config.json"
    qc = json.loads(cfg.read_text())
    qc["bits"] = 5
    cfg.write_text(json.dumps(qc))
    res = run_cli("marlin-convert", gptq_copy, tmp_path / "o.safetensors")
    assert res.returncode == 2
    assert "quantization_config.json: bits: 5-bit GPTQ is not supported" in res.stderr


def test_config_group_size_contradicting_tensors(gptq_copy: Path, tmp_path: Path) -> None:
    # group 96 does not divide K = 1024; the config then implies ceil(1024/96) = 11
    # scale rows, but the file holds 8: a contradiction, reported before any write.
    from converter.errors import SourceFormatError

    cfg = gptq_copy / "quantization_config.json"
    qc = json.loads(cfg.read_text())
    qc["group_size"] = 96
    cfg.write_text(json.dumps(qc))
    with pytest.raises(
        SourceFormatError,
        match=r"down_proj.scales: shape \[8, 512\] disagrees with K, N(, bits)? and group_size "
        r"\(expected \[11, 512\]\)",
    ):
        convert(gptq_copy, tmp_path / "o.safetensors")
    assert not (tmp_path / "o.safetensors").exists()


def test_verify_reports_every_problem(realinput: Path, tmp_path: Path) -> None:

    out = tmp_path / "a.safetensors"
    convert(realinput / AUTOROUND, out)
    data = bytearray(out.read_bytes())
    # Flip one byte in the last tensor's data and one in the first.
    data[-1] ^= 0xFF
    header_len = int.from_bytes(data[:8], "little")
    data[8 + header_len] ^= 0xFF
    out.write_bytes(bytes(data))
    res = run_cli("marlin-verify", out, "--shapes", "--json")
    assert res.returncode == 1
    rep = json.loads(res.stdout)
    codes = [p["code"] for p in rep["problems"]]
    assert codes == ["checksum_mismatch", "checksum_mismatch"]


def test_gpu_and_cpu_flags_conflict(tmp_path: Path) -> None:
    res = run_cli("marlin-verify", tmp_path / "x.safetensors", "--gpu", "--cpu")
    assert res.returncode == 2 and "contradict" in res.stderr


def test_verify_not_an_artifact(realinput: Path) -> None:
    res = run_cli("marlin-verify", realinput / AUTOROUND / "model.safetensors", "--shapes")
    assert res.returncode == 2
    assert "not a marlin-convert artifact" in res.stderr


def test_layer_without_qweight_is_refused(gptq_copy: Path, tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    from converter.safetensors_io import SafetensorsFile

    f = gptq_copy / "model.safetensors"
    with SafetensorsFile(f) as st:
        tensors = {n: np.array(st.array(n)) for n in st.infos if n != "model.layers.0.self_attn.q_proj.qweight"}
    save_file(tensors, f)
    res = run_cli("marlin-convert", gptq_copy, tmp_path / "o.safetensors")
    assert res.returncode == 2
    assert (
        "model.layers.0.self_attn.q_proj.g_idx: layer model.layers.0.self_attn.q_proj has g_idx but no qweight"
        in res.stderr
    )
    assert not (tmp_path / "o.safetensors").exists()


# --------------------------------------------------------------------------- bad input


@pytest.fixture()
def gptq(tmp_path: Path) -> Path:
    return small_gptq(tmp_path / "ckpt")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_gptq_artifact(tmp_path_factory.mktemp("art"))


def copy_of(path: Path, tmp_path: Path, data: bytes | None = None) -> Path:
    p = tmp_path / path.name
    p.write_bytes(path.read_bytes() if data is None else data)
    return p


def test_cli_convert_truncated_shard(gptq: Path, tmp_path: Path) -> None:
    shard = only_shard(gptq)
    os.truncate(shard, shard.stat().st_size - 1)
    out = tmp_path / "out.safetensors"
    r = run_cli("marlin-convert", gptq, out)
    assert_one_line_error(r, str(shard), "file truncated?")
    assert not out.exists() and not list(tmp_path.glob(".out.safetensors.*"))


def test_cli_convert_nan_scale(gptq: Path, tmp_path: Path) -> None:
    s = np.full((2, 128), 0.01, dtype=np.float16)
    s[0, 0] = np.nan
    edit_tensor(gptq, f"{LAYER}.scales", raw=s.tobytes())
    out = tmp_path / "out.safetensors"
    r = run_cli("marlin-convert", gptq, out)
    assert_one_line_error(r, f"{LAYER}.scales", "NaN or Inf")
    assert not out.exists() and not list(tmp_path.glob(".out.safetensors.*"))


def test_cli_convert_config_wrong_type(gptq: Path, tmp_path: Path) -> None:
    set_quant_config(gptq, bits="four")
    out = tmp_path / "out.safetensors"
    r = run_cli("marlin-convert", gptq, out, "--json")
    qc = gptq / "quantize_config.json"
    assert (r.returncode, r.stderr) == (2, "")
    assert json.loads(r.stdout) == {
        "ok": False,
        "error": {
            "type": "ConfigError",
            "message": f'{qc}: bits: expected int, found "four"',
            "file": str(qc),
            "tensor": "bits",
        },
    }
    assert not out.exists()


def test_cli_convert_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors"
    p.write_bytes(b"")
    out = tmp_path / "out.safetensors"
    r = run_cli("marlin-convert", p, out)
    assert_one_line_error(r, str(p), "need at least 8")
    assert not out.exists()


def test_cli_verify_truncated_artifact(artifact: Path, tmp_path: Path) -> None:
    data = artifact.read_bytes()
    p = copy_of(artifact, tmp_path, data[: len(data) - 7])
    r = run_cli("marlin-verify", p, "--shapes")
    assert_one_line_error(r, str(p), "file truncated?")


def test_cli_verify_garbage(tmp_path: Path) -> None:
    p = tmp_path / "garbage.safetensors"
    p.write_bytes(os.urandom(4096))
    r = run_cli("marlin-verify", p, "--shapes")
    assert_one_line_error(r, str(p), "header length")


def test_cli_debug_shows_traceback(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors"
    p.write_bytes(b"")
    r = run_cli("marlin-convert", p, tmp_path / "out.safetensors", "--debug")
    assert r.returncode == 2 and "Traceback" in r.stderr and "SourceFormatError" in r.stderr


def test_messages_are_single_line_for_hostile_names(tmp_path: Path) -> None:
    """A tensor name with a newline must not break the one-line contract."""
    p = tmp_path / "x.safetensors"
    p.write_bytes(st_bytes({"evil\nname": {**T, "dtype": "F7"}}, b"\x00" * 16))
    r = run_cli("marlin-convert", p, tmp_path / "out.safetensors")
    assert_one_line_error(r, f"{p}: evil\\nname: unknown dtype 'F7'")


def test_cli_environment_oserror_is_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Disk full (or any OSError from the environment) mid-write: one line, exit 2."""
    import errno

    from typer.testing import CliRunner

    from converter.cli import convert_app

    convert_module = sys.modules["converter.convert"]  # the package re-exports a function of that name

    def full_disk(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out.safetensors"))

    monkeypatch.setattr(convert_module, "convert", full_disk)
    r = CliRunner().invoke(convert_app, [str(tmp_path), str(tmp_path / "out.safetensors")])
    assert r.exit_code == 2
    out = r.output.strip().splitlines()
    assert out == [f"error: {tmp_path / 'out.safetensors'}: No space left on device"]


# --------------------------------------------------------------------------- the summary (issue 15)


@pytest.fixture(scope="module")
def two_hundred(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 203-layer GPTQ Llama (29 blocks of 7) with hidden 96, group 64: q/k/v/o and
    gate/up regroup (96 % 64) and pad (N = 96, 32, 72), down_proj (K = 72) does not convert."""
    from tests.helpers.synthetic_gptq import write_gptq

    folder = tmp_path_factory.mktemp("g200") / "src"
    write_gptq(folder, hidden=96, intermediate=72, kv=32, blocks=29, vocab=64, shards=1, group_size=64)
    return folder


def test_name_patterns_group_by_numeric_components() -> None:
    from converter.cli import name_patterns

    names = [f"model.layers.{i}.self_attn.q_proj" for i in range(30)] + ["lm_head", "0.weight", "h.1.mlp.c_fc"]
    assert name_patterns(names) == [
        ("model.layers.*.self_attn.q_proj", 30),
        ("lm_head", 1),
        ("0.weight", 1),  # a pattern of one name is that name
        ("h.1.mlp.c_fc", 1),
    ]
    assert name_patterns(["a.1.b.2", "a.3.b.4", "a.1.bb"]) == [("a.*.b.*", 2), ("a.1.bb", 1)]


def test_the_summary_of_a_200_layer_conversion_fits_on_a_screen(two_hundred: Path, tmp_path: Path) -> None:
    res = run_cli("marlin-convert", two_hundred, tmp_path / "a.safetensors")
    assert res.returncode == 0 and res.stdout == "", res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 21 and max(map(len, lines)) <= 160, res.stderr  # piped: a 160-column console
    patterns = [f"model.layers.*.self_attn.{p}_proj" for p in "qkvo"] + [
        f"model.layers.*.mlp.{p}_proj" for p in ("gate", "up")
    ]
    rows = [ln for ln in lines if ln.startswith("│ ")]
    assert [r.split("│")[1].strip() for r in rows] == patterns
    assert rows[1].split("│")[2:6] == [" 29    ", " 96 ", " 32 (pad 64)  ", " 32 (from 64) "]
    text = "\n".join(lines)
    assert (
        "174 layer(s) regrouped, exactly (short last group; each source group's scale and zero repeated per slice): "
        "group size 64 -> 32\n  model.layers.*.self_attn.q_proj (29), model.layers.*.self_attn.k_proj (29)"
    ) in text
    assert "174 layer(s) padded (N rounded up to a multiple of 64 with zero columns; outputs keep N)\n" in text
    assert (
        "29 layer(s) not converted: size_k = 72 is not a multiple of 16 (Marlin tile)\n"
        "  model.layers.*.mlp.down_proj (29)\n"
        "61 plain tensor(s) carried over unchanged: not a quantized linear layer (61)\n"
        "174 layers converted (174 regrouped, 174 padded), 177 tensors passed through; wrote 1.38 MB of tensor data"
    ) in text
    assert "model.layers.17." not in text  # no layer is named one by one


def test_verbose_gives_the_long_form(two_hundred: Path, tmp_path: Path) -> None:
    res = run_cli("marlin-convert", two_hundred, tmp_path / "a.safetensors", "--verbose")
    assert res.returncode == 0, res.stderr
    text = res.stderr
    rows = [ln for ln in text.splitlines() if ln.startswith("│ ")]
    assert len(rows) == 174 and rows[0].split("│")[1].strip() == "model.layers.0.self_attn.q_proj"
    down = "model.layers.28.mlp.down_proj"
    flat = " ".join(text.split())  # long lines wrap at 160 columns
    assert (
        f"pass-through: {down}.qweight, {down}.qzeros, {down}.scales, {down}.g_idx "
        f"(layer {down} not converted: size_k = 72 is not a multiple of 16 (Marlin tile))"
    ) in flat
    assert "model.layers.28.input_layernorm.weight" in text and len(text.splitlines()) > 300


def test_json_keeps_every_tensor_and_no_pad_passes_through(two_hundred: Path, tmp_path: Path) -> None:
    res = run_cli("marlin-convert", two_hundred, tmp_path / "a.safetensors", "--json")
    doc = json.loads(res.stdout)
    assert res.returncode == 0 and res.stderr == ""
    assert len(doc["converted"]) == 174 and len(doc["passthrough"]) == 177 and len(doc["not_converted"]) == 29
    k = next(r for r in doc["converted"] if r["name"] == "model.layers.3.self_attn.k_proj")
    assert (k["size_n"], k["padded_n"], k["group_size"], k["source_group_size"]) == (32, 64, 32, 64)
    res = run_cli("marlin-convert", two_hundred, tmp_path / "b.safetensors", "--json", "--no-pad")
    doc = json.loads(res.stdout)
    assert doc["converted"] == [] and len(doc["not_converted"]) == 203
    assert {s["reason"] for s in doc["not_converted"]} == {
        f"size_n = {n} is not a multiple of 64 (Marlin tile)" for n in (96, 32, 72)
    } | {"size_k = 72 is not a multiple of 16 (Marlin tile)"}
    res = run_cli("marlin-convert", two_hundred, tmp_path / "c.safetensors", "--no-pad")
    lines = res.stderr.splitlines()
    assert lines[-1] == "0 layers converted, 873 tensors passed through; wrote 0.84 MB of tensor data"
    assert lines[-2] == (
        "warning: none of the 203 quantized layers converts (each passes through with its reason, listed above): "
        "the artifact holds the source's tensors unchanged"
    )
    assert len(lines) == 12 and lines[0] == f"wrote {tmp_path / 'c.safetensors'}", res.stderr


def test_verify_prints_the_first_problems_and_counts_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong --against source gives one problem per tensor: the terminal gets the first
    PROBLEM_LINES and a count by code; --json keeps them all."""
    from rich.console import Console

    from converter import cli
    from converter.artifact.problems import Report

    rep = Report("a.safetensors")
    rep.add("source_differs", "the source is not the one this artifact was converted from")
    for i in range(40):
        rep.add("source_mismatch", f"t{i}: a conversion of the source has this tensor; the artifact lacks it", f"t{i}")
    rep.add("non_finite", "t.marlin_delta: 1 NaN or Inf value(s); delta must be finite", "t.marlin_delta")
    console = Console(record=True, width=200, highlight=False)
    monkeypatch.setattr(cli, "out_console", console)
    cli._render_verify(rep, quiet=True)
    lines = console.export_text().splitlines()
    assert len(lines) == cli.PROBLEM_LINES + 2 and lines[0].startswith("problem [source_differs]")
    assert lines[cli.PROBLEM_LINES - 1] == (
        "problem [source_mismatch] t28: a conversion of the source has this tensor; the artifact lacks it"
    )
    assert lines[-2] == "... and 12 more (non_finite, source_mismatch); --json lists every problem"
    assert lines[-1] == "FAILED: 42 problem(s): 0 layers, 0 tensors; checked shapes, checksums"


@pytest.mark.parametrize("tool", ["marlin-convert", "marlin-verify"])
def test_version_is_one_line_or_one_json_document(tool: str) -> None:
    from converter import __version__

    plain = run_cli(tool, "--version")
    assert (plain.returncode, plain.stdout, plain.stderr) == (0, f"{tool} (marlin-convert {__version__})\n", "")
    for args in (("--json", "--version"), ("--version", "--json")):
        res = run_cli(tool, *args)
        assert res.returncode == 0 and res.stderr == ""
        assert json.loads(res.stdout) == {"ok": True, "program": tool, "version": __version__}


def test_the_summary_marks_act_order_layers(tmp_path: Path) -> None:
    """Act-order shows in the summary's group column, not only in --json."""
    from tests.helpers.producers import gptq_config, gptq_tensors, make_layer, write_checkpoint

    rng = np.random.default_rng(3)
    tensors = {}
    for name, act in (("model.layers.0.mlp.up_proj", True), ("model.layers.0.mlp.gate_proj", False)):
        tensors.update(gptq_tensors(name, make_layer(rng, 256, 128, act_order=act), v1=False))
    src = write_checkpoint(tmp_path / "src", tensors, gptq_config(4, 128, fmt="gptq_v2", desc_act=True))
    res = run_cli("marlin-convert", src, tmp_path / "o.safetensors", "--dry-run")
    assert res.returncode == 0, res.stderr
    rows = {
        line.split("│")[1].strip(): line.split("│")[5].strip()
        for line in res.stderr.splitlines()
        if line.startswith("│")
    }
    assert rows == {"model.layers.0.mlp.up_proj": "128 act-order", "model.layers.0.mlp.gate_proj": "128"}


def test_command_line_processes_turn_numpy_huge_pages_off() -> None:
    """Both CLIs switch off NumPy's huge-page advice for arrays (the writers' buffers;
    cli._no_huge_pages_for_arrays), in their own process: checked in a child, so this
    test process keeps NumPy's default."""
    import subprocess

    code = (
        "import numpy as np; from converter import cli; m = np._core.multiarray; "
        "m._set_madvise_hugepage(True); print(cli._no_huge_pages_for_arrays(), m._get_madvise_hugepage())"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert got.stdout.split() == ["True", "False"]

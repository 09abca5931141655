"""The two commands as a user runs them: help, main paths, JSON, exit codes, bad input
(exit 2 with one line naming the file, the tensor and the rule, no traceback, no output)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
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
from tests.helpers.clirun import assert_one_line_error, assert_refused, invoke, run_cli
from tests.helpers.paths import REPO, SAMPLE

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
    assert res.stderr == ""  # the summary is the result: stdout (progress only on a terminal)
    assert "7 layers converted, 4 tensors passed through" in res.stdout
    assert "model.layers.0.mlp.down_proj" in res.stdout
    res = run_cli("marlin-verify", out, "--shapes")
    assert res.returncode == 0
    assert "OK: 7 layers, 25 tensors; checked shapes, checksums" in res.stdout


def test_dry_run(realinput: Path, tmp_path: Path) -> None:
    out = tmp_path / "a.safetensors"
    res = run_cli("marlin-convert", realinput / AUTOROUND, out, "--dry-run")
    assert res.returncode == 0 and not out.exists() and res.stderr == ""
    lines = res.stdout.splitlines()
    assert lines[0] == f"would convert {realinput / AUTOROUND}, would write {out}"
    assert lines[-1] == "would convert 7 layers, pass 4 tensors through; would write 1.69 MB of tensor data"
    assert "converted" not in res.stdout  # a dry run converts nothing


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


def test_a_file_named_otherwise_says_what_in_may_be(tmp_path: Path) -> None:
    """A config.json (or README) given as IN: one line that says what IN may be, not only
    the header length its first 8 bytes spell."""
    cfg = tmp_path / "config.json"
    cfg.write_text('{"architectures": ["LlamaForCausalLM"]}')
    r = invoke("marlin-convert", cfg, tmp_path / "o.safetensors")
    assert (r.exit_code, r.stderr.strip()) == (
        2,
        # 8388350557284278907: the bytes '{"archit' read as a little-endian uint64
        f"error: {cfg}: neither .tinyloop nor safetensors (header length 8388350557284278907 exceeds the "
        "100000000-byte limit); IN is a .tinyloop file, a checkpoint folder, a .safetensors file or a "
        "model.safetensors.index.json",
    )
    assert not (tmp_path / "o.safetensors").exists()


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
    for art in (realinput / AUTOROUND / "model.safetensors", realinput / AUTOROUND):
        res = run_cli("marlin-verify", art, "--shapes")
        assert (res.returncode, res.stderr.strip()) == (
            2,
            f"error: {art}: not a marlin-convert artifact: __metadata__ lacks 'marlin.schema_version' or "
            "'marlin.manifest' (a source checkpoint? convert it with marlin-convert, or compare with it through "
            "--against)",
        )


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
    assert res.returncode == 0 and res.stderr == "", res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 20, res.stdout  # piped: no line wraps
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
    assert res.returncode == 0 and res.stderr == "", res.stderr
    text = res.stdout
    rows = [ln for ln in text.splitlines() if ln.startswith("│ ")]
    assert len(rows) == 174 and rows[0].split("│")[1].strip() == "model.layers.0.self_attn.q_proj"
    down = "model.layers.28.mlp.down_proj"
    # not a terminal: no line wraps, and none ends in padding
    assert (
        f"pass-through: {down}.qweight, {down}.qzeros, {down}.scales, {down}.g_idx  "
        f"(layer {down} not converted: size_k = 72 is not a multiple of 16 (Marlin tile))"
    ) in text.splitlines()
    assert max(map(len, text.splitlines())) > 200
    assert [ln for ln in text.splitlines() if ln != ln.rstrip()] == []
    assert "model.layers.28.input_layernorm.weight" in text and len(text.splitlines()) > 200


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
    lines = res.stdout.splitlines()
    assert lines[-1] == "0 layers converted, 873 tensors passed through; wrote 840.0 kB of tensor data"
    assert res.stderr == (  # a warning: stderr, one line
        "warning: none of the 203 quantized layers converts (each passes through with its reason, listed above): "
        "the artifact holds the source's tensors unchanged\n"
    )
    assert len(lines) == 11 and lines[0] == f"wrote {tmp_path / 'c.safetensors'}", res.stdout


def test_verify_prints_the_first_problems_and_counts_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong --against source gives one problem per tensor: the terminal gets the first
    PROBLEM_LINES and a count by code; --json keeps them all."""
    from rich.console import Console

    from converter.artifact.problems import Report
    from converter.cli import verify_cmd

    rep = Report("a.safetensors")
    rep.add("source_differs", "the source is not the one this artifact was converted from")
    for i in range(40):
        rep.add("source_mismatch", f"t{i}: a conversion of the source has this tensor; the artifact lacks it", f"t{i}")
    rep.add("non_finite", "t.marlin_delta: 1 NaN or Inf value(s); delta must be finite", "t.marlin_delta")
    console = Console(record=True, width=200, highlight=False)
    monkeypatch.setattr(verify_cmd, "out_console", console)
    verify_cmd._render_verify(rep, quiet=True)
    lines = console.export_text().splitlines()
    assert len(lines) == verify_cmd.PROBLEM_LINES + 2 and lines[0].startswith("problem [source_differs]")
    assert lines[verify_cmd.PROBLEM_LINES - 1] == (
        "problem [source_mismatch] t28: a conversion of the source has this tensor; the artifact lacks it"
    )
    assert lines[-2] == "... and 12 more (non_finite, source_mismatch); --verbose or --json lists every problem"
    assert lines[-1] == "FAILED: 42 problem(s): 0 layers, 0 tensors; checked shapes, checksums"


@pytest.mark.parametrize("tool", ["marlin-convert", "marlin-verify"])
def test_version_is_one_line_or_one_json_document(tool: str) -> None:
    from converter import __version__

    plain = run_cli(tool, "--version")
    assert (plain.returncode, plain.stdout, plain.stderr) == (0, f"{tool} {__version__}\n", "")
    assert invoke(tool, "--version").stdout == f"{tool} {__version__}\n"  # whatever argv[0] is
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
        for line in res.stdout.splitlines()
        if line.startswith("│")
    }
    assert rows == {"model.layers.0.mlp.up_proj": "128 act-order", "model.layers.0.mlp.gate_proj": "128"}
    # marlin-verify's table shows the same marker (issue 43)
    convert(src, tmp_path / "o.safetensors")
    res = run_cli("marlin-verify", tmp_path / "o.safetensors", "--shapes")
    assert res.returncode == 0, res.stdout
    rows = {
        line.split("│")[2].strip(): line.split("│")[5].strip()
        for line in res.stdout.splitlines()
        if line.startswith("│")
    }
    assert rows == {"model.layers.0.mlp.up_proj": "128 act-order", "model.layers.0.mlp.gate_proj": "128"}


def test_command_line_processes_turn_numpy_huge_pages_off() -> None:
    """Both CLIs switch off NumPy's huge-page advice for arrays (the writers' buffers;
    converter.cli.entry._no_huge_pages_for_arrays), in their own process: checked in a child, so this
    test process keeps NumPy's default."""
    import subprocess

    code = (
        "import numpy as np; from converter.cli import entry; m = np._core.multiarray; "
        "m._set_madvise_hugepage(True); print(entry._no_huge_pages_for_arrays(), m._get_madvise_hugepage())"
    )
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert got.stdout.split() == ["True", "False"]


# --------------------------------------------------------------------------- a newcomer's first hour (issue 43)


@pytest.fixture()
def no_cupy(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """CuPy cannot be imported (as on a machine without the GPU extra), whatever this one has."""
    from converter.gpu import runtime

    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    runtime._import_cupy.cache_clear()
    yield
    runtime._import_cupy.cache_clear()


def test_no_cupy_message_names_the_cpu_device(no_cupy: None, tmp_path: Path) -> None:
    """1. Without a GPU, installing CuPy cannot help: the message names device="cpu" first."""
    from converter.errors import GpuUnavailableError
    from converter.gpu.runtime import require_gpu

    with pytest.raises(GpuUnavailableError) as err:
        require_gpu()
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("CuPy is not available (ModuleNotFoundError: ")
    assert msg.endswith(
        '; on a machine without an NVIDIA GPU, run on the CPU instead: from_pretrained(..., device_map="cpu"), '
        'load_model(path, device="cpu") or marlin-verify --cpu; with one, install the GPU extra: '
        "pip install -e '.[cuda12]' (or '.[cuda13]') from the checkout"
    )
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from converter import load_model
    from tests.helpers.model_fixture import write_tiny_llama

    convert(write_tiny_llama(tmp_path / "src"), tmp_path / "out", pad=False)
    with pytest.raises(GpuUnavailableError, match=r'load_model\(path, device="cpu"\)'):
        load_model(tmp_path / "out")  # device="cuda" by default
    assert load_model(tmp_path / "out", device="cpu").marlin_report.device == "cpu"


def test_model_check_against_the_wrong_source_stops_at_stage_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2. A source whose sha256 differs fails before any model is built, unless overridden."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from converter.model import reference
    from converter.model import verify as model_verify
    from tests.helpers.model_fixture import write_tiny_llama

    src, wrong = write_tiny_llama(tmp_path / "src"), write_tiny_llama(tmp_path / "wrong", seed=1)
    convert(src, tmp_path / "out", pad=False)

    def no_model(*a: object, **k: object) -> None:
        raise AssertionError("a model was built")

    with monkeypatch.context() as m:
        m.setattr(reference, "build_reference", no_model)
        m.setattr(model_verify, "build_converted", no_model)
        res = invoke("marlin-verify", tmp_path / "out", "--model", "--against", wrong, "--cpu")
    assert res.exit_code == 1, res.output
    assert res.stdout.splitlines() == [
        "problem [source_differs] the source is not the checkpoint this folder was converted from (sha256 differs: "
        "model.safetensors); stopped before building any model (--allow-source-mismatch compares anyway)",
        "FAILED: 1 problem(s): the models were not run",
    ]
    assert res.stderr == "marlin-verify --model: [1/5] checking the artifact and the source\n"
    res = invoke("marlin-verify", tmp_path / "out", "--model", "--against", wrong, "--cpu", "--json")
    doc = json.loads(res.stdout)
    assert res.exit_code == 1 and [s["stage"] for s in doc["stages"]] == ["checking the artifact and the source"]
    assert [(p["code"], p["severity"]) for p in doc["problems"]] == [("source_differs", "error")]
    # The override runs all five stages; the finding stays, as a warning.
    res = invoke("marlin-verify", tmp_path / "out", "--model", "--against", wrong, "--cpu", "--json", "-q")
    doc = json.loads(res.stdout)
    assert len(doc["stages"]) == 1
    res = invoke(
        "marlin-verify", tmp_path / "out", "--model", "--against", wrong, "--cpu", "--json", "--allow-source-mismatch"
    )
    doc = json.loads(res.stdout)
    assert len(doc["stages"]) == 5 and doc["metrics"]["converted"]["mean_rel_err"] > 0
    assert ("source_differs", "warning") in [(p["code"], p["severity"]) for p in doc["problems"]]
    # The right source passes as before; the flag means nothing without --model.
    assert invoke("marlin-verify", tmp_path / "out", "--model", "--against", src, "--cpu", "-q").exit_code == 0
    assert_refused(
        invoke("marlin-verify", tmp_path / "out", "--against", src, "--allow-source-mismatch"),
        "--allow-source-mismatch needs --model",
    )


def test_shard_size_without_a_unit_is_refused(tmp_path: Path) -> None:
    """3. `--max-shard-size 5` once meant 5 bytes (73 shards); now the unit is required."""
    out = tmp_path / "o.safetensors"
    line = assert_refused(invoke("marlin-convert", SAMPLE, out, "--max-shard-size", "5"))
    assert line == (
        "error: --max-shard-size: '5' has no unit; add one of B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, "
        "e.g. 5GB (5B for bytes)"
    )
    assert list(tmp_path.iterdir()) == []
    res = run_cli("marlin-convert", SAMPLE, out, "--max-shard-size", "5", "--json")
    assert (res.returncode, res.stderr) == (2, "")
    error = json.loads(res.stdout)["error"]
    assert (error["type"], error["tensor"]) == ("OptionValueError", "--max-shard-size")


@pytest.mark.parametrize("out", ["missing/o.safetensors", "missing/model"])
def test_a_missing_output_parent_has_its_own_json_type(tmp_path: Path, out: str) -> None:
    """7. A missing folder for the output is an OutputPathError in --json, not the generic ConverterError."""
    for extra in ((), ("--dry-run",)):
        res = run_cli("marlin-convert", SAMPLE, tmp_path / out, "--json", *extra)
        assert (res.returncode, res.stderr) == (2, ""), res.stdout
        assert json.loads(res.stdout)["error"]["type"] == "OutputPathError", (extra, res.stdout)
    assert list(tmp_path.iterdir()) == []


def test_the_files_line_hides_more_than_one_file_or_none() -> None:
    """3. All files when at most one would be hidden; else the first few, the index, and the count last."""
    from converter.cli.convert_cmd import FILES_SHOWN, _files_text

    def files(n: int, index: bool = True) -> list[dict[str, object]]:
        shards = [{"name": f"o-{i:05d}.safetensors", "bytes": 1000} for i in range(1, n + 1)]
        return [*shards, {"name": "o.safetensors.index.json", "bytes": 10}] if index else shards

    everything = _files_text(files(FILES_SHOWN), False)  # FILES_SHOWN + 1 files: one would be hidden
    assert "more" not in everything and everything.count(".safetensors (") == FILES_SHOWN
    assert everything.endswith("o.safetensors.index.json (10 B)")
    assert _files_text(files(FILES_SHOWN + 1), False) == (
        "o-00001.safetensors (1.0 kB), o-00002.safetensors (1.0 kB), o-00003.safetensors (1.0 kB), "
        "o.safetensors.index.json (10 B), ... 2 more (--verbose lists all)"
    )
    assert _files_text(files(9, index=False), False) == (
        "o-00001.safetensors (1.0 kB), o-00002.safetensors (1.0 kB), o-00003.safetensors (1.0 kB), "
        "o-00004.safetensors (1.0 kB), ... 5 more (--verbose lists all)"
    )
    assert "more" not in _files_text(files(20), True)


def test_an_oversized_tensor_warns_and_the_files_line_is_bounded(tmp_path: Path) -> None:
    """3. A layer or tensor above the limit gets its own shard, with a warning naming it, its
    size and the shard; the files line names the first few and counts the rest."""
    out = tmp_path / "o.safetensors"
    res = run_cli("marlin-convert", SAMPLE, out, "--max-shard-size", "50kB")
    assert res.returncode == 0, res.stderr
    assert len(list(tmp_path.glob("o-*-of-00016.safetensors"))) == 16
    assert res.stderr.splitlines() == [
        "warning: layer head (3 tensors) is 71.7 kB, larger than --max-shard-size 50kB: it gets a shard of its own, "
        "o-00013-of-00016.safetensors, over the limit (a layer's tensors stay together)",
        "warning: tensor embed is 256.0 kB, larger than --max-shard-size 50kB: it gets a shard of its own, "
        "o-00015-of-00016.safetensors, over the limit (a tensor is never split)",
    ]
    files = next(ln for ln in res.stdout.splitlines() if ln.startswith("files: "))
    assert files == (
        "files: wrote 17: o-00001-of-00016.safetensors (49.8 kB), o-00002-of-00016.safetensors (55.5 kB), "
        "o-00003-of-00016.safetensors (49.4 kB), o.safetensors.index.json (3.9 kB), ... 13 more (--verbose lists all)"
    )
    res = run_cli("marlin-convert", SAMPLE, out, "--max-shard-size", "50kB", "--force", "--verbose")
    files = next(ln for ln in res.stdout.splitlines() if ln.startswith("files: "))
    assert files.count(".safetensors (") == 16 and "more" not in files
    # -q: nothing but errors, the warnings included; --json: the warnings in the document
    res = run_cli("marlin-convert", SAMPLE, out, "--max-shard-size", "50kB", "--force", "-q")
    assert (res.returncode, res.stdout, res.stderr) == (0, "", "")
    res = run_cli("marlin-convert", SAMPLE, out, "--max-shard-size", "50kB", "--force", "--json")
    assert res.stderr == "" and [w.split(" is ")[0] for w in json.loads(res.stdout)["warnings"]] == [
        "layer head (3 tensors)",
        "tensor embed",
    ]


def test_both_commands_share_one_output_policy(tmp_path: Path) -> None:
    """4. Results on stdout, nothing else on stderr; -q prints nothing on success in both;
    -v exists in both; usage names IN OUT and ART; --overwrite points at --force."""
    out = tmp_path / "o.safetensors"
    res = run_cli("marlin-convert", SAMPLE, out)
    assert res.returncode == 0 and res.stderr == "" and res.stdout.startswith(f"wrote {out}\n")
    res = run_cli("marlin-verify", out, "--shapes")
    assert res.returncode == 0 and res.stderr == "" and res.stdout.startswith(f"{out}")
    for tool, args in (("marlin-convert", (SAMPLE, out, "--force")), ("marlin-verify", (out, "--cpu"))):
        res = run_cli(tool, *args, "-q")
        assert (res.returncode, res.stdout, res.stderr) == (0, "", ""), tool
        res = run_cli(tool, *args, "-v")
        assert res.returncode == 0 and res.stdout, tool
        assert run_cli(tool, *args, "--verbose").stdout == res.stdout
    # -q keeps the errors: a corrupted artifact prints its problem and the status, nothing else
    data = bytearray(out.read_bytes())
    data[-1] ^= 0xFF
    out.write_bytes(bytes(data))
    res = run_cli("marlin-verify", out, "--shapes", "-q")
    assert res.returncode == 1 and res.stderr == ""
    assert [ln.split("]")[0] for ln in res.stdout.splitlines()] == [
        "problem [checksum_mismatch",
        "FAILED: 1 problem(s): 15 layers, 61 tensors; checked shapes, checksums",
    ]
    assert run_cli("marlin-convert", "--help").stdout.startswith("Usage: marlin-convert [OPTIONS] IN OUT\n")
    assert run_cli("marlin-verify", "--help").stdout.startswith("Usage: marlin-verify [OPTIONS] ART\n")
    line = assert_refused(invoke("marlin-convert", SAMPLE, tmp_path / "n.safetensors", "--overwrite"))
    assert line == "error: no such option: --overwrite; to replace an existing output, pass --force"
    assert not (tmp_path / "n.safetensors").exists()


def _readme_verify_example() -> tuple[str, list[str]]:
    """The README's ``marlin-verify`` example: its command line and its output lines."""
    readme = (REPO / "README.md").read_text("utf-8")
    start = readme.index("$ marlin-verify /tmp/sample.marlin.safetensors")
    block = readme[start : readme.index("```", start)].rstrip("\n").splitlines()
    return block[0], block[1:]


@pytest.mark.parametrize("nvidia", [False, True])
def test_gpu_note_only_where_it_helps_and_the_readme_example_matches(
    nvidia: bool, no_cupy: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """5. Without CuPy: on a machine with no NVIDIA GPU nothing about GPU numerics is
    printed (-v: one neutral line), and the output is the README's example, the Quick
    start's command; where a GPU is, the note says what to install."""
    import re

    from converter.cli import verify_cmd

    monkeypatch.setattr(verify_cmd, "nvidia_gpu_present", lambda: nvidia)
    command, expected = _readme_verify_example()
    quick_start = (REPO / "README.md").read_text("utf-8").split("## Quick start", 1)[1].split("```bash\n", 1)[1]
    assert command.replace("$ marlin-verify ", "marlin-verify ") in quick_start.split("\n", 1)[0].replace(
        ".venv/bin/", ""
    )
    art = tmp_path / "sample.marlin.safetensors"
    convert(SAMPLE, art)
    res = invoke("marlin-verify", art, "--against", SAMPLE)
    assert res.exit_code == 0, res.output

    def masked(lines: list[str]) -> list[str]:  # the CPU errors' last digits may differ between builds
        return [re.sub(r"\d\.\d\de-\d\d", "x.xxe-xx", ln.rstrip()) for ln in lines]

    got = res.stdout.replace(str(art), "/tmp/sample.marlin.safetensors").splitlines()
    assert masked(got) == masked(expected)
    if nvidia:
        assert res.stderr.startswith("GPU numerics skipped: CuPy is not available (ModuleNotFoundError: ")
        assert res.stderr.rstrip().endswith(
            "install the GPU extra: pip install -e '.[cuda12]' (or '.[cuda13]') from the checkout"
        )
        assert res.stderr.count("\n") == 1
    else:
        assert res.stderr == ""
        res = invoke("marlin-verify", art, "--against", SAMPLE, "-v")
        assert res.stderr == f"{verify_cmd.cpu_loops_line()}\nGPU numerics not run: no NVIDIA GPU on this machine\n"


def test_nvidia_gpu_present_looks_at_the_device_nodes_and_nvidia_smi(monkeypatch: pytest.MonkeyPatch) -> None:
    from converter.cli import verify_cmd

    monkeypatch.setattr(verify_cmd.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(verify_cmd.shutil, "which", lambda name: None)
    assert verify_cmd.nvidia_gpu_present() is False
    monkeypatch.setattr(
        verify_cmd.glob, "glob", lambda pattern: ["/dev/nvidia0"] if pattern.startswith("/dev/") else []
    )
    assert verify_cmd.nvidia_gpu_present() is True
    monkeypatch.setattr(verify_cmd.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(
        verify_cmd.shutil, "which", lambda name: "/usr/bin/nvidia-smi" if name == "nvidia-smi" else None
    )
    assert verify_cmd.nvidia_gpu_present() is True


def test_the_upstream_column_is_explained_where_it_says_no(realinput: Path, tmp_path: Path) -> None:
    """6. "upstream no" on most of the sample's rows comes with one line saying what it means."""
    from converter.cli import UPSTREAM_LEGEND

    res = run_cli("marlin-convert", SAMPLE, tmp_path / "s.safetensors")
    assert res.returncode == 0
    assert res.stdout.splitlines().count(UPSTREAM_LEGEND) == 1
    assert UPSTREAM_LEGEND.startswith("upstream: whether upstream IST-DASLab Marlin") and len(UPSTREAM_LEGEND) < 160
    res = run_cli("marlin-convert", realinput / AUTOROUND, tmp_path / "a.safetensors")  # every row "yes"
    assert res.returncode == 0 and "upstream: " not in res.stdout


def test_sizes_print_in_units_that_fit() -> None:
    """6. No more `0.00 MB`."""
    from converter.artifact.shards import human_size

    assert [human_size(n) for n in (0, 999, 3_900, 844_600, 1_690_000, 175_110_000, 2_100_000_000)] == [
        "0 B",
        "999 B",
        "3.9 kB",
        "844.6 kB",
        "1.69 MB",
        "175.11 MB",
        "2.10 GB",
    ]


def test_hidden_state_metrics_are_relative_to_the_norm_and_have_no_top_k() -> None:
    """6. An encoder's hidden states: near-zero features no longer blow up the max relative
    error (it is per position, of the norm), and there is no top-1 / top-5."""
    from converter.model.verify import output_metrics

    ref = np.ones((1, 2, 4), dtype=np.float32)
    ref[0, 0, 3] = 1e-6  # a near-zero feature
    y = ref.copy()
    y[0, 0, 3] += 0.03  # 3e4 x that element, 1.5 % of its position's norm (2)
    y[0, 1, 0] += 0.01
    hidden = output_metrics(y, ref, encoder=True, ids=None)
    assert hidden["top1"] is None and hidden["top5"] is None
    assert hidden["max_rel_err"] == pytest.approx(0.03 / np.linalg.norm(ref[0, 0]), rel=1e-6)
    assert hidden["mean_rel_err"] == pytest.approx(0.04 / float(np.abs(ref).sum()), rel=1e-5)
    logits = output_metrics(y, ref, encoder=False, ids=None)
    assert logits["top1"] == 1.0 and logits["max_rel_err"] == pytest.approx(0.03 / float(np.abs(ref).mean()), rel=1e-5)


def test_hidden_state_report_has_no_top_k_columns() -> None:
    from rich.console import Console

    from converter.model.report import ModelReport, render

    rep = ModelReport(model="m", source="s", device="cpu", architecture="BertModel", output="last_hidden_state")
    rep.input = {"sequences": 4, "tokens": 128}
    row = {"mean_rel_err": 1.1e-2, "max_rel_err": 3e-2, "top1": None, "top5": None, "cosine": 0.999995}
    rep.metrics = {"converted": row, "fp16_dequant": dict(row), "fp32": {}}
    rep.bar = {"mean_rel_err_limit": 1.7e-2, "top1_min": None}
    out = Console(record=True, width=200, highlight=False)
    render(rep, out, out)
    text = out.export_text()
    assert "top-1" not in text and "top-5" not in text
    assert "max rel err (per position, of its norm)" in text
    assert text.splitlines()[-1] == (
        "OK: BertModel on cpu, 0 layers (); last_hidden_state mean rel err 1.10e-02 (fp16 dequantized 1.10e-02, "
        "limit 1.70e-02), cosine 0.999995 (fp16 0.999995); 0.0 s"
    )


def test_a_path_without_the_suffix_is_a_model_folder(tmp_path: Path) -> None:
    """8. As with save_pretrained: OUT without .safetensors is a folder, no trailing / needed."""
    out = tmp_path / "mymodel"
    res = run_cli("marlin-convert", SAMPLE, out)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"wrote {out / 'model.safetensors'}\n")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert run_cli("marlin-verify", out, "--shapes", "-q").returncode == 0
    # .safetensors still means one file; a trailing / still means a folder
    assert run_cli("marlin-convert", SAMPLE, tmp_path / "one.safetensors", "-q").returncode == 0
    assert (tmp_path / "one.safetensors").is_file()
    assert run_cli("marlin-convert", SAMPLE, f"{tmp_path / 'slash'}/", "-q").returncode == 0
    assert (tmp_path / "slash" / "model.safetensors").is_file()
    # a folder's parent must exist (a mistyped path is an error, not a new tree)
    assert_refused(  # the missing folder named, as the dry run names it
        invoke("marlin-convert", SAMPLE, tmp_path / "nope" / "mymodel"),
        f"{tmp_path / 'nope'}: output folder's parent does not exist",
    )
    assert_refused(invoke("marlin-convert", SAMPLE, tmp_path / "nope" / "m", "--dry-run"), "parent does not exist")
    assert not (tmp_path / "nope").exists()
    # what surely means a file is refused, not turned into a folder
    (tmp_path / "taken").write_bytes(b"x")
    assert_refused(
        invoke("marlin-convert", SAMPLE, tmp_path / "taken"),
        f"{tmp_path / 'taken'}: output exists and is not a folder: a path that does not end in '.safetensors'",
    )
    # a trailing slash is the rule that made it a folder: said so, not the suffix rule
    (tmp_path / "file.safetensors").write_bytes(b"y")
    assert_refused(
        invoke("marlin-convert", SAMPLE, f"{tmp_path / 'file.safetensors'}/"),
        f"{tmp_path / 'file.safetensors'}: output exists and is not a folder: a path ending in '/' names a model "
        "folder; drop the '/' to write the file",
    )
    assert (tmp_path / "file.safetensors").read_bytes() == b"y"
    for name in ("m.SafeTensors", "m.safetensors.index.json"):
        assert_refused(invoke("marlin-convert", SAMPLE, tmp_path / name), "output names neither a .safetensors file")
    assert (tmp_path / "taken").read_bytes() == b"x" and not (tmp_path / "m.SafeTensors").exists()


def test_verbose_names_the_cpu_loops_that_ran(no_cupy: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """1. The cpu rel err figures depend on the compiled loops or the NumPy code: -v says
    which ran (stderr, one line); without -v, and with --shapes (no CPU numerics), nothing."""
    from converter import native
    from converter.cli import verify_cmd

    monkeypatch.setattr(verify_cmd, "nvidia_gpu_present", lambda: False)
    art = tmp_path / "a.safetensors"
    convert(SAMPLE, art)
    lines = {}
    for path, (lib, why) in {
        "compiled": (object(), "compiled, avx2 loops"),
        "numpy": (None, "disabled by MARLIN_NATIVE=0"),
    }.items():
        monkeypatch.setattr(native, "_LIB", lib if path == "numpy" else native._LIB)
        monkeypatch.setattr(native, "_WHY", why if path == "numpy" else native._WHY)
        res = invoke("marlin-verify", art, "--cpu", "-v")
        assert res.exit_code == 0, res.output
        lines[path] = [ln for ln in res.stderr.splitlines() if ln.startswith("CPU numerics: ")]
        assert len(lines[path]) == 1, res.stderr
    assert lines["numpy"] == [
        "CPU numerics: NumPy code (disabled by MARLIN_NATIVE=0); the cpu rel err figures depend on which ran"
    ]
    assert (
        lines["compiled"] == [verify_cmd.cpu_loops_line()]
        and lines["compiled"] != lines["numpy"]
        or native.lib() is None
    )
    assert "CPU numerics: " not in invoke("marlin-verify", art, "--cpu").stderr
    assert "CPU numerics: " not in invoke("marlin-verify", art, "--shapes", "-v").stderr
    assert "CPU numerics: " not in invoke("marlin-verify", art, "--cpu", "-v", "-q").stderr


def test_a_layer_that_does_not_match_its_source_shows_no_cpu_rel_err(monkeypatch: pytest.MonkeyPatch) -> None:
    """2. Against a wrong source every row fails; its cpu rel err is "-", not a number that reads as a pass."""
    from rich.console import Console

    from converter.artifact.problems import Report
    from converter.cli import verify_cmd

    rep = Report("a.safetensors", checked={"against": "src", "cpu_numerics": True, "layers": 3, "tensors": 9})
    base = {"size_k": 128, "size_n": 128, "group_size": 64, "symmetric": False, "cpu_rel_err": 3.71e-07}
    rep.layers = [
        {**base, "name": "good", "codes_exact": True, "scales_exact": True, "delta_exact": True},
        {**base, "name": "bad", "codes_exact": False, "scales_exact": True, "delta_exact": True},
        {**base, "name": "extra"},  # in the artifact, not in the source: no exact columns
    ]
    rep.add("source_mismatch", "layer bad: codes not bit-identical to the source", "bad")
    rep.add("source_mismatch", "layer extra is in the artifact but not converted from the source", "extra")
    console = Console(record=True, width=200, highlight=False)
    monkeypatch.setattr(verify_cmd, "out_console", console)
    verify_cmd._render_verify(rep, quiet=False)
    rows = {
        cells[2]: cells[-2]
        for ln in console.export_text().splitlines()
        if len(cells := [c.strip() for c in ln.split("│")]) > 8
    }
    assert rows == {"good": "3.71e-07", "bad": "-", "extra": "-"}


def test_verify_help_says_what_quiet_prints() -> None:
    """6. -q of marlin-verify prints the failing problems and the status line too: its help says so."""
    res = invoke("marlin-verify", "--help")
    flat = " ".join(res.stdout.split())
    assert "Print nothing but errors" not in flat
    assert "errors, and when the check fails its failing problems and the status line" in flat
    assert "Print nothing but errors" in " ".join(invoke("marlin-convert", "--help").stdout.split())


def test_piped_output_is_never_wrapped_nor_padded(monkeypatch: pytest.MonkeyPatch) -> None:
    """4. Not a terminal: a long line stays one line, a table its natural width, no trailing spaces."""
    import io

    from rich.table import Table

    from converter.cli.streams import _LazyConsole

    buf = io.StringIO()
    monkeypatch.setattr(sys, "stdout", buf)
    console = _LazyConsole(stderr=False)
    console.print("x " * 200 + "end")
    table = Table()
    table.add_column("layer")
    table.add_row("y" * 300)
    console.print(table)
    lines = buf.getvalue().splitlines()
    assert lines[0] == ("x " * 200 + "end") and len(lines) == 1 + 5
    assert all(len(ln) == 304 for ln in lines[1:]) and all(ln == ln.rstrip() for ln in lines)


def test_the_model_report_says_what_its_numbers_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """4, 5. --model's title is a line of its own (not wrapped nor padded off a terminal);
    the per-layer line says it is the error against the source."""
    import io

    from converter.cli.streams import _LazyConsole
    from converter.model.report import ModelReport, render

    rep = ModelReport("out", "src", device="cpu", architecture="LlamaForCausalLM" + "X" * 150, output="logits")
    rep.input = {"sequences": 2, "tokens": 16}
    row = {"mean_rel_err": 1e-3, "max_rel_err": 2e-3, "top1": 1.0, "top5": 1.0}
    rep.metrics = {"converted": row, "fp16_dequant": row, "fp32": row}
    rep.layers = [{"name": "model.layers.0.mlp.up_proj", "rel_err": 1.76e-04, "fp16_rel_err": 2.60e-04}]
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stdout", buf)
    console = _LazyConsole(stderr=False)
    render(rep, console, console)
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("LlamaForCausalLMXXX") and lines[0].endswith(
        ": logits against the fp32 model dequantized from the source, 2 x 16 tokens"
    )
    assert (
        "largest per-layer error against the source (relative to 16-bit dequantized's): "
        "model.layers.0.mlp.up_proj 1.76e-04 (16-bit dequantized 2.60e-04)"
    ) in lines
    assert "furthest" not in buf.getvalue() and all(ln == ln.rstrip() for ln in lines)
